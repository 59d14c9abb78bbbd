"""Sharded variables and sparse gradients under a real ``mpiexec``.

Rank ``r`` holds shard ``r`` of each sharded variable (``numpy.array_split``'s geometry); dense
gradients of sharded variables are reduce-scattered, sparse ones all-gathered, and the result
must be bit-identical to ``MirroredStrategy(N)`` in one process (``_mpi_model.train_sharded``
runs in both).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="the MPI tests need the [mpi] extra (mpi4py and mpich)")

import _mpi_model as model_code
from test_mpi import assert_bit_equal, launch, load

import parallelvars as pv

# Real MPI runs (2-4 processes each); CI runs them (.ci/run, -m slow).
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("n", "optimizer"), [(2, "adagrad"), (3, "adam"), (4, "adagrad")])
def test_sharded_and_sparse_training_equals_mirrored_in_one_process(
    tmp_path: Path, n: int, optimizer: str
) -> None:
    scenario = f"sharded_train-{optimizer}"
    launch(n, scenario, str(tmp_path))
    ranks = load(tmp_path, scenario, n)

    strategy = pv.MirroredStrategy(n)
    model, opt = model_code.train_sharded(strategy, steps=3, seed=0, optimizer=optimizer)
    with strategy.scope():
        expected = model_code.sharded_state(strategy, model, opt)
    slots = 1 if optimizer == "adagrad" else 2
    assert len(expected) == 6 * (1 + slots) + 1
    assert int(expected["iterations"]) == 3
    for r, got in enumerate(ranks):
        assert_bit_equal(got, expected, expected)  # every variable and slot, gathered
        # Reads give the local shard: shard r of the array_split geometry, nothing else.
        rows = np.array_split(np.arange(10), n)[r]
        assert tuple(got["local_e_shape"]) == (len(rows), 4)
        assert_bit_equal({"e": got["local_e"]}, {"e": expected["e"][rows]})
        # The slot of the axis-1 table is sharded like it.
        cols = np.array_split(np.arange(7), n)[r]
        slot = next(k for k in expected if k.startswith("f/"))
        assert_bit_equal({"s": got["local_f_slot"]}, {"s": expected[slot][:, cols]})
    # The test can fail: one replica more gives other sums.
    other, _ = model_code.train_sharded(
        pv.MirroredStrategy(n + 1), steps=3, seed=0, optimizer=optimizer
    )
    assert not np.array_equal(np.asarray(other.e), expected["e"])


def test_one_collective_per_dtype_per_step(tmp_path: Path) -> None:
    launch(2, "sharded_collectives", str(tmp_path))
    for got in load(tmp_path, "sharded_collectives", 2):
        # float32, float64 and bfloat16 sharded tables: one reduce-scatter each; float32 and float64
        # sparse gradients: one all-gather each, after one gather of the row counts; the
        # small mirrored vector: one all-gather.
        assert sorted(got["calls"]) == ["Allgather=2", "Allgatherv=2", "Alltoallv=3"]
