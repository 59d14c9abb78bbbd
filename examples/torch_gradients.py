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

from _common import train


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed; skipping this example (pip install torch)")
        return 0
    torch.set_num_threads(1)  # the replicas already run in parallel threads

    def grads_torch(params, x, y, global_batch, out):
        w1, b1, w2, b2 = tensors = [
            torch.from_numpy(p).requires_grad_() for p in params
        ]  # shares memory
        for t, view in zip(tensors, out, strict=True):
            view.fill(0)  # autograd adds into an existing .grad
            t.grad = torch.from_numpy(view)  # the gradient buffer itself
        pred = torch.tanh(torch.from_numpy(x) @ w1 + b1) @ w2 + b2
        loss = ((pred - torch.from_numpy(y)) ** 2).sum() / global_batch
        loss.backward()
        for t, view in zip(tensors, out, strict=True):
            if t.grad.data_ptr() != view.ctypes.data:  # torch chose a new tensor: copy it in
                view[...] = t.grad.numpy()
        return float(loss.detach())

    first, last = train(grads_torch, args.steps, gradient_buffers=True)
    print(f"torch gradients: loss {first:.4f} -> {last:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
