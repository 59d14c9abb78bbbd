"""A restore lands only checked bytes, read once: the sweep over kinds, dtypes, sizes and entry
points (docs/checkpoints.md, "A restore lands only checked bytes").

Within ``RESTORE_KEEP_LIMIT`` (the bytes a restore may hold), every byte is read once, checked
against its checksum and copied into the variables from that memory, after every check of the
restore passed: a file rewritten or cut by another process once the checks are done changes
nothing (the restore is whole, with the values checked), and a change met while the file is
still being read is an error that leaves every variable as it was. Past the limit (0 here),
a component is read again when it is copied and checked before it lands: a change is a
ConcurrentWriteError naming the variables already restored, and no byte of the other file
lands.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import parallelvars as pv
from parallelvars.checkpoint import matching
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.checkpoint.h5io import read as read_module
from parallelvars.errors import CheckpointError, ConcurrentWriteError

KINDS = ("single", "mirrored", "on_read", "sharded", "independent")
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "int8", "bool", "bytes")
SIZES = ("small", "large")  # under 64 KiB a component (the read-ahead), and over


def _dtype(name: str) -> np.dtype:
    return np.dtype(object) if name == "bytes" else np.dtype(getattr(ml_dtypes, name, name))


def _values(dtype: str, size: str, seed: float) -> np.ndarray:
    dt = _dtype(dtype)
    n = 12 if size == "small" else (1 << 17) // max(dt.itemsize, 1) + 6
    if dtype == "bytes":
        return np.array(
            [b"%d-%d" % (seed, k) * (1 if size == "small" else 40) for k in range(n // 8)], object
        )
    if dtype == "bool":
        return (np.arange(n) + int(seed)) % 3 == 0
    return ((np.arange(n) % 50) + seed).astype(dt)


def _scope(kind: str) -> contextlib.AbstractContextManager[object]:
    if kind == "single":
        return contextlib.nullcontext()
    if kind == "independent":
        return pv.independent_buffers(2)
    return pv.MirroredStrategy(2).scope()


def _model(kind: str, dtype: str, size: str, seed: float) -> pv.Module:
    """Three variables of ``kind`` (and a small float32 one), ``seed`` in their values."""
    options: dict[str, Any] = {}
    if kind == "on_read":
        options = {"synchronization": "on_read", "aggregation": "only_first_replica"}
    if kind == "sharded":
        options = {"shard_axis": 0}
    m = pv.Module()
    with _scope(kind):
        m.vs = [
            pv.Variable(_values(dtype, size, seed + 10 * k), name=f"v{k}", **options)
            for k in range(3)
        ]
        m.w = pv.Variable(np.full(4, seed, np.float32), name="w")
    return m


def _state(m: pv.Module) -> list[list[bytes]]:
    return [
        [
            np.ascontiguousarray(c).tobytes() if c.dtype.kind != "O" else repr(list(c)).encode()
            for c in v.components
        ]
        for v in [*m.vs, m.w]
    ]


def _saved_pair(tmp_path: Path, kind: str, dtype: str, size: str) -> tuple[str, str, Any]:
    """Two files of one layout (``a``: the values restored, ``b``: other values of the same
    sizes), and the state a restore of ``a`` gives."""
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    saved = _model(kind, dtype, size, 1)
    pv.Checkpoint(model=saved).write(a)
    pv.Checkpoint(model=_model(kind, dtype, size, 2)).write(b)
    assert os.path.getsize(a) == os.path.getsize(b)
    return a, b, _state(saved)


def _rewrite(a: str, b: str) -> Callable[[], None]:
    def change() -> None:  # in place, as another process writing the file would
        with open(b, "rb") as src, open(a, "r+b") as dst:
            shutil.copyfileobj(src, dst)

    return change


def _truncate(a: str) -> Callable[[], None]:
    return lambda: os.truncate(a, os.path.getsize(a) // 3)


def _after_the_checks(monkeypatch: pytest.MonkeyPatch, change: Callable[[], None]) -> None:
    """Run ``change()`` once every check of the restore passed, before the first copy."""
    apply = matching.RestorePlan.apply
    done = []

    def hooked(self: Any) -> None:
        if not done:
            done.append(1)
            change()
        apply(self)

    monkeypatch.setattr(matching.RestorePlan, "apply", hooked)


def _after_the_first_read(monkeypatch: pytest.MonkeyPatch, change: Callable[[], None]) -> None:
    """Run ``change()`` right after the restore's first read of data (more reads follow, on
    one thread: after the change)."""
    monkeypatch.setattr(read_module, "BULK_PIECE", 1 << 12)
    monkeypatch.setenv("PARALLELVARS_THREADS", "1")
    read = H5Reader._read_fully
    done = []

    def hooked(self: Any, *args: Any, **kw: Any) -> int:
        out = read(self, *args, **kw)
        if not done:
            done.append(1)
            change()
        return out

    monkeypatch.setattr(H5Reader, "_read_fully", hooked)


# The default suite takes every kind and size with three dtypes (bfloat16: an extension dtype,
# bytes: read through HDF5); the other dtypes run with -m slow.
QUICK_DTYPES = ("float32", "bfloat16", "bytes")
SWEEP = [
    pytest.param(how, kind, dtype, size, marks=() if dtype in QUICK_DTYPES else pytest.mark.slow)
    for how in ("rewritten", "truncated")
    for kind in KINDS
    for dtype in DTYPES
    for size in SIZES
]


@pytest.mark.parametrize(("how", "kind", "dtype", "size"), SWEEP)
def test_a_file_changed_after_the_checks_restores_whole_what_was_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, kind: str, dtype: str, size: str
) -> None:
    a, b, expected = _saved_pair(tmp_path, kind, dtype, size)
    _after_the_checks(monkeypatch, _rewrite(a, b) if how == "rewritten" else _truncate(a))
    live = _model(kind, dtype, size, 0)
    pv.Checkpoint(model=live).restore(a).assert_consumed()
    assert _state(live) == expected


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["rewritten", "truncated"])
def test_a_file_changed_while_it_is_read_leaves_every_variable_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, kind: str, size: str
) -> None:
    """All or nothing: an error naming the file (nothing written), or, when every byte the
    restore needed had been read before the change (small components, read in one go), the
    whole restore of the values read and checked."""
    a, b, expected = _saved_pair(tmp_path, kind, "float32", size)
    _after_the_first_read(monkeypatch, _rewrite(a, b) if how == "rewritten" else _truncate(a))
    live = _model(kind, "float32", size, 0)
    before = _state(live)
    try:
        pv.Checkpoint(model=live).restore(a)
    except CheckpointError as exc:
        assert exc.file == a
        assert not isinstance(exc, ConcurrentWriteError)  # nothing was written
        assert _state(live) == before
    else:
        assert size == "small"  # (large components: read in many reads, met the change)
        assert _state(live) == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bytes"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["rewritten", "truncated"])
def test_past_the_limit_a_change_is_an_error_naming_what_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, kind: str, dtype: str
) -> None:
    """Nothing held (RESTORE_KEEP_LIMIT 0): each component is read again when it is copied
    and checked before it lands; no byte of the other file ever lands. (Byte strings are read
    through HDF5, whose cache may still hold the checked values: those land, checked again.)"""
    monkeypatch.setattr(read_module, "RESTORE_KEEP_LIMIT", 0)
    a, b, expected = _saved_pair(tmp_path, kind, dtype, "large")
    _after_the_checks(monkeypatch, _rewrite(a, b) if how == "rewritten" else _truncate(a))
    live = _model(kind, dtype, "large", 0)
    before = _state(live)
    try:
        pv.Checkpoint(model=live).restore(a)
    except ConcurrentWriteError as exc:
        assert exc.file == a and "changed after it was verified" in str(exc)
        named, failed = str(exc), exc.variable or ""
    else:
        assert dtype == "bytes", "a change after the checks went unnoticed"
        assert _state(live) == expected
        return
    paths = [f"model/vs/{k}" for k in range(3)] + ["model/w"]
    for path, got, old, new in zip(paths, _state(live), before, expected, strict=True):
        if got == new and got != old:
            assert path in named, (path, named)  # written, and named
        elif got != old:  # in part: only the variable the error names
            assert failed.startswith(path), (path, named)


@pytest.mark.parametrize("limit", [None, 0])
def test_a_mirrored_component_stored_once_is_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int | None
) -> None:
    """The components of a mirrored variable share one dataset: a restore reads its bytes
    once and copies them into every live component (past the limit: once to check them, once
    to copy them, not once per component)."""
    if limit is not None:
        monkeypatch.setattr(read_module, "RESTORE_KEEP_LIMIT", limit)
    a, _, expected = _saved_pair(tmp_path, "mirrored", "float32", "large")
    read = H5Reader._read_fully
    sizes: list[int] = []

    def counted(self: Any, view: memoryview, *args: Any, **kw: Any) -> int:
        sizes.append(len(view))
        return read(self, view, *args, **kw)

    monkeypatch.setattr(H5Reader, "_read_fully", counted)
    live = _model("mirrored", "float32", "large", 0)
    pv.Checkpoint(model=live).restore(a)
    assert _state(live) == expected
    component = _values("float32", "large", 0).nbytes
    assert component * 3 <= sum(sizes) < component * 3 * 2  # three datasets, each read once


def test_the_manager_restore_and_a_foreign_format_land_what_was_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same mechanism behind CheckpointManager.restore, and a safetensors file (read once
    when verified, copied from memory)."""
    from parallelvars import formats

    saved = _model("mirrored", "bfloat16", "large", 1)
    with pv.CheckpointManager(pv.Checkpoint(model=saved), tmp_path / "run") as mgr:
        first = mgr.save()
    other = tmp_path / "other.h5"
    pv.Checkpoint(model=_model("mirrored", "bfloat16", "large", 2)).write(other)
    st_a, st_b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    formats.convert(first, st_a)
    formats.convert(other, st_b)
    _after_the_checks(monkeypatch, _rewrite(first, str(other)))
    live = _model("mirrored", "bfloat16", "large", 0)
    with pv.CheckpointManager(pv.Checkpoint(model=live), tmp_path / "run") as mgr:
        mgr.restore()
    assert _state(live) == _state(saved)

    assert os.path.getsize(st_a) == os.path.getsize(st_b)
    monkeypatch.undo()
    _after_the_checks(monkeypatch, _rewrite(str(st_a), str(st_b)))
    live = _model("mirrored", "bfloat16", "large", 0)
    pv.Checkpoint(model=live).restore(st_a)
    assert [v.numpy().tobytes() for v in live.vs] == [v.numpy().tobytes() for v in saved.vs]


