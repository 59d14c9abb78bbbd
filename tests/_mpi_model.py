"""A small training job shared by the MPI worker processes and the one-process reference.

The same functions run under ``MultiWorkerMirroredStrategy`` (one process per replica) and
under ``MirroredStrategy(n)`` (one thread per replica), so their results can be compared bit
for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import parallelvars as pv
from parallelvars.testing import as_dtype

BATCH = 6


class Model(pv.Module):
    """Variables of two dtypes (two fused buffers per step) and an on-read counter."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.w = pv.Variable(rng.normal(size=(4, 3)).astype(np.float32), name="w")
        self.b = pv.Variable(rng.normal(size=(3,)).astype(np.float32), name="b")
        self.c = pv.Variable(rng.normal(size=(5,)), name="c")  # float64
        self.seen = pv.Variable(
            np.int64(0),
            name="seen",
            synchronization=pv.Synchronization.ON_READ,
            aggregation=pv.Aggregation.SUM,
        )

    def trainable(self) -> list[Any]:
        return [self.w, self.b, self.c]


def batches(step: int, n: int) -> pv.PerReplica:
    """Replica ``r``'s batch of ``step`` (the same on every process)."""
    out = []
    for r in range(n):
        rng = np.random.default_rng(1000 * step + r)
        x = rng.normal(size=(BATCH, 4)).astype(np.float32)
        y = rng.normal(size=(BATCH, 3)).astype(np.float32)
        z = rng.normal(size=(5,))
        out.append((x, y, z))
    return pv.PerReplica(out)


def replica_step(model: Model, opt: Any, batch: Any) -> Any:
    x, y, z = batch
    w, b, c = (np.asarray(v) for v in model.trainable())
    err = x @ w + b - y
    loss = np.float32(np.mean(err * err)) + np.float64(np.dot(c, z))
    d = (2.0 / err.size) * err
    grads = [(x.T @ d).astype(np.float32), d.sum(axis=0).astype(np.float32), z * np.sin(c)]
    opt.apply_gradients(list(zip(grads, model.trainable(), strict=True)))
    model.seen.assign_add(np.int64(len(x)))
    return loss


def train(strategy: Any, steps: int, seed: int = 0) -> tuple[Model, Any, list[float]]:
    """``steps`` Adam steps; returns the model, the optimizer and the mean loss per step."""
    with strategy.scope():
        model = Model(seed)
        opt = pv.optimizers.Adam(0.05)
    losses = []
    for step in range(steps):
        loss = strategy.run(
            replica_step, args=(model, opt, batches(step, strategy.num_replicas_in_sync))
        )
        losses.append(float(strategy.reduce(pv.ReduceOp.MEAN, loss)))
    return model, opt, losses


def state(model: Model, opt: Any) -> dict[str, np.ndarray]:
    """The values to compare: variables, slots and the step counter (component 0 of each)."""
    out = {v.name: np.array(v.components[0]) for v in model.trainable()}
    for var, slot_name, slot in opt._checkpoint_slots():
        out[f"{var.name}/{slot_name}"] = np.array(slot.components[0])
    out["iterations"] = np.array(opt.iterations.components[0])
    return out


