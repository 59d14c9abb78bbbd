"""HDF5 object headers: the one bounded parser (versions 1 and 2, continuation chunks) and the
encoder of version-2 headers (:func:`encode_chunked`: a header of any length, continued in
chunks of at most :data:`CHUNK` bytes).

An object header is a list of messages (type, flags, body) spread over chunks. Version 2
(``libver="latest"``) starts with ``OHDR``, version, flags, the optional times and attribute
phase-change values, and the size of chunk 0 in 1, 2, 4 or 8 bytes (flags bits 0-1); each
message has a 4-byte head (type: 1 byte, size: 2, flags: 1; 2 more for the creation order when
flags bit 2 is set), and each chunk ends with the lookup3 checksum of everything before it in
the chunk. A continuation message (type 0x10: address, length) names a further chunk, which
starts with ``OCHK`` and ends with its checksum. Version 1 has a 16-byte prefix (version,
reserved, message count, reference count, chunk 0 size, padding), 8-byte message heads (type:
2 bytes, size: 2, flags: 1, reserved: 3) and bodies padded to 8 bytes, and no checksums.

:func:`read_object_header` is a hostile-input parser: every size is checked against the file
(or the chunk holding it) before anything is read, chunks are followed at most once each and
at most ``max_chunks`` of them, and anything else is :class:`~.source.Refused`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from parallelvars.checkpoint.h5raw.lookup3 import lookup3
from parallelvars.checkpoint.h5raw.source import Refused, Source

__all__ = [
    "ATTRIBUTE",
    "ATTRIBUTE_INFO",
    "CONTINUATION",
    "DATASPACE",
    "DATATYPE",
    "FILL_VALUE",
    "GROUP_INFO",
    "LAYOUT",
    "LINK",
    "LINK_INFO",
    "NIL",
    "REFCOUNT",
    "SUPERBLOCK_SIZE",
    "Chunk",
    "Message",
    "ObjectHeader",
    "encode_chunked",
    "encode_v2",
    "read_object_header",
    "v2_prefix",
]

# Message types (HDF5 File Format Specification, IV.A.2).
NIL = 0x0000
DATASPACE = 0x0001
LINK_INFO = 0x0002
DATATYPE = 0x0003
FILL_VALUE = 0x0005
LINK = 0x0006
LAYOUT = 0x0008
GROUP_INFO = 0x000A
ATTRIBUTE = 0x000C
CONTINUATION = 0x0010
ATTRIBUTE_INFO = 0x0015
REFCOUNT = 0x0016

SIGNATURE = b"OHDR"
CONTINUATION_SIGNATURE = b"OCHK"
_TIMES = 0x20  # flags bit 5: access, modification, change and birth times (4 bytes each)
_PHASE_CHANGE = 0x10  # flags bit 4: max compact and min dense attribute counts (2 bytes each)
_CREATION_ORDER = 0x04  # flags bit 2: each message head holds its creation order (2 bytes)
_KNOWN_FLAGS = 0x3F
_V1_PREFIX = 16
_V1_MESSAGE = struct.Struct("<HHB3x")  # type, size, flags
_V2_MESSAGE = struct.Struct("<BHB")  # type, size, flags
DEFAULT_MAX_CHUNKS = 256  # chunks followed per object (HDF5 writes a handful)


@dataclass(frozen=True, slots=True)
class Message:
    """One header message: its type, flags, the file offset of its body, and the body."""

    type: int
    flags: int
    at: int
    body: bytes


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of an object header. Version 2: ``start`` is its signature (``OHDR`` or
    ``OCHK``) and ``end`` its checksum's offset (the checksum covers ``[start, end)``).
    Version 1: the chunk's message area ``[start, end)`` (no checksum)."""

    start: int
    end: int


