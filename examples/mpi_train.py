"""Data-parallel training with one process per replica over MPI, then a checkpoint.

    pip install ".[mpi]"
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/mpi_train.py [OUT_DIR]

Every process runs this same file. Variables start from rank 0's values, each process trains
on its own slice of every batch, gradients are summed across processes (one fused collective
per step), and the checkpoint is one file at the path ``save()`` returns, with each rank's
components in its own file next to it. The checkpoint restores in any number of processes, or
in a plain Python process without MPI.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

import parallelvars as pv


def main() -> None:
    strategy = pv.MultiWorkerMirroredStrategy()
    rank, n = strategy.cluster_rank, strategy.num_replicas_in_sync
    out_dir = (
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.join(tempfile.gettempdir(), "parallelvars-mpi")
    )

    rng = np.random.default_rng(42)  # the same data on every rank; each takes its slice
    x = rng.normal(size=(64 * n, 8)).astype(np.float32)
    true_w = rng.normal(size=(8, 1)).astype(np.float32)
    y = x @ true_w

    model = pv.Module()
    with strategy.scope():
        model.w = pv.Variable(np.zeros((8, 1), np.float32), name="w")
        opt = pv.optimizers.Adam(0.05)

    def step(xb: np.ndarray, yb: np.ndarray) -> np.float32:
        err = xb @ np.asarray(model.w) - yb
        grad = (2.0 / (len(xb) * n)) * (xb.T @ err)  # the global mean's gradient, per replica
        opt.apply_gradients([(grad.astype(np.float32), model.w)])
        return np.float32(np.mean(err * err))

    xs = pv.PerReplica(np.array_split(x, n))
    ys = pv.PerReplica(np.array_split(y, n))
    for i in range(200):
        loss = strategy.reduce(pv.ReduceOp.MEAN, strategy.run(step, args=(xs, ys)))
        if rank == 0 and i % 50 == 0:
            print(f"step {i}: loss {float(loss):.5f}")
    path = pv.Checkpoint(model=model, optimizer=opt).save(os.path.join(out_dir, "run"))
    if rank == 0:
        print(f"final loss {float(loss):.6f}; checkpoint of {n} processes: {path}")


if __name__ == "__main__":
    main()
