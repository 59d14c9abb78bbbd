"""Benchmark: what the gradients that still take the per-variable path cost inside ``strategy.run``.

docs/training.md lists the gradients ``apply_gradients`` reduces one variable at a time
(``batch_reduce``) instead of on the fused path; this measures each, 4 replicas, Adam, on
variables of model B's size (512 float32 parameters, 8 x 64 where rows matter), against the
fused step of the same variables in the same run, taken in turns:

* **run**: every replica hands its own float32 arrays of every variable (all fused);
* **form**: the same, but the replicas disagree about the form of one variable's gradient
  (replica 0 an ``IndexedSlices`` of all its rows, the others arrays): that variable is reduced
  per variable, the rest fused;
* **dtypes**: the replicas disagree about one variable's dtype (replica 0 float64, the others
  float32: ``add_n`` promotes to float64): that variable per variable, the rest fused;
* **sparse**: an ``IndexedSlices`` of 4 rows per variable per replica, arena variables (the
  vectorised sparse route), and **sparse_cast**: the same with float64 values for float32
  variables (once every variable per variable; the sparse route now sums them in float64 and
  rounds once, so this row prices that rounding);
* **own_sparse**: those sparse gradients of sharded variables made around arrays of their own
  (``ShardedVariable(array, ...)``, no arena), against **arena_sparse**, the same variables
  made by ``pv.Variable(..., shard_axis=0)``.

Each row prints its time, its ratio to its baseline, and what it costs per variable that took
the per-variable path.

    python bench/bench_pervar_routes.py                 # 2,000 variables (200 for own_sparse)
    python bench/bench_pervar_routes.py --scale 0.1     # a quick check
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from bench_train_step import _model
from bench_update import B1, B2, EPS, LR, TIMERS, _time_interleaved

import parallelvars as pv
from parallelvars.variables import ShardedVariable

SHAPE = (8, 64)
ROWS = 4


def _variables(
    strategy: pv.MirroredStrategy, n: int, rng: np.random.Generator, shard: bool = False
) -> tuple[list[pv.ParallelVariable], pv.optimizers.Optimizer]:
    return _model(strategy, [SHAPE] * n, rng, shard_axis=0 if shard else None)


def _own_arrays(
    strategy: pv.MirroredStrategy, n: int, rng: np.random.Generator
) -> tuple[list[ShardedVariable], pv.optimizers.Optimizer]:
    with strategy.scope():
        device = pv.Variable(np.zeros(1, np.float32), name="d").device
        vs = [
            ShardedVariable(
                rng.standard_normal(SHAPE, dtype=np.float32),
                device=device,
                name=f"s{i}",
                shard_axis=0,
                trainable=True,
            )
            for i in range(n)
        ]
        opt = pv.optimizers.Adam(LR, B1, B2, EPS)
    return vs, opt


def _step(
    strategy: pv.MirroredStrategy,
    vs: list[object],
    opt: pv.optimizers.Optimizer,
    per_replica: list[list[object]],
) -> Callable[[], object]:
    def replica_step(grads: list[object]) -> None:
        opt.apply_gradients(zip(grads, vs, strict=True))

    arg = pv.PerReplica(per_replica)
    return lambda: strategy.run(replica_step, args=(arg,))


def _dense(rng: np.random.Generator, n: int, replicas: int) -> list[list[object]]:
    return [
        [rng.standard_normal(SHAPE, dtype=np.float32) for _ in range(n)] for _ in range(replicas)
    ]


def _sparse(
    rng: np.random.Generator, n: int, replicas: int, dtype: object = np.float32
) -> list[list[object]]:
    return [
        [
            pv.IndexedSlices(
                rng.standard_normal((ROWS, SHAPE[1])).astype(dtype),
                rng.integers(0, SHAPE[0], ROWS),
                SHAPE,
            )
            for _ in range(n)
        ]
        for _ in range(replicas)
    ]


def run(
    n: int, n_own: int, replicas: int, steps: int, timer: Callable[[], float]
) -> dict[str, float]:
    rng = np.random.default_rng(0)
    strategy = pv.MirroredStrategy(replicas)
    dense = _dense(rng, n, replicas)
    form = [list(g) for g in dense]
    form[0][0] = pv.IndexedSlices(np.asarray(dense[0][0]), np.arange(SHAPE[0]), SHAPE)
    dtypes = [list(g) for g in dense]
    dtypes[0][0] = np.asarray(dense[0][0], np.float64)
    sparse = _sparse(rng, n, replicas)
    own = _sparse(rng, n_own, replicas)
    fns: dict[str, Callable[[], object]] = {}
    for name, grads in (("run", dense), ("form", form), ("dtypes", dtypes), ("sparse", sparse)):
        fns[name] = _step(strategy, *_variables(strategy, n, rng), grads)  # type: ignore[arg-type]
    fns["sparse_cast"] = _step(
        strategy,
        *_variables(strategy, n, rng),  # type: ignore[arg-type]
        _sparse(rng, n, replicas, np.float64),
    )
    fns["arena_sparse"] = _step(strategy, *_variables(strategy, n_own, rng, True), own)  # type: ignore[arg-type]
    fns["own_sparse"] = _step(strategy, *_own_arrays(strategy, n_own, rng), own)  # type: ignore[arg-type]
    return _time_interleaved(fns, steps, timer)


# What each row is: (name, description, baseline, variables that take the per-variable path).
def rows(n: int, n_own: int) -> list[tuple[str, str, str | None, int]]:
    return [
        ("run", "per-replica float32 arrays, all fused", None, 0),
        ("form", "one variable: replica 0 an IndexedSlices, the others arrays", "run", 1),
        ("dtypes", "one variable: replica 0 float64, the others float32", "run", 1),
        ("sparse", f"IndexedSlices, {ROWS} rows per variable per replica", "run", 0),
        ("sparse_cast", "the same with float64 values (float32 variables)", "sparse", n),
        ("arena_sparse", f"{n_own} sharded variables, IndexedSlices", None, 0),
        (
            "own_sparse",
            "the same, sharded variables around arrays of their own",
            "arena_sparse",
            n_own,
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=7, help="timed steps (best of)")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of 2,000 variables")
    parser.add_argument("--timer", choices=sorted(TIMERS), default="wall")
    args = parser.parse_args(argv)
    n = max(2, round(2000 * args.scale))
    n_own = max(2, round(200 * args.scale))
    started = time.strftime("%H:%M:%S")
    t = run(n, n_own, args.replicas, args.steps, TIMERS[args.timer])
    print(
        f"Adam inside strategy.run, {args.replicas} replicas, {n:,} variables of "
        f"{SHAPE[0]} x {SHAPE[1]} float32, best of {args.steps} ({args.timer} time, "
        f"started {started})"
    )
    print(f"{'step':<15}{'ms':>9}{'vs':>14}{'ratio':>8}{'us/var':>9}  what")
    for name, what, base, slow in rows(n, n_own):
        ratio = f"{t[name] / t[base]:.2f}x" if base else ""
        per = f"{1e6 * (t[name] - t[base]) / slow:.0f}" if base and slow else ""
        print(f"{name:<15}{1e3 * t[name]:>9.1f}{base or '':>14}{ratio:>8}{per:>9}  {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
