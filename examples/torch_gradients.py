"""Embed parallelvars in a training loop whose gradients come from PyTorch autograd.

Each replica wraps its own parameter components as torch tensors without a copy
(``torch.from_numpy``) and runs forward and backward in torch. The gradients go straight into
the optimizer's gradient buffers: each parameter's ``.grad`` is a torch view of that replica's
slot in one flat, arena-shaped buffer (``opt.gradient_buffers(params)``), so autograd
accumulates into parallelvars memory and ``apply_gradients`` sums the replicas' buffers and
updates every replica without copying a gradient.

    python examples/torch_gradients.py [--steps 300]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from _common import make_data, make_params

import parallelvars as pv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed; skipping this example (pip install torch)")
        return 0
    torch.set_num_threads(1)  # the replicas already run in parallel threads

    devices, batch = 4, 128
    x, y = make_data()
    strategy = pv.MirroredStrategy(devices)
    with strategy.scope():
        params = make_params()
        opt = pv.optimizers.Adam(learning_rate=0.01)
        grads = opt.gradient_buffers(params)  # one flat gradient buffer per replica

    def step(xb: np.ndarray, yb: np.ndarray) -> float:
        views = grads.views()  # this replica's gradient of each parameter, in its buffer
        for view in views:
            view.fill(0)  # autograd accumulates into .grad
        w1, b1, w2, b2 = tensors = [torch.from_numpy(np.asarray(p)).requires_grad_() for p in params]
        for t, view in zip(tensors, views, strict=True):
            t.grad = torch.from_numpy(view)  # shares memory with the buffer
        out = torch.tanh(torch.from_numpy(xb) @ w1 + b1) @ w2 + b2
        loss = ((out - torch.from_numpy(yb)) ** 2).sum() / batch
        loss.backward()
        for t, view in zip(tensors, views, strict=True):
            if t.grad is not None and t.grad.data_ptr() != view.ctypes.data:  # pragma: no cover
                view[...] = t.grad.numpy()  # torch chose a new tensor: copy it in
        opt.apply_gradients(grads.grads_and_vars())  # no packing: the buffers are summed as they are
        return float(loss.detach())

    losses = []
    for i in range(args.steps):
        j = (i * batch) % len(x)
        xb, yb = x[j : j + batch], y[j : j + batch]
        per_replica = strategy.run(
            step, args=(pv.PerReplica(np.array_split(xb, devices)), pv.PerReplica(np.array_split(yb, devices)))
        )
        losses.append(float(strategy.reduce(pv.ReduceOp.SUM, per_replica)))
    identical = all(np.array_equal(c, p.components[0]) for p in params for c in p.components)
    print(f"replicas identical after {args.steps} steps: {identical}")
    first, last = float(np.mean(losses[:10])), float(np.mean(losses[-10:]))
    print(f"torch gradients: loss {first:.4f} -> {last:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
