"""The calling thread's cost of a non-blocking ``CheckpointManager.save``, in one run against a
blocking ``Checkpoint.write`` of the same model and safetensors ``save_file`` + fsync.

Models: the ``5k`` and ``50k`` sizes of ``bench_checkpoint.py --peers`` (5,000 or 50,000
float32 variables of log-uniform sizes, 20 MB in all, one component each). Every save is a
repeated one (the structure was saved before). Per round, one of each in turn, so all see the
same load; best of ``--repeat`` rounds:

* ``async_call``: ``manager.save(blocking=False)`` until it returns (the snapshot of the
  variables: what training waits for); ``async_total``: until ``manager.wait()`` returns
  (the background write as well, nothing else running).
* ``blocking``: ``Checkpoint.write`` to a new file (fsync and rename included).
* ``safetensors``: ``safetensors.numpy.save_file`` + fsync of the same tensors.

    python bench/bench_async_save.py [--sizes 5k,50k] [--repeat 5] [--dir DIR] [--json PATH]

Prints the times, the per-variable cost of the call, and the ratios call/blocking and
call/safetensors (lower is better: the share of a save that training still waits for), and
total/blocking (the whole non-blocking save, which also commits it in the manager's
directory, against the blocking write: the work the background thread adds).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
from bench_checkpoint import PEER_SIZES, fsync_file, peer_model, remove

import parallelvars as pv

try:
    import safetensors.numpy
except ImportError:
    safetensors = None  # type: ignore[assignment]


def one(name: str, repeat: int, directory: str | None) -> dict:
    _, variables, devices, params = PEER_SIZES[name]
    model = peer_model(variables, devices, params, np.random.default_rng(0))
    named = {f"v{i}/{j}": c for i, v in enumerate(model.vars) for j, c in enumerate(v.components)}
    times: dict[str, list[float]] = {
        k: [] for k in ("async_call", "async_total", "blocking", "safetensors")
    }
    with tempfile.TemporaryDirectory(dir=directory) as d:
        ckpt = pv.Checkpoint(model=model)
        mgr = pv.CheckpointManager(ckpt, os.path.join(d, "managed"), max_to_keep=1)
        ours, st = os.path.join(d, "o.h5"), os.path.join(d, "st.bin")
        ckpt.write(ours)  # the structure's first save
        mgr.save(blocking=False)  # and the manager's: every timed save is a repeated one
        mgr.wait()
        for _ in range(repeat):
            remove(ours)
            t = time.perf_counter()
            ckpt.write(ours)
            times["blocking"].append(time.perf_counter() - t)

            if safetensors is not None:
                remove(st)
                t = time.perf_counter()
                safetensors.numpy.save_file(named, st)
                fsync_file(st)
                times["safetensors"].append(time.perf_counter() - t)

            t = time.perf_counter()
            mgr.save(blocking=False)
            times["async_call"].append(time.perf_counter() - t)
            mgr.wait()
            times["async_total"].append(time.perf_counter() - t)
        mgr.close()
    best = {k: min(v) for k, v in times.items() if v}
    ratios = {
        "call_vs_blocking": best["async_call"] / best["blocking"],
        "total_vs_blocking": best["async_total"] / best["blocking"],
    }
    if "safetensors" in best:
        ratios["call_vs_safetensors"] = best["async_call"] / best["safetensors"]
    return {
        "size": name,
        "variables": variables,
        "times": best,
        "call_per_variable_us": best["async_call"] / variables * 1e6,
        "ratios": ratios,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="5k,50k")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = ap.parse_args()
    results = []
    print(f"non-blocking manager save, best of {args.repeat} rounds (times in s)")
    print(
        f"{'size':6}{'call':>9}{'total':>9}{'blocking':>10}{'st':>9}"
        f"{'call/var (us)':>15}{'call/blocking':>15}{'call/st':>9}{'total/blocking':>16}"
    )
    for name in (n.strip() for n in args.sizes.split(",") if n.strip()):
        r = one(name, args.repeat, args.dir)
        t, q = r["times"], r["ratios"]
        st_time = f"{t['safetensors']:9.3f}" if "safetensors" in t else f"{'-':>9}"
        st_ratio = f"{q['call_vs_safetensors']:9.3f}" if "call_vs_safetensors" in q else f"{'-':>9}"
        print(
            f"{name:6}{t['async_call']:9.3f}{t['async_total']:9.3f}{t['blocking']:10.3f}"
            f"{st_time}{r['call_per_variable_us']:15.2f}{q['call_vs_blocking']:15.3f}{st_ratio}"
            f"{q['total_vs_blocking']:16.3f}"
        )
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"benchmark": "async_save", "repeat": args.repeat, "sizes": results}, f, indent=2
            )


if __name__ == "__main__":
    main()
