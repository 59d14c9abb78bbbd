"""Embed parallelvars in a training loop whose gradients come from PyTorch autograd.

Each replica wraps its own parameter components as torch tensors without a copy
(``torch.from_numpy``), runs forward and backward in torch, and hands the gradients back as
numpy arrays to a parallelvars optimizer, which all-reduces them and updates every replica.

    python examples/torch_gradients.py [--steps 300]
"""

from __future__ import annotations

import argparse
import sys

from _common import train


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

    def grads_torch(params, x, y, global_batch):
        w1, b1, w2, b2 = (torch.from_numpy(p).requires_grad_() for p in params)  # shares memory
        out = torch.tanh(torch.from_numpy(x) @ w1 + b1) @ w2 + b2
        loss = ((out - torch.from_numpy(y)) ** 2).sum() / global_batch
        loss.backward()
        return float(loss.detach()), [t.grad.numpy() for t in (w1, b1, w2, b2)]

    first, last = train(grads_torch, args.steps)
    print(f"torch gradients: loss {first:.4f} -> {last:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
