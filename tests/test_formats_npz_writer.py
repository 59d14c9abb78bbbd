"""The npz writer's own zip records (``zip_policy.StoredZipWriter``) are byte for byte what
zipfile writes for the same members, and numpy and zipfile read them."""

from __future__ import annotations

import os
import time
import zipfile

import ml_dtypes
import numpy as np
import pytest

from parallelvars.formats import ArrayEntry, DictView, open_checkpoint
from parallelvars.formats.npz import INFO_MEMBER, write_npz
from parallelvars.formats.testing import zip_policy


def _zipfile_bytes(path: str, members: list[tuple[str, bytes, bool]]) -> bytes:
    """The archive zipfile writes: ``writestr`` for a member without zip64, else
    ``open(name, "w", force_zip64=True)`` (what the npz writer did before it had its own)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data, zip64 in members:
            if not zip64:
                zf.writestr(name, data)
            else:
                with zf.open(name, "w", force_zip64=True) as f:
                    f.write(data)
    with open(path, "rb") as f:
        return f.read()


def _ours(path: str, members: list[tuple[str, bytes, bool]], now: tuple[int, ...]) -> bytes:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        zw = zip_policy.StoredZipWriter(fd)
        for name, data, zip64 in members:
            stamp = now if not zip64 else (1980, 1, 1, 0, 0, 0)
            zw.add(name, [data[:3], data[3:]], zip64=zip64, date_time=stamp)  # type: ignore[arg-type]
        size = zw.finish()
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        data = f.read()
    assert size == len(data)
    return data


@pytest.mark.parametrize("count", [0, 1, 5, 300, 1500])  # (1500: past IOV_MAX buffers)
def test_same_bytes_as_zipfile(tmp_path, monkeypatch, count) -> None:
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    now = time.localtime(time.time())[:6]
    rng = np.random.default_rng(count)
    members = [("__record__.json", b'{"a": 1}', False)]
    members += [
        (f"w{k}/\u00e9t\u00e9.npy" if k % 7 == 3 else f"w{k}.npy", rng.bytes(k % 50 + 3), True)
        for k in range(count)
    ]
    want = _zipfile_bytes(str(tmp_path / "ref.zip"), members)
    got = _ours(str(tmp_path / "ours.zip"), members, now)
    assert got == want
    with zipfile.ZipFile(tmp_path / "ours.zip") as zf:
        assert zf.testzip() is None
        assert [i.filename for i in zf.infolist()] == [m[0] for m in members]


@pytest.mark.slow
def test_zip64_member_count_same_as_zipfile(tmp_path, monkeypatch) -> None:
    """More members than the classic end record counts: zip64 end records, as zipfile."""
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    now = time.localtime(time.time())[:6]
    members = [(f"m{k}.npy", k.to_bytes(4, "little"), True) for k in range(70_000)]
    want = _zipfile_bytes(str(tmp_path / "ref.zip"), members)
    assert _ours(str(tmp_path / "ours.zip"), members, now) == want


def test_written_npz_read_by_numpy_and_ours(tmp_path) -> None:
    """Every dtype the writer takes, 0-d and empty, kinds with several components: numpy's
    own loader and our reader give back the bytes."""
    rng = np.random.default_rng(1)
    entries = [
        ArrayEntry("a/f32", [rng.standard_normal((3, 4)).astype(np.float32)] * 2, kind="mirrored"),
        ArrayEntry("a/bf16", [rng.standard_normal(5).astype(ml_dtypes.bfloat16)]),
        ArrayEntry("a/f8", [rng.standard_normal(7).astype(ml_dtypes.float8_e4m3fn)]),
        ArrayEntry("a/i8", [np.arange(-3, 3, dtype=np.int8)]),
        ArrayEntry("a/b", [np.array([True, False])]),
        ArrayEntry("a/s", [np.array(2.5)]),
        ArrayEntry("a/e", [np.zeros((0, 2), np.complex64)]),
        ArrayEntry("a/be", [np.arange(4, dtype=">i4")]),
        ArrayEntry("a/bytes", [np.array([b"ab", b"c"], dtype=object)]),
        ArrayEntry(
            "a/sh",
            [
                np.arange(6, dtype=np.float64).reshape(3, 2),
                np.arange(2, dtype=np.float64).reshape(1, 2),
            ],
            kind="sharded",
            shape=(4, 2),
            attrs={"shard_axis": 0, "shard_offsets": [0, 3]},
        ),
    ]
    out = write_npz(tmp_path / "x.npz", DictView(entries))
    with np.load(out) as z:
        assert np.array_equal(z["a/f32"], entries[0].component(0))
        assert z["a/s"].shape == ()
        assert np.array_equal(z["a/be"], np.arange(4))
        assert z["a/sh"].shape == (4, 2)
    with zipfile.ZipFile(out) as zf:
        assert zf.testzip() is None
        assert zf.namelist()[0] == INFO_MEMBER
    with open_checkpoint(out) as view:
        for e in entries:
            got = view[e.path]
            assert got.kind == e.kind and got.num_components == e.num_components
            for i in range(e.num_components):
                a, b = got.component(i), e.component(i)
                assert a.shape == b.shape
                if b.dtype.kind == "O":
                    assert a.tolist() == b.tolist()
                else:
                    assert a.tobytes() == np.asarray(b, b.dtype.newbyteorder("<")).tobytes()
