"""The fused gradient path under MultiWorkerMirroredStrategy: one all-reduce per dtype buffer.

Ranks train with their own gradients (plain arrays and gradient buffers); the result must be
bit-identical to ``MirroredStrategy`` with as many replicas in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="the MPI tests need the [mpi] extra (mpi4py and mpich)")

from test_mpi import _mpiexec

import parallelvars as pv

# A real MPI run of the fused all-reduce; CI runs it (.ci/run, -m slow).
pytestmark = pytest.mark.slow

# Shared by the ranks and the one-process reference (exec'd in both).
MODEL = """
import numpy as np
import parallelvars as pv

SHAPES = [(37, 5), (3,), (), (1001,)]
DTYPES = [np.float32, np.float32, np.float64, np.float64]


def grads_of(step, replica):
    rng = np.random.default_rng(100 * step + replica)
    return [(rng.normal(size=s) * 10.0 ** (replica - 1)).astype(d) for s, d in zip(SHAPES, DTYPES)]


def train(strategy, buffers, local_replicas):
    with strategy.scope():
        rng = np.random.default_rng(0)
        vs = [pv.Variable(rng.normal(size=s).astype(d), name=f"v{i}") for i, (s, d) in enumerate(zip(SHAPES, DTYPES))]
        opt = pv.optimizers.Adam(0.01)
        bufs = opt.gradient_buffers(vs) if buffers else None

    def step(replica):
        grads = grads_of(k, replica)
        if bufs is not None:
            for view, g in zip(bufs.views(), grads):
                view[...] = g
            opt.apply_gradients(bufs.grads_and_vars())
        else:
            opt.apply_gradients(list(zip(grads, vs)))

    for k in range(3):
        strategy.run(step, args=(local_replicas,))
    state = {v.name: np.array(v.components[0]) for v in vs}
    for var, name, slot in opt._checkpoint_slots():
        state[f"{var.name}/{name}"] = np.array(slot.components[0])
    return state, opt
"""

WORKER = (
    MODEL
    + """
import sys
s = pv.MultiWorkerMirroredStrategy()
rank = s.cluster_rank
for buffers in (False, True):
    state, opt = train(s, buffers, pv.PerReplica(list(range(s.num_replicas_in_sync))))
    assert opt._pv_transport.lines, "the fused path was not taken"
    np.savez(f"{sys.argv[1]}/rank{rank}-{int(buffers)}.npz", **state)
"""
)


def _bits(a: Any) -> np.ndarray:
    arr = np.ascontiguousarray(a)
    return arr.view(np.dtype(f"u{arr.dtype.itemsize}"))


def test_fused_all_reduce_equals_mirrored_in_one_process(tmp_path: Path) -> None:
    n = 3
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ)
    env.setdefault("MPIR_CVAR_CH4_OFI_ENABLE_PROGRESS_THREAD", "0")
    env.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "100")
    proc = subprocess.run(
        [_mpiexec(), "-n", str(n), sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    namespace: dict[str, Any] = {}
    exec(MODEL, namespace)  # the test's own model code, shared with the ranks
    for buffers in (False, True):
        ref, _ = namespace["train"](pv.MirroredStrategy(n), buffers, pv.PerReplica(list(range(n))))
        for r in range(n):
            with np.load(tmp_path / f"rank{r}-{int(buffers)}.npz") as f:
                got = {k: f[k] for k in f.files}
            assert set(got) == set(ref)
            for k in ref:
                assert got[k].dtype == ref[k].dtype, k
                assert np.array_equal(_bits(got[k]), _bits(ref[k])), (buffers, r, k)
