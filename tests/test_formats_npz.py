"""NumPy .npz adapter: lazy reads without unpickling, numpy as the client of our output."""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import struct
import tracemalloc
import zipfile

import ml_dtypes
import numpy as np
import pytest
from formats_testlib import KERAS, TORCH, assert_same_view, same_bits, torch_expected

from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    NotACheckpointError,
    TruncatedFileError,
    UnsupportedDtypeError,
)
from parallelvars.formats import ArrayEntry, DictView, detect_format
from parallelvars.formats.npz import INFO_MEMBER, open_npz, write_npz


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
    view = DictView(
        [
            ArrayEntry("bf", [bits.view(ml_dtypes.bfloat16).reshape(3, 4)]),
            ArrayEntry("f8", [np.arange(5, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)]),
            ArrayEntry("s", [np.array([[b"ab", b""], [b"xyz", b"\x00q"]], dtype=object)]),
        ]
    )
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
    view = DictView(
        [
            ArrayEntry(
                "e",
                shards,
                kind="sharded",
                shape=(4, 10),
                attrs={"shard_axis": 1, "shard_offsets": offsets},
            )
        ]
    )
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


def _npz_of_member(path: pathlib.Path, version: int, header: str, data: bytes = b"") -> None:
    """An archive of one member ``x.npy``: magic, the header's length field, header, data."""
    raw = header.encode("latin1")
    length = struct.pack("<H" if version == 1 else "<I", len(raw))
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", b"\x93NUMPY" + bytes([version, 0]) + length + raw + data)


@pytest.mark.parametrize(
    "version, header, error, message",
    [
        # numpy's tokenizer fallback (for Python 2 headers) raises its own TokenError here
        (1, "{'descr': '<f4', (", CorruptCheckpointError, "cannot parse"),
        (2, '"""', CorruptCheckpointError, "cannot parse"),
        (1, "{'descr': '<f4', 'fortran_order': 0, 'shape': ()}", CorruptCheckpointError, "parse"),
        (1, "{'descr': '<f4', 'shape': ()}", CorruptCheckpointError, "cannot parse"),
        (1, "[1, 2]", CorruptCheckpointError, "cannot parse"),
        # numpy lets negative and bool dimensions through; we do not
        (
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,)}",
            CorruptCheckpointError,
            "bad shape",
        ),
        (
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (True,)}",
            CorruptCheckpointError,
            "bad shape",
        ),
        (
            1,
            "{'descr': '<q9', 'fortran_order': False, 'shape': ()}",
            UnsupportedDtypeError,
            "unknown .npy dtype",
        ),
        (
            1,
            "{'descr': '|O', 'fortran_order': False, 'shape': ()}",
            UnsupportedDtypeError,
            "pickled",
        ),
        (
            1,
            "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': ()}",
            UnsupportedDtypeError,
            "plain",
        ),
        (
            4,
            "{'descr': '<f4', 'fortran_order': False, 'shape': ()}",
            CorruptCheckpointError,
            "version",
        ),
    ],
)
def test_bad_npy_headers_raise_our_errors(tmp_path, version, header, error, message) -> None:
    path = tmp_path / "bad.npz"
    _npz_of_member(path, version, header)
    with pytest.raises(error, match=message) as err:
        open_npz(path)
    assert str(path) in str(err.value) and "'x'" in str(err.value)


def test_npy_header_length_claiming_gigabytes_is_refused_before_reading(tmp_path) -> None:
    path = tmp_path / "h.npz"
    with zipfile.ZipFile(path, "w") as zf:  # 2.0 length field: 4 GiB - 1, then 64 MiB of header
        zf.writestr(
            "x.npy", b"\x93NUMPY\x02\x00" + struct.pack("<I", 2**32 - 1) + b" " * (64 << 20)
        )
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="header too large") as err:
            open_npz(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"{2**32 - 1} bytes" in str(err.value)
    assert peak < 1 << 20  # numpy's reader never got to read the claimed header


@pytest.mark.parametrize("cut", [5, 9, 40])
def test_npy_header_cut_short(tmp_path, cut) -> None:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.zeros(3, np.float32))
    path = tmp_path / "cut.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", buf.getvalue()[:cut])
    with pytest.raises(TruncatedFileError, match="cut short") as err:
        open_npz(path)
    assert "'x'" in str(err.value)


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_every_npy_version_reads(tmp_path, version) -> None:
    want = np.arange(12, dtype=np.int16).reshape(3, 4)
    buf = io.BytesIO()
    np.lib.format.write_array(buf, want, version=version)
    path = tmp_path / "v.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", buf.getvalue())
    with open_npz(path) as view:
        assert same_bits(view["x"].value(), want)


