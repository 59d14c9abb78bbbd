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
* **bf16 floor** (a historical name; no bound): the bfloat16 <-> float32 conversions that
  arithmetic needs, alone, over the same parameters, in the core's cache-sized blocks (each
  replica's gradient widened and added, the running sum rounded to bfloat16 after each
  addition; the variable and both slots widened and rounded back). ``(run + conversions) /
  run`` is the float32 step's work plus these passes; the bfloat16 step also moves half the
  bytes of the float32 one, which saves part of that, so it can cost less than run +
  conversions (it usually does): the row prices the conversions, it bounds nothing;
* **bf16_f32g**: bfloat16 variables with float32 gradients (mixed precision: the replicas'
  gradients summed in float32 and the sum cast once to bfloat16, as the per-variable path
  does it);
* **run2d**: the in-run step of float32 mirrored variables of 2-D shapes (8 x 64 each for
  model B, 500 x 100 for model A) with per-replica arrays: the dense step of the variables the
  sharded and sparse steps train;
* **sharded**: the in-run step of those 2-D float32 variables sharded along axis 0, per-replica
  gradients of the full shape;
* **sparse**: the in-run step with one ``IndexedSlices`` of 4 rows per variable per replica, on
  those 2-D variables, against run2d (their dense step);
* **sparse_cast**: the sparse step of those 2-D variables in bfloat16 with float32 slices (mixed
  precision: the rows summed in float32 and rounded once to bfloat16), against sparse;
