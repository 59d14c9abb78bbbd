"""Byte-level facts of the TensorFlow bundle format (FORMATS.md section 1), reproduced exactly."""

from __future__ import annotations

import numpy as np
import pytest

from parallelvars.formats.testing import (
    BLOCK_SIZE,
    BundleEntry,
    BundleHeader,
    TableBuilder,
    TableReader,
    c_escape,
    c_unescape,
    decode_entry,
    decode_header,
    decode_strings,
    encode_entry,
    encode_header,
    encode_strings,
    escape_local_name,
    find_short_successor,
    find_shortest_separator,
    parse_key,
    unescape_local_name,
)
from parallelvars.formats.testing import tf_crc as _crc
from parallelvars.formats.testing import tf_ordered_code as _ordered_code
from parallelvars.formats.tf import BundleReader, BundleWriter

WORKED_INDEX = bytes.fromhex(
    # data block: header entry and "x"
    "000006"
    "08011a020801"
    "00010f78"
    "0801120412020802280835593ce535"
    "00000000"
    "01000000"
    "00"
    "91364233"
    # metaindex block
    "00000000"
    "01000000"
    "00"
    "c0f2a1b0"
    # index block: "y" -> (0, 36)
    "0001027900"
    "24"
    "00000000"
    "01000000"
    "00"
    "08121017"
    # footer
    "2908360e" + "00" * 36 + "57fb808b247547db"
)


def test_crc32c_check_value_and_masking() -> None:
    assert _crc.crc32c(b"123456789") == 0xE3069283
    assert _crc.crc32c(b"6789", _crc.crc32c(b"12345")) == 0xE3069283
    assert _crc.mask(0) == 0xA282EAD8
    assert _crc.mask(0x28C0C9B1) == 0x35E53C59
    for value in (0, 1, 0xFFFFFFFF, 0x12345678, 0xE3069283):
        assert _crc.unmask(_crc.mask(value)) == value


def test_crc32c_reads_numpy_buffers_without_copy() -> None:
    a = np.arange(1000, dtype=np.float32)
    assert _crc.crc32c(a) == _crc.crc32c(a.tobytes())
    assert _crc.crc32c(a.view(np.uint8)[4:]) == _crc.crc32c(a.tobytes()[4:])


def test_worked_example_is_reproduced_byte_for_byte(tmp_path) -> None:
    assert len(WORKED_INDEX) == 121
    prefix = str(tmp_path / "ckpt")
    with BundleWriter(prefix) as w:
        w.add(b"x", np.array([1.0, 2.0], np.float32))
    assert (tmp_path / "ckpt.index").read_bytes() == WORKED_INDEX
    assert (tmp_path / "ckpt.data-00000-of-00001").read_bytes() == bytes.fromhex("0000803f00000040")
    with BundleReader(prefix) as r:
        assert r.header == BundleHeader(num_shards=1, producer=1)
        assert r.entries[b"x"] == BundleEntry(1, (2,), 0, 0, 8, 0x35E53C59)
        np.testing.assert_array_equal(r.read(b"x"), [1.0, 2.0])


def test_worked_example_table_structure() -> None:
    table = TableReader(WORKED_INDEX, file="worked.index")
    assert table.index == [(b"y", (0, 36))]
    assert table.metaindex == (41, 8)
    assert list(table) == [
        (b"", bytes.fromhex("08011a020801")),
        (b"x", bytes.fromhex("0801120412020802280835593ce535")),
    ]


def test_header_and_entry_protos() -> None:
    assert encode_header(BundleHeader(1, 0, 1)) == bytes.fromhex("08011a020801")
    assert decode_header(bytes.fromhex("08011a020801")) == BundleHeader(1, 0, 1)
    # a scalar has an empty shape message; a zero dim is an empty Dim
    assert encode_entry(BundleEntry(9, (), size=8)) == bytes.fromhex("080912002808")
    assert encode_entry(BundleEntry(1, (0,))) == bytes.fromhex("080112021200")
    # rows 2..4 of a [4, 3] tensor: the full entry carries dtype, shape and the slice
    full = BundleEntry(1, (4, 3), slices=(((2, 2), (0, None)),))
    data = encode_entry(full)
    assert data.endswith(bytes.fromhex("3a080a04080210020a00"))
    assert decode_entry(data) == full


