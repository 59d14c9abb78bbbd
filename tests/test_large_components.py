"""Components larger than one read or write chunk: written in several ``pwrite`` calls, verified
in several streamed reads, restored straight into their buffers, and refused whole when any
chunk is damaged."""

from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest

import parallelvars as pv
from parallelvars.errors import ChecksumMismatchError
from parallelvars.testing import threads as _threads

# Larger than the streamed check's 8 MiB reads and the writer's 1 MiB chunks, so both loops
# run more than once, with a partial last chunk.
BIG = (9 << 20) // 4 + 123  # float32 elements
BIG_NAME = "model/big/parallel_component_1"
# (its mirrored components are one dataset, stored once: a damage is named by either name)
BIG_NAMES = r"model/big/(primary|parallel_component_1)"


@pytest.fixture(params=["1", "3"])
def threads(request, monkeypatch):
    """Inline, and spread over threads whatever the amount of work."""
    monkeypatch.setenv("PARALLELVARS_THREADS", request.param)
    monkeypatch.setattr(_threads, "MIN_PARALLEL_BYTES", 0)
    return request.param


def _model(fill: float | None = None) -> tuple[pv.Checkpoint, pv.Module]:
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        big = np.arange(BIG, dtype=np.float32) if fill is None else np.full(BIG, fill, np.float32)
        m.big = pv.Variable(big, name="big")
        small = np.arange(100, dtype=np.int64) if fill is None else np.full(100, fill, np.int64)
        m.small = pv.Variable(small, name="small")
    return pv.Checkpoint(model=m), m


def _components(m: pv.Module) -> list[np.ndarray]:
    return [np.asarray(c) for v in (m.big, m.small) for c in v.components]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[bool, str]:
    """The same checkpoint written by HDF5 (False) and from the cached skeleton (True)."""
    d = tmp_path_factory.mktemp("large")
    ckpt, _ = _model()
    first = ckpt.write(d / "first.h5")
    return {False: first, True: ckpt.write(d / "repeated.h5")}


def _flip(path: str, dataset: str, at: int) -> None:
    with h5py.File(path, "r") as f:
        offset = int(f[dataset].id.get_offset())
    with open(path, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x04]))


@pytest.mark.parametrize("repeated", [False, True], ids=["first save", "repeated save"])
def test_a_large_component_restores_every_byte(saved, threads, repeated) -> None:
    path = saved[repeated]
    with h5py.File(path, "r") as f:  # what any HDF5 reader sees
        np.testing.assert_array_equal(f[BIG_NAME][()], np.arange(BIG, dtype=np.float32))
    ckpt, m = _model(fill=-1)
    ckpt.restore(path).assert_consumed()
    want = _components(_model()[1])
    for got, expected in zip(_components(m), want, strict=True):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    "at",
    [0, (8 << 20) + 5, BIG * 4 - 1],
    ids=["first byte", "second streamed read", "last byte"],
)
@pytest.mark.parametrize("repeated", [False, True], ids=["first save", "repeated save"])
def test_damage_anywhere_in_a_large_component_restores_nothing(
    tmp_path, saved, threads, repeated, at
) -> None:
    path = str(shutil.copy(saved[repeated], tmp_path / "c.h5"))
    _flip(path, BIG_NAME, at)
    ckpt, m = _model(fill=-1)
    with pytest.raises(ChecksumMismatchError, match=BIG_NAMES) as info:
        ckpt.restore(path)
    assert str(path) in str(info.value)
    for c in _components(m):  # all or nothing: the sound components were not written either
        assert (c == -1).all()
