"""What the cyclic garbage collector costs a save and a restore of many variables.

The library never pauses the collector (a pause is visible to every thread, a training loop
beside a non-blocking save included); a restore only exempts the objects older than itself from
its collections (``gc.freeze()``). This measures what running the collector costs: one model of ``--variables`` mirrored float32 variables (50,000 by default, 20
parameters each, on 2 devices), and each operation timed in rounds, once with the collector on
(as a program runs) and once with it disabled by this benchmark around the call (what the
library used to do), in the same run:

* save: a repeated ``Checkpoint.write`` of the same structure (written from the skeleton);
* async_save: ``CheckpointManager.save(blocking=False)`` and ``wait()`` (snapshot + write);
* restore: ``Checkpoint.restore(path).assert_consumed()``.

Prints the best time of each and the ratio on/off (1.0: the collector costs nothing).

    python bench/bench_gc.py [--variables 50000] [--repeat 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np

import parallelvars as pv


def timed(fn: Callable[[], object], collector: bool) -> float:
    gc.collect()
    was = gc.isenabled()
    if not collector:
        gc.disable()
    try:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    finally:
        if was:
            gc.enable()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--variables", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with pv.MirroredStrategy(2).scope():
        model = pv.Module()
        model.vars = [
            pv.Variable(np.full(20, i, np.float32), name=f"v{i}") for i in range(args.variables)
        ]
    ckpt = pv.Checkpoint(model=model)
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "a.h5")
    ckpt.write(path)  # the first save of the structure (HDF5 builds it): not timed
    mgr = pv.CheckpointManager(ckpt, os.path.join(folder, "managed"), max_to_keep=1)
    mgr.save()

    def async_save() -> None:
        mgr.save(blocking=False)
        mgr.wait()

    ops: dict[str, Callable[[], object]] = {
        "save": lambda: ckpt.write(path),
        "async_save": async_save,
        "restore": lambda: ckpt.restore(path).assert_consumed(),
    }
    best: dict[str, dict[str, float]] = {
        op: {"on": float("inf"), "off": float("inf")} for op in ops
    }
    for _ in range(args.repeat):  # rounds: on and off see the same load
        for op, fn in ops.items():
            for mode in ("on", "off"):
                best[op][mode] = min(best[op][mode], timed(fn, mode == "on"))
    mgr.close()
    print(f"{args.variables} variables (best of {args.repeat}); load {os.getloadavg()[0]:.2f}")
    print(f"{'operation':<12} {'collector on':>13} {'off':>9} {'on/off':>7}")
    out = {}
    for op, t in best.items():
        ratio = t["on"] / t["off"]
        out[op] = {**t, "ratio": ratio}
        print(f"{op:<12} {t['on']:>12.3f}s {t['off']:>8.3f}s {ratio:>6.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"variables": args.variables, "times": out}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