@dataclass
class ObjectHeader:
    """A parsed object header: its version, flags, chunks (chunk 0 first) and messages in
    file order, and the attribute phase-change values it stores (None: HDF5's defaults)."""

    address: int
    version: int
    flags: int
    chunks: list[Chunk] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    phase_change: tuple[int, int] | None = None

    def of_type(self, mtype: int) -> Iterator[Message]:
        """The messages of type ``mtype``, in file order."""
        return (m for m in self.messages if m.type == mtype)

    def first(self, mtype: int) -> Message | None:
        """The first message of type ``mtype`` (None: none)."""
        return next(self.of_type(mtype), None)


def v2_prefix(head: bytes | memoryview) -> tuple[int, int, int] | None:
    """``(flags, prefix length, chunk 0 size)`` of the version-2 header whose first bytes are
    ``head`` (its signature first; at least 32 bytes, or all there are), or None when ``head``
    is not one. Chunk 0's messages start at ``prefix length`` and its checksum at
    ``prefix length + chunk 0 size``."""
    if len(head) < 7 or bytes(head[:4]) != SIGNATURE or head[4] != 2:
        return None
    flags = head[5]
    if flags & ~_KNOWN_FLAGS:
        return None
    p = 6 + (16 if flags & _TIMES else 0) + (4 if flags & _PHASE_CHANGE else 0)
    width = 1 << (flags & 0x03)
    if p + width > len(head):
        return None
    return flags, p + width, int.from_bytes(bytes(head[p : p + width]), "little")


def read_object_header(
    source: Source,
    address: int,
    *,
    sizeof_addr: int = 8,
    sizeof_size: int = 8,
    checksums: bool = False,
    max_chunks: int = DEFAULT_MAX_CHUNKS,
    keep: frozenset[int] | None = None,
) -> ObjectHeader:
    """The object header at ``address`` of ``source``, every chunk and message, bounded.

    With ``checksums``, each version-2 chunk's lookup3 checksum must be the one stored (HDF5
    checks them when it loads a header; a caller that reads before HDF5 does asks for it).
    With ``keep``, only the messages of those types are listed (every message is still walked
    and bounded, and every continuation followed).
    """
    where = f"the object header at {address}"
    head = source.read_upto(address, 512, where)
    if len(head) < _V1_PREFIX:
        raise Refused(
            f"{where} lies outside the file",
            f"at least {_V1_PREFIX} bytes before the end of a file of {source.size} bytes",
            f"{len(head)} bytes",
        )
    if head[:4] == SIGNATURE:
        prefix = v2_prefix(head)
        if prefix is None:
            raise Refused(f"{where}: version or flags", "version 2, known flags", head[4:6].hex())
        flags, length, size = prefix
        header = ObjectHeader(address, 2, flags)
        if flags & _PHASE_CHANGE:
            at = 6 + (16 if flags & _TIMES else 0)
            header.phase_change = struct.unpack_from("<HH", head, at)
        first = (address, address + length + size)  # (the chunk under its checksum)
        mhead = 4 + (2 if flags & _CREATION_ORDER else 0)
    elif head[0] == 1:
        count, _refs, size = struct.unpack_from("<HII", head, 2)
        header = ObjectHeader(address, 1, 0)
        first = (address + _V1_PREFIX, address + _V1_PREFIX + size)
        mhead = 8
    else:
        raise Refused(f"{where}: version", "1 or 2", head[0])
    pending: list[tuple[int, int]] = [first]
    seen: set[int] = set()
    while pending:
        start, end = pending.pop(0)
        if len(header.chunks) >= max_chunks:
            raise Refused(f"{where}: chunks", f"at most {max_chunks}", "more")
        if start in seen:
            raise Refused(f"{where}: a chunk listed twice", "each chunk once", start)
        seen.add(start)
        if end < start:
            raise Refused(f"{where}: a chunk of negative length", "a length", end - start)
        what = f"a chunk of {where}"
        if header.version == 2:
            data = (
                head[start - address : end - address + 4]
                if start == address and end + 4 - address <= len(head)
                else source.read(start, end + 4 - start, what)
            )
            if start != address and data[:4] != CONTINUATION_SIGNATURE:
                raise Refused(f"{what} at {start}", "signature b'OCHK'", repr(data[:4]))
            if checksums:
                stored = int.from_bytes(data[-4:], "little")
                found = lookup3(data[:-4])
                if stored != found:
                    raise Refused(
                        f"{what} at {start} fails its checksum",
                        f"lookup3 {stored:#010x}",
                        f"lookup3 {found:#010x}",
                    )
            header.chunks.append(Chunk(start, end))
            body_start = length if start == address else 4
            _messages(
                header, data, start, body_start, end - start, mhead, pending, sizeof_addr, 8, keep
            )
        else:
            data = source.read(start, end - start, what)
            header.chunks.append(Chunk(start, end))
            _messages(
                header, data, start, 0, end - start, mhead, pending, sizeof_addr, sizeof_size, keep
            )
    if header.version == 1 and len(header.messages) > count:
        del header.messages[count:]  # (a version-1 header counts its messages)
    return header


