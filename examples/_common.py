"""Shared bits of the examples: a small regression task and its parameters as parallel variables."""

from __future__ import annotations

import numpy as np

import parallelvars as pv

FEATURES, HIDDEN = 8, 16


def make_data(n: int = 2048, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """y = sin(x @ a) + noise: a smooth target a two-layer network can learn."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    a = rng.normal(size=(FEATURES, 1)).astype(np.float32) / np.sqrt(FEATURES)
    y = (np.sin(3 * x @ a) + 0.05 * rng.normal(size=(n, 1))).astype(np.float32)
    return x, y


def make_params(seed: int = 0, dtype: object = np.float32) -> list[pv.ParallelVariable]:
    """w1, b1, w2, b2 as variables of ``dtype`` (mirrored when created in a strategy scope)."""
    rng = np.random.default_rng(seed)
    return [
        pv.Variable(
            rng.normal(0, 1 / np.sqrt(FEATURES), (FEATURES, HIDDEN)).astype(dtype), name="w1"
        ),
        pv.Variable(np.zeros(HIDDEN, dtype), name="b1"),
        pv.Variable(rng.normal(0, 1 / np.sqrt(HIDDEN), (HIDDEN, 1)).astype(dtype), name="w2"),
        pv.Variable(np.zeros(1, dtype), name="b2"),
    ]


def train(
    grad_fn,
    steps: int,
    devices: int = 4,
    batch: int = 128,
    lr: float = 0.01,
    gradient_buffers: bool = False,
    dtype: object = np.float32,
) -> tuple[float, float]:
    """Train with ``grad_fn(params_as_arrays, x, y, global_batch) -> (loss, grads)`` per replica.

    ``grad_fn`` sees each replica's own parameter values (numpy arrays) and its slice of the
    batch; whatever computes the gradients (numpy, PyTorch, JAX) stays outside the toolkit.
    With ``gradient_buffers``, ``grad_fn(params, x, y, global_batch, out) -> loss`` writes the
    gradients into ``out``, this replica's views of the optimizer's gradient buffers
    (``opt.gradient_buffers``), and ``apply_gradients`` takes them without a packing copy.
    ``dtype``: the parameters' dtype (their gradients have it too).
    Returns the mean loss of the first and of the last ten steps.
    """
    x, y = make_data()
    strategy = pv.MirroredStrategy(devices)
    with strategy.scope():
        params = make_params(dtype=dtype)
        opt = pv.optimizers.Adam(learning_rate=lr)
        buffers = opt.gradient_buffers(params) if gradient_buffers else None

    def step(xb: np.ndarray, yb: np.ndarray) -> float:
        arrays = [np.asarray(p) for p in params]
        if buffers is not None:
            loss = grad_fn(arrays, xb, yb, batch, buffers.views())
            opt.apply_gradients(buffers.grads_and_vars())
            return loss
        loss, grads = grad_fn(arrays, xb, yb, batch)
        opt.apply_gradients(list(zip(grads, params, strict=True)))
        return loss

    losses = []
    for i in range(steps):
        j = (i * batch) % len(x)
        xb, yb = x[j : j + batch], y[j : j + batch]
        per_replica = strategy.run(
            step,
            args=(
                pv.PerReplica(np.array_split(xb, devices)),
                pv.PerReplica(np.array_split(yb, devices)),
            ),
        )
        losses.append(float(strategy.reduce(pv.ReduceOp.SUM, per_replica)))
    identical = all(np.array_equal(c, p.components[0]) for p in params for c in p.components)
    print(f"replicas identical after {steps} steps: {identical}")
    return float(np.mean(losses[:10])), float(np.mean(losses[-10:]))
