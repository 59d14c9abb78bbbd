"""Conversions out of a native file stream its components in runs read ahead in bulk
(``H5Reader.prefetch`` through ``ReadAhead``, any forwarding entry between), into every
writer: safetensors, npz, TensorFlow and the native layout (convert and reshard). Runs of one
tensor and runs of many write the same values; real readers read the outputs; a damaged
component is still named."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from test_commands_bulk import _files, _records

from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.errors import ChecksumMismatchError
from parallelvars.formats import convert, open_checkpoint, reshard, write_checkpoint

_FORMATS = {"safetensors": "o.safetensors", "npz": "o.npz", "tf": "tf/ckpt", "hdf5": "o.h5"}


def _source(tmp_path, fmt: str) -> str:
    records = _records()
    if fmt == "safetensors":  # (no byte strings in safetensors)
        records = [r for r in records if r.path != "m/txt"]
    return _files(tmp_path, records)[1]


def _bytes(a: np.ndarray) -> object:
    return a.tolist() if a.dtype.kind == "O" else (a.dtype.str, a.shape, a.tobytes())


def _values(path: str, fmt: str) -> dict[str, list[object]]:
    with open_checkpoint(path, format=fmt) as view:
        return {
            k: [_bytes(np.asarray(view[k].component(i))) for i in range(view[k].num_components)]
            for k in view
        }


@pytest.mark.parametrize("fmt", sorted(_FORMATS))
@pytest.mark.parametrize("limit", [1, 64, 1 << 25])
def test_runs_of_any_size_write_the_source(tmp_path, monkeypatch, fmt, limit) -> None:
    src = _source(tmp_path, fmt)
    calls: list[list[str]] = []
    prefetch = H5Reader.prefetch

    def counted(self, paths):  # type: ignore[no-untyped-def]
        calls.append(list(paths))
        return prefetch(self, paths)

    monkeypatch.setattr(H5Reader, "prefetch", counted)
    monkeypatch.setattr("parallelvars._spans.BULK_BYTES", limit)
    out = convert(src, tmp_path / _FORMATS[fmt], to_format=fmt)
    assert any(calls) and calls[-1] == []  # read ahead, and dropped at the end
    if limit == 1:
        assert sum(1 for c in calls if c) > 3  # one run per tensor
    assert _values(out, fmt) == _values(src, "hdf5")


@pytest.mark.parametrize("limit", [1, 1 << 25])
def test_reshard_streams_through_its_rewritten_entries(tmp_path, monkeypatch, limit) -> None:
    """reshard's entries forward to the file's: the run is read ahead all the same, and
    h5py reads what the generator wrote."""
    src = _files(tmp_path, [r for r in _records() if r.kind not in ("independent",)])[1]
    monkeypatch.setattr("parallelvars._spans.BULK_BYTES", limit)
    with open_checkpoint(src) as view:
        out = write_checkpoint(tmp_path / "r3.h5", reshard(view, 3), format="hdf5")
        want = {k: reshard(view, 3)[k] for k in view}
        with open_checkpoint(out) as got:
            for k, e in want.items():
                assert got[k].num_components == e.num_components
                for i in range(e.num_components):
                    assert _bytes(got[k].component(i)) == _bytes(e.component(i)), k
    with h5py.File(out, "r") as f:
        assert f["m/eq/parallel_component_2"].shape == (6,)
        assert np.array_equal(f["m/eq/parallel_component_2"][()], np.arange(6, dtype=np.float32))


def test_real_clients_read_the_outputs(tmp_path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    # (the library's numpy side has no float8 dtype: that record is left out here)
    src = _files(tmp_path, [r for r in _records() if r.path not in ("m/txt", "m/f8")])[1]
    out = convert(src, tmp_path / "o.safetensors", names="slash")
    loaded = safetensors_numpy.load_file(out)
    assert np.array_equal(loaded["m/eq"], np.arange(6, dtype=np.float32))
    assert np.array_equal(loaded["m/ne/parallel_component_1"], np.arange(6, dtype=np.float32) + 1)
    npz = convert(src, tmp_path / "o.npz")
    with np.load(npz) as z:
        assert np.array_equal(z["m/eq"], np.arange(6, dtype=np.float32))


@pytest.mark.parametrize("fmt", sorted(_FORMATS))
def test_a_damaged_component_is_named(tmp_path, fmt) -> None:
    src = _source(tmp_path, fmt)
    with H5Reader(src) as r:
        row = r.table.rows["m/ne"]
        at = int(r.table.offsets[r.table.first[row] + 1])
    with open(src, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatchError, match="m/ne"):
        convert(src, tmp_path / _FORMATS[fmt], to_format=fmt)


def _safetensors_source(tmp_path) -> str:
    src = _files(tmp_path, [r for r in _records() if r.path != "m/txt"])[1]
    return convert(src, tmp_path / "s.safetensors")


@pytest.mark.parametrize("fmt", sorted(_FORMATS))
@pytest.mark.parametrize("limit", [1, 1 << 25])
def test_a_safetensors_source_is_read_ahead_in_runs(tmp_path, monkeypatch, fmt, limit) -> None:
    """Out of a safetensors file, the runs a writer asks for are read in a few ``pread``
    calls (``StoreView.prefetch``, checksums checked): no tensor of the components layout
    is read one by one, and the output holds the source's values."""
    src = _safetensors_source(tmp_path)
    with open_checkpoint(src) as view:
        store = type(view._store)  # type: ignore[attr-defined]  # (the file's byte store)
    one_by_one: list[str] = []
    read_bytes = store._read_bytes

    def counted(self, key, offset, buf):  # type: ignore[no-untyped-def]
        one_by_one.append(key)
        return read_bytes(self, key, offset, buf)

    monkeypatch.setattr(store, "_read_bytes", counted)
    monkeypatch.setattr("parallelvars._spans.BULK_BYTES", limit)
    out = convert(src, tmp_path / _FORMATS[fmt], to_format=fmt)
    # (only the on-read variable's aggregate and parts, stored in the aggregate layout, and
    # the independent float8 pair's are read one by one)
    with open_checkpoint(src) as view:
        bulk = {
            k
            for k in view
            if view[k].layout == "components" and view[k].kind != "sharded"  # type: ignore[attr-defined]
        }
        keys = {key for k in bulk for key in view[k].keys}  # type: ignore[attr-defined]
    assert bulk and not keys & set(one_by_one)
    monkeypatch.setattr(store, "_read_bytes", read_bytes)
    assert _values(out, fmt) == _values(src, "safetensors")


def test_a_damaged_safetensors_tensor_read_ahead_is_named(tmp_path) -> None:
    src = _safetensors_source(tmp_path)
    with open_checkpoint(src) as view:
        key = view["m/ne"].keys[1]  # type: ignore[attr-defined]
    with open(src, "rb") as f:
        import json
        import struct

        n = struct.unpack("<Q", f.read(8))[0]
        start = json.loads(f.read(n))[key]["data_offsets"][0]
    with open(src, "r+b") as f:
        f.seek(8 + n + start)
        byte = f.read(1)
        f.seek(8 + n + start)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatchError, match=r"m\.ne/parallel_component_1"):
        convert(src, tmp_path / "o.h5")
    assert not (tmp_path / "o.h5").exists()
