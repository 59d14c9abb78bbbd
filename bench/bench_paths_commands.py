"""Benchmark: every path a user walks, against safetensors on the same tensors.

``--commands``: the command line on a native checkpoint written by ``Checkpoint.write``
(variables of ~100 float32 parameters on 2 mirrored devices, in groups of 100; ``--adam``
adds Adam's ``m`` and ``v`` slots, three entries per variable), each command run in its own
child process (its time and its peak resident memory, ``VmHWM``, are its own):

============================================  ===============================================
ours                                          safetensors baseline (same tensors, same disk)
============================================  ===============================================
``inspect --json``                            ``load_file``
``verify`` (the saved file)                   ``load_file``
``verify`` (the same content, generated)      ``load_file``
``diff A.h5 A.safetensors``                   ``load_file`` (and, beside it, two
                                              ``load_file`` + ``array_equal`` per tensor)
``extract A.h5 NAME`` (one variable)          ``load_file``
``convert A.h5 o.safetensors`` / ``.npz`` /   ``load_file`` + ``save_file`` + fsync
``--to tf``, ``convert A.safetensors b.h5``,
``reshard --devices 3``
============================================  ===============================================

The baseline file is the same tensors written by ``safetensors.numpy.save_file`` (every
component under its own key). ``diff`` and ``convert A.safetensors b.h5`` read our own
safetensors file of the checkpoint (its parallel info in the header); where that header would
pass the 100 MB readers take (50,000 variables with Adam's slots: 300,000 tensors), it is a
shard set, whose index then holds the info past the same limit: the diff row is not run.

``diff`` reads two checkpoints and compares them, so its row also prints its ratio to what the
same work costs a safetensors user (both files loaded, every tensor compared): the issue's
baseline, one ``load_file``, is printed first and its target judged against it.

Each row prints the time, the baseline's, their ratio (target <= 3x) and the ratio of their
CPU times (steadier on a loaded machine), the time per variable,
and the peak RSS against the bound ``largest component + 256 MB``. Times are the command's own
(``parallelvars.cli.main`` called in the child once its imports are done; the baseline the same
way), so interpreter start-up and imports count for neither.

Usage::

    python bench/bench_paths_commands.py --commands                       # 5,000 and 50,000 variables
    python bench/bench_paths_commands.py --commands --sizes 5000 --adam both --json paths.json
    python bench/bench_paths_commands.py --commands --only inspect,verify,diff,extract
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

MB = 1 << 20
PARAMS = 100  # float32 parameters per variable
DEVICES = 2
RSS_OVERHEAD = 256 * MB
TARGET = 3.0


def _peak_rss() -> int:
    """This process's peak resident set (``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------------------- child side
def _child(op: str, args: list[str]) -> None:
    """Run one operation, print ``{"seconds": ..., "peak_rss": ...}``."""
    if op == "cli":
        import importlib

        from parallelvars.cli import main

        # Imports are not the command's cost (nor the baseline's): done before the clock.
        for module in (
            "parallelvars.formats",
            "parallelvars.formats.hdf5",
            "parallelvars.formats.npz",
            "parallelvars.formats.safetensors",
            "parallelvars.formats.tf",
            "parallelvars.cli.inspect",
            "parallelvars.cli.verify",
            "parallelvars.cli.diff",
            "parallelvars.cli.extract",
            "parallelvars.cli.convert",
            "parallelvars.cli.reshard",
            "parallelvars.cli.demo",  # (main's parser imports every subcommand: demo too)
        ):
            importlib.import_module(module)

        devnull = os.open(os.devnull, os.O_WRONLY)
        saved = os.dup(1)
        c0 = time.process_time()
        t0 = time.perf_counter()
        os.dup2(devnull, 1)
        try:
            code = main(args)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0
        if code not in (0, 1):  # 1: diff found differences (components vs logical names)
            raise SystemExit(f"command failed ({code}): {args}")
    elif op == "load":
        from safetensors.numpy import load_file

        c0 = time.process_time()
        t0 = time.perf_counter()
        for shard in _shards(args[0]):
            tensors = load_file(shard)
            del tensors
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0
    elif op == "load_compare":
        # What diffing two checkpoints costs a safetensors user: both files loaded, every
        # tensor compared (the same file twice here: every pair equal, as in our diff row).
        import numpy as np
        from safetensors.numpy import load_file

        c0 = time.process_time()
        t0 = time.perf_counter()
        for shard in _shards(args[0]):
            a, b = load_file(shard), load_file(shard)
            same = all(np.array_equal(a[k], b[k]) for k in a)
            assert same and a.keys() == b.keys()
            del a, b
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0
    elif op == "load_save":
        from safetensors.numpy import load_file, save_file

        c0 = time.process_time()
        t0 = time.perf_counter()
        for k, shard in enumerate(_shards(args[0])):
            tensors = load_file(shard)
            save_file(tensors, f"{args[1]}.{k}")
            del tensors
            fd = os.open(f"{args[1]}.{k}", os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0
    else:
        raise SystemExit(f"unknown op {op}")
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "peak_rss": _peak_rss()}))


