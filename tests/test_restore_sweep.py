"""The verified restore's path swept over what reaches it: every kind (a mirrored variable's
components stored once, under hard links), dtypes with and without a buffer protocol (bfloat16,
byte strings), small components (under 64 KiB: read ahead together) and large ones, a restore
onto another number of devices, a file written by h5py rather than our generator (every
dataset moved, so the index's offsets no longer place them), and a writer changing the file
after the checks. New staging memory is made for each restore and faulted in with steps small
enough that every restore here takes both page sizes' paths (staging.py).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from test_restore_landing import _after_the_checks, _dtype, _rewrite

import parallelvars as pv
from parallelvars.checkpoint.h5io import read as read_module
from parallelvars.checkpoint.h5io import staging
from parallelvars.errors import ConcurrentWriteError

KINDS = ("single", "mirrored", "on_read", "sharded")
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "int8", "bool", "bytes")
QUICK_DTYPES = ("float32", "bfloat16", "bytes")


def _values(dtype: str, size: str, seed: int) -> np.ndarray:
    dt = _dtype(dtype)
    n = 12 if size == "small" else (1 << 17) // max(dt.itemsize, 1) + 6
    n -= n % 6  # (shards evenly over 2 and 3 devices)
    if dtype == "bytes":  # (large: 1,200 strings of about 300 bytes)
        count = 12 if size == "small" else 1200
        return np.array([b"%d-%d" % (seed, k) * (1 + 40 * (size == "large")) for k in range(count)])
    if dtype == "bool":
        return (np.arange(n) + seed) % 3 == 0
    return ((np.arange(n) % 50) + seed).astype(dt)


def _model(kind: str, dtype: str, size: str, devices: int, seed: int) -> pv.Module:
    options: dict[str, Any] = {}
    if kind == "on_read":
        options = {"synchronization": "on_read", "aggregation": "only_first_replica"}
    if kind == "sharded":
        options = {"shard_axis": 0}
    scope = contextlib.nullcontext() if kind == "single" else pv.MirroredStrategy(devices).scope()
    m = pv.Module()
    with scope:
        m.vs = [
            pv.Variable(
                _values(dtype, size, seed + 10 * k).astype(object if dtype == "bytes" else None),
                name=f"v{k}",
                **options,
            )
            for k in range(3)
        ]
        m.w = pv.Variable(np.full(4, seed, np.float32), name="w")
    return m


def _logical(m: pv.Module) -> list[list[Any]]:
    return [np.asarray(v.read_value()).tolist() for v in [*m.vs, m.w]]


def _by_h5py(src: str, dst: str) -> None:
    """``src`` copied object by object into a new file by h5py (HDF5's own object copy:
    every dataset at a new place, the hard links of a dataset stored once kept together)."""
    with h5py.File(src, "r") as a, h5py.File(dst, "w") as b:
        for name in a:
            a.copy(a[name], b, name=name)
        b.attrs.update(a.attrs)


def _saved(tmp_path: Path, kind: str, dtype: str, size: str, writer: str) -> tuple[str, Any]:
    path = str(tmp_path / "a.h5")
    saved = _model(kind, dtype, size, 2, 1)
    pv.Checkpoint(model=saved).write(path)
    if writer == "h5py":
        copied = str(tmp_path / "h5py.h5")
        _by_h5py(path, copied)
        path = copied
    return path, _logical(saved)


SWEEP = [
    pytest.param(kind, dtype, size, marks=() if dtype in QUICK_DTYPES else pytest.mark.slow)
    for kind in KINDS
    for dtype in DTYPES
    for size in ("small", "large")
]


@pytest.fixture(autouse=True)
def _new_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every restore makes new staging memory, faulted in 64 KiB steps."""
    staging.release()
    monkeypatch.setattr(staging, "_STEP", 1 << 16)
    monkeypatch.setattr(staging, "KEEP_BYTES", 0)


@pytest.mark.parametrize(("kind", "dtype", "size"), SWEEP)
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("writer", ["ours", "h5py"])
def test_a_restore_lands_the_saved_values(
    tmp_path: Path, kind: str, dtype: str, size: str, devices: int, writer: str
) -> None:
    if kind == "single" and devices == 3:
        pytest.skip("a single variable has one device")
    path, want = _saved(tmp_path, kind, dtype, size, writer)
    live = _model(kind, dtype, size, devices, 2)
    pv.Checkpoint(model=live).restore(path).assert_consumed()
    assert _logical(live) == want
    if kind != "sharded":  # every component holds the whole value
        for v in live.vs:
            for c in v.components:
                assert np.asarray(c).tolist() == np.asarray(v.read_value()).tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("limit", [None, 0])
@pytest.mark.parametrize("writer", ["ours", "h5py"])
def test_a_writer_after_the_checks_lands_no_unchecked_byte_on_other_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, limit: int | None, writer: str
) -> None:
    """Onto 3 devices from 2: within the restore's limit the values checked land, whole,
    also from a file h5py wrote (each component found where HDF5 places it, the index's
    offset stale, is kept as it was checked there); past it (0: nothing held) the change is
    a ConcurrentWriteError, and every component holds the bytes checked or its old value,
    never a byte of the other file."""
    path, want = _saved(tmp_path, kind, "float32", "large", writer)
    other = str(tmp_path / "b.h5")
    pv.Checkpoint(model=_model(kind, "float32", "large", 2, 3)).write(other)
    if writer == "h5py":
        _by_h5py(other, str(tmp_path / "b2.h5"))
        other = str(tmp_path / "b2.h5")
    assert os.path.getsize(other) == os.path.getsize(path)
    if limit is not None:
        monkeypatch.setattr(read_module, "RESTORE_KEEP_LIMIT", limit)
    devices = 1 if kind == "single" else 3

    def components(source: str | None) -> list[list[Any]]:
        m = _model(kind, "float32", "large", devices, 2)
        if source is not None:
            pv.Checkpoint(model=m).restore(source).assert_consumed()
        return [np.asarray(c).tolist() for v in [*m.vs, m.w] for c in v.components]

    mine, old, theirs = components(path), components(None), components(other)
    _after_the_checks(monkeypatch, _rewrite(path, other))
    live = _model(kind, "float32", "large", devices, 2)
    if limit is None:
        pv.Checkpoint(model=live).restore(path).assert_consumed()
        assert _logical(live) == want
        return
    with pytest.raises(ConcurrentWriteError) as info:
        pv.Checkpoint(model=live).restore(path)
    assert path in str(info.value)
    got = [np.asarray(c).tolist() for v in [*live.vs, live.w] for c in v.components]
    for k, component in enumerate(got):  # each component checked bytes or untouched
        assert component in (mine[k], old[k]), k
        assert component != theirs[k], k
