"""Write the golden native checkpoints of ``tests/data/native/v1/``.

Usage (from the repository root)::

    .venv/bin/python tools/make_golden_native.py tests/data/native/v1

writes ``single.h5`` (one process, every kind of variable) with ``single-expected.npz``, then
launches itself under ``mpiexec -n 2`` to write ``mpi.h5`` and its ``mpi.h5.parts/`` folder
with ``mpi-expected.npz``. The ``*-expected.npz`` files hold every component's value taken
from the live buffers at save time (key ``<variable path>/<component index>``), so a test can
check the files without trusting the reader that reads them.

The model builders are imported by ``tests/test_golden_native.py`` to restore the files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

import ml_dtypes
import numpy as np

import parallelvars as pv
from parallelvars.checkpoint.graph import build_object_graph

SINGLE_DEVICES = 3
MPI_RANKS = 2


def build_single() -> tuple[Any, Any]:
    """Every kind of variable on ``SINGLE_DEVICES`` replicas, and an optimizer (with slots)."""
    with pv.MirroredStrategy(SINGLE_DEVICES).scope():
        m: Any = pv.Module()
        m.kernel = pv.Variable(np.zeros((3, 2), np.float32), name="kernel")
        m.bias = pv.Variable(np.zeros(2, np.float32), name="bias")
        m.embedding = pv.Variable(np.zeros((7, 2), np.float32), name="embedding", shard_axis=0)
        m.count = pv.Variable(
            np.int64(0), name="count", synchronization="on_read", aggregation="sum"
        )
        m.mean = pv.Variable(
            np.float64(0), name="mean", synchronization="on_read", aggregation="mean"
        )
        m.first = pv.Variable(
            np.float32(0), name="first", synchronization="on_read", aggregation="only_first_replica"
        )
        m.half = pv.Variable(np.zeros(4, ml_dtypes.bfloat16), name="half", dtype=ml_dtypes.bfloat16)
        m.single = pv.Variable(np.zeros(3, np.int32), name="single")
        opt = pv.optimizers.Adam(0.1)
    with pv.independent_buffers(SINGLE_DEVICES):
        m.ind = pv.Variable(np.zeros(2, np.float64), name="ind")
    return m, opt


def fill_single(m: Any, opt: Any) -> None:
    m.kernel.assign(np.arange(6, dtype=np.float32).reshape(3, 2) / 4)
    m.bias.assign(np.array([0.5, -1.5], np.float32))
    m.embedding.assign(np.arange(14, dtype=np.float32).reshape(7, 2) - 3)
    for i, c in enumerate(m.count.components):
        c[...] = 10 * (i + 1)
    for i, c in enumerate(m.mean.components):
        c[...] = i + 1.25
    for i, c in enumerate(m.first.components):
        c[...] = 7 + i
    m.half.assign(np.array([1.0, -2.5, 3.25, 1e-3], ml_dtypes.bfloat16))
    m.single.assign(np.array([1, -2, 3], np.int32))
    for i, c in enumerate(m.ind.components):
        c[...] = [i, -i / 2]
    strategy = pv.MirroredStrategy(SINGLE_DEVICES)
    grads = [np.full((3, 2), 0.25, np.float32), np.array([1.0, -1.0], np.float32)]
    strategy.run(lambda: opt.apply_gradients(list(zip(grads, [m.kernel, m.bias], strict=True))))


def build_mpi(strategy: Any) -> tuple[Any, Any]:
    """The multi-process model (one replica per rank), with an optimizer."""
    with strategy.scope():
        m: Any = pv.Module()
        m.w = pv.Variable(np.zeros((2, 3), np.float32), name="w")
        m.seen = pv.Variable(np.int64(0), name="seen", synchronization="on_read", aggregation="sum")
        m.avg = pv.Variable(
            np.float32(0), name="avg", synchronization="on_read", aggregation="mean"
        )
        opt = pv.optimizers.Adam(0.1)
    return m, opt


def expected(ckpt: pv.Checkpoint) -> dict[str, np.ndarray]:
    """Every component of every variable of a checkpoint, by ``<path>/<index>``."""
    out: dict[str, np.ndarray] = {}
    for _, obj, path in build_object_graph(ckpt).variables():
        for i, c in enumerate(obj.components):
            out[f"{path}/{i}"] = np.array(c, copy=True)
    return out


def _save_npz(path: str, values: dict[str, np.ndarray]) -> None:
    # bfloat16 is not an npz dtype: store its bits.
    bits: dict[str, Any] = {
        k: (v.view(np.uint16) if v.dtype == ml_dtypes.bfloat16 else v) for k, v in values.items()
    }
    np.savez(path, **bits)


def write_single(out_dir: str) -> None:
    m, opt = build_single()
    fill_single(m, opt)
    ckpt = pv.Checkpoint(model=m, optimizer=opt)
    ckpt.write(os.path.join(out_dir, "single.h5"))
    _save_npz(os.path.join(out_dir, "single-expected.npz"), expected(ckpt))


def write_mpi_rank(out_dir: str) -> None:
    """Run under mpiexec: every rank takes one optimizer step, then they save together."""
    strategy = pv.MultiWorkerMirroredStrategy()  # type: ignore[operator]
    rank = strategy.cluster_rank
    m, opt = build_mpi(strategy)
    m.w.assign(np.arange(6, dtype=np.float32).reshape(2, 3) / 8)
    m.seen.components[0][...] = 100 * (rank + 1)
    m.avg.components[0][...] = 2.0 * (rank + 1)
    grad = np.full((2, 3), 0.5, np.float32)
    strategy.run(lambda: opt.apply_gradients([(grad, m.w)]))
    ckpt = pv.Checkpoint(model=m, optimizer=opt)
    ckpt.write(os.path.join(out_dir, "mpi.h5"))
    _save_npz(os.path.join(out_dir, f"mpi-expected-rank{rank}.npz"), expected(ckpt))


def merge_mpi_expected(out_dir: str) -> None:
    """One expected file: per-replica values take their index from their rank."""
    merged: dict[str, np.ndarray] = {}
    for rank in range(MPI_RANKS):
        part = os.path.join(out_dir, f"mpi-expected-rank{rank}.npz")
        with np.load(part) as z:
            for key in z.files:
                path, index = key.rsplit("/", 1)
                if rank and path == "save_counter":  # one value, written by rank 0
                    continue
                merged[f"{path}/{rank + int(index)}" if rank else key] = z[key]
        os.remove(part)
    _save_npz(os.path.join(out_dir, "mpi-expected.npz"), merged)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--mpi-rank":
        write_mpi_rank(sys.argv[2])
        return
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "tests/data/native/v1"
    os.makedirs(out_dir, exist_ok=True)
    write_single(out_dir)
    shutil.rmtree(os.path.join(out_dir, "mpi.h5.parts"), ignore_errors=True)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    subprocess.run(
        [
            mpiexec,
            "-n",
            str(MPI_RANKS),
            sys.executable,
            os.path.abspath(__file__),
            "--mpi-rank",
            out_dir,
        ],
        check=True,
        timeout=120,
    )
    merge_mpi_expected(out_dir)


if __name__ == "__main__":
    main()
