"""Embed parallelvars in a training loop whose gradients come from plain numpy.

python examples/numpy_gradients.py [--steps 300]
"""

from __future__ import annotations

import argparse

import numpy as np
from _common import train


def grads_numpy(params, x, y, global_batch):
    w1, b1, w2, b2 = params
    h_pre = x @ w1 + b1
    h = np.tanh(h_pre)
    err = h @ w2 + b2 - y
    loss = float((err**2).sum() / global_batch)
    d_out = 2 * err / global_batch  # the replicas' gradients add up to the mean's gradient
    dw2, db2 = h.T @ d_out, d_out.sum(0)
    dh = (d_out @ w2.T) * (1 - h**2)
    return loss, [x.T @ dh, dh.sum(0), dw2, db2]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300)
    first, last = train(grads_numpy, ap.parse_args().steps)
    print(f"numpy gradients: loss {first:.4f} -> {last:.4f}")
