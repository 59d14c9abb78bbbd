"""Zip archives as hostile as any input: npz files, ``.keras`` archives and the ``.keras``
templates a writer copies (``--like``) go through one policy (``formats/_zip.py``).

A template is copied with the limits its weights member is read with: no duplicate or
overlapping entries (one member listed forty times would be inflated forty times), the
expansion bounded by deflate's ratio, at most ``MAX_MEMBERS`` members; a bad CRC, an encrypted
member or an unknown compression method is our documented error, and none of zipfile's
warnings reaches the user.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from formats_testlib import KERAS

from parallelvars import formats
from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    LimitExceededError,
    NotACheckpointError,
)
from parallelvars.formats.testing import zip_policy as _zip

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = KERAS / "model.weights.h5"
CONFIG = json.dumps({"class_name": "Sequential", "config": {"name": "sequential"}})
META = json.dumps({"keras_version": "3.15.1", "date_saved": "2026-01-01@00:00:00"})
BIG = 64 << 20  # the member a hostile template lists many times: 64 MiB of zeros (~64 KB)


def template(path: Path, *, big: int = 0) -> Path:
    """An archive laid out as Keras 3 writes one, with a member ``big.bin`` of ``big`` zero
    bytes (DEFLATED) when asked."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("metadata.json", META)
        z.writestr("config.json", CONFIG)
        if big:
            z.writestr("big.bin", bytes(big))
        z.write(WEIGHTS, "model.weights.h5", compress_type=zipfile.ZIP_STORED)
    return path


def _records(raw: bytes) -> tuple[int, int, int]:
    """(offset of the end record, of the central directory, its size)."""
    end = raw.rindex(b"PK\x05\x06")
    size, start = struct.unpack_from("<II", raw, end + 12)
    return end, start, size


def central_record(raw: bytes, name: str) -> tuple[int, int]:
    """Where the central directory record of ``name`` starts, and its length."""
    _, start, size = _records(raw)
    at = start
    while at < start + size:
        n, m, k = struct.unpack_from("<HHH", raw, at + 28)
        if raw[at + 46 : at + 46 + n] == name.encode():
            return at, 46 + n + m + k
        at += 46 + n + m + k
    raise AssertionError(name)


def relist(path: Path, name: str, times: int, *, rename: bool = False) -> None:
    """List member ``name`` ``times`` times more in the central directory (the same bytes),
    under its own name or (``rename``) under others of the same length."""
    raw = bytearray(path.read_bytes())
    at, length = central_record(bytes(raw), name)
    record = bytes(raw[at : at + length])
    extra = b""
    for k in range(times):
        copy = bytearray(record)
        if rename:
            copy[46 : 46 + 3] = f"{k:03d}".encode()
        extra += bytes(copy)
    end, start, size = _records(bytes(raw))
    raw[start + size : start + size] = extra  # right after the last record
    end += len(extra)
    count = struct.unpack_from("<H", raw, end + 10)[0] + times
    struct.pack_into("<HHI", raw, end + 8, count, count, size + len(extra))
    path.write_bytes(bytes(raw))


def patch_record(path: Path, name: str, offset: int, fmt: str, value: int) -> None:
    raw = bytearray(path.read_bytes())
    at, _ = central_record(bytes(raw), name)
    struct.pack_into(fmt, raw, at + offset, value)
    path.write_bytes(bytes(raw))


@pytest.fixture
def weights(tmp_path: Path) -> str:
    """The template's weights as a native checkpoint (what a convert writes back)."""
    return formats.convert(str(template(tmp_path / "t.keras")), str(tmp_path / "run.h5"))


def cli(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "parallelvars", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )


# ------------------------------------------------------------------------------ templates