@pytest.mark.parametrize("limit", [None, 0])
def test_two_names_of_one_dataset_verified_at_once_are_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int | None
) -> None:
    """Two threads verifying two names of one stored-once dataset at the same time (a
    mirrored variable's components): one reads it (into its slot, or streamed past the limit),
    the other waits for that read and takes its checksum."""
    if limit is not None:
        monkeypatch.setattr(read_module, "RESTORE_KEEP_LIMIT", limit)
    a, _, _ = _saved_pair(tmp_path, "mirrored", "float32", "large")
    with H5Reader(a) as reader:
        var = reader["model/vs/0"]
        loc = var._location(0)
        assert loc is not None and loc == var._location(1)  # one dataset, two names
        offset, size = loc
        nbytes = size * var.dtype.itemsize
        reader.stage([var])
        preadv = os.preadv
        read: list[int] = []
        # Each read of the dataset waits (at most 0.5 s) for a second one to start meanwhile.
        both = threading.Barrier(2, timeout=0.5)

        def counted(fd: int, buffers: Any, at: int) -> int:
            if offset <= at < offset + nbytes:
                with contextlib.suppress(threading.BrokenBarrierError):
                    both.wait()
                n = preadv(fd, buffers, at)
                read.append(n)
                return n
            return preadv(fd, buffers, at)

        monkeypatch.setattr(os, "preadv", counted)
        threads = [threading.Thread(target=var.verify, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        monkeypatch.undo()
        assert sum(read) == nbytes  # read once, not once per name
        assert 0 in var._verified and 1 in var._verified
        reader.unstage()