@pytest.mark.parametrize(
    ("start", "limit", "expected"),
    [
        (b"abc", b"abe", b"abd"),  # a[i] + 1 < b[i]: shortened
        (b"abc", b"abd", b"abc"),  # a[i] + 1 == b[i]: unchanged
        (b"ab", b"abc", b"ab"),  # prefix: unchanged
        (b"a\xffz", b"b", b"a\xffz"),  # first difference 'a' vs 'b': a+1 == b, unchanged
        (b"\xff\x01", b"\xff\x05", b"\xff\x02"),
        (b"net/a", b"step", b"o"),
        (b"x\xff", b"y", b"x\xff"),
    ],
)
def test_find_shortest_separator(start: bytes, limit: bytes, expected: bytes) -> None:
    sep = find_shortest_separator(start, limit)
    assert sep == expected
    assert start <= sep < limit


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (b"save_counter/.ATTRIBUTES/VARIABLE_VALUE", b"t"),
        (b"x", b"y"),
        (b"\xff\xffa", b"\xff\xffb"),
        (b"\xff\xff", b"\xff\xff"),
        (b"", b""),
    ],
)
def test_find_short_successor(key: bytes, expected: bytes) -> None:
    assert find_short_successor(key) == expected


def _predicted_split(entries: list[tuple[bytes, bytes]]) -> list[int]:
    """Entry indexes where a new data block starts, by the block-size rule of FORMATS.md."""
    starts = [0]
    size = 4  # restart count
    restarts = 1
    count = 0
    last = b""
    for i, (key, value) in enumerate(entries):
        if count and len(key) + len(value) >= 2 * BLOCK_SIZE:
            starts.append(i)
            size, restarts, count, last = 4, 1, 0, b""
        if count and count % 16 == 0:
            restarts += 1
            shared = 0
        else:
            shared = _shared(last, key)
        size += _varlen(shared) + _varlen(len(key) - shared) + _varlen(len(value))
        size += len(key) - shared + len(value)
        count += 1
        last = key
        if size + 4 * restarts >= BLOCK_SIZE and i + 1 < len(entries):
            starts.append(i + 1)
            size, restarts, count, last = 4, 1, 0, b""
    return starts


def _shared(a: bytes, b: bytes) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _varlen(n: int) -> int:
    length = 1
    while n > 0x7F:
        n >>= 7
        length += 1
    return length


def test_multi_block_index_follows_the_block_size_and_separator_rules() -> None:
    entries = [(f"model/layer_{i:05d}/kernel".encode(), bytes(40 + i % 7)) for i in range(5001)]
    builder = TableBuilder()
    for k, v in entries:
        builder.add(k, v)
    data = builder.finish()
    table = TableReader(data, file="multi.index")
    assert len(table.index) > 1
    assert list(table) == entries
    # blocks start where the size rule says, and separators follow the comparator rules
    starts = _predicted_split(entries)
    assert len(table.index) == len(starts)
    bounds = [*starts, len(entries)]
    for b, (sep, _) in enumerate(table.index):
        last = entries[bounds[b + 1] - 1][0]
        if b + 1 < len(starts):
            assert sep == find_shortest_separator(last, entries[bounds[b + 1]][0])
        else:
            assert sep == find_short_successor(last)


def test_an_overly_large_entry_starts_a_new_block() -> None:
    builder = TableBuilder()
    builder.add(b"a", b"1")
    builder.add(b"b", bytes(2 * BLOCK_SIZE))
    builder.add(b"c", b"3")
    table = TableReader(builder.finish(), file="big.index")
    assert [sep for sep, _ in table.index] == [b"a", b"b", b"d"]
    assert [k for k, _ in table] == [b"a", b"b", b"c"]


def test_string_tensor_encoding_example() -> None:
    data, crc = encode_strings([b"ab", b"", b"xyz"])
    assert data == bytes.fromhex("0200031b428bca616278797a")
    assert len(data) == 12
    assert decode_strings(data, 3, expected_crc=crc) == [b"ab", b"", b"xyz"]


def test_string_tensor_round_trip_through_a_bundle(tmp_path) -> None:
    prefix = str(tmp_path / "s")
    value = np.array([[b"ab", b""], [b"\x00\xff", "é".encode()]], dtype=object)
    with BundleWriter(prefix) as w:
        w.add(b"s", value)
        w.add(b"e", np.array([], dtype=object))
    with BundleReader(prefix) as r:
        out = r.read(b"s")
        assert out.dtype == object and out.shape == (2, 2)
        assert out.tolist() == value.tolist()
        assert r.read(b"e").shape == (0,)
        assert r.entries[b"e"].size == 4  # only the checksum of no lengths


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, "80"),
        (2, "82"),
        (-1, "7f"),
        (63, "bf"),
        (64, "c040"),
        (8191, "dfff"),
        (8192, "e02000"),
        (200000, "e30d40"),
    ],
)
def test_signed_num_increasing_examples(value: int, encoded: str) -> None:
    assert _ordered_code.encode_signed_num_increasing(value).hex() == encoded
    assert _ordered_code.decode_signed_num_increasing(bytes.fromhex(encoded)) == (
        value,
        len(encoded) // 2,
    )