def _shards(path: str) -> list[str]:
    """The files of a safetensors file or shard set (``*.index.json``)."""
    if not path.endswith(".index.json"):
        return [path]
    with open(path) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(os.path.dirname(path), name) for name in files]


def _run(op: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", op, *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{op} {args}: {proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------------------------- the files
def _model(n: int, adam: bool) -> Any:
    import numpy as np

    import parallelvars as pv

    rng = np.random.default_rng(0)
    m = pv.Module()
    with pv.MirroredStrategy(DEVICES).scope():
        blocks = []
        for b in range((n + 99) // 100):
            blocks.append(
                [
                    pv.Variable(rng.standard_normal(PARAMS).astype(np.float32), name=f"w{k}")
                    for k in range(min(100, n - 100 * b))
                ]
            )
        m.blocks = blocks
        opt = None
        if adam:
            opt = pv.optimizers.Adam(1e-3)
            opt.build([v for block in blocks for v in block])
    return pv.Checkpoint(model=m, optimizer=opt) if adam else pv.Checkpoint(model=m)


def _files(folder: str, n: int, adam: bool) -> dict[str, Any]:
    """The checkpoint as ``Checkpoint.write`` saves it, the same content written by the
    generator, and the same tensors as safetensors (every component under its own name)."""
    from parallelvars.checkpoint.h5io import H5Reader
    from parallelvars.checkpoint.h5raw.native import write_native
    from parallelvars.errors import InvalidEntryError
    from parallelvars.formats import convert

    tag = f"{n}{'_adam' if adam else ''}"
    saved = os.path.join(folder, f"a{tag}.h5")
    _model(n, adam).write(saved)
    safet = os.path.join(folder, f"a{tag}.safetensors")
    shard_option: list[str] = []
    try:
        convert(saved, safet)
    except InvalidEntryError as exc:  # a header over the 100 MB readers take: a shard set
        print(f"  (safetensors as a shard set: {str(exc)[:90]}...)", file=sys.stderr)
        size = str(max(1 << 20, os.path.getsize(saved) // 8))
        safet = convert(saved, safet, max_shard_size=size)
        shard_option = ["--max-shard-size", size]
    generated = os.path.join(folder, f"g{tag}.h5")
    plain = os.path.join(folder, f"p{tag}.safetensors")
    with H5Reader(saved) as r:
        records = [_Record(r[k]) for k in r]
        # The baseline: the same tensors written by safetensors itself (one file, its header
        # the tensors' only: what a user of safetensors has).
        from safetensors.numpy import save_file

        save_file(
            {f"{rec.path}/{i}": c for rec in records for i, c in enumerate(rec.components)},
            plain,
        )
        try:
            write_native(generated, records, object_graph=r.object_graph, metadata=r.metadata)
        except Exception as exc:  # what the generator cannot express (reported, not hidden)
            print(f"  (generated copy not written: {exc})", file=sys.stderr)
            generated = ""
    return {
        "saved": saved,
        "safetensors": safet,
        "plain": plain,
        "generated": generated,
        "shard_option": shard_option,
    }


class _Record:
    """A stored variable's layout and components, for ``write_native``."""

    def __init__(self, stored: Any) -> None:
        self.path, self.kind, self.shape = stored.path, stored.kind, stored.shape
        self.dtype, self.attrs = stored.dtype, stored.attrs
        self.components = [stored.component(i) for i in range(stored.num_components)]


# ---------------------------------------------------------------------------------- commands
def commands(folder: str, n: int, adam: bool, only: list[str] | None = None) -> dict[str, Any]:
    """Every command row at one size (or those whose label holds one of ``only``); figures
    and ratios."""
    t0 = time.perf_counter()
    files = _files(folder, n, adam)
    print(f"  files written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    h5, st, gen = files["saved"], files["safetensors"], files["generated"]
    out = os.path.join(folder, "out")
    os.makedirs(out, exist_ok=True)
    name = "model/blocks/0/0"
    read = _run("load", files["plain"])
    write = _run("load_save", files["plain"], os.path.join(out, "copy.safetensors"))
    rows: list[tuple[str, list[str], dict[str, Any]]] = [
        ("inspect --json", ["--json", "inspect", h5], read),
        ("verify", ["verify", h5], read),
    ]
    if gen:
        rows.append(("verify (generated file)", ["verify", gen], read))
    rows += [
        # (Our safetensors file of the same checkpoint, its parallel info with it; a shard
        # set's index then holds that info too, past the 100 MB our reader takes: not run.)
        *(
            [("diff a.h5 a.safetensors", ["diff", h5, st], read)]
            if not files["shard_option"]
            else []
        ),
        ("extract (one variable)", ["extract", h5, name, "-o", os.path.join(out, "x.npy")], read),
        (
            "convert -> safetensors",
            ["convert", h5, os.path.join(out, "o.safetensors"), *files["shard_option"]],
            write,
        ),
        ("convert -> npz", ["convert", h5, os.path.join(out, "o.npz")], write),
        (
            "convert -> tf",
            ["convert", h5, os.path.join(out, "tf", "ckpt"), "--to", "tf", "--parents"],
            write,
        ),
        (
            "convert safetensors -> hdf5",
            # (a shard set's index is past our reader's limit: the plain file then)
            ["convert", files["plain"] if files["shard_option"] else st, os.path.join(out, "b.h5")],
            write,
        ),
        (
            "reshard --devices 3",
            ["reshard", "--devices", "3", h5, os.path.join(out, "r3.h5")],
            write,
        ),
    ]
    if only:
        rows = [row for row in rows if any(text in row[0] for text in only)]
    entries = n * (3 if adam else 1)
    largest = PARAMS * 4
    results = {}
    for label, argv, base in rows:
        try:
            ours = _run("cli", *argv)
        except SystemExit as exc:  # reported, and the other rows still run
            print(f"  {label:32s} FAILED: {str(exc)[-300:]}", flush=True)
            results[label] = {"failed": str(exc)[-2000:]}
            continue
        ratio = ours["seconds"] / base["seconds"]
        cpu_ratio = ours["cpu_seconds"] / max(base["cpu_seconds"], 1e-9)
        results[label] = {
            "seconds": ours["seconds"],
            "baseline_seconds": base["seconds"],
            "ratio": ratio,
            # CPU time (this process's): steadier than wall time on a shared, loaded machine.
            "cpu_seconds": ours["cpu_seconds"],
            "baseline_cpu_seconds": base["cpu_seconds"],
            "cpu_ratio": cpu_ratio,
            "per_variable_us": ours["seconds"] / entries * 1e6,
            "peak_rss": ours["peak_rss"],
            "baseline_peak_rss": base["peak_rss"],
            "targets": {
                "ratio": {"op": "<=", "value": TARGET, "met": ratio <= TARGET},
                "peak_rss": {
                    "op": "<=",
                    "value": largest + RSS_OVERHEAD,
                    "met": ours["peak_rss"] <= largest + RSS_OVERHEAD,
                },
            },
        }
        if label.startswith("diff"):
            pair = _run("load_compare", files["plain"])
            results[label]["two_loads_compare"] = {
                "seconds": pair["seconds"],
                "cpu_seconds": pair["cpu_seconds"],
                "ratio": ours["seconds"] / pair["seconds"],
                "cpu_ratio": ours["cpu_seconds"] / max(pair["cpu_seconds"], 1e-9),
            }
        print(
            f"  {label:32s} {ours['seconds']:8.2f} s  vs {base['seconds']:6.2f} s  "
            f"{ratio:6.2f}x (cpu {cpu_ratio:5.2f}x)  "
            f"{results[label]['per_variable_us']:7.1f} us/entry  "
            f"RSS {ours['peak_rss'] / MB:6.0f} MB (bound {(largest + RSS_OVERHEAD) / MB:.0f} MB)",
            flush=True,
        )
        if "two_loads_compare" in results[label]:
            pair = results[label]["two_loads_compare"]
            print(
                f"  {'':32s} vs two load_file + array_equal {pair['seconds']:6.2f} s: "
                f"{pair['ratio']:6.2f}x (cpu {pair['cpu_ratio']:5.2f}x)",
                flush=True,
            )
    return {
        "variables": n,
        "adam": adam,
        "entries": entries,
        "components": entries * DEVICES,
        "file_bytes": os.path.getsize(h5),
        "commands": results,
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--commands", action="store_true", help="the command-line rows")
    p.add_argument("--sizes", default="5000,50000", help="variable counts, comma-separated")
    p.add_argument("--adam", choices=("without", "with", "both"), default="both")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--dir", help="where to write the files (default: a temporary folder)")
    p.add_argument(
        "--only",
        action="append",
        metavar="TEXT",
        help="run only the rows whose label holds TEXT (repeatable, or comma-separated: "
        "'inspect,verify,diff,extract', 'convert')",
    )
    args = p.parse_args()
    if not args.commands:
        p.error("say which rows to run: --commands")
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    modes = {"without": [False], "with": [True], "both": [False, True]}[args.adam]
    figures: dict[str, Any] = {"load_average": list(load), "commands": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for n in (int(s) for s in args.sizes.split(",")):
            for adam in modes:
                print(f"{n:,} variables x {DEVICES} components{' + Adam slots' if adam else ''}:")
                sub = os.path.join(folder, f"{n}{adam}")
                os.makedirs(sub)
                only = [t for text in args.only for t in text.split(",")] if args.only else None
                figures["commands"].append(commands(sub, n, adam, only))
                subprocess.run(["rm", "-rf", sub], check=False)
    figures["load_average_end"] = list(os.getloadavg())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
