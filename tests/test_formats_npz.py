"""NumPy .npz adapter: lazy reads without unpickling, numpy as the client of our output."""

from __future__ import annotations

import io
import pathlib
import pickle
import struct
import zipfile

import ml_dtypes
import numpy as np
import pytest
from formats_testlib import KERAS, TORCH, assert_same_view, same_bits, torch_expected
from parallelvars.formats import ArrayEntry, DictView, detect_format
from parallelvars.formats.npz import INFO_MEMBER, open_npz, write_npz

from parallelvars.errors import (
    CorruptCheckpointError,
    NotACheckpointError,
    TruncatedFileError,
    UnsupportedDtypeError,
)


def test_reads_torch_expected_with_dtype_tags() -> None:
    expected = torch_expected()
    with open_npz(TORCH / "torch_expected.npz") as view:
        assert sorted(view) == sorted(expected)  # the "#dtype" members are folded in
        for key, want in expected.items():
            assert same_bits(view[key].value(), want), key
        assert view["layers.0.attn.q.weight"].dtype == np.dtype(ml_dtypes.bfloat16)


def test_reads_keras_expected() -> None:
    with np.load(KERAS / "keras_expected.npz") as z, open_npz(KERAS / "keras_expected.npz") as view:
        assert sorted(view) == sorted(z.files)
        for key in z.files:
            assert same_bits(view[key].value(), z[key])


def test_numpy_loads_our_output(tmp_path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "model/w": rng.standard_normal((3, 4)).astype(np.float32),
        "model/b": np.arange(4, dtype=np.int64),
        "flags": np.array([True, False]),
        "scalar": np.array(2.5),
        "empty": np.zeros((0, 2), np.complex64),
    }
    out = write_npz(tmp_path / "a.npz", DictView([ArrayEntry(k, [v]) for k, v in arrays.items()]))
    with np.load(out) as z:  # allow_pickle stays False
        assert sorted(k for k in z.files if k != INFO_MEMBER) == sorted(arrays)
        for k, v in arrays.items():
            assert same_bits(z[k], v)
    with zipfile.ZipFile(out) as zf:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())


def test_ml_dtypes_as_raw_bits_and_strings(tmp_path) -> None:
    bits = np.arange(12, dtype=np.uint16)
    view = DictView([
        ArrayEntry("bf", [bits.view(ml_dtypes.bfloat16).reshape(3, 4)]),
        ArrayEntry("f8", [np.arange(5, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)]),
        ArrayEntry("s", [np.array([[b"ab", b""], [b"xyz", b"\x00q"]], dtype=object)]),
    ])
    out = write_npz(tmp_path / "d.npz", view)
    with np.load(out) as z:
        assert z["bf"].dtype == np.uint16 and same_bits(z["bf"], bits.reshape(3, 4))
        assert z["s"].dtype.kind == "S"
    with open_npz(out) as back:
        assert_same_view(back, view)


def test_strings_ending_in_nul_are_refused(tmp_path) -> None:
    view = DictView([ArrayEntry("s", [np.array([b"a\x00"], dtype=object)])])
    with pytest.raises(UnsupportedDtypeError, match="'s'"):
        write_npz(tmp_path / "s.npz", view)


@pytest.mark.parametrize("writer", ["savez", "savez_compressed"])
def test_reads_numpy_written_files_lazily(tmp_path, writer) -> None:
    rng = np.random.default_rng(2)
    a = rng.standard_normal((6, 5)).astype(np.float32)
    f = np.asfortranarray(rng.standard_normal((3, 4)))
    big = np.arange(10, dtype=">i4")
    path = tmp_path / "n.npz"
    getattr(np, writer)(path, a=a, f=f, big=big)
    with open_npz(path) as view:
        assert view.format == "npz"
        assert same_bits(view["a"].value(), a)
        assert same_bits(view["f"].value(), np.ascontiguousarray(f))
        assert view["big"].dtype == np.dtype("int32")
        assert view["big"].value().tolist() == list(range(10))
    assert detect_format(path) == "npz"


def test_sharded_components_are_slices_of_the_stored_value(tmp_path) -> None:
    full = np.arange(40, dtype=np.int16).reshape(4, 10)
    offsets = [0, 4, 7]
    shards = [full[:, 0:4], full[:, 4:7], full[:, 7:]]
    view = DictView([ArrayEntry("e", shards, kind="sharded", shape=(4, 10),
                                attrs={"shard_axis": 1, "shard_offsets": offsets})])
    out = write_npz(tmp_path / "e.npz", view)
    with np.load(out) as z:
        assert same_bits(z["e"], full)  # a plain reader sees the full tensor
    with open_npz(out) as back:
        for i, shard in enumerate(shards):
            assert same_bits(back["e"].component(i), shard)


# ------------------------------------------------------------------------------------------
# bad input


def test_object_array_is_refused_before_unpickling(tmp_path, monkeypatch) -> None:
    path = tmp_path / "obj.npz"
    np.savez(path, ok=np.zeros(2), evil=np.array([{"payload": 1}, None], dtype=object))

    def no_unpickling(*args, **kwargs):
        raise AssertionError("the reader unpickled something")

    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(pickle, "Unpickler", no_unpickling)
    with pytest.raises(UnsupportedDtypeError) as err:
        open_npz(path)
    assert str(path) in str(err.value) and "'evil'" in str(err.value)
    assert "pickled" in str(err.value)


def test_oversized_npy_header_is_refused(tmp_path) -> None:
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), " + " " * 20000 + "}\n"
    npy = b"\x93NUMPY\x02\x00" + struct.pack("<I", len(header)) + header.encode() + bytes(4)
    path = tmp_path / "h.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", npy)
    with pytest.raises(CorruptCheckpointError, match="header too large") as err:
        open_npz(path)
    assert "'x'" in str(err.value)


def test_member_shorter_than_its_header_says(tmp_path) -> None:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.zeros(1000, np.float64))
    path = tmp_path / "short.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", buf.getvalue()[:-8])  # claims 1000 floats, holds 999
    with pytest.raises(TruncatedFileError, match="'x'"):
        open_npz(path)


def test_truncated_archive(tmp_path) -> None:
    good = tmp_path / "good.npz"
    np.savez(good, a=np.zeros(1000))
    raw = good.read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TruncatedFileError) as err:
        open_npz(cut)
    assert str(cut) in str(err.value)


def test_not_a_zip(tmp_path) -> None:
    path = tmp_path / "x.npz"
    path.write_bytes(b"hello world, not a zip at all" * 10)
    with pytest.raises(NotACheckpointError, match="zip"):
        open_npz(path)


def test_bad_parallel_info_is_reported(tmp_path) -> None:
    path = tmp_path / "i.npz"
    with zipfile.ZipFile(path, "w") as zf:
        buf = io.BytesIO()
        np.lib.format.write_array(buf, np.zeros(2))
        zf.writestr("a.npy", buf.getvalue())
        zf.writestr(INFO_MEMBER, '{"format": "parallelvars", "version": 1, "variables": '
                                 '{"a": {"kind": "mirrored", "dtype": "float64", "shape": [2], '
                                 '"num_components": 2, "keys": ["a", "a/parallel_component_1"]}}}')
    with pytest.raises(CorruptCheckpointError, match="missing") as err:
        open_npz(path)
    assert "variable 'a'" in str(err.value)
    assert pathlib.Path(path).exists()
