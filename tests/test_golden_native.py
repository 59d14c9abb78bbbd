"""The golden layout-version-1 checkpoints of tests/data/native/v1 still read, value for value.

The files were written once by ``tools/make_golden_native.py``; the values they must hold come
from the live buffers at save time (``*-expected.npz``), not from our reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import make_golden_native as golden
import ml_dtypes
import numpy as np
import pytest

import parallelvars as pv
from parallelvars.checkpoint.graph import build_object_graph
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.checkpoint.registry import component_name

DATA = Path(__file__).parent / "data" / "native" / "v1"


def expected(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / f"{name}-expected.npz") as z:
        return {k: z[k] for k in z.files}


def same(found: np.ndarray, want: np.ndarray, what: str) -> None:
    found = np.asarray(found)
    if found.dtype == ml_dtypes.bfloat16:
        found = found.view(np.uint16)
    assert found.dtype == want.dtype, what
    np.testing.assert_array_equal(found, want, err_msg=what)


def check_h5py(path: Path, want: dict[str, np.ndarray]) -> None:
    """Plain h5py (following the external links of a multi-process file) sees every value."""
    with h5py.File(path, "r") as f:
        for key, value in want.items():
            var, index = key.rsplit("/", 1)
            data = f[f"{var}/{component_name(int(index))}"][()]
            if f[var].attrs["dtype"] == "bfloat16":
                data = np.asarray(data).view(np.uint16)
            same(data, value, key)


def check_restored(ckpt: Any, want: dict[str, np.ndarray]) -> None:
    seen = set()
    for _, obj, path in build_object_graph(ckpt).variables():
        for i, c in enumerate(obj.components):
            same(c, want[f"{path}/{i}"], f"{path}/{i}")
            seen.add(f"{path}/{i}")
    assert seen == set(want)


def check_restored_subset(ckpt: Any, want: dict[str, np.ndarray]) -> None:
    for _, obj, path in build_object_graph(ckpt).variables():
        for i, c in enumerate(obj.components):
            key = f"{path}/{i}"
            if key in want:
                same(c, want[key], key)


def test_single_process_file_reads_with_h5py() -> None:
    check_h5py(DATA / "single.h5", expected("single"))


def test_single_process_file_restores_every_kind() -> None:
    want = expected("single")
    m, opt = golden.build_single()
    ckpt = pv.Checkpoint(model=m, optimizer=opt)
    status = ckpt.restore(DATA / "single.h5")
    # The optimizer's variables are made by its first step: make them (as that step would),
    # and the pending restore fills them as they appear.
    strategy = pv.MirroredStrategy(golden.SINGLE_DEVICES)
    with strategy.scope():
        opt._create_non_slots(strategy, [m.kernel, m.bias])
        opt._create_slots([m.kernel, m.bias])
    status.assert_consumed()
    check_restored(ckpt, want)
    sharded = H5Reader(DATA / "single.h5")["model/embedding"]
    assert sharded.kind == "sharded" and list(sharded.attrs["shard_offsets"]) == [0, 3, 5]
    np.testing.assert_array_equal(
        sharded.value(), np.arange(14, dtype=np.float32).reshape(7, 2) - 3
    )


def test_single_process_file_reader_values() -> None:
    want = expected("single")
    with H5Reader(DATA / "single.h5") as reader:
        assert reader.verify_all() == []
        for key, value in want.items():
            var, index = key.rsplit("/", 1)
            same(reader[var].component(int(index)), value, key)


def test_multi_process_file_reads_with_h5py() -> None:
    check_h5py(DATA / "mpi.h5", expected("mpi"))


def test_multi_process_file_reader_values() -> None:
    want = expected("mpi")
    with H5Reader(DATA / "mpi.h5") as reader:
        assert reader.verify_all() == []
        for key, value in want.items():
            var, index = key.rsplit("/", 1)
            same(reader[var].component(int(index)), value, key)
        assert reader["model/seen"].value() == 300  # SUM over the two ranks' 100 and 200


def test_multi_process_file_restores_onto_two_replicas() -> None:
    want = expected("mpi")
    with pv.MirroredStrategy(golden.MPI_RANKS).scope():
        m: Any = pv.Module()
        m.w = pv.Variable(np.zeros((2, 3), np.float32), name="w")
        m.seen = pv.Variable(np.int64(0), name="seen", synchronization="on_read", aggregation="sum")
        m.avg = pv.Variable(
            np.float32(0), name="avg", synchronization="on_read", aggregation="mean"
        )
    ckpt = pv.Checkpoint(model=m)
    ckpt.restore(DATA / "mpi.h5").assert_existing_objects_matched()
    check_restored_subset(ckpt, {k: v for k, v in want.items() if k.startswith("model/")})
    assert [int(c) for c in m.seen.components] == [100, 200]
    np.testing.assert_array_equal(np.asarray(m.avg.components[1]), np.float32(4.0))


@pytest.mark.parametrize("name", ["single.h5", "mpi.h5"])
def test_golden_files_are_small(name: str) -> None:
    assert (DATA / name).stat().st_size < 64 << 10
