"""Minimal protobuf wire coding, and the bundle's own messages.

Only what TensorFlow bundles use: varints, length-delimited fields and fixed32/fixed64. Fields
are written in field-number order with proto3 defaults left out, which is what TensorFlow's
serializer does, so the bytes match. Decoding skips unknown fields and raises
:class:`DecodeError` (an internal error; callers turn it into a checkpoint error naming the file
and key) on anything malformed.

Messages (field numbers from TensorFlow's ``tensor_bundle.proto``, ``tensor_shape.proto``,
``tensor_slice.proto`` and ``versions.proto``):

- ``BundleHeaderProto``: num_shards=1, endianness=2, version=3 (``VersionDef``: producer=1,
  min_consumer=2, bad_consumers=3).
- ``BundleEntryProto``: dtype=1, shape=2, shard_id=3, offset=4, size=5, crc32c=6 (fixed32),
  slices=7.
- ``TensorShapeProto``: dim=2 (``Dim``: size=1, name=2), unknown_rank=3.
- ``TensorSliceProto``: extent=1 (``Extent``: start=1, length=2; no length = the full dimension).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "DecodeError",
    "encode_varint",
    "decode_varint",
    "iter_fields",
    "field_varint",
    "field_bytes",
    "field_fixed32",
    "as_int64",
    "as_int32",
    "Extent",
    "SliceSpec",
    "BundleHeader",
    "BundleEntry",
    "encode_header",
    "decode_header",
    "encode_entry",
    "encode_stored",
    "decode_entry",
    "encode_shape",
    "decode_shape",
]

VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5
_U64 = (1 << 64) - 1

#: One dimension of a slice: ``(start, length)``, or ``(0, None)`` for the full dimension.
Extent = tuple[int, int | None]
#: A slice: one extent per dimension.
SliceSpec = tuple[Extent, ...]


class DecodeError(ValueError):
    """Malformed protobuf or varint bytes (internal; never leaves the package)."""


# --- wire level -----------------------------------------------------------------------------


# The one-byte varints, made once (most of an index's field keys, lengths and dimensions).
_ONE_BYTE = tuple(bytes((i,)) for i in range(0x80))


def encode_varint(value: int) -> bytes:
    """A base-128 varint; negative values take ten bytes (64-bit two's complement)."""
    if 0 <= value <= 0x7F:
        return _ONE_BYTE[value]
    if 0 < value <= 0x3FFF:
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    if value < 0:
        value &= _U64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(buf: bytes, pos: int, end: int, max_bytes: int = 10) -> tuple[int, int]:
    """Decode a varint from ``buf[pos:end]``; returns ``(value, new_pos)``.

    ``max_bytes`` is 10 for 64-bit varints and 5 for the 32-bit ones of table blocks.
    """
    result = 0
    shift = 0
    for _ in range(max_bytes):
        if pos >= end:
            raise DecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            limit = _U64 if max_bytes > 5 else 0xFFFFFFFF
            return result & limit, pos
        shift += 7
    raise DecodeError(f"varint longer than {max_bytes} bytes")


def as_int64(value: int) -> int:
    """Reinterpret an unsigned 64-bit varint value as a signed int64."""
    return value - (1 << 64) if value >= 1 << 63 else value


def as_int32(value: int) -> int:
    """Reinterpret a varint value as int32 (protobuf sign-extends int32 to 64 bits)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def iter_fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """Yield ``(field_number, wire_type, value)`` for each field of a serialized message.

    Varint and fixed values are ints; length-delimited values are bytes.
    """
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = decode_varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise DecodeError("field number 0")
        value: int | bytes
        if wire == VARINT:
            value, pos = decode_varint(buf, pos, end)
        elif wire == FIXED64:
            if end - pos < 8:
                raise DecodeError("truncated fixed64")
            value = int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
        elif wire == LEN:
            n, pos = decode_varint(buf, pos, end)
            if n > end - pos:
                raise DecodeError(f"length-delimited field of {n} bytes overruns the message")
            value = bytes(buf[pos : pos + n])
            pos += n
        elif wire == FIXED32:
            if end - pos < 4:
                raise DecodeError("truncated fixed32")
            value = int.from_bytes(buf[pos : pos + 4], "little")
            pos += 4
        else:
            raise DecodeError(f"unsupported wire type {wire} (field {field})")
        yield field, wire, value


def _expect(field: int, wire: int, want: int) -> None:
    if wire != want:
        raise DecodeError(f"field {field} has wire type {wire}, expected {want}")


def expect_int(field: int, wire: int, value: int | bytes) -> int:
    """``value`` as an int, checking that field ``field`` is a varint."""
    _expect(field, wire, VARINT)
    assert isinstance(value, int)
    return value


def expect_bytes(field: int, wire: int, value: int | bytes) -> bytes:
    """``value`` as bytes, checking that field ``field`` is length-delimited."""
    _expect(field, wire, LEN)
    assert isinstance(value, bytes)
    return value


# The tags of fields 1 .. 15 by wire type (every field this module writes): one byte each.
_VARINT_TAG = tuple(encode_varint(f << 3 | VARINT) for f in range(16))
_LEN_TAG = tuple(encode_varint(f << 3 | LEN) for f in range(16))


def field_varint(field: int, value: int) -> bytes:
    tag = _VARINT_TAG[field] if 0 < field < 16 else encode_varint(field << 3 | VARINT)
    return tag + (_ONE_BYTE[value] if 0 <= value < 0x80 else encode_varint(value))


def field_bytes(field: int, data: bytes) -> bytes:
    tag = _LEN_TAG[field] if 0 < field < 16 else encode_varint(field << 3 | LEN)
    n = len(data)
    return tag + (_ONE_BYTE[n] if n < 0x80 else encode_varint(n)) + data


def field_fixed32(field: int, value: int) -> bytes:
    return encode_varint(field << 3 | FIXED32) + (value & 0xFFFFFFFF).to_bytes(4, "little")


# --- TensorShapeProto / TensorSliceProto ----------------------------------------------------


@functools.lru_cache(maxsize=4096)
def encode_shape(shape: tuple[int, ...]) -> bytes:
    """``TensorShapeProto`` with one ``Dim`` per dimension (a size-0 dim is an empty Dim).

    (Cached: a checkpoint's tensors share a few shapes, and its index encodes one per tensor.)
    """
    return b"".join(field_bytes(2, field_varint(1, d) if d else b"") for d in shape)


def decode_shape(data: bytes) -> tuple[int, ...]:
    dims: list[int] = []
    for field, wire, value in iter_fields(data):
        if field == 2:
            size = 0
            for f2, w2, v2 in iter_fields(expect_bytes(field, wire, value)):
                if f2 == 1:
                    size = as_int64(expect_int(f2, w2, v2))
            if size < 0:
                raise DecodeError(f"dimension of size {size} (unknown dimensions cannot be stored)")
            dims.append(size)
        elif field == 3 and expect_int(field, wire, value):
            raise DecodeError("shape of unknown rank")
    return tuple(dims)


def encode_slice(spec: SliceSpec) -> bytes:
    out = []
    for start, length in spec:
        if length is None:
            ext = b""
        else:
            ext = (field_varint(1, start) if start else b"") + field_varint(2, length)
        out.append(field_bytes(1, ext))
    return b"".join(out)


def decode_slice(data: bytes) -> SliceSpec:
    extents: list[Extent] = []
    for field, wire, value in iter_fields(data):
        if field != 1:
            continue
        start, length = 0, None
        for f2, w2, v2 in iter_fields(expect_bytes(field, wire, value)):
            if f2 == 1:
                start = as_int64(expect_int(f2, w2, v2))
            elif f2 == 2:
                length = as_int64(expect_int(f2, w2, v2))
        if start < 0 or (length is not None and length < 0):
            raise DecodeError(f"slice extent start={start} length={length}")
        if length is None and start != 0:
            raise DecodeError(f"full-dimension extent with start {start}")
        extents.append((start, length))
    return tuple(extents)


# --- BundleHeaderProto ------------------------------------------------------------------------


@dataclass(frozen=True)
class BundleHeader:
    """The bundle header (the value of the empty key)."""

    num_shards: int = 1
    endianness: int = 0  # 0 little, 1 big
    producer: int = 1
    min_consumer: int = 0
    bad_consumers: tuple[int, ...] = ()


def encode_header(h: BundleHeader) -> bytes:
    version = b""
    if h.producer:
        version += field_varint(1, h.producer)
    if h.min_consumer:
        version += field_varint(2, h.min_consumer)
    if h.bad_consumers:
        version += field_bytes(3, b"".join(encode_varint(b) for b in h.bad_consumers))
    out = b""
    if h.num_shards:
        out += field_varint(1, h.num_shards)
    if h.endianness:
        out += field_varint(2, h.endianness)
    return out + field_bytes(3, version)


def decode_header(data: bytes) -> BundleHeader:
    num_shards, endianness, producer, min_consumer = 0, 0, 0, 0
    bad: list[int] = []
    for field, wire, value in iter_fields(data):
        if field == 1:
            num_shards = as_int32(expect_int(field, wire, value))
        elif field == 2:
            endianness = as_int32(expect_int(field, wire, value))
        elif field == 3:
            for f2, w2, v2 in iter_fields(expect_bytes(field, wire, value)):
                if f2 == 1:
                    producer = as_int32(expect_int(f2, w2, v2))
                elif f2 == 2:
                    min_consumer = as_int32(expect_int(f2, w2, v2))
                elif f2 == 3:
                    if w2 == LEN:  # packed
                        assert isinstance(v2, bytes)
                        pos = 0
                        while pos < len(v2):
                            b, pos = decode_varint(v2, pos, len(v2))
                            bad.append(as_int32(b))
                    else:
                        bad.append(as_int32(expect_int(f2, w2, v2)))
    return BundleHeader(num_shards, endianness, producer, min_consumer, tuple(bad))


# --- BundleEntryProto -------------------------------------------------------------------------


@dataclass(frozen=True)
class BundleEntry:
    """Where one tensor lives: dtype, shape, shard, byte range, checksum, or its slices."""

    dtype: int
    shape: tuple[int, ...]
    shard_id: int = 0
    offset: int = 0
    size: int = 0
    crc32c: int = 0
    slices: tuple[SliceSpec, ...] = ()


@functools.lru_cache(maxsize=4096)
def _entry_head(dtype: int, shape: tuple[int, ...]) -> bytes:
    """Fields 1 and 2 of an entry (its dtype and shape): a file's entries share a few."""
    head = field_varint(1, dtype) if dtype else b""
    return head + field_bytes(2, encode_shape(shape))


def encode_stored(dtype: int, shape: tuple[int, ...], offset: int, size: int, crc: int) -> bytes:
    """``encode_entry`` of a tensor stored whole in shard 0: what a writer keeps per tensor
    until the index is written (bytes, not a :class:`BundleEntry`)."""
    out = _entry_head(dtype, shape)
    if offset:
        out += b"\x20" + encode_varint(offset)  # (field 4, a varint)
    if size:
        out += b"\x28" + encode_varint(size)  # (field 5, a varint)
    if crc:
        out += b"\x35" + (crc & 0xFFFFFFFF).to_bytes(4, "little")  # (field 6, fixed32)
    return out


def encode_entry(e: BundleEntry) -> bytes:
    if not e.shard_id and not e.slices:
        return encode_stored(e.dtype, e.shape, e.offset, e.size, e.crc32c)
    out = _entry_head(e.dtype, e.shape)
    if e.shard_id:
        out += field_varint(3, e.shard_id)
    if e.offset:
        out += field_varint(4, e.offset)
    if e.size:
        out += field_varint(5, e.size)
    if e.crc32c:
        out += field_fixed32(6, e.crc32c)
    if e.slices:
        out += b"".join(field_bytes(7, encode_slice(s)) for s in e.slices)
    return out


def decode_entry(data: bytes) -> BundleEntry:
    dtype, shard_id, offset, size, crc = 0, 0, 0, 0, 0
    shape: tuple[int, ...] = ()
    slices: list[SliceSpec] = []
    for field, wire, value in iter_fields(data):
        if field == 1:
            dtype = as_int32(expect_int(field, wire, value))
        elif field == 2:
            shape = decode_shape(expect_bytes(field, wire, value))
        elif field == 3:
            shard_id = as_int32(expect_int(field, wire, value))
        elif field == 4:
            offset = as_int64(expect_int(field, wire, value))
        elif field == 5:
            size = as_int64(expect_int(field, wire, value))
        elif field == 6:
            _expect(field, wire, FIXED32)
            assert isinstance(value, int)
            crc = value
        elif field == 7:
            slices.append(decode_slice(expect_bytes(field, wire, value)))
    if shard_id < 0 or offset < 0 or size < 0:
        raise DecodeError(f"negative shard_id/offset/size ({shard_id}, {offset}, {size})")
    for spec in slices:
        if len(spec) != len(shape):
            raise DecodeError(f"a slice of rank {len(spec)} for a tensor of rank {len(shape)}")
    return BundleEntry(dtype, shape, shard_id, offset, size, crc, tuple(slices))