def test_npy_header_claiming_a_terabyte(tmp_path) -> None:
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': (137438953472,), }"
    header += " " * (-(len(header) + 11) % 64) + "\n"
    path = tmp_path / "tb.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            "big.npy", b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode()
        )
    tracemalloc.start()
    try:
        with pytest.raises(TruncatedFileError, match="'big'"):
            open_npz(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


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
        zf.writestr(
            INFO_MEMBER,
            '{"format": "parallelvars", "version": 1, "variables": '
            '{"a": {"kind": "mirrored", "dtype": "float64", "shape": [2], '
            '"num_components": 2, "keys": ["a", "a/parallel_component_1"]}}}',
        )
    with pytest.raises(CorruptCheckpointError, match="missing") as err:
        open_npz(path)
    assert "variable 'a'" in str(err.value)
    assert pathlib.Path(path).exists()


def test_detection_is_strict(tmp_path) -> None:
    torch_like = tmp_path / "model.pt"
    with zipfile.ZipFile(torch_like, "w") as zf:  # the layout of torch.save
        zf.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        zf.writestr("archive/data/0", bytes(8))
    with pytest.raises(NotACheckpointError, match="not a checkpoint of any known format"):
        detect_format(torch_like)
    good = tmp_path / "a.npz"
    np.savez(good, a=np.zeros(100))
    cut = tmp_path / "cut.npz"
    cut.write_bytes(good.read_bytes()[:200])
    assert detect_format(cut) == "npz"  # by its suffix: the zip directory is gone
    with pytest.raises(TruncatedFileError):
        open_npz(cut)
    empty = tmp_path / "empty.npz"
    np.savez(empty)
    assert detect_format(empty) == "npz"
    with open_npz(empty) as view:
        assert len(view) == 0


# ------------------------------------------------------------------------------------------
# integrity: the zip's CRC-32 of every member is checked, and our record lists the members


def _sample(tmp_path) -> tuple[str, DictView]:
    # members larger than zipfile's 4 KiB read-ahead, so that opening reads only their headers
    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    view = DictView(
        [
            ArrayEntry("model/w", [w, w + 1], kind="mirrored"),
            ArrayEntry(
                "model/e",
                [w[:32], w[32:]],
                kind="sharded",
                shape=(64, 64),
                attrs={"shard_axis": 0, "shard_offsets": [0, 32]},
            ),
            ArrayEntry("step", [np.array(7, np.int64)]),
        ]
    )
    return write_npz(tmp_path / "m.npz", view), view


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x01]))


@pytest.mark.parametrize("member", ["model/w", "model/e"])
def test_a_flipped_data_byte_fails_the_zip_crc(tmp_path, member) -> None:
    path, _ = _sample(tmp_path)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(f"{member}.npy")
        with zf.open(info) as f:
            data = f.read()
    end_of_data = info.header_offset + 30 + len(info.filename) + len(info.extra) + len(data)
    _flip(path, end_of_data - 1)  # the member's last data byte
    with open_npz(path) as view:
        entry = view[member]
        i = (
            entry.num_components - 1 if entry.kind == "sharded" else 0
        )  # a slice: the whole member is checked
        with pytest.raises(ChecksumMismatchError, match=f"{member}.*CRC-32"):
            entry.component(i)


def test_zip_errors_become_ours_naming_the_member(tmp_path) -> None:
    path, _ = _sample(tmp_path)
    data = bytearray(pathlib.Path(path).read_bytes())
    at = data.rindex(b"model/w/parallel_component_1.npy")  # the name in the central directory
    data[at + 2] ^= 0x01
    pathlib.Path(path).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="BadZipFile"):
        open_npz(path)


def test_our_record_comes_first_and_lists_every_member(tmp_path) -> None:
    path, _ = _sample(tmp_path)
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        record = json.loads(zf.read(INFO_MEMBER))
    assert names[0] == INFO_MEMBER and record["members"] == names[1:]
    assert sorted(np.load(path).files) == sorted(
        n.removesuffix(".npy") for n in names
    )  # numpy still reads it


def test_an_archive_that_lost_a_member_is_detected(tmp_path) -> None:
    path, _ = _sample(tmp_path)
    cut = tmp_path / "cut.npz"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(cut, "w") as dst:
        for info in src.infolist()[:-1]:  # what a directory cut short still lists
            dst.writestr(info, src.read(info))
    with pytest.raises(CorruptCheckpointError, match=r"step\.npy.*missing|missing.*step"):
        open_npz(cut)


def test_variables_alike_in_every_attribute_share_one_dict_until_one_changes(tmp_path):
    """A version-2 (column) info's variables alike in every attribute share one dict of
    them (one per distinct combination, not one per variable); an entry copies it at its
    first use, so a change through one entry stays its own and never reaches the other."""
    tensors = {k: np.arange(4, dtype=np.float32) for k in ("a", "a/c1", "b", "b/c1", "c", "c/c1")}
    columns = {
        "path": ["a", "b", "c"],
        "kind": {"values": ["mirrored"], "index": 0},
        "dtype": {"values": ["float32"], "index": 0},
        "shape": {"values": [[4]], "index": 0},
        "num_components": {"values": [2], "index": 0},
        "layout": {"values": ["components"], "index": 0},
        "keys": list(range(6)),
        "attrs": {
            "devices": {"values": [["d0", "d1"]], "index": 0},
            "note": {"values": [[1, 2], [9]], "index": [0, 0, 1]},
        },
    }
    info = {"format": "parallelvars", "version": 2, "names": "slash", "columns": columns}
    path = tmp_path / "alike.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(INFO_MEMBER, json.dumps(info))
        for key, value in tensors.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, value)
            z.writestr(f"{key}.npy", buf.getvalue())
    with open_npz(path) as view:
        a, b, c = view["a"], view["b"], view["c"]
        assert a._own is None and b._own is None  # (nothing read their attributes yet)
        assert a._shared is b._shared  # one dict for the two alike
        assert c._shared is not a._shared and c._shared["note"] == [9]
        want = {"devices": ["d0", "d1"], "note": [1, 2]}
        a.attrs["note"].append(3)
        assert a.attrs["note"] == [1, 2, 3]
        assert b.attrs == want and c.attrs["note"] == [9]
        assert view["a"].attrs["note"] == [1, 2, 3]
        assert b.component(1).tolist() == [0.0, 1.0, 2.0, 3.0]
