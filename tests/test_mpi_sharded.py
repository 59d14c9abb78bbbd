"""Sharded variables and sparse gradients under a real ``mpiexec``.

Rank ``r`` holds shard ``r`` of each sharded variable (``numpy.array_split``'s geometry); dense
gradients of sharded variables are reduce-scattered, sparse ones all-gathered, and the result
must be bit-identical to ``MirroredStrategy(N)`` in one process (``_mpi_model.train_sharded``
runs in both).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="the MPI tests need the [mpi] extra (mpi4py and mpich)")

import _mpi_model as model_code
from test_mpi import assert_bit_equal, launch, load

import parallelvars as pv
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.testing import as_dtype

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
        # float32, float64 and bfloat16 sharded tables: one reduce-scatter each; the sparse
        # gradients: one all-gather of their rows each, after one gather of the row counts,
        # the mirrored table's (float32) on the fused route and the sharded one's (float64,
        # rows kept per shard) in batch_reduce; the small mirrored vector: one all-gather.
        assert sorted(got["calls"]) == ["Allgather=3", "Allgatherv=2", "Alltoallv=3"]


def _restored_reference(path: str, n: int) -> dict[str, np.ndarray]:
    """One process, no MPI: MirroredStrategy(n) restores the file and takes the next step."""
    strategy = pv.MirroredStrategy(n)
    with strategy.scope():
        model = model_code.ShardedModel(seed=99)
        opt = pv.optimizers.Adagrad(0.1)
    status = pv.Checkpoint(model=model, optimizer=opt).restore(path)
    with strategy.scope():
        opt.build(model.trainable())
    status.assert_consumed()
    with strategy.scope():
        out = model_code.sharded_state(strategy, model, opt)
    model_code.train_more(strategy, model, opt, step=2)
    with strategy.scope():
        out.update(
            {f"next/{k}": v for k, v in model_code.sharded_state(strategy, model, opt).items()}
        )
    return out


def test_sharded_checkpoint_of_three_ranks_restores_onto_two_and_one(tmp_path: Path) -> None:
    launch(3, "sharded_save", str(tmp_path))
    saved = load(tmp_path, "sharded_save", 3)
    path = str(saved[0]["path"])
    state = {k: v for k, v in saved[0].items() if k != "path"}
    parts = Path(path + ".parts")

    # The index describes each whole variable as a one-process sharded file does; plain h5py
    # reads the stitched value through the parts.
    with h5py.File(path, "r") as f:
        grp = f["model/e"]
        assert grp.attrs["kind"] == "sharded" and tuple(grp.attrs["shape"]) == (10, 4)
        assert list(grp.attrs["shard_offsets"]) == [0, 4, 7]
        assert int(grp.attrs["num_components"]) == 3
        assert_bit_equal({"e": grp["value"][()]}, {"e": state["e"]})
        assert_bit_equal({"f": f["model/f/value"][()]}, {"f": state["f"]})
    # Each rank file holds its own shards, and each mirrored variable is written by one rank.
    holders: dict[str, list[int]] = {}
    for r in range(3):
        with h5py.File(parts / f"rank-{r:05d}-of-00003.h5", "r") as f:
            rows = np.array_split(np.arange(10), 3)[r]
            assert f["model/e/primary"].shape == (len(rows), 4)
            assert f["model/f/primary"].shape == (3, len(np.array_split(np.arange(7), 3)[r]))
            for name in ("w", "m"):
                if f"model/{name}" in f:
                    holders.setdefault(name, []).append(r)
    assert sorted(len(v) for v in holders.values()) == [1, 1], holders
    with H5Reader(path) as reader:
        assert reader.verify_all() == []

    reference = _restored_reference(path, 2)
    assert_bit_equal(reference, state, state)  # what was saved, in one process without MPI
    for m in (2, 1):
        launch(m, "sharded_restore", str(tmp_path), path)
        ranks = load(tmp_path, "sharded_restore", m)
        expected = reference if m == 2 else _restored_reference(path, 1)
        for r, got in enumerate(ranks):
            assert_bit_equal(got, state, state)  # every variable and slot, re-split
            rows = np.array_split(np.arange(10), m)[r]
            assert_bit_equal({"e": got["local_e"]}, {"e": state["e"][rows]})
            # and the step after it equals MirroredStrategy(m)'s after the same restore
            assert_bit_equal(got, expected, [k for k in expected if k.startswith("next/")])


def test_reshard_reads_a_multi_process_sharded_checkpoint(tmp_path: Path) -> None:
    from parallelvars.formats import reshard

    launch(2, "sharded_save", str(tmp_path))
    saved = load(tmp_path, "sharded_save", 2)
    with H5Reader(str(saved[0]["path"])) as reader:
        view = reshard(reader, 3)
        e = view["model/e"]
        assert e.kind == "sharded" and e.num_components == 3
        assert_bit_equal({"e": np.concatenate([e.component(i) for i in range(3)])}, saved[0], ["e"])


def test_a_restore_one_rank_cannot_serve_raises_on_every_rank(tmp_path: Path) -> None:
    launch(2, "sharded_save", str(tmp_path))
    path = str(load(tmp_path, "sharded_save", 2)[0]["path"])
    # Damage shard 1 of e: only rank 1 of a 2-process restore reads it.
    with h5py.File(Path(path + ".parts") / "rank-00001-of-00002.h5", "r+") as f:
        f["model/e/primary"][0, 0] += 1
    launch(2, "sharded_restore_refused", str(tmp_path), path)
    ranks = load(tmp_path, "sharded_restore_refused", 2)
    assert "ChecksumMismatchError" in str(ranks[1]["error"]) and "model/e" in str(ranks[1]["error"])
    assert "nothing was restored" in str(ranks[0]["error"]) and "rank 1" in str(ranks[0]["error"])
    assert all(bool(r["unchanged"]) for r in ranks)


def test_every_dtype_is_scattered_gathered_saved_and_restored(tmp_path: Path) -> None:
    launch(3, "sharded_dtypes", str(tmp_path))
    ranks = load(tmp_path, "sharded_dtypes", 3)
    expected = model_code.sweep_values(seed=0)  # rank 0's initial values
    for r, got in enumerate(ranks):
        for name, shape, axis in model_code.SWEEP:
            full = model_code.bits(expected[name])
            np.testing.assert_array_equal(got[f"full/{name}"], full)
            part = np.array_split(np.arange(shape[axis]), 3)[r]
            np.testing.assert_array_equal(got[f"local/{name}"], np.take(full, part, axis=axis))
    # One process without MPI restores every dtype's full value from the rank files.
    sweep = pv.Module()
    for name, shape, _ in model_code.SWEEP:
        zeros = np.full(shape, b"", object) if name == "bytes" else np.zeros(shape, as_dtype(name))
        setattr(sweep, name, pv.Variable(zeros, name=name))
    path = str(ranks[0]["path"])
    pv.Checkpoint(sweep=sweep).restore(path).assert_consumed()
    for name, _, _ in model_code.SWEEP:
        np.testing.assert_array_equal(
            model_code.bits(getattr(sweep, name)), model_code.bits(expected[name])
        )
    with H5Reader(path) as reader:
        assert reader.verify_all() == []


def test_a_damaged_shard_read_in_pieces_is_caught_on_every_rank(tmp_path: Path) -> None:
    launch(3, "sharded_save", str(tmp_path))
    path = str(load(tmp_path, "sharded_save", 3)[0]["path"])
    # Saved shard 1 of e (rows 4:7) is read in two pieces by a 2-process restore (rows 4 of
    # rank 0, rows 5:7 of rank 1): neither piece has a checksum of its own, their combination
    # must match the shard's.
    with h5py.File(Path(path + ".parts") / "rank-00001-of-00003.h5", "r+") as f:
        f["model/e/primary"][2, 0] += 1
    launch(2, "sharded_restore_refused", str(tmp_path), path)
    ranks = load(tmp_path, "sharded_restore_refused", 2)
    for got in ranks:
        assert "ChecksumMismatchError" in str(got["error"]), got["error"]
        assert "model/e/parallel_component_1" in str(got["error"])
        assert bool(got["unchanged"])
