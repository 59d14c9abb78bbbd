"""A bfloat16 model whose gradients come from PyTorch autograd, written into parallelvars memory.

As ``torch_gradients.py``, with bfloat16 parameters: each replica's parameter components and
each parameter's ``.grad`` are torch tensors over parallelvars memory (the optimizer's
gradient buffers for the gradients), so autograd writes its bfloat16 gradients where
``apply_gradients`` sums the replicas and updates them (bfloat16 variables: the update is
computed in float32 and rounded once, see docs/training.md).

``torch.from_numpy`` refuses numpy's bfloat16 (an ml_dtypes type it does not know), so the
arrays cross as 16-bit integers of the same bits, viewed back as bfloat16 on the torch side:
``torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)``, no copy either way.

    python examples/torch_bfloat16.py [--steps 300]
"""

from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np
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

    def as_torch(a: np.ndarray) -> torch.Tensor:
        """A torch bfloat16 tensor over the memory of the numpy bfloat16 array ``a``."""
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)

    def grads_torch(params, x, y, global_batch, out):
        w1, b1, w2, b2 = tensors = [as_torch(p).requires_grad_() for p in params]
        for t, view in zip(tensors, out, strict=True):
            view.fill(0)  # autograd adds into an existing .grad
            t.grad = as_torch(view)  # the gradient buffer itself
        xb = torch.from_numpy(x).to(torch.bfloat16)
        pred = torch.tanh(xb @ w1 + b1) @ w2 + b2
        loss = ((pred.float() - torch.from_numpy(y)) ** 2).sum() / global_batch
        loss.backward()
        for t, view in zip(tensors, out, strict=True):
            if t.grad.data_ptr() != view.ctypes.data:  # torch chose a new tensor: copy it in
                view.view(np.int16)[...] = t.grad.view(torch.int16).numpy()
        return float(loss.detach())

    first, last = train(grads_torch, args.steps, gradient_buffers=True, dtype=ml_dtypes.bfloat16)
    print(f"torch bfloat16 gradients: loss {first:.4f} -> {last:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
