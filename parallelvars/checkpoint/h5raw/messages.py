"""The bodies of the HDF5 header messages our files hold: encoders, and the attribute decoder.

Each encoder returns one message body as HDF5 (``libver="latest"``) writes it for the same
object, byte for byte where a choice exists (the tests compare them with libhdf5's): datatypes
(integers, IEEE floats, booleans as HDF5's 8-bit enum ``FALSE``/``TRUE``, complex numbers as the
compound ``{r, i}``, opaque types, fixed-length and variable-length strings), dataspaces
(scalar or simple, with their maximum dimensions), attribute messages (version 3), link
messages (hard links), link info, group info, attribute info, fill value, data layout
(contiguous or virtual) and object reference count messages; and :func:`superblock`, the
version-3 superblock a generated file starts with.

One choice differs from libhdf5 2.0: booleans and complex numbers are encoded with datatype
message version 3 (what HDF5 1.8-1.14 write and read), not version 5, so files stay readable
by every HDF5 since 1.8; h5py reads both as the same type.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from parallelvars.checkpoint.h5raw.lookup3 import lookup3
from parallelvars.checkpoint.h5raw.source import Refused

__all__ = [
    "UNDEF",
    "FixedString",
    "Opaque",
    "Unsupported",
    "VlenString",
    "attribute",
    "attribute_info",
    "attribute_parts",
    "contiguous_layout",
    "dataspace",
    "datatype",
    "external_link",
    "fill_value",
    "group_info",
    "hard_link",
    "link_info",
    "refcount",
    "superblock",
    "virtual_layout",
]

UNDEF = 0xFFFFFFFFFFFFFFFF  # an undefined address
_UNDEF8 = b"\xff" * 8


class Unsupported(Exception):
    """Something the generator cannot express (a dtype, a size); the caller writes the file
    through libhdf5 instead. The message says what and why."""


@dataclass(frozen=True)
class Opaque:
    """An HDF5 opaque type of ``size`` bytes with an ASCII ``tag``."""

    size: int
    tag: str


@dataclass(frozen=True)
class FixedString:
    """A fixed-length string type of ``size`` bytes (null-padded, ASCII: numpy's ``S``)."""

    size: int


@dataclass(frozen=True)
class VlenString:
    """A variable-length string type: UTF-8 (h5py's ``str``) or ASCII (h5py's ``bytes``)."""

    utf8: bool = True


TypeSpec = Any  # a numpy dtype, Opaque, FixedString or VlenString


# ----------------------------------------------------------------------------- datatypes
_FLOATS = {
    # itemsize: (exponent location, exponent size, mantissa size, bias)
    2: (10, 5, 10, 15),
    4: (23, 8, 23, 127),
    8: (52, 11, 52, 1023),
}
_U8 = b"\x10\x00\x00\x00\x01\x00\x00\x00\x00\x00\x08\x00"  # unsigned 8-bit integer, little-endian


def datatype(spec: TypeSpec) -> bytes:
    """The datatype message body of ``spec`` (a numpy dtype or one of the classes above)."""
    if isinstance(spec, VlenString):
        # class 9 (variable-length), version 1; type string, null-terminated, the character
        # set; element size 16 (length, collection address, index); base type: u8
        return bytes((0x19, 0x01, 0x01 if spec.utf8 else 0x00, 0)) + _u32(16) + _U8
    if isinstance(spec, FixedString):
        return bytes((0x13, 0x01, 0, 0)) + _u32(spec.size)  # null-padded, ASCII
    if isinstance(spec, Opaque):
        tag = spec.tag.encode("ascii")
        padded = tag + b"\x00" * (8 - len(tag) % 8)  # NUL-terminated, to a multiple of 8
        if len(padded) > 255:
            raise Unsupported(f"an opaque tag of {len(tag)} bytes")
        return bytes((0x15, len(padded), 0, 0)) + _u32(spec.size) + padded
    dt = np.dtype(spec)
    order = 1 if dt.byteorder == ">" else 0
    if dt.kind == "b":
        base = bytes((0x10, 0x08, 0, 0)) + _u32(1) + struct.pack("<HH", 0, 8)  # int8
        # class 8 (enumeration), version 3; 2 members; names without padding, then values
        return bytes((0x38, 2, 0, 0)) + _u32(1) + base + b"FALSE\x00TRUE\x00" + b"\x00\x01"
    if dt.kind in "iu":
        flags = order | (0x08 if dt.kind == "i" else 0)
        return bytes((0x10, flags, 0, 0)) + _u32(dt.itemsize) + _bits(dt.itemsize)
    if dt.kind == "f" and dt.itemsize in _FLOATS:
        eloc, esize, msize, bias = _FLOATS[dt.itemsize]
        bits = 8 * dt.itemsize
        head = bytes((0x11, 0x20 | order, bits - 1, 0)) + _u32(dt.itemsize)
        return head + struct.pack("<HHBBBBI", 0, bits, eloc, esize, 0, msize, bias)
    if dt.kind == "c" and dt.itemsize // 2 in (4, 8):
        part = datatype(np.dtype(f"{dt.byteorder if order else '<'}f{dt.itemsize // 2}"))
        width = _offset_width(dt.itemsize)
        members = (
            b"r\x00"
            + (0).to_bytes(width, "little")
            + part
            + b"i\x00"
            + (dt.itemsize // 2).to_bytes(width, "little")
            + part
        )
        return bytes((0x36, 2, 0, 0)) + _u32(dt.itemsize) + members
    raise Unsupported(f"dtype {dt} has no HDF5 type our generator writes")


def _offset_width(size: int) -> int:
    """Bytes of a compound member's offset for a compound of ``size`` bytes (version 3)."""
    return 1 if size < 1 << 8 else 2 if size < 1 << 16 else 3 if size < 1 << 24 else 4


def _bits(itemsize: int) -> bytes:
    return struct.pack("<HH", 0, 8 * itemsize)  # bit offset, precision


def _u32(n: int) -> bytes:
    return n.to_bytes(4, "little")


# ----------------------------------------------------------------------------- dataspaces
def dataspace(shape: tuple[int, ...] | None) -> bytes:
    """A version-2 dataspace message: scalar for ``()``, simple (with maximum dimensions
    equal to the dimensions, as ``H5Screate_simple`` records them) otherwise."""
    if not shape:
        return b"\x02\x00\x00\x00"
    dims = struct.pack(f"<{len(shape)}Q", *shape)
    return bytes((2, len(shape), 1, 1)) + dims + dims


def dataspace_size(ndim: int) -> int:
    return 4 + 16 * ndim


# ----------------------------------------------------------------------------- attributes
def attribute(name: str, dtype: bytes, space: bytes, data: bytes) -> bytes:
    """A version-3 attribute message (name in ASCII, as h5py's low-level API creates it)."""
    raw = name.encode("utf-8") + b"\x00"
    head = struct.pack("<BBHHHB", 3, 0, len(raw), len(dtype), len(space), 0)
    return head + raw + dtype + space + data


def attribute_data_offset(name: str, dtype: bytes, space: bytes) -> int:
    """Where an attribute message's data starts, from the start of its body."""
    return 9 + len(name.encode("utf-8")) + 1 + len(dtype) + len(space)


def attribute_parts(body: bytes, where: str) -> tuple[bytes, int, bytes]:
    """An attribute message's name, the offset of its data in ``body``, and the data; refused
    when the message is short, of an unknown version, or shares its type or space."""
    if len(body) < 8:
        raise Refused(f"{where}: a short attribute message", "at least 8 bytes", len(body))
    version, flags, name_size, type_size, space_size = struct.unpack_from("<BBHHH", body)
    if version == 1:
        at = 8
        sizes = (_align8(name_size), _align8(type_size), _align8(space_size))
    elif version in (2, 3):
        at = 8 if version == 2 else 9
        sizes = (name_size, type_size, space_size)
    else:
        raise Refused(f"{where}: attribute message version", "1-3", version)
    if flags & 0x03:  # a shared datatype or dataspace: not what we write; refused
        raise Refused(
            f"{where}: an attribute with a shared type or space", "its own type and space", "shared"
        )
    name = body[at : at + name_size].split(b"\x00", 1)[0]
    data_at = at + sum(sizes)
    if data_at > len(body):
        raise Refused(f"{where}: a short attribute message", f"{data_at} bytes", len(body))
    return name, data_at, body[data_at:]


def _align8(n: int) -> int:
    return (n + 7) & ~7


# ----------------------------------------------------------------------------- groups
def hard_link(name: bytes, address: int) -> bytes:
    """A version-1 link message: a hard link named ``name`` (ASCII character set flag, as
    libhdf5's default link creation property list records it)."""
    n = len(name)
    code = 0 if n < 1 << 8 else 1 if n < 1 << 16 else 2
    return bytes((1, code)) + n.to_bytes(1 << code, "little") + name + address.to_bytes(8, "little")


def external_link(name: bytes, file: bytes, path: bytes) -> bytes:
    """A version-1 link message: an external link named ``name`` to ``path`` in ``file``
    (link type 64; its value: a version-0 flags byte, the file and the object path, each
    NUL-terminated)."""
    n = len(name)
    code = 0 if n < 1 << 8 else 1 if n < 1 << 16 else 2
    value = b"\x00" + file + b"\x00" + path + b"\x00"
    head = bytes((1, code | 0x08, 64)) + n.to_bytes(1 << code, "little") + name
    return head + len(value).to_bytes(2, "little") + value


def link_info(heap: int = UNDEF, names: int = UNDEF) -> bytes:
    """A link info message: compact storage (undefined addresses), or the dense storage's
    fractal heap and name-index B-tree."""
    return b"\x00\x00" + heap.to_bytes(8, "little") + names.to_bytes(8, "little")


def group_info(phase_change: tuple[int, int] | None = None) -> bytes:
    """A group info message, with the link phase-change values when not HDF5's defaults."""
    if phase_change is None:
        return b"\x00\x00"
    return b"\x00\x01" + struct.pack("<HH", *phase_change)


def attribute_info() -> bytes:
    """An attribute info message of compact attribute storage (no creation order)."""
    return b"\x00\x00" + _UNDEF8 + _UNDEF8


def refcount(count: int) -> bytes:
    """An object reference count message (an object with ``count`` hard links)."""
    return b"\x00" + _u32(count)


# ----------------------------------------------------------------------------- datasets
# Fill value message flags (version 3): space allocation time in bits 0-1 (1 early, 2 late,
# 3 incremental), fill value write time in bits 2-3 (0 on allocation, 1 never, 2 if set).
FILL_EARLY_NEVER = b"\x03\x05"  # our components: allocated at creation, never filled
FILL_LATE_IFSET = b"\x03\x0a"  # h5py's default (the metadata documents)
FILL_LATE_ON_ALLOC = b"\x03\x02"  # h5py's default for variable-length data
FILL_INCREMENTAL_IFSET = b"\x03\x0b"  # a virtual dataset


def fill_value(flags: bytes) -> bytes:
    return flags


def contiguous_layout(address: int, size: int) -> bytes:
    """A version-3 contiguous data layout message."""
    return b"\x03\x01" + address.to_bytes(8, "little") + size.to_bytes(8, "little")


def virtual_layout(collection: int, index: int) -> bytes:
    """A version-4 virtual data layout message: the global heap object of its mapping."""
    return b"\x04\x03" + collection.to_bytes(8, "little") + _u32(index)


def superblock(eof: int, root: int) -> bytes:
    """Superblock version 3: 8-byte addresses and lengths, no extension, closed."""
    body = (
        b"\x89HDF\r\n\x1a\n\x03\x08\x08\x00"
        + (0).to_bytes(8, "little")
        + UNDEF.to_bytes(8, "little")
        + eof.to_bytes(8, "little")
        + root.to_bytes(8, "little")
    )
    return body + lookup3(body).to_bytes(4, "little")