def test_slice_key_example() -> None:
    key = _ordered_code.encode_slice_key(b"e", ((2, 2), (0, None)))
    assert key == bytes.fromhex("0065000101028282807f")
    assert _ordered_code.decode_slice_key(key) == (b"e", ((2, 2), (0, None)))
    assert _ordered_code.encode_num_increasing(0) == b"\x00"
    assert _ordered_code.encode_num_increasing(300) == b"\x02\x01\x2c"
    assert _ordered_code.encode_string(b"a\x00b\xff") == b"a\x00\xffb\xff\x00\x00\x01"
    assert _ordered_code.decode_string(b"a\x00\xffb\xff\x00\x00\x01") == (b"a\x00b\xff", 8)


def test_signed_num_increasing_preserves_order() -> None:
    rng = np.random.default_rng(0)
    raw = rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64)
    shifts = rng.integers(0, 63, 3000)
    values = sorted(
        {int(v) >> int(s) for v, s in zip(raw, shifts, strict=True)} | {-(2**63), 2**63 - 1, 0, -1}
    )
    encoded = [_ordered_code.encode_signed_num_increasing(v) for v in values]
    assert encoded == sorted(encoded)
    assert [_ordered_code.decode_signed_num_increasing(e)[0] for e in encoded] == values


@pytest.mark.parametrize(
    ("name", "escaped"),
    [
        ("kernel", "kernel"),
        ("a.b", "a..b"),
        ("a/b", "a.Sb"),
        (".S", "..S"),
        ("/.", ".S.."),
        ("..", "...."),
    ],
)
def test_local_name_escaping(name: str, escaped: str) -> None:
    assert escape_local_name(name) == escaped
    assert unescape_local_name(escaped) == name


def test_key_parsing() -> None:
    p = parse_key("model/w/.ATTRIBUTES/parallel_component_2")
    assert p is not None and (p.path, p.component) == ("model/w", 2)
    p = parse_key(
        "model/layer_with_weights-0/kernel/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE"
    )
    assert p is not None
    assert p.path == "optimizer/slots/model/layer_with_weights-0/kernel/m"
    assert (p.slot_of, p.slot_name, p.component) == ("model/layer_with_weights-0/kernel", "m", 0)
    p = parse_key("a..b/c.Sd/.ATTRIBUTES/VARIABLE_VALUE")
    assert p is not None and p.path == "a.b/c/d"
    p = parse_key("layer/.ATTRIBUTES/OBJECT_CONFIG_JSON")
    assert p is not None and (p.path, p.component) == ("layer/.ATTRIBUTES/OBJECT_CONFIG_JSON", 0)
    assert parse_key("dense/kernel") is None
    assert parse_key("_CHECKPOINTABLE_OBJECT_GRAPH") is None


def test_text_format_string_escapes() -> None:
    text = 'dir "q" \\ \n\t é'
    escaped = c_escape(text)
    assert escaped == 'dir \\"q\\" \\\\ \\n\\t \\303\\251'
    assert c_unescape(escaped) == text
    assert c_unescape("\\x41\\101\\'") == "AA'"


def test_a_gathered_run_writes_the_bytes_of_tensors_added_one_by_one(tmp_path) -> None:
    """``BundleWriter.add_run`` (the converter's gathered write) makes the data file and the
    index that adding each tensor alone makes, every dtype and shape (empty, 0-d) included."""
    import ml_dtypes

    rng = np.random.default_rng(3)
    tensors = [
        (b"a/x", rng.standard_normal((3, 4)).astype(np.float32)),
        (b"a/y", np.array(7, np.int64)),
        (b"b/empty", np.zeros((0, 5), np.float16)),
        (b"b/bf", rng.standard_normal(9).astype(ml_dtypes.bfloat16)),
        (b"c/flag", np.array([True, False, True])),
        (b"c/q", rng.integers(-128, 127, (200,), dtype=np.int8)),
    ]
    one = tmp_path / "one" / "ckpt"
    many = tmp_path / "many" / "ckpt"
    with BundleWriter(str(one)) as w:
        for key, value in tensors:
            w.add(key, value)
    with BundleReader(str(one)) as r:  # (each tensor's TensorFlow type, as add gave it)
        types = {key: r.entries[key].dtype for key, _ in tensors}
    with BundleWriter(str(many)) as w:
        data = np.concatenate([v.reshape(-1).view(np.uint8) for _, v in tensors])
        w.add_run([(k, types[k], tuple(v.shape), v.nbytes) for k, v in tensors], data)
    for suffix in (".index", ".data-00000-of-00001"):
        assert (tmp_path / "one" / f"ckpt{suffix}").read_bytes() == (
            tmp_path / "many" / f"ckpt{suffix}"
        ).read_bytes()
    with BundleReader(str(many)) as r:
        for key, value in tensors:
            np.testing.assert_array_equal(r.read(key), value)


