"""Save and restore throughput of the native checkpoint against raw file I/O, in one run.

Model: 200 mirrored float32 variables of mixed sizes (25M parameters by default) on 4 devices,
so 4 components each (400 MB by default). Baselines, on the same bytes and the same disk:
save = ``ndarray.tofile`` of every component into one new file + fsync; restore = ``readinto``
every component buffer from that file. Our save includes checksums, fsync and the atomic
rename; our restore includes checksum verification of every component before any write.

    python bench/bench_checkpoint.py [--params 25e6] [--variables 200] [--devices 4] [--repeat 3]
                                     [--json PATH]

Prints times and the rate ratio ours/raw (1.0 = as fast as raw I/O; target >= 0.7), for
restore both with the files in the page cache and with their pages evicted first. ``--json PATH``
also writes the figures (times in seconds, ratios, targets and whether each was met) to PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

import parallelvars as pv


def sizes(total: int, count: int, rng: np.random.Generator) -> list[int]:
    weights = np.exp(rng.uniform(0, np.log(1000), count))  # log-uniform: a few big, many small
    out = np.maximum(1, (weights / weights.sum() * total).astype(np.int64))
    out[np.argmax(out)] += total - out.sum()
    return [int(s) for s in out]


def raw_save(path: str, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as f:
        for a in arrays:
            a.tofile(f)
        f.flush()
        os.fsync(f.fileno())


def raw_restore(path: str, arrays: list[np.ndarray]) -> None:
    with open(path, "rb", buffering=0) as f:
        for a in arrays:
            f.readinto(memoryview(a).cast("B"))


def evict(*paths: str) -> None:
    """Drop the files' pages from the page cache (they are fsynced, so this is allowed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(*paths: str) -> None:
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)


def best(fn, repeat: int, before=None) -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


TARGET = 0.7  # rate ratio ours / raw, for save and both restores


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--params", type=float, default=25e6)
    ap.add_argument("--variables", type=int, default=200)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    model = pv.Module()
    with pv.MirroredStrategy(args.devices).scope():
        model.vars = [
            pv.Variable(rng.standard_normal(s).astype(np.float32), name=f"v{i}")
            for i, s in enumerate(sizes(int(args.params), args.variables, rng))
        ]
    components = [c for v in model.vars for c in v.components]
    nbytes = sum(c.nbytes for c in components)
    ckpt = pv.Checkpoint(model=model)

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        raw_path, ours = os.path.join(d, "raw.bin"), os.path.join(d, "ckpt.h5")
        # Each save writes a new file: removing the previous one (freeing its blocks) is not
        # part of writing the bytes, and would otherwise be timed for both sides.
        t_raw_save = best(
            lambda: raw_save(raw_path, components), args.repeat, before=lambda: remove(raw_path)
        )
        t_save = best(lambda: ckpt.write(ours), args.repeat, before=lambda: remove(ours))
        t_raw_restore = best(lambda: raw_restore(raw_path, components), args.repeat)
        t_restore = best(lambda: ckpt.restore(ours).assert_consumed(), args.repeat)
        cold = lambda: evict(raw_path, ours)  # noqa: E731
        t_raw_cold = best(lambda: raw_restore(raw_path, components), args.repeat, before=cold)
        t_cold = best(lambda: ckpt.restore(ours).assert_consumed(), args.repeat, before=cold)
        file_size = os.path.getsize(ours)

    gb = nbytes / 1e9
    print(
        f"checkpoint: {args.variables} variables, {int(args.params):,} parameters x {args.devices} components "
        f"= {nbytes / 1e6:.0f} MB (file {file_size / 1e6:.0f} MB), best of {args.repeat}"
    )
    print(f"{'':10}{'raw (s)':>10}{'ours (s)':>10}{'raw GB/s':>10}{'ours GB/s':>11}{'ratio':>8}")
    rows = (
        ("save", t_raw_save, t_save),
        ("restore", t_raw_restore, t_restore),
        ("restore*", t_raw_cold, t_cold),
    )
    for name, raw, our in rows:
        print(f"{name:10}{raw:10.3f}{our:10.3f}{gb / raw:10.2f}{gb / our:11.2f}{raw / our:8.2f}")
    print("restore: files in the page cache; restore*: pages evicted first (read from disk)")
    if args.json:
        keys = {"save": "save", "restore": "restore_warm", "restore*": "restore_evicted"}
        ratios = {keys[name]: raw / our for name, raw, our in rows}
        figures = {
            "benchmark": "checkpoint",
            "params": {
                "params": int(args.params),
                "variables": args.variables,
                "devices": args.devices,
                "repeat": args.repeat,
            },
            "bytes": nbytes,
            "file_bytes": file_size,
            "times": {
                f"{keys[name]}_{who}_s": t
                for name, raw, our in rows
                for who, t in (("raw", raw), ("ours", our))
            },
            "ratios": ratios,
            "targets": {
                k: {"op": ">=", "value": TARGET, "met": r >= TARGET} for k, r in ratios.items()
            },
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
