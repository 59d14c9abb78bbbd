"""OrderedCode: the order-preserving key encoding of TensorFlow's tensor-slice keys.

A slice of a partitioned tensor is stored under
``NumIncreasing(0) + String(name) + NumIncreasing(rank)`` followed, per dimension, by
``SignedNumIncreasing(start) + SignedNumIncreasing(length)`` (length -1 for a full dimension).
Byte-wise order of the encodings matches the numeric / lexicographic order of the values.
"""

from __future__ import annotations

import re

from parallelvars.errors import InvalidEntryError

from ._proto import DecodeError, SliceSpec

__all__ = [
    "encode_num_increasing",
    "decode_num_increasing",
    "encode_string",
    "decode_string",
    "encode_signed_num_increasing",
    "decode_signed_num_increasing",
    "encode_slice_key",
    "decode_slice_key",
]

# Header bits XORed into the first two bytes of a signed encoding of n bytes (n = 1..10).
_HEADER_BITS = [
    (0x00, 0x00),
    (0x80, 0x00),
    (0xC0, 0x00),
    (0xE0, 0x00),
    (0xF0, 0x00),
    (0xF8, 0x00),
    (0xFC, 0x00),
    (0xFE, 0x00),
    (0xFF, 0x00),
    (0xFF, 0x80),
    (0xFF, 0xC0),
]
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_SPECIAL = re.compile(rb"[\x00\xff]")
_ESCAPES = {b"\x00": b"\x00\xff", b"\xff": b"\xff\x00"}


def encode_num_increasing(value: int) -> bytes:
    """A byte count, then ``value`` big-endian (``0`` is the single byte ``00``)."""
    if not 0 <= value < 1 << 64:
        raise InvalidEntryError(f"NumIncreasing takes a uint64, not {value}")
    n = (value.bit_length() + 7) // 8
    return bytes([n]) + value.to_bytes(n, "big")


def decode_num_increasing(buf: bytes, pos: int = 0) -> tuple[int, int]:
    if pos >= len(buf):
        raise DecodeError("truncated NumIncreasing")
    n = buf[pos]
    if n > 8 or pos + 1 + n > len(buf):
        raise DecodeError(f"bad NumIncreasing length {n}")
    return int.from_bytes(buf[pos + 1 : pos + 1 + n], "big"), pos + 1 + n


def encode_string(value: bytes) -> bytes:
    """``00`` -> ``00 ff``, ``ff`` -> ``ff 00``, terminated by ``00 01``."""
    return _SPECIAL.sub(lambda m: _ESCAPES[m.group()], value) + b"\x00\x01"


def decode_string(buf: bytes, pos: int = 0) -> tuple[bytes, int]:
    out = bytearray()
    n = len(buf)
    while pos < n:
        b = buf[pos]
        if b not in (0x00, 0xFF):
            out.append(b)
            pos += 1
            continue
        if pos + 1 >= n:
            break
        nxt = buf[pos + 1]
        if b == 0x00 and nxt == 0x01:
            return bytes(out), pos + 2
        if b == 0x00 and nxt == 0xFF:
            out.append(0x00)
        elif b == 0xFF and nxt == 0x00:
            out.append(0xFF)
        else:
            raise DecodeError(f"bad escape {b:02x} {nxt:02x} in an OrderedCode string")
        pos += 2
    raise DecodeError("unterminated OrderedCode string")


def encode_signed_num_increasing(value: int) -> bytes:
    """The signed, order-preserving, variable-length encoding of an int64."""
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise InvalidEntryError(f"SignedNumIncreasing takes an int64, not {value}")
    x = ~value if value < 0 else value
    if x < 64:
        return bytes([(0x80 ^ value) & 0xFF])
    n = 2
    while x >= 1 << (7 * n - 1):
        n += 1
    buf = bytearray((value & ((1 << 80) - 1)).to_bytes(10, "big")[-n:])
    h0, h1 = _HEADER_BITS[n]
    buf[0] ^= h0
    buf[1] ^= h1
    return bytes(buf)


def decode_signed_num_increasing(buf: bytes, pos: int = 0) -> tuple[int, int]:
    if pos >= len(buf):
        raise DecodeError("truncated SignedNumIncreasing")
    negative = not buf[pos] & 0x80
    flip = 0xFF if negative else 0x00
    first = buf[pos] ^ flip
    second = (buf[pos + 1] ^ flip) if pos + 1 < len(buf) else 0
    header = first << 8 | second
    n = 0
    while n < 16 and header & (0x8000 >> n):
        n += 1
    if not 1 <= n <= 10 or pos + n > len(buf):
        raise DecodeError("bad SignedNumIncreasing length")
    raw = bytearray(b ^ flip for b in buf[pos : pos + n])
    h0, h1 = _HEADER_BITS[n]
    raw[0] ^= h0
    if n > 1:
        raw[1] ^= h1
    x = int.from_bytes(raw, "big")
    value = ~x if negative else x
    if not _INT64_MIN <= value <= _INT64_MAX or encode_signed_num_increasing(value) != bytes(
        buf[pos : pos + n]
    ):
        raise DecodeError("non-canonical SignedNumIncreasing")
    return value, pos + n


def encode_slice_key(name: bytes, spec: SliceSpec) -> bytes:
    """The bundle key of one slice of the tensor saved under ``name``."""
    parts = [encode_num_increasing(0), encode_string(name), encode_num_increasing(len(spec))]
    for start, length in spec:
        parts.append(encode_signed_num_increasing(start))
        parts.append(encode_signed_num_increasing(-1 if length is None else length))
    return b"".join(parts)


def decode_slice_key(key: bytes) -> tuple[bytes, SliceSpec]:
    """Invert :func:`encode_slice_key`; raises ``DecodeError`` for other keys."""
    zero, pos = decode_num_increasing(key, 0)
    if zero != 0:
        raise DecodeError("not a slice key")
    name, pos = decode_string(key, pos)
    rank, pos = decode_num_increasing(key, pos)
    if rank > (len(key) - pos) // 2:
        raise DecodeError("slice key rank exceeds its length")
    spec = []
    for _ in range(rank):
        start, pos = decode_signed_num_increasing(key, pos)
        length, pos = decode_signed_num_increasing(key, pos)
        if start < 0 or length < -1 or (length == -1 and start != 0):
            raise DecodeError(f"bad slice extent start={start} length={length}")
        spec.append((start, None if length == -1 else length))
    if pos != len(key):
        raise DecodeError("trailing bytes after a slice key")
    return name, tuple(spec)
