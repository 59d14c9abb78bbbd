"""The cost of checking variable-length attribute values in ``verify_all``, in one run.

Model: ``--variables`` small variables (5,000 by default), a third mirrored on 2 devices, a
third sharded on 2 devices, a third single, so every group carries variable-length string
attributes (kind, dtype, aggregation, devices). Timed: ``H5Reader.verify_all`` as it is (the
global heap objects of those attributes validated by our parser, their values compared with
the index) against the baseline of the same call with the heap check left out (the values'
presence only, as verify did before), in interleaved rounds.

    python bench/bench_verify.py [--variables 5000] [--repeat 5]

Prints the best time of each and the ratio ours/baseline (target <= 1.10).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

import parallelvars as pv
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.checkpoint.h5io.stored import StoredVariable


def model(variables: int) -> pv.Module:
    m = pv.Module()
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((4, 8)).astype(np.float32) for _ in range(variables)]
    with pv.MirroredStrategy(2).scope():
        vs = [
            pv.Variable(x, name=f"v{i}", **({"shard_axis": 0} if i % 3 == 1 else {}))
            for i, x in enumerate(data)
            if i % 3 != 2
        ]
    vs += [pv.Variable(x, name=f"v{i}") for i, x in enumerate(data) if i % 3 == 2]
    m.vs = vs
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variables", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = pv.Checkpoint(model=model(args.variables)).write(os.path.join(d, "c.h5"))
        checked = StoredVariable.verify_group

        def presence_only(self: StoredVariable, heap: object = None) -> None:
            checked(self, None)

        def run(patch: bool) -> float:
            StoredVariable.verify_group = presence_only if patch else checked  # type: ignore[method-assign]
            try:
                with H5Reader(path) as r:
                    t = time.perf_counter()
                    problems = r.verify_all()
                    elapsed = time.perf_counter() - t
            finally:
                StoredVariable.verify_group = checked  # type: ignore[method-assign]
            assert problems == [], problems[:3]
            return elapsed

        times: dict[str, list[float]] = {"ours": [], "baseline": []}
        for _ in range(args.repeat):
            times["ours"].append(run(False))
            times["baseline"].append(run(True))
        ours, base = min(times["ours"]), min(times["baseline"])
        print(f"verify_all, {args.variables} variables ({os.path.getsize(path)} bytes)")
        print(f"  baseline (heap not checked): {base:.3f} s")
        print(f"  ours (heap checked, values compared): {ours:.3f} s")
        print(f"  ours/baseline: {ours / base:.3f} (target <= 1.10)")


if __name__ == "__main__":
    main()