@pytest.mark.parametrize("rename", [False, True])
def test_a_template_listing_one_member_forty_times_is_refused(
    tmp_path: Path, weights: str, rename: bool
) -> None:
    path = template(tmp_path / "bomb.keras", big=BIG)
    assert path.stat().st_size < 200_000
    relist(path, "big.bin", 39, rename=rename)
    with zipfile.ZipFile(path) as z:  # what zipfile lists: 40 entries of 64 MiB
        assert sum(i.file_size for i in z.infolist() if i.file_size == BIG) == 40 * BIG
    match = "share bytes" if rename else "same name"
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        formats.convert(weights, str(tmp_path / "out.keras"), like=str(path))
    assert info.value.file == str(path)
    assert not (tmp_path / "out.keras").exists()
    proc = cli(["convert", weights, str(tmp_path / "out.keras"), "--like", str(path)])
    assert proc.returncode == 2, proc.stderr
    # one line, ours; none of zipfile's warnings ("Duplicate name")
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("parallelvars: error:"), (
        proc.stderr
    )
    assert match in proc.stderr


def test_a_legal_template_with_a_large_member_is_copied(tmp_path: Path, weights: str) -> None:
    path = template(tmp_path / "big.keras", big=BIG)
    out = formats.convert(weights, str(tmp_path / "out.keras"), like=str(path))
    with zipfile.ZipFile(out) as z, zipfile.ZipFile(path) as t:
        assert z.namelist() == t.namelist()
        assert z.getinfo("big.bin").file_size == BIG
        assert z.read("config.json") == t.read("config.json")


@pytest.mark.parametrize(
    ("damage", "error", "match"),
    [
        ("crc", ChecksumMismatchError, "CRC"),
        ("encrypted", NotACheckpointError, "encrypted"),
        ("method", NotACheckpointError, "unsupported zip compression"),
        ("size", LimitExceededError, "claims more bytes"),
    ],
)
def test_hostile_template_members_are_our_errors(
    tmp_path: Path, weights: str, damage: str, error: type[Exception], match: str
) -> None:
    path = template(tmp_path / "t.keras")
    if damage == "crc":
        patch_record(path, "config.json", 16, "<I", 0x12345678)
    elif damage == "encrypted":
        patch_record(path, "config.json", 8, "<H", 0x1)
    elif damage == "method":
        patch_record(path, "config.json", 10, "<H", 99)  # AES: not a method we read
    else:
        patch_record(path, "config.json", 24, "<I", 1 << 30)  # 1 GiB from a few bytes
    with pytest.raises(error, match=match) as info:
        formats.convert(weights, str(tmp_path / "out.keras"), like=str(path))
    assert info.value.file == str(path) and info.value.variable == "config.json"  # type: ignore[attr-defined]
    assert not (tmp_path / "out.keras").exists()
    proc = cli(["convert", weights, str(tmp_path / "out.keras"), "--like", str(path)])
    assert proc.returncode == 2 and match in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_too_many_members_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = template(tmp_path / "t.keras")
    monkeypatch.setattr(_zip, "MAX_MEMBERS", 2)
    with pytest.raises(LimitExceededError, match="too many members"):
        formats.open_checkpoint(str(path))


# ------------------------------------------------------------------------------ readers


def test_an_npz_listing_a_member_twice_or_overlapping_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.npz"
    formats.write_checkpoint(
        str(path), {"w": formats.ArrayEntry("w", [np.arange(4, dtype=np.float32)])}
    )
    twice = tmp_path / "twice.npz"
    twice.write_bytes(path.read_bytes())
    relist(twice, "w.npy", 1)
    with pytest.raises(CorruptCheckpointError, match="same name"):
        formats.open_checkpoint(str(twice))
    overlap = tmp_path / "overlap.npz"
    overlap.write_bytes(path.read_bytes())
    relist(overlap, "w.npy", 1, rename=True)  # "000.npy": the same bytes under a new name
    with pytest.raises(CorruptCheckpointError, match="share bytes"):
        formats.open_checkpoint(str(overlap))


def test_a_keras_archive_listing_its_weights_twice_is_refused(tmp_path: Path) -> None:
    path = template(tmp_path / "m.keras")
    relist(path, "model.weights.h5", 1)
    with pytest.raises(CorruptCheckpointError, match="same name"):
        formats.open_checkpoint(str(path))
