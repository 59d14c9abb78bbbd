"""The HDF5 metadata generator alone (``h5raw.generate.FilePlan``): CPU time per entry and the
plan's memory, on a first save's own records.

For N variables (default 5,000 and 50,000) mirrored on 2 devices (100 float32 parameters
each), with and without Adam slots, ``layered`` (``model/layers/<k>/w<j>``, 100 a group) and
``flat`` (one list of N), each case in a fresh process: the records a first save gathers, their
sharing and classes as the save finds them, then

* ``plan``: ``FilePlan(...)`` as a save makes it (records passed as they are);
* ``image``: every window of its metadata (``FilePlan.chunks``), as a save writes it;

CPU time of each (best of ``--repeat``), per entry (variable or slot), and with ``tracemalloc``
the plan's memory once made (what it holds while the save runs) and the peak of the two steps
above what was allocated before. Against the cost of ``safetensors.numpy.save_file`` of the same
tensors (to memory: ``save``, no disk) measured in the same process, so that the ratio holds on
a loaded machine. The plan and the image are timed as a save makes them: with the objects
made before frozen (``older_objects_frozen``: the collector does not walk the model).

With ``--baseline TREE`` (a checkout of another revision, e.g. ``git worktree add --detach
/tmp/main main``), each case runs that tree's generator and this one's alternately
(``--rounds`` times each, in fresh processes), and prints the best of each and their ratio.

    python bench/bench_generate.py [--sizes 5000,50000] [--structures layered,flat] \\
        [--repeat 3] [--baseline TREE [--rounds 2]] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
from typing import Any


def _env_of(tree: str | None) -> dict[str, str] | None:
    """The environment of a child that imports ``parallelvars`` from ``tree`` (its folder first
    on ``PYTHONPATH``, ahead of the installed editable one); None: this tree's."""
    if tree is None:
        return None
    path = os.pathsep.join(p for p in (os.path.abspath(tree), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def worker(count: int, adam: bool, layered: bool, repeat: int) -> dict[str, Any]:
    from bench_paths import _model, _tensors  # (run as bench/bench_generate.py)

    from parallelvars.checkpoint._gcfreeze import older_objects_frozen
    from parallelvars.checkpoint.h5io.layout import COLUMNS_DATASET, INDEX_DATASET
    from parallelvars.checkpoint.h5io.records import record_classes
    from parallelvars.checkpoint.h5raw.component_bytes import _checksummed
    from parallelvars.checkpoint.h5raw.generate import FilePlan

    ckpt, _ = _model(count, 100, 2, adam, layered)
    records, _, _ = ckpt._gather(False)
    _, _, shared, _ = _checksummed(records, True)
    classes = record_classes(records, shared)
    root = {"parallelvars_format": 1, "created": 0.0}
    documents = [INDEX_DATASET, COLUMNS_DATASET]
    caps = {INDEX_DATASET: 1 << 20, COLUMNS_DATASET: 1 << 20}

    def plan() -> Any:
        return FilePlan(
            records, root_attrs=root, documents=documents, shared=shared, classes=classes
        )

    def image(p: Any) -> int:
        return sum(len(b) for _, b in p.chunks(caps))

    best_plan = best_image = float("inf")
    for _ in range(repeat):
        gc.collect()
        with older_objects_frozen():
            c = time.process_time()
            p = plan()
            best_plan = min(best_plan, time.process_time() - c)
            c = time.process_time()
            image(p)
            best_image = min(best_image, time.process_time() - c)
            del p
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    p = plan()
    held = tracemalloc.get_traced_memory()[0] - base
    image(p)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    del p
    tensors = _tensors(ckpt)
    from safetensors.numpy import save

    best_st = float("inf")
    for _ in range(repeat):
        c = time.process_time()
        save(tensors)
        best_st = min(best_st, time.process_time() - c)
    return {
        "entries": len(records),
        "plan_s": best_plan,
        "image_s": best_image,
        "held_mb": held / 2**20,
        "peak_mb": peak / 2**20,
        "st_s": best_st,
    }


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The best of several runs of one case: the least of each time (memory is the same)."""
    best = dict(runs[0])
    for key in ("plan_s", "image_s", "st_s"):
        best[key] = min(r[key] for r in runs)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="5000,50000")
    ap.add_argument("--structures", default="layered,flat")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", help="a source tree to compare with, alternately")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tree (--baseline)")
    ap.add_argument("--json", help="also write the figures to this JSON file (run_all.py)")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        count, adam, layered, repeat = map(int, args.worker)
        print(json.dumps(worker(count, bool(adam), bool(layered), repeat)))
        return 0
    load = os.getloadavg()[0]
    print(f"load: {load:.2f}", flush=True)
    results: list[dict[str, Any]] = []
    for count in map(int, args.sizes.split(",")):
        for structure in args.structures.split(","):
            for adam in (False, True):
                flags = [str(count), str(int(adam)), str(int(structure == "layered"))]
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", *flags]
                label = f"{count} {structure}{' +Adam' if adam else ''}"
                trees = [None] if not args.baseline else [args.baseline, None] * args.rounds
                runs: dict[Any, list[dict[str, Any]]] = {}
                for tree in trees:
                    done = subprocess.run(
                        [*cmd, str(args.repeat)],
                        env=_env_of(tree),
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    if done.returncode:
                        break
                    runs.setdefault(tree, []).append(
                        json.loads(done.stdout.strip().splitlines()[-1])
                    )
                if done.returncode:
                    print(f"  {label}: failed: {done.stderr.strip()[-400:]}", flush=True)
                    results.append({"label": label, "failed": done.stderr.strip()[-400:]})
                    continue
                r = _best(runs[None])
                n = r["entries"]
                total = r["plan_s"] + r["image_s"]
                if args.baseline:
                    b = _best(runs[args.baseline])
                    base = b["plan_s"] + b["image_s"]
                    r["baseline"] = b
                    print(
                        f"  {label:22s} baseline plan {1e6 * b['plan_s'] / n:5.1f} + image "
                        f"{1e6 * b['image_s'] / n:5.1f} = {1e6 * base / n:5.1f} us/entry, holds "
                        f"{b['held_mb']:6.1f} MB, peak {b['peak_mb']:6.1f} MB; this tree / "
                        f"baseline: CPU {total / base:4.2f}, holds "
                        f"{r['held_mb'] / max(b['held_mb'], 1e-9):4.2f}",
                        flush=True,
                    )
                results.append({"label": label, **r})
                print(
                    f"  {label:22s} {n:6d} entries  plan {1e6 * r['plan_s'] / n:5.1f} + image "
                    f"{1e6 * r['image_s'] / n:5.1f} = {1e6 * total / n:5.1f} us/entry CPU "
                    f"(safetensors save {1e6 * r['st_s'] / n:5.1f} us/entry; gen/st "
                    f"{total / max(r['st_s'], 1e-9):4.2f})  plan holds {r['held_mb']:6.1f} MB "
                    f"({1e6 * r['held_mb'] * 2**20 / n / 1e6:5.0f} B/entry), peak "
                    f"{r['peak_mb']:6.1f} MB",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"load": load, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