def _messages(
    header: ObjectHeader,
    data: bytes,
    base: int,
    p: int,
    end: int,
    mhead: int,
    pending: list[tuple[int, int]],
    sizeof_addr: int,
    sizeof_size: int = 8,
    keep: frozenset[int] | None = None,
) -> None:
    """Append the messages of one chunk (``data`` starts at file offset ``base``; its messages
    lie in ``[p, end)``; with ``keep``, those of these types only); queue the chunks its
    continuation messages name."""
    v2 = header.version == 2
    unpack = _V2_MESSAGE.unpack_from if v2 else _V1_MESSAGE.unpack_from
    while p + mhead <= end:
        mtype, size, flags = unpack(data, p)
        body_at = p + mhead
        if body_at + size > end:
            raise Refused(
                f"the object header at {header.address}: a message runs past its chunk",
                f"at most {end - body_at} bytes",
                f"{size} bytes",
            )
        if keep is not None and mtype not in keep and mtype != CONTINUATION:
            p = body_at + (size if v2 else (size + 7) & ~7)
            continue
        body = data[body_at : body_at + size]
        header.messages.append(Message(mtype, flags, base + body_at, body))
        if mtype == CONTINUATION:
            if size < sizeof_addr + sizeof_size:
                raise Refused(
                    f"the object header at {header.address}: a short continuation message",
                    f"{sizeof_addr + sizeof_size} bytes",
                    f"{size} bytes",
                )
            address = int.from_bytes(body[:sizeof_addr], "little")
            length = int.from_bytes(body[sizeof_addr : sizeof_addr + sizeof_size], "little")
            if v2 and length < 8:
                raise Refused(
                    f"the object header at {header.address}: a continuation chunk",
                    "at least 8 bytes (signature and checksum)",
                    f"{length} bytes",
                )
            # (version 2: the chunk under its checksum is [address, address + length - 4))
            pending.append((address, address + length - 4) if v2 else (address, address + length))
        p = body_at + (size if v2 else (size + 7) & ~7)


def encode_v2(
    messages: Iterable[tuple[int, int, bytes]],
    *,
    phase_change: tuple[int, int] | None = None,
) -> bytes:
    """A version-2 object header of one chunk holding ``messages`` (type, flags, body), with
    its checksum; ``phase_change``: the attribute phase-change values to store."""
    body = b"".join(_V2_MESSAGE.pack(t, len(b), f) + b for t, f, b in messages)
    return encode_v2_raw(body, phase_change=phase_change)


def encode_v2_raw(body: bytes, *, phase_change: tuple[int, int] | None = None) -> bytes:
    """A version-2 object header of one chunk whose messages (heads included) are ``body``."""
    head = prefix_v2(len(body), phase_change=phase_change)
    data = head + body
    return data + lookup3(data).to_bytes(4, "little")


