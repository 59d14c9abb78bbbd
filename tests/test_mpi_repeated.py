"""Repeated checkpoint saves under a real ``mpiexec``: the rank files and the index file are
written with their cached generated metadata, byte for byte the files a save without any cache
generates, and restore exactly onto 1, 2 and 4 processes (the thread-rank checks of the same are in ``test_mpi_files.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="the MPI tests need the [mpi] extra (mpi4py and mpich)")

import _mpi_model as model_code
from test_mpi import launch, load

import parallelvars as pv
from parallelvars.checkpoint.h5io import H5Reader

pytestmark = pytest.mark.slow  # real MPI runs (CI's slow step)


def files_of(path: Path) -> dict[str, bytes]:
    out = {"index": path.read_bytes()}
    for f in sorted(Path(f"{path}.parts").iterdir()):
        out[f.name] = f.read_bytes()
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_repeated_saves_are_the_files_a_fresh_save_writes_and_restore_exactly(
    tmp_path: Path, n: int
) -> None:
    launch(n, "repeat", str(tmp_path))
    ranks = load(tmp_path, "repeat", n)
    skel, plain = tmp_path / "skel", tmp_path / "plain"
    for k in (1, 2, 3, 4, 6):  # 4: a new variable; 6: after the failed save
        assert files_of(skel / f"ckpt-{k}.h5") == files_of(plain / f"ckpt-{k}.h5"), k
    assert all(str(r["plan_kept"]) == "Prepared" for r in ranks)
    assert str(ranks[0]["index_plan"]) == "Prepared"
    for r in ranks:  # saves 2 and 3 were written with save 1's rank-file plans, not made again
        assert r["plans_1"].tolist() == r["plans_2"].tolist() == r["plans_3"].tolist()
    # Rank 1 failed save 5: every rank raised, nothing was committed, ckpt-4 is intact.
    assert all("rank 1" in str(r["failed"]) for r in ranks)
    assert not (skel / "ckpt-5.h5").exists()
    with H5Reader(str(skel / "ckpt-4.h5")) as reader:
        assert reader.verify_all() == []

    path = str(ranks[0]["path"])
    with h5py.File(path, "r") as f:  # plain h5py, through the links
        grp = f["model/extra"]
        for r in range(n):
            name = "primary" if r == 0 else f"parallel_component_{r}"
            assert isinstance(grp.get(name, getlink=True), h5py.ExternalLink)
            np.testing.assert_array_equal(grp[name][()], ranks[r]["extra"])
        np.testing.assert_array_equal(f["model/w/primary"][()], ranks[0]["w"])

    names = ("w", "b", "c", "extra")
    with pv.MirroredStrategy(3).scope():  # one process, no MPI
        model = model_code.Model(seed=9)
        model.extra = pv.Variable(np.zeros(3, np.float32), name="extra")
    pv.Checkpoint(model=model).restore(path).expect_partial()
    for name in ("w", "b", "c"):
        for comp in getattr(model, name).components:
            np.testing.assert_array_equal(comp, ranks[0][name])
    np.testing.assert_array_equal(model.extra.components[0], ranks[0]["extra"])
    for m in (2, 4):
        launch(m, "restore_exact", str(tmp_path), path)
        for r, got in enumerate(load(tmp_path, "restore_exact", m)):
            for name in names:
                # A mirrored restore gives every replica the saved primary (rank 0's value).
                np.testing.assert_array_equal(got[name], ranks[0][name], err_msg=f"{m}:{r}:{name}")
    assert os.path.exists(path)