* **sparse_mixed**: the same with every other variable float32 and the others bfloat16, all
  slices float32 (a values dtype that is the variable's for some variables and not for others);
* **pervar**: the in-run step with the fused path off (``strategy.fusion = False``): every
  gradient reduced by ``batch_reduce`` one variable at a time, what a gradient the fused
  routes do not take costs;
* **tf**: ``tf.distribute.MirroredStrategy`` on 4 logical CPU devices doing the same step, when
  TensorFlow is importable (an optional anchor, skipped otherwise).

    python bench/bench_train_step.py                        # model A and B, 4 replicas
    python bench/bench_train_step.py --scale 0.05 --steps 3 # a quick check
    python bench/bench_train_step.py --json step.json       # also write the figures as JSON
    python bench/bench_train_step.py --timer cpu            # CPU time: a loaded machine

Models: A = 200 variables x 50,000 parameters, B = 2,000 x 512 (the sizes of issue 28; the
update core's own benchmark keeps 2,000 x 500). Targets: in-run <= 1.35x the core alone for
model A and <= 1.5x for model B; the shared-gradient, bfloat16 and sharded steps <= 1.5x the
float32 in-run step; the sparse step <= 2x the dense step of the same variables (run2d). Every
step is also reported against the per-component loop (not a target: the core itself is only
~9-10x that loop on model B).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np
from bench_update import (
    B1,
    B2,
    EPS,
    LR,
    TIMERS,
    _time_interleaved,
    check_targets,
    models_of,
    parse_args,
    write_json,
)

import parallelvars as pv
from parallelvars import update_core


def _model(
    strategy: pv.MirroredStrategy,
    sizes: list[int] | list[tuple[int, ...]],
    rng: np.random.Generator,
    dtype: object = np.float32,
    shard_axis: int | None = None,
) -> tuple[list[pv.ParallelVariable], pv.optimizers.Optimizer]:
    """The variables (``dtype``: one for all, or a list the variables take in turn) and Adam."""
    dtypes = dtype if isinstance(dtype, list) else [dtype]
    with strategy.scope():
        vs = [
            pv.Variable(
                rng.standard_normal(s, dtype=np.float32).astype(dtypes[i % len(dtypes)]),
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
    var_dtype: object = None,
) -> Callable[[], object]:
    dtype = per_replica[0][0].dtype if var_dtype is None else var_dtype
    vs, opt = _model(strategy, sizes, rng, dtype, shard_axis)

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


# The 2-D shape of each model's variables in the sharded, sparse and run2d steps.
SHAPES_2D = {"A": (500, 100), "B": (8, 64)}


def shape_2d(label: str, size: int) -> tuple[int, int]:
    """The 2-D shape the sharded, sparse and run2d rows give a variable of model ``label``
    (``size`` parameters): 8 x 64 (model B), 500 x 100 (model A)."""
    rows, cols = SHAPES_2D[label]
    if rows * cols != size:
        raise ValueError(f"model {label}: {rows} x {cols} is not {size} parameters")
    return rows, cols


def make_bf16_floor(n_params: int, replicas: int, rng: np.random.Generator) -> Callable[[], object]:
    """The bfloat16 <-> float32 conversions of the bfloat16 Adam step alone (see the module's
    docstring), over ``n_params`` parameters in the update core's blocks, done the cheapest way
    known here: each replica's gradient widened and added in float32, the running sum rounded
    to bfloat16's precision on its bits after each addition (as the step sums); the variable and
    both slots widened, and rounded back with the float32 -> bfloat16 cast. No Adam arithmetic."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    width = update_core.block_width(1, bf16)
    var, m, v = (rng.standard_normal(n_params, dtype=np.float32).astype(bf16) for _ in range(3))
    grads = [rng.standard_normal(n_params, dtype=np.float32).astype(bf16) for _ in range(replicas)]
    wide = [np.empty(width, np.float32) for _ in range(5)]
    bits = np.empty(width, np.uint32)

    def step() -> None:
        for c0 in range(0, n_params, width):
            c1 = min(n_params, c0 + width)
            w = [a[: c1 - c0] for a in wide]
            t = bits[: c1 - c0]
            u = w[0].view(np.uint32)
            np.copyto(w[0], grads[0][c0:c1], casting="unsafe")
            for g in grads[1:]:
                np.copyto(w[1], g[c0:c1], casting="unsafe")
                np.add(w[0], w[1], out=w[0])
                np.right_shift(u, 16, out=t)  # round to nearest even, on the bits
                np.bitwise_and(t, 1, out=t)
                np.add(t, 0x7FFF, out=t)
                np.add(u, t, out=u)
                np.bitwise_and(u, 0xFFFF0000, out=u)
            np.minimum.reduce(w[0])  # the NaN check
            for k, a in enumerate((var, m, v)):
                np.copyto(w[k + 2], a[c0:c1], casting="unsafe")
            for k, a in enumerate((var, m, v)):
                np.copyto(a[c0:c1], w[k + 2], casting="unsafe")

    return step


def make_sparse(
    strategy: pv.MirroredStrategy,
    shapes: list[tuple[int, int]],
    rows: int,
    rng: np.random.Generator,
    var_dtype: object = np.float32,
) -> Callable[[], object]:
    """The in-run step with an ``IndexedSlices`` of ``rows`` float32 rows per variable per
    replica (``var_dtype``: the variables', as :func:`_model` takes it)."""
    replicas = strategy.num_replicas_in_sync
    vs, opt = _model(strategy, shapes, rng, var_dtype)
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


def run_model(
    label: str,
    n_vars: int,
    size: int,
    replicas: int,
    steps: int,
    timer: Callable[[], float] = time.perf_counter,
) -> dict[str, object]:
    rng = np.random.default_rng(0)
    sizes = [size] * n_vars
    shapes = [shape_2d(label, size)] * n_vars
    per_replica = [
        [rng.standard_normal(s, dtype=np.float32) for s in sizes] for _ in range(replicas)
    ]
    reduced = [sum(g[j] for g in per_replica[1:]) + per_replica[0][j] for j in range(n_vars)]
    strategy = pv.MirroredStrategy(replicas)
    # The same strategy with the fused path off: every gradient reduced per variable.
    per_variable = pv.MirroredStrategy(replicas)
    per_variable.fusion = False  # type: ignore[attr-defined]
    per_replica_2d = [[g.reshape(shapes[0]) for g in p] for p in per_replica]
    fns: dict[str, Callable[[], object]] = {
        "core": make_core(strategy, sizes, reduced, rng),
        "run": make_run(strategy, sizes, per_replica, rng),
        "apply": make_apply(strategy, sizes, per_replica, rng),
        "buffers": make_buffers(strategy, sizes, per_replica, rng),
        "shared": make_run(strategy, sizes, [per_replica[0]] * replicas, rng),
        "bf16": make_run(
            strategy, sizes, [[g.astype(ml_dtypes.bfloat16) for g in p] for p in per_replica], rng
        ),
        "bf16_floor": make_bf16_floor(n_vars * size, replicas, rng),
        "bf16_f32g": make_run(strategy, sizes, per_replica, rng, var_dtype=ml_dtypes.bfloat16),
        "run2d": make_run(strategy, shapes, per_replica_2d, rng),
        "sharded": make_run(strategy, shapes, per_replica_2d, rng, shard_axis=0),
        "sparse": make_sparse(strategy, shapes, SPARSE_ROWS, rng),
        "sparse_cast": make_sparse(strategy, shapes, SPARSE_ROWS, rng, ml_dtypes.bfloat16),
        "sparse_mixed": make_sparse(
            strategy, shapes, SPARSE_ROWS, rng, [np.float32, ml_dtypes.bfloat16]
        ),
        "loop": make_loop(sizes, per_replica, rng),
        "pervar": make_run(per_variable, sizes, per_replica, rng),
    }
    fns.update(make_tf(sizes, per_replica))
    t = _time_interleaved(fns, steps, timer)
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
        ("sparse_over_run2d", "<=", 2.0),
    ],
    "B": [
        ("run_over_core", "<=", 1.5),
        ("shared_over_run", "<=", 1.5),
        ("bf16_over_run", "<=", 1.5),
        ("sharded_over_run", "<=", 1.5),
        ("sparse_over_run2d", "<=", 2.0),
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
        "bf16_floor_over_run": (t["run"] + t["bf16_floor"]) / t["run"],
        "bf16_f32g_over_run": t["bf16_f32g"] / t["run"],
        "loop_over_bf16_f32g": t["loop"] / t["bf16_f32g"],
        "run2d_over_run": t["run2d"] / t["run"],
        "sharded_over_run": t["sharded"] / t["run"],
        "sharded_over_run2d": t["sharded"] / t["run2d"],
        "loop_over_sharded": t["loop"] / t["sharded"],
        "sparse_over_run2d": t["sparse"] / t["run2d"],
        "loop_over_sparse": t["loop"] / t["sparse"],
        "sparse_cast_over_sparse": t["sparse_cast"] / t["sparse"],
        "sparse_mixed_over_sparse": t["sparse_mixed"] / t["sparse"],
        "pervar_over_run": t["pervar"] / t["run"],
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


# What each printed row is: (name, description, baseline).
ROWS = [
    ("core", "distributed_apply of reduced gradients (the update core alone)", None),
    ("run", "apply_gradients(zip(...)) in strategy.run, per-replica float32 arrays", "core"),
    ("apply", "the same as opt.apply(grads, variables)", "core"),
    ("buffers", "the same with gradient_buffers views", "core"),
    ("shared", "one gradient list every replica hands in", "run"),
    ("bf16", "bfloat16 variables and gradients", "run"),
    ("bf16_floor", "bfloat16 <-> float32 conversions alone (no Adam arithmetic)", "run"),
    ("bf16_f32g", "bfloat16 variables, float32 gradients (summed in float32, cast once)", "run"),
    ("run2d", "float32 mirrored, 2-D variables (8 x 64 / 500 x 100), per-replica arrays", "run"),
    ("sharded", "those 2-D variables sharded along axis 0", "run"),
    (
        "sparse",
        f"IndexedSlices, {SPARSE_ROWS} rows per variable per replica, same 2-D variables",
        "run2d",
    ),
    ("sparse_cast", "bfloat16 variables, float32 IndexedSlices (summed, cast once)", "sparse"),
    ("sparse_mixed", "float32 and bfloat16 variables in turn, float32 IndexedSlices", "sparse"),
    ("loop", "per-component numpy loop", "run"),
    ("pervar", "run with the fused path off (every gradient reduced per variable)", "run"),
    ("tf_function", "tf.distribute.MirroredStrategy in tf.function", "run"),
]


def _settle_allocator() -> None:
    """Put glibc's malloc in the state a long-running process reaches: freeing one mapped
    block of 4 MiB raises its dynamic mmap threshold to that size, so later temporaries of up
    to 4 MiB (the per-component loop's, ~200 KB each in model A) come from the heap instead of
    fresh zeroed pages. Otherwise whether the loop pays page faults depends on what the
    contenders before it happened to free (a 1.8x or a 9x loop in two runs of one version)."""
    block = np.ones(4 << 20, np.uint8)
    del block


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, steps=9)
    _settle_allocator()
    models = [(label, n, 512 if label == "B" else size) for label, n, size in models_of(args)]
    print(
        f"Adam inside strategy.run, {args.replicas} replicas with their own gradients, "
        f"best of {args.steps}, steps taken in turns ({args.timer} time)"
    )
    figures: dict[str, object] = {}
    for label, n_vars, size in models:
        started = time.strftime("%H:%M:%S")
        r = run_model(label, n_vars, size, args.replicas, args.steps, TIMERS[args.timer])
        figures[label] = _model_json(r)
        t: dict[str, float] = r["times"]  # type: ignore[assignment]
        print(f"\nmodel {label}: {n_vars:,} variables x {size:,} parameters (started {started})")
        print(f"{'step':<12}{'ms':>9}{'vs':>8}{'ratio':>9}{'loop/it':>9}  what")
        for name, what, base in ROWS:
            if name not in t:
                continue
            ratio = f"{t[name] / t[base]:.2f}x" if base else ""
            loop = f"{t['loop'] / t[name]:.1f}x" if name not in ("loop", "bf16_floor") else ""
            print(f"{name:<12}{1e3 * t[name]:>9.1f}{base or '':>8}{ratio:>9}{loop:>9}  {what}")
        ratios: dict[str, float] = figures[label]["ratios"]  # type: ignore[index]
        print(f"(run + bf16 conversions) / run = {ratios['bf16_floor_over_run']:.2f}x")
        for name, target in figures[label]["targets"].items():  # type: ignore[index]
            met = "met" if target["met"] else "NOT met"
            print(f"target {name} {target['op']} {target['value']}x: {ratios[name]:.2f}x, {met}")
    write_json(args, "train_step", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
