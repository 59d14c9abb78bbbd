"""A small training job shared by the MPI worker processes and the one-process reference.

The same functions run under ``MultiWorkerMirroredStrategy`` (one process per replica) and
under ``MirroredStrategy(n)`` (one thread per replica), so their results can be compared bit
for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import parallelvars as pv

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
