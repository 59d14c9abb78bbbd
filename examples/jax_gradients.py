"""Embed parallelvars in a training loop whose gradients come from JAX.

Each replica passes its own parameter values to ``jax.value_and_grad`` and hands the gradients
back as numpy arrays to a parallelvars optimizer.

    python examples/jax_gradients.py [--steps 300]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from _common import train


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        print("JAX is not installed; skipping this example (pip install jax)")
        return 0

    def loss_fn(params, x, y, global_batch):
        w1, b1, w2, b2 = params
        out = jnp.tanh(x @ w1 + b1) @ w2 + b2
        return jnp.sum((out - y) ** 2) / global_batch

    value_and_grad = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)

    def grads_jax(params, x, y, global_batch):
        loss, grads = value_and_grad(params, x, y, global_batch)
        return float(loss), [np.asarray(g) for g in grads]

    first, last = train(grads_jax, args.steps)
    print(f"jax gradients: loss {first:.4f} -> {last:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