# ------------------------------------------------------------------ sharded variables
class ShardedModel(pv.Module):
    """Sharded tables (along axis 0 with uneven shards, along axis 1; float32, float64 and
    bfloat16) beside a mirrored vector; ``s`` and ``m`` take sparse gradients."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.e = pv.Variable(rng.normal(size=(10, 4)).astype(np.float32), name="e", shard_axis=0)
        self.f = pv.Variable(rng.normal(size=(3, 7)), name="f", shard_axis=1)  # float64
        self.w = pv.Variable(rng.normal(size=(4,)).astype(np.float32), name="w")
        self.s = pv.Variable(rng.normal(size=(9, 2)), name="s", shard_axis=0)  # float64, sparse
        self.m = pv.Variable(rng.normal(size=(6, 3)).astype(np.float32), name="m")  # sparse
        self.h = pv.Variable(rng.normal(size=(5, 3)), name="h", dtype="bfloat16", shard_axis=0)

    def trainable(self) -> list[Any]:
        return [self.e, self.f, self.w, self.s, self.m, self.h]


def sharded_batches(step: int, n: int) -> pv.PerReplica:
    out = []
    for r in range(n):
        rng = np.random.default_rng(7000 + 1000 * step + r)
        out.append(
            (
                rng.normal(size=(10, 4)).astype(np.float32),
                rng.normal(size=(3, 7)),
                rng.normal(size=(4,)).astype(np.float32),
                rng.integers(0, 9, size=5),  # repeats on purpose
                rng.normal(size=(5, 2)),
                rng.integers(0, 6, size=4),
                rng.normal(size=(4, 3)).astype(np.float32),
                rng.normal(size=(5, 3)),
            )
        )
    return pv.PerReplica(out)


def sharded_step(model: ShardedModel, opt: Any, full: dict[str, np.ndarray], batch: Any) -> Any:
    a, b, c, si, sv, mi, mv, hv = batch
    w = np.asarray(model.w)
    grads = [
        (a * full["e"] + np.float32(0.5)).astype(np.float32),
        np.sin(full["f"]) * b,
        (c * w).astype(np.float32),
        pv.IndexedSlices(sv * full["s"][si], si, dense_shape=(9, 2)),
        pv.IndexedSlices(mv, mi, dense_shape=(6, 3)),
        (hv * full["h"].astype(np.float64)).astype(full["h"].dtype),
    ]
    opt.apply_gradients(list(zip(grads, model.trainable(), strict=True)))
    return np.float32(np.sum(a))


def full_values(strategy: Any, model: ShardedModel) -> dict[str, np.ndarray]:
    """The sharded tables' full values (a collective under MPI, a read in one process)."""
    return {k: strategy.gather(getattr(model, k)) for k in ("e", "f", "s", "h")}


def train_sharded(
    strategy: Any, steps: int, seed: int = 0, optimizer: str = "adagrad"
) -> tuple[ShardedModel, Any]:
    with strategy.scope():
        model = ShardedModel(seed)
        opt = pv.optimizers.Adam(0.05) if optimizer == "adam" else pv.optimizers.Adagrad(0.1)
    for step in range(steps):
        full = full_values(strategy, model)
        strategy.run(
            sharded_step,
            args=(model, opt, full, sharded_batches(step, strategy.num_replicas_in_sync)),
        )
    return model, opt


def train_more(strategy: Any, model: ShardedModel, opt: Any, step: int) -> None:
    """Step ``step`` of :func:`train_sharded`'s loop, on a model made elsewhere."""
    full = full_values(strategy, model)
    strategy.run(
        sharded_step,
        args=(model, opt, full, sharded_batches(step, strategy.num_replicas_in_sync)),
    )


def sharded_state(strategy: Any, model: ShardedModel, opt: Any) -> dict[str, np.ndarray]:
    """Full values of every variable and slot (gathered under MPI) and the step count."""
    out = {}
    for v in model.trainable():
        out[v.name] = strategy.gather(v) if v.kind == "sharded" else np.array(v.components[0])
    for var, slot_name, slot in opt._checkpoint_slots():
        out[f"{var.name}/{slot_name}"] = (
            strategy.gather(slot) if slot.kind == "sharded" else np.array(slot.components[0])
        )
    out["iterations"] = np.array(opt.iterations.components[0])
    # bfloat16 as its bits: an npz file keeps no extension dtype
    return {k: v.view(np.uint16) if v.dtype.kind == "V" else v for k, v in out.items()}


# (dtype name, shape, shard axis) of the dtype sweep of sharded variables over processes
SWEEP = [
    ("float16", (7, 3), 0),
    ("bfloat16", (5,), 0),
    ("float8_e4m3fn", (4, 6), 1),
    ("int32", (9, 2), 0),
    ("bool", (3, 5), 1),
    ("bytes", (6,), 0),
]


def sweep_values(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape, _ in SWEEP:
        if name == "bytes":
            out[name] = np.array([b"x" * int(k) for k in rng.integers(0, 9, size=shape)], object)
        elif name == "bool":
            out[name] = rng.integers(0, 2, size=shape).astype(bool)
        elif name == "int32":
            out[name] = rng.integers(-1000, 1000, size=shape).astype(np.int32)
        else:
            out[name] = rng.normal(size=shape).astype(as_dtype(name))
    return out


def bits(a: Any) -> np.ndarray:
    """An array as comparable bits that npz keeps (extension dtypes as unsigned ints, byte
    strings as fixed-width ones)."""
    a = np.asarray(a)
    if a.dtype.kind == "O":
        return a.astype(f"S{max((len(x) for x in a.flat), default=0) + 1}")
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "V" else a
