"""The shared tensor-bytes writer (parallelvars._fileio)."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from parallelvars import _fileio
from parallelvars.errors import ConcurrentWriteError


@pytest.fixture(params=["inline", "helper thread"])
def threads(request, monkeypatch):
    monkeypatch.setenv("PARALLELVARS_THREADS", "1" if request.param == "inline" else "2")
    return request.param


def test_writes_every_byte_at_its_offset_with_its_checksum(tmp_path, threads) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"")
    arrays = [np.arange(n, dtype=np.float32) for n in (0, 1, 1000, 700_000)]  # up to ~3 chunks
    offsets, at = [], 16
    for a in arrays:
        offsets.append(at)
        at += a.nbytes + 8
    writer = _fileio.DataWriter(str(path), "f.bin")
    try:
        crcs = [writer.write(a, off) for a, off in zip(arrays, offsets, strict=True)]
    finally:
        writer.close(raise_errors=True)
    data = path.read_bytes()
    for a, off, crc in zip(arrays, offsets, crcs, strict=True):
        assert data[off : off + a.nbytes] == a.tobytes()
        assert crc == _fileio.checksum(a)


def test_writeback_hints_cover_what_was_written(tmp_path, monkeypatch, threads) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(
        _fileio, "_SYNC_FILE_RANGE", lambda fd, off, n, flags: calls.append((off, n, flags)) or 0
    )
    monkeypatch.setattr(_fileio.DataWriter, "WRITEBACK_STEP", 1 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(b"")
    writer = _fileio.DataWriter(str(path), "f.bin")
    a = np.ones(300_000, np.float32)  # 1.2 MB: over the step each time
    try:
        for k in range(3):
            writer.write(a, k * a.nbytes)
    finally:
        writer.close(raise_errors=True)
    covered = sorted((off, off + n) for off, n, _ in calls)
    assert all(flags == _fileio._SYNC_FILE_RANGE_WRITE for *_, flags in calls)
    assert covered[0][0] == 0 and covered[-1][1] == 3 * a.nbytes
    assert all(x[1] == y[0] for x, y in itertools.pairwise(covered))


def test_a_changed_buffer_fails_the_save(tmp_path, threads) -> None:
    """Inline the check raises at once; on the helper thread it is raised by close()."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"")
    a = np.zeros(200_000, np.float32)  # large enough for the helper thread
    writer = _fileio.DataWriter(str(path), "ckpt.h5")
    crc = writer.write(a, 0)
    a[7] = 1  # changed after its write, before the check
    try:
        with pytest.raises(
            ConcurrentWriteError,
            match=r"ckpt\.h5: variable 'model/w': changed while it was being saved",
        ):
            writer.check_unchanged(a, crc, "model/w")
            writer.close(raise_errors=True)
    finally:
        writer.close(raise_errors=False)  # idempotent here: a failing save keeps its own error


def test_atomic_path_leaves_the_old_file_on_failure(tmp_path) -> None:
    target = tmp_path / "sub" / "c.bin"
    with _fileio.atomic_path(str(target)) as tmp:
        assert os.path.basename(tmp).startswith(".c.bin.tmp-")
        with open(tmp, "wb") as f:
            f.write(b"old")
    with pytest.raises(ValueError), _fileio.atomic_path(str(target)) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"new, half")
        raise ValueError("interrupted")
    assert target.read_bytes() == b"old" and os.listdir(target.parent) == ["c.bin"]


def test_checksum_combine_joins_the_checksums_of_pieces() -> None:
    import crc32c

    from parallelvars._fileio import checksum_combine

    rng = np.random.default_rng(0)
    for n1, n2 in [(0, 5), (5, 0), (1, 1), (100, 7), (1000, 12345), (3, 1 << 20)]:
        a, b = rng.bytes(n1), rng.bytes(n2)
        assert checksum_combine(crc32c.crc32c(a), crc32c.crc32c(b), n2) == crc32c.crc32c(a + b)
