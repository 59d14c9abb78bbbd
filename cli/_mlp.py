"""The demo's model: a two-layer MLP classifier with hand-written numpy gradients.

Kept apart from the command so the math can be read (and tested) on its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import parallelvars as pv

__all__ = ["MLP", "make_blobs", "loss_and_grads", "accuracy"]


def make_blobs(n: int, features: int, classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic data set: one Gaussian blob per class, overlapping (no download).

    The blobs overlap so that the task is not trivial: the nearest-centre rule gets about 89%
    of the examples right with 32 features and 4 classes.
    """
    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, 0.7, size=(classes, features)).astype(np.float32)
    y = rng.integers(0, classes, size=n)
    x = centers[y] + rng.normal(0.0, 1.5, size=(n, features)).astype(np.float32)
    return x.astype(np.float32), y.astype(np.int64)


class MLP(pv.Module):
    """``logits = relu(x @ w1 + b1) @ w2 + b2``."""

    def __init__(self, features: int, hidden: int, classes: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.w1 = pv.Variable(
            rng.normal(0, np.sqrt(2 / features), (features, hidden)).astype(np.float32), name="w1"
        )
        self.b1 = pv.Variable(np.zeros(hidden, np.float32), name="b1")
        self.w2 = pv.Variable(
            rng.normal(0, np.sqrt(1 / hidden), (hidden, classes)).astype(np.float32), name="w2"
        )
        self.b2 = pv.Variable(np.zeros(classes, np.float32), name="b2")
        self.seen = pv.Variable(
            np.int64(0), name="examples_seen", synchronization="on_read", aggregation="sum"
        )

    @property
    def params(self) -> list[Any]:
        return [self.w1, self.b1, self.w2, self.b2]

    def logits(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h = np.maximum(x @ self.w1 + self.b1, 0.0)
        return h, h @ self.w2 + self.b2


def loss_and_grads(
    model: MLP, x: np.ndarray, y: np.ndarray, global_batch: int
) -> tuple[float, list[np.ndarray]]:
    """Softmax cross-entropy summed over ``x`` and divided by the *global* batch size.

    Dividing by the global batch makes the replicas' gradients add up to the gradient of the mean
    loss, which is what a SUM all-reduce of per-replica gradients expects.
    """
    h, z = model.logits(x)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).sum() / global_batch)
    dz = p
    dz[np.arange(n), y] -= 1.0
    dz /= global_batch
    dw2 = h.T @ dz
    db2 = dz.sum(axis=0)
    dh = dz @ np.asarray(model.w2).T
    dh[h <= 0] = 0.0
    dw1 = x.T @ dh
    db1 = dh.sum(axis=0)
    return loss, [
        dw1.astype(np.float32),
        db1.astype(np.float32),
        dw2.astype(np.float32),
        db2.astype(np.float32),
    ]


def accuracy(model: MLP, x: np.ndarray, y: np.ndarray) -> float:
    return float((model.logits(x)[1].argmax(axis=1) == y).mean())
