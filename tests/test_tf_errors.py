"""Damaged and unsupported checkpoints: each gives one of our errors, naming the file and key."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    FormatVersionError,
    NotACheckpointError,
    ParallelVarsError,
    TruncatedFileError,
    UnsupportedDtypeError,
)
from parallelvars.formats import open_checkpoint
from parallelvars.formats.testing import (
    BundleEntry,
    BundleHeader,
    TableBuilder,
    TableReader,
    crc32c,
    encode_entry,
    encode_header,
    encode_slice_key,
    mask,
)
from parallelvars.formats.tf import BundleReader, BundleWriter, TfCheckpointView

DATA = Path(__file__).parent / "data" / "tf"
KERNEL = "net/kernel/.ATTRIBUTES/VARIABLE_VALUE"


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    """A writable copy of the plain fixture; returns its prefix."""
    for f in (DATA / "plain").iterdir():
        shutil.copy(f, tmp_path / f.name)
    return tmp_path / "ckpt-1"


def make_bundle(
    prefix: Path,
    entries: dict[bytes, BundleEntry | bytes],
    shards: list[bytes],
    header: BundleHeader | bytes | None = None,
) -> str:
    """A bundle with hand-made index entries (BundleEntry or raw value bytes) and data shards."""
    head = (
        header if isinstance(header, bytes) else encode_header(header or BundleHeader(len(shards)))
    )
    table = TableBuilder()
    table.add(b"", head)
    for key in sorted(entries):
        value = entries[key]
        table.add(key, value if isinstance(value, bytes) else encode_entry(value))
    prefix.with_name(prefix.name + ".index").write_bytes(table.finish())
    for i, data in enumerate(shards):
        prefix.with_name(f"{prefix.name}.data-{i:05d}-of-{len(shards):05d}").write_bytes(data)
    return str(prefix)


def f32_entry(data: bytes, shape: tuple[int, ...], offset: int = 0, shard: int = 0) -> BundleEntry:
    return BundleEntry(1, shape, shard, offset, len(data), mask(crc32c(data)))


def check(err: BaseException, *names: str) -> None:
    assert isinstance(err, ParallelVarsError)
    assert isinstance(err, (ValueError, TypeError))
    for name in names:
        assert name in str(err), (name, str(err))


@pytest.mark.parametrize("cut", [0, 10, 47, 48, 120, -1, -9])
def test_truncated_index(plain: Path, cut: int) -> None:
    index = plain.with_suffix(".index")
    data = index.read_bytes()
    index.write_bytes(data[:cut])
    with pytest.raises((TruncatedFileError, NotACheckpointError)) as info:
        BundleReader(str(plain))
    check(info.value, str(index))


def test_bad_magic(plain: Path) -> None:
    index = plain.with_suffix(".index")
    data = bytearray(index.read_bytes())
    data[-1] ^= 0xFF
    index.write_bytes(bytes(data))
    with pytest.raises(NotACheckpointError, match="magic") as info:
        open_checkpoint(plain, format="tf")
    check(info.value, str(index))


def test_block_checksum_mismatch(plain: Path) -> None:
    index = plain.with_suffix(".index")
    data = bytearray(index.read_bytes())
    at = data.index(b"net/bf")
    data[at] ^= 0x01
    index.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match="data block 0 at offset 0") as info:
        open_checkpoint(plain, format="tf")
    check(info.value, str(index))


def test_entry_checksum_mismatch_is_found_when_the_tensor_is_read(plain: Path) -> None:
    shard = plain.with_name("ckpt-1.data-00000-of-00001")
    data = bytearray(shard.read_bytes())
    data[80] ^= 0x10  # inside net/kernel (offset 76, 60 bytes)
    shard.write_bytes(bytes(data))
    with open_checkpoint(plain) as view:  # opening reads no tensor bytes
        view["net/bias"].component(0)
        with pytest.raises(ChecksumMismatchError) as info:
            view["net/kernel"].component(0)
        check(info.value, str(shard), KERNEL)
    with TfCheckpointView(plain, verify=False) as view:
        assert view["net/kernel"].component(0).shape == (5, 3)


def test_missing_data_shard(plain: Path) -> None:
    shard = plain.with_name("ckpt-1.data-00000-of-00001")
    shard.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing") as info:
        open_checkpoint(plain)
    check(info.value, str(shard))


def test_entry_past_the_end_of_its_shard(plain: Path) -> None:
    shard = plain.with_name("ckpt-1.data-00000-of-00001")
    data = shard.read_bytes()
    shard.write_bytes(data[:200])
    with pytest.raises(TruncatedFileError) as info:
        open_checkpoint(plain)
    check(info.value, str(shard), "run past the end")


def test_shard_truncated_after_opening(plain: Path) -> None:
    shard = plain.with_name("ckpt-1.data-00000-of-00001")
    with open_checkpoint(plain) as view:
        shard.write_bytes(shard.read_bytes()[:100])
        with pytest.raises(TruncatedFileError) as info:
            view["net/kernel"].component(0)
        check(info.value, str(shard), KERNEL)


@pytest.mark.parametrize(
    ("entry", "error", "match"),
    [
        (BundleEntry(1, (2**30, 2**30), size=8), CorruptCheckpointError, "size does not match"),
        (BundleEntry(1, (2**40, 2**40), size=8), CorruptCheckpointError, "impossible tensor shape"),
        (BundleEntry(1, (2**31, 2**31), size=2**64 - 2**32), CorruptCheckpointError, "negative"),
        (
            BundleEntry(1, (2**20, 2**20), size=4 * 2**40, crc32c=1),
            TruncatedFileError,
            "past the end",
        ),
        (BundleEntry(7, (2**50,), size=20), CorruptCheckpointError, "too small"),
        (BundleEntry(1, (2,), shard_id=3, size=8), CorruptCheckpointError, "shard id"),
        (
            BundleEntry(1, (2**30, 2**30), slices=(((0, 1), (0, 1)),)),
            CorruptCheckpointError,
            "missing",
        ),
        (
            BundleEntry(1, (0, 2**62), crc32c=mask(0)),
            CorruptCheckpointError,
            "impossible tensor shape",
        ),
        (BundleEntry(1, (1,) * 70, size=4, crc32c=1), CorruptCheckpointError, "rank 70"),
        (
            BundleEntry(1, (2**62, 0), slices=(((0, 0), (0, 0)),)),
            CorruptCheckpointError,
            "impossible",
        ),
    ],
)
def test_absurd_sizes_and_shapes_allocate_nothing(
    tmp_path: Path, entry: BundleEntry, error, match: str
) -> None:
    prefix = make_bundle(tmp_path / "c", {b"w": entry}, [bytes(64)])
    with pytest.raises(error, match=match) as info:
        BundleReader(prefix)
    check(info.value, "'w'")


def test_slices_must_cover_the_tensor_without_overlap(tmp_path: Path) -> None:
    part = np.zeros((2, 2), np.float32).tobytes()
    spec_a, spec_b = ((0, 2), (0, None)), ((1, 2), (0, None))
    entries: dict[bytes, BundleEntry | bytes] = {
        b"w": BundleEntry(1, (3, 2), slices=(spec_a, spec_b)),
        encode_slice_key(b"w", spec_a): f32_entry(part, (2, 2)),
        encode_slice_key(b"w", spec_b): f32_entry(part, (2, 2), offset=16),
    }
    prefix = make_bundle(tmp_path / "c", entries, [part * 2])
    with pytest.raises(CorruptCheckpointError, match="do not cover") as info:
        BundleReader(prefix)
    check(info.value, "'w'")
    entries[b"w"] = BundleEntry(1, (4, 2), slices=(spec_a, spec_b))
    prefix = make_bundle(tmp_path / "d", entries, [part * 2])
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        BundleReader(prefix)
    entries[b"w"] = BundleEntry(1, (4, 2), slices=(spec_a, ((1, 3), (0, None))))
    with pytest.raises(CorruptCheckpointError, match="missing"):
        BundleReader(make_bundle(tmp_path / "e", entries, [part * 2]))


def test_a_slice_is_named_by_its_tensor_and_extent_not_its_encoded_key(tmp_path: Path) -> None:
    part = np.arange(4, dtype=np.float32).tobytes()
    spec_a, spec_b = ((0, 2), (0, None)), ((2, 2), (0, None))
    emb = b"model/emb/.ATTRIBUTES/VARIABLE_VALUE"
    bad = f32_entry(part, (2, 2), offset=16)
    entries: dict[bytes, BundleEntry | bytes] = {
        emb: BundleEntry(1, (4, 2), slices=(spec_a, spec_b)),
        encode_slice_key(emb, spec_a): f32_entry(part, (2, 2)),
        encode_slice_key(emb, spec_b): dataclasses.replace(bad, crc32c=bad.crc32c ^ 1),
    }
    prefix = make_bundle(tmp_path / "c", entries, [part * 2])
    with open_checkpoint(prefix) as view, pytest.raises(ChecksumMismatchError) as info:
        view["model/emb"].value()
    message = str(info.value)
    assert "model/emb/.ATTRIBUTES/VARIABLE_VALUE (slice 2,2:-)" in message, message
    assert "\\x00" not in message and "\x00" not in message  # was: the ordered-code key


@pytest.mark.parametrize(
    ("dtype", "name"),
    [(21, "DT_VARIANT"), (20, "DT_RESOURCE"), (99, "unknown TensorFlow dtype number 99")],
)
def test_variant_resource_and_unknown_dtypes_are_refused(
    tmp_path: Path, dtype: int, name: str
) -> None:
    good = np.arange(2, dtype=np.float32).tobytes()
    prefix = make_bundle(
        tmp_path / "c",
        {
            b"it/.ATTRIBUTES/ITERATOR_STATE": BundleEntry(dtype, (1,), size=4, crc32c=1),
            b"w/.ATTRIBUTES/VARIABLE_VALUE": f32_entry(good, (2,), offset=4),
        },
        [bytes(4) + good],
    )
    with pytest.raises(UnsupportedDtypeError, match=name) as info:
        open_checkpoint(prefix)
    check(info.value, "it/.ATTRIBUTES/ITERATOR_STATE", prefix)
    with TfCheckpointView(prefix, skip_unsupported=True) as view:
        assert list(view) == ["w"]
        assert set(view.skipped) == {"it/.ATTRIBUTES/ITERATOR_STATE"}
        np.testing.assert_array_equal(view["w"].component(0), [0, 1])
    with BundleReader(prefix) as r, pytest.raises(UnsupportedDtypeError):
        r.read(b"it/.ATTRIBUTES/ITERATOR_STATE")


@pytest.mark.parametrize(
    ("header", "error", "match"),
    [
        (BundleHeader(1, 0, 1, min_consumer=2), FormatVersionError, "newer reader"),
        (BundleHeader(1, 0, 1, bad_consumers=(1,)), FormatVersionError, "newer reader"),
        (BundleHeader(0), CorruptCheckpointError, "shard count"),
        (BundleHeader(1, endianness=5), CorruptCheckpointError, "byte order"),
        (b"\x0a\xff", CorruptCheckpointError, "bad bundle header"),
    ],
)
def test_bad_headers(tmp_path: Path, header, error, match: str) -> None:
    prefix = make_bundle(tmp_path / "c", {}, [b""], header=header)
    with pytest.raises(error, match=match) as info:
        BundleReader(prefix)
    check(info.value, prefix + ".index")


def test_an_index_without_header(tmp_path: Path) -> None:
    table = TableBuilder()
    table.add(b"w", encode_entry(BundleEntry(1, (0,))))
    (tmp_path / "c.index").write_bytes(table.finish())
    with pytest.raises(CorruptCheckpointError, match="bundle header"):
        BundleReader(str(tmp_path / "c"))


def test_snappy_blocks_are_refused(plain: Path) -> None:
    index = plain.with_suffix(".index")
    data = bytearray(index.read_bytes())
    block_end = _first_block_size(
        bytes(data)
    )  # the only data block starts at 0; its trailer follows
    data[block_end] = 1
    data[block_end + 1 : block_end + 5] = mask(
        crc32c(b"\x01", crc32c(bytes(data[:block_end])))
    ).to_bytes(4, "little")
    index.write_bytes(bytes(data))
    with pytest.raises(FormatVersionError, match="snappy") as info:
        open_checkpoint(plain)
    check(info.value, str(index))


def _first_block_size(index: bytes) -> int:
    return TableReader(index, file="x").index[0][1][1]


def test_bad_object_graph_and_metadata(tmp_path: Path) -> None:
    def bundle(name: str, **strings: bytes) -> str:
        prefix = str(tmp_path / name)
        with BundleWriter(prefix) as w:
            w.add(b"w/.ATTRIBUTES/VARIABLE_VALUE", np.ones(2))
            for key, value in strings.items():
                w.add(key.encode(), np.array(value, dtype=object))
        return prefix

    graph = "_CHECKPOINTABLE_OBJECT_GRAPH"
    meta = "_PARALLELVARS_METADATA"
    with pytest.raises(CorruptCheckpointError, match="object graph") as info:
        open_checkpoint(bundle("g", **{graph: b"\x0a\x05\x0a\x03\x08\x07"}))
    check(info.value, graph)
    with pytest.raises(CorruptCheckpointError, match="not JSON") as info:
        open_checkpoint(bundle("m1", **{meta: b"{nope"}))
    check(info.value, meta)
    doc = {"format": "parallelvars.tf-metadata", "version": 9}
    with pytest.raises(FormatVersionError, match="newer"):
        open_checkpoint(bundle("m2", **{meta: json.dumps(doc).encode()}))
    doc = {
        "format": "parallelvars.tf-metadata",
        "version": 1,
        "variables": {"w": {"kind": "sideways"}},
    }
    with pytest.raises(CorruptCheckpointError, match="malformed metadata record"):
        open_checkpoint(bundle("m3", **{meta: json.dumps(doc).encode()}))
    doc["variables"] = {"w": {"kind": "sharded"}}
    with pytest.raises(CorruptCheckpointError, match="bad shard axis or offsets") as info:
        open_checkpoint(bundle("m4", **{meta: json.dumps(doc).encode()}))
    check(info.value, "'w'")
    doc["variables"] = {
        "w": {"kind": "sharded", "attrs": {"shard_axis": 0, "shard_offsets": [0, 1]}}
    }
    with pytest.raises(CorruptCheckpointError, match="do not match the saved slices") as info:
        open_checkpoint(bundle("m6", **{meta: json.dumps(doc).encode()}))
    check(info.value, "'w'")
    prefix = str(tmp_path / "m5")
    with BundleWriter(prefix) as w:
        w.add(meta.encode(), np.array([b"a", b"b"], dtype=object))
    with pytest.raises(CorruptCheckpointError, match="not a scalar string"):
        open_checkpoint(prefix)


def test_damaged_string_tensors(tmp_path: Path) -> None:
    prefix = str(tmp_path / "s")
    with BundleWriter(prefix) as w:
        w.add(b"s", np.array([b"ab", b"xyz"], dtype=object))
    shard = tmp_path / "s.data-00000-of-00001"
    good = shard.read_bytes()
    shard.write_bytes(good[:2] + bytes([good[2] ^ 1]) + good[3:])  # the length checksum
    with (
        BundleReader(prefix) as r,
        pytest.raises(ChecksumMismatchError, match="string lengths") as info,
    ):
        r.read(b"s")
    check(info.value, str(shard), "'s'")
    shard.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # a string byte
    with BundleReader(prefix) as r, pytest.raises(ChecksumMismatchError) as info:
        r.read(b"s")
    check(info.value, "'s'")


def test_errors_are_never_bare_os_errors_for_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(NotACheckpointError) as info:
        TfCheckpointView(tmp_path / "nothing")
    check(info.value, "nothing.index")
    with pytest.raises(NotACheckpointError, match="no TensorFlow checkpoint"):
        TfCheckpointView(tmp_path)


def test_bool_bytes_other_than_one_read_as_true(tmp_path: Path) -> None:
    raw = b"\x00\x02\x01\xff"
    prefix = make_bundle(
        tmp_path / "c", {b"b": BundleEntry(10, (4,), size=4, crc32c=mask(crc32c(raw)))}, [raw]
    )
    with BundleReader(prefix) as r:
        value = r.read(b"b")
    assert value.tolist() == [False, True, True, True]
    assert value.view(np.uint8).tolist() == [0, 1, 1, 1]