def test_a_gathered_run_refuses_a_key_twice_and_bytes_that_do_not_add_up(tmp_path) -> None:
    from parallelvars.errors import InvalidEntryError

    x = np.ones(2, np.float32)
    with (
        pytest.raises(InvalidEntryError, match="added twice"),
        BundleWriter(str(tmp_path / "ckpt")) as w,
    ):
        w.add_run([(b"k", 1, (2,), 8), (b"k", 1, (2,), 8)], np.concatenate([x, x]).view(np.uint8))
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    with pytest.raises(InvalidEntryError, match="bytes"), BundleWriter(str(tmp_path / "ckpt")) as w:
        w.add_run([(b"k", 1, (2,), 8)], np.zeros(12, np.uint8))
    assert list(tmp_path.iterdir()) == []


def test_a_gathered_run_checks_each_tensor_as_add_does(tmp_path) -> None:
    """Each tensor's size must be its shape's elements times its type's itemsize (the sum
    alone is not enough), its type number one we write, its dimensions non-negative ints."""
    from parallelvars.errors import InvalidEntryError, UnsupportedDtypeError

    bad = [
        # sizes add up (4 + 12 = 16) but neither tensor is 2 floats
        ([(b"a", 1, (2,), 4), (b"b", 1, (2,), 12)], 16, InvalidEntryError, "'a'.*expected 8"),
        ([(b"a", 1, (-2,), 0)], 0, InvalidEntryError, "non-negative integers"),
        ([(b"a", 1, (True,), 4)], 4, InvalidEntryError, "non-negative integers"),
        ([(b"a", 1, (2.0,), 8)], 8, InvalidEntryError, "non-negative integers"),
        ([(b"a", 1, None, 8)], 8, InvalidEntryError, "non-negative integers"),
        ([(b"a", 999, (2,), 8)], 8, UnsupportedDtypeError, "dtype number 999"),
        ([(b"a", 1.0, (2,), 8)], 8, InvalidEntryError, "type number must be an integer"),
    ]
    for tensors, nbytes, error, message in bad:
        with (
            pytest.raises(error, match=message) as info,
            BundleWriter(str(tmp_path / "ckpt")) as w,
        ):
            w.add_run(tensors, np.zeros(nbytes, np.uint8))
        assert "ckpt.index" in str(info.value)
        assert list(tmp_path.iterdir()) == []  # nothing left behind
    # the same check in add: a forced type number whose itemsize is not the value's
    with (
        pytest.raises(InvalidEntryError, match="expected 8 bytes, found 16 bytes"),
        BundleWriter(str(tmp_path / "ckpt")) as w,
    ):
        w.add(b"a", np.zeros(2, np.float64), dtype=1)
    assert list(tmp_path.iterdir()) == []


def test_a_gathered_run_takes_list_shapes_strided_data_and_swapping_writers(tmp_path) -> None:
    x = np.arange(6, dtype=np.float32)
    for big_endian in (False, True):
        one, many = tmp_path / f"one{big_endian}" / "c", tmp_path / f"many{big_endian}" / "c"
        with BundleWriter(str(one), big_endian=big_endian) as w:
            w.add(b"a", x[:2])
            w.add(b"b", x[2:].reshape(2, 2))
        strided = np.zeros((24, 2), np.uint8)
        strided[:, 0] = x.view(np.uint8)
        with BundleWriter(str(many), big_endian=big_endian) as w:
            w.add_run([(b"a", 1, [2], 8), (b"b", 1, [2, 2], 16)], strided[:, 0])  # not contiguous
        for suffix in (".index", ".data-00000-of-00001"):
            assert (
                one.with_name("c" + suffix).read_bytes()
                == many.with_name("c" + suffix).read_bytes()
            )
        with BundleReader(str(many)) as r:
            np.testing.assert_array_equal(r.read(b"b"), x[2:].reshape(2, 2))
            assert r.entries[b"b"].shape == (2, 2)
