"""Run by tests/test_mpi_fused.py under ``mpiexec -n N`` (and, for the reference, imported by
it): a training step whose gradients take the fused routes other than the dense one of the
variables' dtype, across processes.

Usage: ``python _mpi_fused_worker.py OUT_DIR OPTIMIZER``; each rank writes
``OUT_DIR/fused-rank<r>.npz``: the state after training with the fused routes, the state of a
second model trained with ``strategy.fusion = False`` (every gradient reduced per variable by
``batch_reduce``), and how many times each path called ``batch_reduce``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

import parallelvars as pv

STEPS = 3


class MixedModel(pv.Module):
    """Mirrored variables whose gradients are cast (another dtype than the variable's), sparse
    (``IndexedSlices`` with repeated rows, two values dtypes) or plain."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.a = pv.Variable(rng.normal(size=(6, 4)).astype(np.float32), name="a")  # float64 g
        self.h = pv.Variable(rng.normal(size=(5, 3)), name="h", dtype="bfloat16")  # float32 g
        self.i = pv.Variable(rng.normal(size=(7,)).astype(np.float32), name="i")  # int16 g
        self.e = pv.Variable(rng.normal(size=(8, 3)).astype(np.float32), name="e")  # sparse
        self.q = pv.Variable(rng.normal(size=(5, 2)), name="q")  # float64, sparse
        self.w = pv.Variable(rng.normal(size=(4,)).astype(np.float32), name="w")  # plain

    def trainable(self) -> list[Any]:
        return [self.a, self.h, self.i, self.e, self.q, self.w]


def grads(step: int, replica: int, model: MixedModel) -> list[Any]:
    """Replica ``replica``'s gradients of ``step`` (the same in every process)."""
    rng = np.random.default_rng(9000 + 1000 * step + replica)
    a = np.asarray(model.a)
    return [
        rng.normal(size=(6, 4)) * a,  # float64 for a float32 variable
        rng.normal(size=(5, 3)).astype(np.float32),  # float32 for a bfloat16 variable
        rng.integers(-3, 4, size=7).astype(np.int16),
        pv.IndexedSlices(rng.normal(size=(5, 3)).astype(np.float32), rng.integers(0, 8, 5), (8, 3)),
        pv.IndexedSlices(rng.normal(size=(3, 2)), rng.integers(0, 5, 3), (5, 2)),
        rng.normal(size=(4,)).astype(np.float32),
    ]


def train(strategy: Any, optimizer: str, seed: int) -> tuple[MixedModel, Any]:
    with strategy.scope():
        model = MixedModel(seed)
        opt = pv.optimizers.Adam(0.05) if optimizer == "adam" else pv.optimizers.Momentum(0.1, 0.9)
    n = strategy.num_replicas_in_sync
    for step in range(STEPS):

        def replica_step(g: list[Any]) -> None:
            opt.apply_gradients(list(zip(g, model.trainable(), strict=True)))

        strategy.run(replica_step, args=(pv.PerReplica([grads(step, r, model) for r in range(n)]),))
    return model, opt


def state(model: MixedModel, opt: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """Every variable and slot (component 0) and the step count, as bits npz keeps."""
    out = {f"{prefix}{v.name}": np.array(v.components[0]) for v in model.trainable()}
    for var, slot_name, slot in opt._checkpoint_slots():
        out[f"{prefix}{var.name}/{slot_name}"] = np.array(slot.components[0])
    out[f"{prefix}iterations"] = np.array(opt.iterations.components[0])
    return {k: v.view(np.uint16) if v.dtype.kind == "V" else v for k, v in out.items()}


def main() -> None:
    out_dir, optimizer = sys.argv[1], sys.argv[2]
    strategy = pv.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_rank
    calls = {"n": 0}
    batch_reduce = strategy.batch_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return batch_reduce(*args, **kwargs)

    strategy.batch_reduce = counting  # type: ignore[method-assign]
    # Each rank starts from its own values: the broadcast from rank 0 must win.
    model, opt = train(strategy, optimizer, seed=rank)
    out = state(model, opt)
    out["fused_batch_reduces"] = np.asarray(calls["n"])
    calls["n"] = 0
    strategy.fusion = False
    model, opt = train(strategy, optimizer, seed=rank)
    out.update(state(model, opt, "pervar/"))
    out["pervar_batch_reduces"] = np.asarray(calls["n"])
    np.savez(os.path.join(out_dir, f"fused-rank{rank}.npz"), **out)


if __name__ == "__main__":
    main()
