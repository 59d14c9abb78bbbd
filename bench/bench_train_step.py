"""Benchmark: the training step users write, ``opt.apply_gradients`` inside ``strategy.run``.

Every replica holds its own float32 gradients (a ``PerReplica`` argument, as a data-parallel
step has them) and calls ``opt.apply_gradients(zip(grads, variables))`` inside
``strategy.run(step)``, exactly as the README and docs/training.md write it. Measured against,
in the same run and in turns:

* **core**: the update core alone, ``opt.distributed_apply`` with one already-reduced gradient
  per variable (what the step costs without reducing anything);
* **loop**: the per-component loop a user would write without the library: sum the replicas'
  gradients of a variable, then update each replica's copy with numpy;
* **apply**: the same in-run step written ``opt.apply(grads, variables)`` (two lists, no pair
  per variable);
* **buffers**: the in-run step with the replicas' gradients already in
  ``opt.gradient_buffers(variables)`` views (written in place by the gradient code), so
  ``apply_gradients`` skips the gathering copy;
* **shared**: the in-run step with one gradient list that every replica hands in (the same
  array objects, as ``pv.PerReplica([grads] * 4)`` passes them): each replica's term is
  summed, so it must cost what ``run`` costs;
* **bf16**: the in-run step of bfloat16 variables with bfloat16 gradients (Adam computed in
  float32 per block, rounded once into the variable and its slots);
* **sharded**: the in-run step of float32 variables sharded along axis 0 (10 x 50 each for
  model B, 500 x 100 for model A), per-replica gradients of the full shape;
* **sparse**: the in-run step with one ``IndexedSlices`` of 4 rows per variable per replica, on
  variables of those 2-D shapes (its dense counterpart is ``run``: as many parameters);
* **tf**: ``tf.distribute.MirroredStrategy`` on 4 logical CPU devices doing the same step, when
  TensorFlow is importable (an optional anchor, skipped otherwise).

    python bench/bench_train_step.py                        # model A and B, 4 replicas
    python bench/bench_train_step.py --scale 0.05 --steps 3 # a quick check
    python bench/bench_train_step.py --json step.json       # also write the figures as JSON

Targets: in-run <= 1.35x the core alone for model A (200 vars, 10M params) and <= 1.5x for
model B (2,000 vars, 1M params); the shared-gradient step <= 1.5x the in-run step with
per-replica arrays, for both, and the bfloat16 and sharded steps <= 1.5x the float32 in-run
step; the sparse step <= 2x the dense in-run step. (The core itself is only ~9-10x the
per-component loop on model B, so the loop is reported, not a target.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import ml_dtypes
import numpy as np
from bench_update import (
    B1,
    B2,
    EPS,
    LR,
    _time_interleaved,
    check_targets,
    models_of,
    parse_args,
    write_json,
)

import parallelvars as pv


def _model(
    strategy: pv.MirroredStrategy,
    sizes: list[int] | list[tuple[int, ...]],
    rng: np.random.Generator,
    dtype: object = np.float32,
    shard_axis: int | None = None,
) -> tuple[list[pv.ParallelVariable], pv.optimizers.Optimizer]:
    with strategy.scope():
        vs = [
            pv.Variable(
                rng.standard_normal(s, dtype=np.float32).astype(dtype),
                name=f"v{i}",
                shard_axis=shard_axis,
            )
            for i, s in enumerate(sizes)
        ]
        opt = pv.optimizers.Adam(LR, B1, B2, EPS)
    return vs, opt


def make_core(
    strategy: pv.MirroredStrategy,
    sizes: list[int],
    grads: list[np.ndarray],
    rng: np.random.Generator,
) -> Callable[[], object]:
    vs, opt = _model(strategy, sizes, rng)
    pairs = list(zip(grads, vs, strict=True))

    def step() -> None:
        with strategy.scope():
            opt.distributed_apply(strategy, pairs)

    return step


def make_run(
    strategy: pv.MirroredStrategy,
    sizes: list[int] | list[tuple[int, ...]],
    per_replica: list[list[np.ndarray]],
    rng: np.random.Generator,
    shard_axis: int | None = None,
) -> Callable[[], object]:
    vs, opt = _model(strategy, sizes, rng, per_replica[0][0].dtype, shard_axis)

    def replica_step(grads: list[np.ndarray]) -> None:
        opt.apply_gradients(zip(grads, vs, strict=True))

    arg = pv.PerReplica(per_replica)
    return lambda: strategy.run(replica_step, args=(arg,))


def make_apply(
    strategy: pv.MirroredStrategy,
    sizes: list[int],
    per_replica: list[list[np.ndarray]],
    rng: np.random.Generator,
) -> Callable[[], object]:
    vs, opt = _model(strategy, sizes, rng)

    def replica_step(grads: list[np.ndarray]) -> None:
        opt.apply(grads, vs)

    arg = pv.PerReplica(per_replica)
    return lambda: strategy.run(replica_step, args=(arg,))


def make_buffers(
    strategy: pv.MirroredStrategy,
    sizes: list[int],
    per_replica: list[list[np.ndarray]],
    rng: np.random.Generator,
) -> Callable[[], object]:
    vs, opt = _model(strategy, sizes, rng)
    with strategy.scope():
        bufs = opt.gradient_buffers(vs)
    for r, grads in enumerate(per_replica):  # as if the gradient code had written them in place
        for view, g in zip(bufs.views(r), grads, strict=True):
            view[...] = g

    def replica_step() -> None:
        opt.apply_gradients(bufs.grads_and_vars())

    return lambda: strategy.run(replica_step)


def shape_2d(size: int) -> tuple[int, int]:
    """The 2-D shape the sharded and sparse rows give a variable of ``size`` parameters:
    10 x 50 (model B), 500 x 100 (model A)."""
    rows = 10 if size < 10_000 else size // 100
    if size % rows:
        raise ValueError(f"no 2-D shape of {rows} rows for {size} parameters")
    return rows, size // rows


def make_sparse(
    strategy: pv.MirroredStrategy,
    shapes: list[tuple[int, int]],
    rows: int,
    rng: np.random.Generator,
) -> Callable[[], object]:
    """The in-run step with an ``IndexedSlices`` of ``rows`` rows per variable per replica."""
    replicas = strategy.num_replicas_in_sync
    vs, opt = _model(strategy, shapes, rng)
    per_replica = [
        [
            pv.IndexedSlices(
                rng.standard_normal((rows, s[1]), dtype=np.float32),
                rng.integers(0, s[0], rows),
                s,
            )
            for s in shapes
        ]
        for _ in range(replicas)
    ]

    def replica_step(grads: list[pv.IndexedSlices]) -> None:
        opt.apply_gradients(zip(grads, vs, strict=True))

    arg = pv.PerReplica(per_replica)
    return lambda: strategy.run(replica_step, args=(arg,))


def make_loop(
    sizes: list[int], per_replica: list[list[np.ndarray]], rng: np.random.Generator
) -> Callable[[], object]:
    replicas = len(per_replica)
    comps = [[rng.standard_normal(s, dtype=np.float32) for _ in range(replicas)] for s in sizes]
    ms = [[np.zeros(s, np.float32) for _ in range(replicas)] for s in sizes]
    vs = [[np.zeros(s, np.float32) for _ in range(replicas)] for s in sizes]
    state = {"t": 0}

    def step() -> None:
        state["t"] += 1
        t = state["t"]
        lr_t = LR * math.sqrt(1 - B2**t) / (1 - B1**t)
        for j in range(len(sizes)):
            g = per_replica[0][j].copy()
            for r in range(1, replicas):
                g += per_replica[r][j]
            for d in range(replicas):
                m, v, var = ms[j][d], vs[j][d], comps[j][d]
                m[...] = B1 * m + (1 - B1) * g
                v[...] = B2 * v + (1 - B2) * g * g
                var -= lr_t * m / (np.sqrt(v) + EPS)

    return step


def make_tf(
    sizes: list[int], per_replica: list[list[np.ndarray]]
) -> dict[str, Callable[[], object]]:
    """``tf.distribute.MirroredStrategy`` on 4 logical CPUs, eager and in ``tf.function``."""
    try:
        import tensorflow as tf  # type: ignore[import-not-found]
    except ImportError:
        return {}
    replicas = len(per_replica)
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas
        )
    except RuntimeError:  # already initialised
        pass
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        vs = [tf.Variable(np.zeros(s, np.float32)) for s in sizes]
        opt = tf.keras.optimizers.Adam(LR, B1, B2, EPS)
    grads = strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.constant(g) for g in per_replica[ctx.replica_id_in_sync_group]]
    )

    def replica_step(gs: list[object]) -> None:
        opt.apply_gradients(zip(gs, vs, strict=True))

    graph = tf.function(lambda: strategy.run(replica_step, args=(grads,)))
    return {"tf_eager": lambda: strategy.run(replica_step, args=(grads,)), "tf_function": graph}


def run_model(label: str, n_vars: int, size: int, replicas: int, steps: int) -> dict[str, object]:
    rng = np.random.default_rng(0)
    sizes = [size] * n_vars
    per_replica = [
        [rng.standard_normal(s, dtype=np.float32) for s in sizes] for _ in range(replicas)
    ]
    reduced = [sum(g[j] for g in per_replica[1:]) + per_replica[0][j] for j in range(n_vars)]
    strategy = pv.MirroredStrategy(replicas)
    fns: dict[str, Callable[[], object]] = {
        "core": make_core(strategy, sizes, reduced, rng),
        "run": make_run(strategy, sizes, per_replica, rng),
        "apply": make_apply(strategy, sizes, per_replica, rng),
        "buffers": make_buffers(strategy, sizes, per_replica, rng),
        "shared": make_run(strategy, sizes, [per_replica[0]] * replicas, rng),
        "bf16": make_run(
            strategy, sizes, [[g.astype(ml_dtypes.bfloat16) for g in p] for p in per_replica], rng
        ),
        "sharded": make_run(
            strategy,
            [shape_2d(size)] * n_vars,
            [[g.reshape(shape_2d(size)) for g in p] for p in per_replica],
            rng,
            shard_axis=0,
        ),
        "sparse": make_sparse(strategy, [shape_2d(size)] * n_vars, SPARSE_ROWS, rng),
        "loop": make_loop(sizes, per_replica, rng),
    }
    fns.update(make_tf(sizes, per_replica))
    t = _time_interleaved(fns, steps)
    return {"label": label, "vars": n_vars, "params": n_vars * size, "times": t}


# Rows of each variable one replica's sparse gradient holds.
SPARSE_ROWS = 4

# The targets of the issue, per model: (ratio, comparison, bound).
TARGETS = {
    "A": [
        ("run_over_core", "<=", 1.35),
        ("shared_over_run", "<=", 1.5),
        ("bf16_over_run", "<=", 1.5),
        ("sharded_over_run", "<=", 1.5),
        ("sparse_over_run", "<=", 2.0),
    ],
    "B": [
        ("run_over_core", "<=", 1.5),
        ("shared_over_run", "<=", 1.5),
        ("bf16_over_run", "<=", 1.5),
        ("sharded_over_run", "<=", 1.5),
        ("sparse_over_run", "<=", 2.0),
    ],
}


def _model_json(r: dict[str, object]) -> dict[str, object]:
    t: dict[str, float] = r["times"]  # type: ignore[assignment]
    ratios = {
        "run_over_core": t["run"] / t["core"],
        "apply_over_core": t["apply"] / t["core"],
        "run_over_apply": t["run"] / t["apply"],
        "buffers_over_core": t["buffers"] / t["core"],
        "loop_over_run": t["loop"] / t["run"],
        "loop_over_buffers": t["loop"] / t["buffers"],
        "shared_over_run": t["shared"] / t["run"],
        "loop_over_shared": t["loop"] / t["shared"],
        "bf16_over_run": t["bf16"] / t["run"],
        "loop_over_bf16": t["loop"] / t["bf16"],
        "sharded_over_run": t["sharded"] / t["run"],
        "loop_over_sharded": t["loop"] / t["sharded"],
        "sparse_over_run": t["sparse"] / t["run"],
        "loop_over_sparse": t["loop"] / t["sparse"],
    }
    for k in ("tf_eager", "tf_function"):
        if k in t:
            ratios[f"{k}_over_run"] = t[k] / t["run"]
    targets = check_targets(ratios, TARGETS[str(r["label"])])
    return {
        "vars": r["vars"],
        "params": r["params"],
        "times": {f"{k}_s": v for k, v in t.items()},
        "ratios": ratios,
        "targets": targets,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, steps=9)
    models = models_of(args)
    print(
        f"float32 Adam inside strategy.run, {args.replicas} replicas with their own gradients, best of {args.steps}"
    )
    header = (
        f"{'model':<6}{'vars':>6}{'params':>12}{'core ms':>10}{'run ms':>10}{'apply ms':>10}"
        f"{'bufs ms':>10}{'loop ms':>10}{'tf ms':>10}{'run/core':>10}{'apply/core':>11}"
        f"{'bufs/core':>11}{'loop/run':>10}{'shared ms':>11}{'shared/run':>11}"
        f"{'bf16 ms':>9}{'bf16/run':>10}{'shard ms':>10}{'shard/run':>10}"
        f"{'sparse ms':>10}{'sparse/run':>11}"
    )
    print(header)
    print("-" * len(header))
    figures: dict[str, object] = {}
    for label, n_vars, size in models:
        r = run_model(label, n_vars, size, args.replicas, args.steps)
        figures[label] = _model_json(r)
        t: dict[str, float] = r["times"]  # type: ignore[assignment]
        tf_ms = f"{1e3 * t['tf_function']:.1f}" if "tf_function" in t else "skipped"
        print(
            f"{label:<6}{n_vars:>6}{n_vars * size:>12,}{1e3 * t['core']:>10.1f}{1e3 * t['run']:>10.1f}"
            f"{1e3 * t['apply']:>10.1f}{1e3 * t['buffers']:>10.1f}{1e3 * t['loop']:>10.1f}{tf_ms:>10}"
            f"{t['run'] / t['core']:>9.2f}x{t['apply'] / t['core']:>10.2f}x"
            f"{t['buffers'] / t['core']:>10.2f}x{t['loop'] / t['run']:>9.1f}x"
            f"{1e3 * t['shared']:>11.1f}{t['shared'] / t['run']:>10.2f}x"
            f"{1e3 * t['bf16']:>9.1f}{t['bf16'] / t['run']:>9.2f}x"
            f"{1e3 * t['sharded']:>10.1f}{t['sharded'] / t['run']:>9.2f}x"
            f"{1e3 * t['sparse']:>10.1f}{t['sparse'] / t['run']:>10.2f}x"
        )
    print("core: distributed_apply of reduced gradients; run: apply_gradients(zip(...)) in")
    print(
        "strategy.run with per-replica gradients; apply: the same as opt.apply(grads, variables);"
    )
    print("bufs: the same with gradient_buffers views; loop: per-component numpy;")
    print("shared: the in-run step with one gradient list that every replica hands in;")
    print("bf16: the in-run step of bfloat16 variables and gradients;")
    print("shard: the in-run step of float32 variables sharded along axis 0 (10 x 50, 500 x 100);")
    print(
        f"sparse: the in-run step with IndexedSlices of {SPARSE_ROWS} rows per variable per replica"
    )
    print("  on the same 2-D variables (run: the dense step of as many parameters)")
    print("targets: A run/core <= 1.35x; B run/core <= 1.5x; shared/run, bf16/run, shard/run")
    print("  <= 1.5x; sparse/run <= 2x")
    write_json(args, "train_step", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