def prefix_v2(size: int, *, phase_change: tuple[int, int] | None = None) -> bytes:
    """The prefix of a version-2 object header whose chunk 0 holds ``size`` bytes of messages:
    the size field as wide as the size needs (1, 2, 4 or 8 bytes)."""
    code = 0 if size < 1 << 8 else 1 if size < 1 << 16 else 2 if size < 1 << 32 else 3
    flags = code | (_PHASE_CHANGE if phase_change is not None else 0)
    out = SIGNATURE + bytes((2, flags))
    if phase_change is not None:
        out += struct.pack("<HH", *phase_change)
    return out + size.to_bytes(1 << code, "little")


def message_head(mtype: int, size: int, flags: int = 0) -> bytes:
    """The 4-byte head of a version-2 message."""
    return _V2_MESSAGE.pack(mtype, size, flags)


def continuation_candidates(image: bytes) -> dict[int, int]:
    """``{address: length}`` of what look like the continuation chunks (``OCHK``) of a file's
    image, from the continuation messages that point at them (type 0x10 of 16 bytes: an 8-byte
    address and an 8-byte length, after a 4-byte message head, or 6 with creation order),
    found by scanning rather than by walking every header. A wrong guess is harmless to the
    caller, which checks each chunk's checksum before using it."""
    found: dict[int, int] = {}
    for match in re.finditer(rb"\x10\x10\x00", image):
        for head in (4, 6):
            at = match.start() + head
            address, length = (
                struct.unpack_from("<QQ", image, at) if at + 16 <= len(image) else (0, 0)
            )
            if image[address : address + 4] == b"OCHK" and 8 < length <= len(image) - address:
                found.setdefault(address, length)
    return found


SUPERBLOCK_SIZE = 48  # the superblock the generator writes (version 3)
CHUNK = 4096  # the most bytes of messages in one object header chunk the generator writes
_PENDING = b"\x00\x00\x00\x00"  # a checksum still to compute (computed for all headers at once)


def encode_chunked(
    messages: list[tuple[int, int, bytes]], phase: tuple[int, int] | None, address: int
) -> tuple[bytes, list[tuple[int, int]]]:
    """A version-2 object header at ``address`` holding ``messages``: one chunk, or for a
    long header chunk 0 with continuation messages to further chunks (each at most
    ``CHUNK`` bytes of messages) laid right after it, and each chunk's (start, checksum
    offset) in the header. Checksums are left zero: every chunk's is computed at the end, for
    all headers at once."""
    bodies = [message_head(t, len(b), f) + b for t, f, b in messages]
    total = sum(map(len, bodies))
    if total <= CHUNK:
        head = prefix_v2(total, phase_change=phase)
        return head + b"".join(bodies) + _PENDING, [(0, len(head) + total)]
    # group the messages into chunks; chunk 0 holds the continuation messages
    chunks: list[list[bytes]] = [[]]
    size = 0
    for b in bodies:
        if size + len(b) > CHUNK and chunks[-1]:
            chunks.append([])
            size = 0
        chunks[-1].append(b)
        size += len(b)
    cont = 4 + 16  # a continuation message with its head
    first = chunks[0]
    rest = chunks[1:]
    # chunk 0: its own messages plus one continuation message per further chunk
    size0 = sum(map(len, first)) + cont * len(rest)
    head = prefix_v2(size0, phase_change=phase)
    at = address + len(head) + size0 + 4
    conts = []
    tails = []
    spans = [(0, len(head) + size0)]
    for chunk in rest:
        length = 4 + sum(map(len, chunk)) + 4  # signature, messages, checksum
        conts.append(
            message_head(CONTINUATION, 16) + at.to_bytes(8, "little") + length.to_bytes(8, "little")
        )
        tails.append(CONTINUATION_SIGNATURE + b"".join(chunk) + _PENDING)
        spans.append((at - address, at - address + length - 4))
        at += length
    data = head + b"".join(first) + b"".join(conts) + _PENDING + b"".join(tails)
    return data, spans
