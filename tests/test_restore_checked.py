"""A restore lands only checksummed bytes, even when the file changes under it.

A restore verifies every checksum before it writes any variable (all or nothing); large
components are then read again to be copied. Another process rewriting or cutting the file in
between must not make the restore land bytes no checksum covered: every byte copied is checked
again as it lands, and a change found then is a ConcurrentWriteError naming the variables
already written, never a silent restore of other values.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import parallelvars as pv
from parallelvars.checkpoint.h5io import read as read_module
from parallelvars.checkpoint.h5io.stored import StoredVariable
from parallelvars.errors import ConcurrentWriteError

N = 1 << 18  # float32: 1 MiB per variable, read in two passes (verify, then copy)


def model(value: float) -> tuple[pv.Checkpoint, list[Any]]:
    variables = [pv.Variable(np.full(N, value + i, np.float32), name=f"v{i}") for i in range(3)]
    m = pv.Module()
    m.a, m.b, m.c = variables
    return pv.Checkpoint(model=m), variables


def _between_passes(monkeypatch: pytest.MonkeyPatch, change: Any) -> None:
    """Run ``change()`` once, when the restore copies ``model/c`` (after its pass of checks,
    and after other variables were written)."""
    original = StoredVariable.read_component_into
    calls = [0]

    def hooked(self: StoredVariable, *args: Any, **kw: Any) -> None:
        if self.path == "model/c" and not calls[0]:
            calls[0] += 1
            change()
        original(self, *args, **kw)

    monkeypatch.setattr(StoredVariable, "read_component_into", hooked)


@pytest.mark.parametrize("how", ["rewritten", "truncated"])
@pytest.mark.parametrize("kept", [True, False])
def test_a_file_changed_between_the_passes_lands_no_unchecked_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, kept: bool
) -> None:
    """Kept in memory (RESTORE_KEEP_LIMIT set), the verified bytes are copied: the restore is
    whole and ignores the change. Not kept (the default), each component is read again into a
    buffer and checked there before it lands: ConcurrentWriteError, nothing unchecked landed."""
    monkeypatch.setattr(read_module, "RESTORE_KEEP_LIMIT", 1 << 30 if kept else 0)
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    model(1.0)[0].write(a)
    model(100.0)[0].write(b)  # the same structure: the same layout, other values
    assert os.path.getsize(a) == os.path.getsize(b)
    ckpt, live = model(0.0)

    def change() -> None:
        if how == "rewritten":  # in place, as another process writing the file would
            with open(b, "rb") as src, open(a, "r+b") as dst:
                shutil.copyfileobj(src, dst)
        else:
            os.truncate(a, os.path.getsize(a) // 2)

    _between_passes(monkeypatch, change)
    if kept:
        ckpt.restore(a)
        for i, v in enumerate(live):
            assert np.array_equal(np.asarray(v), np.full(N, 1.0 + i, np.float32))
        return
    with pytest.raises(ConcurrentWriteError, match="changed after it was verified") as info:
        ckpt.restore(a)
    message = str(info.value)
    assert info.value.file == a
    written = 0
    for i, v in enumerate(live):
        got = np.asarray(v)
        # the saved values, or untouched: never the other file's bytes
        assert np.array_equal(got, np.full(N, 1.0 + i, np.float32)) or np.array_equal(
            got, np.full(N, 0.0 + i, np.float32)
        ), (i, got[:4])
        if np.array_equal(got, np.full(N, 1.0 + i, np.float32)):
            written += 1
            assert f"model/{'abc'[i]}" in message  # a variable written is named
    assert written >= 1 and "already restored" in message, message


def test_an_unchanged_file_restores_after_the_second_check(tmp_path: Path) -> None:
    a = str(tmp_path / "a.h5")
    model(1.0)[0].write(a)
    ckpt, live = model(0.0)
    ckpt.restore(a)
    for i, v in enumerate(live):
        assert np.array_equal(np.asarray(v), np.full(N, 1.0 + i, np.float32))


def test_pieces_of_a_shard_verify_only_when_they_cover_it_and_their_checksums_join() -> None:
    import crc32c

    from parallelvars.errors import ChecksumMismatchError, CorruptCheckpointError
    from parallelvars.testing import Piece, verify_pieces

    data = bytes(range(200))
    whole = crc32c.crc32c(data)

    def piece(a: int, b: int, expected: int = whole) -> Piece:
        return Piece("v", 1, a, b - a, crc32c.crc32c(data[a:b]), len(data), expected)

    verify_pieces([piece(120, 200), piece(0, 50), piece(50, 120)], "f.h5")  # any order
    with pytest.raises(ChecksumMismatchError, match="v/parallel_component_1"):
        verify_pieces([piece(0, 50, whole ^ 1), piece(50, 200, whole ^ 1)], "f.h5")
    with pytest.raises(CorruptCheckpointError, match="do not cover"):
        verify_pieces([piece(0, 50), piece(60, 200)], "f.h5")  # a gap
    with pytest.raises(CorruptCheckpointError, match="do not cover"):
        verify_pieces([piece(0, 50)], "f.h5")  # the rest read by no one
