"""Cast and sparse gradients under a real ``mpiexec``: the cross-process fused routes.

Each process packs its gradients of another dtype than their variables' into one flat buffer
per gradient dtype and all-reduces it in rank order before the one cast, and gathers its
sparse gradients with one collective per values dtype for all of them; the results must be
bit-identical to the per-variable path (``strategy.fusion = False``: ``batch_reduce`` one
variable list at a time) on every rank, and to ``MirroredStrategy(N)`` in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="the MPI tests need the [mpi] extra (mpi4py and mpich)")

import _mpi_fused_worker as worker
from test_mpi import LAUNCH_TIMEOUT, _mpiexec, assert_bit_equal

import parallelvars as pv

# Real MPI runs (2-3 processes each); CI runs them (.ci/run, -m slow).
pytestmark = pytest.mark.slow


def _launch(n: int, out: Path, optimizer: str) -> list[dict[str, np.ndarray]]:
    proc = subprocess.run(
        [_mpiexec(), "-n", str(n), sys.executable, worker.__file__, str(out), optimizer],
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
        env={
            **os.environ,
            "MPIR_CVAR_CH4_OFI_ENABLE_PROGRESS_THREAD": "0",
            "MPIR_CVAR_POLLS_BEFORE_YIELD": "100",
        },
    )
    if proc.returncode != 0:
        pytest.fail(f"mpiexec -n {n} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    ranks = []
    for r in range(n):
        with np.load(out / f"fused-rank{r}.npz") as f:
            ranks.append({k: f[k] for k in f.files})
    return ranks


@pytest.mark.parametrize(("n", "optimizer"), [(2, "adam"), (3, "momentum")])
def test_cast_and_sparse_gradients_fused_across_processes(
    tmp_path: Path, n: int, optimizer: str
) -> None:
    ranks = _launch(n, tmp_path, optimizer)
    model, opt = worker.train(pv.MirroredStrategy(n), optimizer, seed=0)
    expected = worker.state(model, opt)
    slots = 2 if optimizer == "adam" else 1
    assert len(expected) == 6 * (1 + slots) + 1
    for got in ranks:
        # The fused routes took every gradient: batch_reduce was never called.
        assert int(got["fused_batch_reduces"]) == 0
        assert int(got["pervar_batch_reduces"]) == worker.STEPS
        assert_bit_equal(got, expected, expected)  # as one process sums its replicas
        pervar = {k: got[f"pervar/{k}"] for k in expected}
        assert_bit_equal(pervar, expected, expected)  # and as the per-variable path
    # The test can fail: one replica more gives other sums.
    other, other_opt = worker.train(pv.MirroredStrategy(n + 1), optimizer, seed=0)
    assert not np.array_equal(worker.state(other, other_opt)["e"], expected["e"])


_RANK_SHARDED = """
import sys, numpy as np, parallelvars as pv
dt = np.dtype(sys.argv[1])
s = pv.MultiWorkerMirroredStrategy()
s.fusion = sys.argv[2] == "fused"
with s.scope():
    v = pv.Variable(np.ones((1, 4), np.float32), name="v", shard_axis=0)  # one rank's shard empty
    w = pv.Variable(np.ones((4,), np.float32), name="w")
    opt = pv.optimizers.SGD(0.1)
def f(g):
    opt.apply_gradients([(g[0], v), (g[1], w)])
for _ in range(2):
    s.run(f, args=(pv.PerReplica([[np.full((1, 4), 0.5, dt), np.ones(4, np.float32)]] * 2),))
np.save(sys.argv[3] + f"-{s.cluster_rank}.npy", np.concatenate([np.ravel(v), np.ravel(w)]))
"""


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_variables_sharded_across_processes_take_one_route_on_every_rank(
    tmp_path: Path, dtype: str
) -> None:
    """A variable sharded across processes holds another shard on each rank (here one rank's
    is empty): its gradient must take the same route on every rank, or the ranks call
    different collectives and hang."""
    script = tmp_path / "rank_sharded.py"
    script.write_text(_RANK_SHARDED)
    results = {}
    for mode in ("fused", "pervar"):
        proc = subprocess.run(
            [_mpiexec(), "-n", "2", sys.executable, str(script), dtype, mode, str(tmp_path / mode)],
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT,
            env={**os.environ, "MPIR_CVAR_CH4_OFI_ENABLE_PROGRESS_THREAD": "0"},
        )
        assert proc.returncode == 0, proc.stderr
        results[mode] = [np.load(tmp_path / f"{mode}-{r}.npy") for r in range(2)]
    for fused, pervar in zip(results["fused"], results["pervar"], strict=True):
        assert fused.tobytes() == pervar.tobytes()
