"""Skeleton reuse for the index file of a multi-process checkpoint (see ``write_h5_index``).

The index file has no component data: its groups, attributes and external links depend on the
structure alone, except for three kinds of value, each of a length fixed by the structure:

* the header values a single-file skeleton patches too (``created``, ``save_counter``,
  ``step``, ``processes``, the index document's ``crc32c``), in the root's and the index
  dataset's object headers;
* the index document (the component checksums), raw data at a fixed offset;
* the folder of the rank files in every external link (``ckpt-7.h5.parts/``): a link's target
  file is stored in the link message, in its group's object header, so a save to another path
  changes one string per component.

The first save of a structure is written by HDF5 with random sentinels in place of those
values (the folder as a random string of the same length); the sentinels are found in the
file, each inside a metadata block whose stored Jenkins lookup3 checksum is reproduced here
(an object header chunk, ``OHDR`` or a continuation ``OCHK``, or, for a group of more than 8
links, a fractal heap direct block ``FHDB``), and the file's bytes are kept. A later save of
the structure copies them, puts the new values in, and recomputes the checksums of the chunks
it changed, all of them at once (:func:`lookup3_many`, vectorised over chunks). The result is
byte for byte the file HDF5 writes. Anything the capture cannot check (a sentinel found twice or
outside such a block) means no skeleton: HDF5 writes every save of that structure.
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c
import numpy as np

from parallelvars._fileio import pwrite_all
from parallelvars.checkpoint._skeleton import MAX_IMAGE_BYTES

__all__ = ["IndexSkeleton", "NoSkeleton", "capture", "link_sentinel", "lookup3_many"]

_U32 = np.uint32


def _rot(x: np.ndarray, k: int) -> np.ndarray:
    return (x << _U32(k)) | (x >> _U32(32 - k))


def lookup3_many(image: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Bob Jenkins' lookup3 ``hashlittle`` (HDF5's metadata checksum, initial value 0) of
    ``image[start:end]`` for every span, computed for all spans together (uint32 array).

    The spans are sorted by length, longest first, so the rows still mixing at any block are a
    leading slice and each lookup3 round is a handful of numpy operations over all of them.
    """
    n = len(spans)
    out = np.empty(n, np.uint32)
    if n == 0:
        return out
    lengths = np.array([e - s for s, e in spans], np.int64)
    order = np.argsort(-lengths, kind="stable")
    lens = lengths[order]
    blocks = max(1, int(-(-int(lens[0]) // 12)))
    data = np.zeros((n, blocks * 12), np.uint8)
    for row, i in enumerate(order.tolist()):
        s, e = spans[i]
        data[row, : e - s] = image[s:e]
    words = data.view("<u4").reshape(n, blocks, 3).astype(np.uint32)
    a = ((0xDEADBEEF + lens) & 0xFFFFFFFF).astype(np.uint32)
    b = a.copy()
    c = a.copy()
    with np.errstate(over="ignore"):
        for j in range(blocks):
            rest = lens - 12 * j
            mixing = int(np.count_nonzero(rest > 12))  # a leading slice: lens is descending
            last = int(np.count_nonzero(rest > 0))
            if mixing:
                x, y, z = a[:mixing], b[:mixing], c[:mixing]
                x += words[:mixing, j, 0]
                y += words[:mixing, j, 1]
                z += words[:mixing, j, 2]
                x -= z
                x ^= _rot(z, 4)
                z += y
                y -= x
                y ^= _rot(x, 6)
                x += z
                z -= y
                z ^= _rot(y, 8)
                y += x
                x -= z
                x ^= _rot(z, 16)
                z += y
                y -= x
                y ^= _rot(x, 19)
                x += z
                z -= y
                z ^= _rot(y, 4)
                y += x
            if last > mixing:  # the rows whose last (zero-padded) block is block j
                sl = slice(mixing, last)
                x, y, z = a[sl], b[sl], c[sl]
                x += words[sl, j, 0]
                y += words[sl, j, 1]
                z += words[sl, j, 2]
                z ^= y
                z -= _rot(y, 14)
                x ^= z
                x -= _rot(z, 11)
                y ^= x
                y -= _rot(x, 25)
                z ^= y
                z -= _rot(y, 16)
                x ^= z
                x -= _rot(z, 4)
                y ^= x
                y -= _rot(x, 14)
                z ^= y
                z -= _rot(y, 24)
            if last == 0:
                break
    out[order] = c
    return out


def link_sentinel(length: int) -> bytes:
    """Random lowercase letters and digits, ``length`` bytes: stands for the rank files'
    folder in the links of a first save (never mistaken for a signature such as ``OHDR``)."""
    alphabet = b"abcdefghijklmnopqrstuvwxyz0123456789"
    return bytes(alphabet[b % len(alphabet)] for b in os.urandom(length))


def _signatures(image: bytes) -> dict[bytes, list[int]]:
    """Where each metadata block signature occurs in ``image``, in order."""
    return {
        sig: [m.start() for m in re.finditer(re.escape(sig), image)]
        for sig in (b"OHDR", b"OCHK", b"FHDB")
    }


def _before(positions: list[int], pos: int) -> int:
    """The last of ``positions`` (sorted) that ends by ``pos``, or -1."""
    i = bisect.bisect_right(positions, pos - 4) - 1
    return positions[i] if i >= 0 else -1


def _header_chunk(
    image: bytes,
    pos: int,
    end_of: int,
    continuations: dict[int, int],
    signatures: dict[bytes, list[int]],
) -> tuple[int, int, int] | None:
    """The checksummed metadata block that holds ``image[pos:end_of]``, by its layout alone
    (the checksums are checked together afterwards), as ``(start, end, checksum offset)``: its
    lookup3 checksum covers ``image[start:end]`` with the checksum's own 4 bytes as zeros.
    An object header chunk (``OHDR`` chunk 0, or a continuation ``OCHK``) ends at its
    checksum; a fractal heap direct block (``FHDB``: a group's links in dense storage) holds
    its checksum in its prefix. None for anything else."""
    ohdr, ochk, fhdb = (_before(signatures[sig], pos) for sig in (b"OHDR", b"OCHK", b"FHDB"))
    nearest = max(ohdr, ochk, fhdb)
    if nearest < 0:
        return None
    if nearest == fhdb:
        block = _direct_block(image, fhdb)
        if block is None:
            return None
        start, end, cpos = block
        if start + 4 < pos and end_of <= end and (end_of <= cpos or pos >= cpos + 4):
            return start, end, cpos
        return None
    if nearest == ochk:  # a continuation chunk: its length is in the message that points to it
        length = continuations.get(ochk)
        if length is None:
            return None
        start, end = ochk, ochk + length - 4
    else:
        head = image[ohdr : ohdr + 32]
        if len(head) < 7 or head[4] != 2:
            return None
        flags = head[5]
        p = 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
        width = 1 << (flags & 0x03)
        if p + width > len(head):
            return None
        start = ohdr
        end = ohdr + p + width + int.from_bytes(head[p : p + width], "little")
    if start < pos and end_of <= end and end + 4 <= len(image):
        return start, end, end
    return None


def _direct_block(image: bytes, at: int) -> tuple[int, int, int] | None:
    """(start, end, checksum offset) of the fractal heap direct block at ``at``, from its heap
    header (``FRHP``: 8-byte addresses and lengths, no filters, checksummed direct blocks)."""
    if image[at + 4 : at + 5] != b"\x00":
        return None
    heap = int.from_bytes(image[at + 5 : at + 13], "little")
    hdr = image[heap : heap + 146]
    if len(hdr) < 146 or hdr[:5] != b"FRHP\x00" or hdr[7:9] != b"\x00\x00" or not hdr[9] & 2:
        return None
    width = int.from_bytes(hdr[110:112], "little")
    first = int.from_bytes(hdr[112:120], "little")
    bits = int.from_bytes(hdr[128:130], "little")
    off_size = (bits + 7) // 8
    if not (width and first and 0 < off_size <= 8):
        return None
    offset = int.from_bytes(image[at + 13 : at + 13 + off_size], "little")
    # The doubling table: rows 0 and 1 of blocks of the first size, then each row's twice
    # the last's, ``width`` blocks a row.
    row = offset // (width * first)
    size = first if row == 0 else first << (row.bit_length() - 1)
    cpos = at + 13 + off_size
    if cpos + 4 > at + size or at + size > len(image):
        return None
    return at, at + size, cpos


def _continuations(image: bytes) -> dict[int, int]:
    """``{address: length}`` of the continuation chunks (``OCHK``) of the file, from the
    continuation messages that point at them (type 0x10 of 16 bytes: an 8-byte address and an
    8-byte length, after a 4-byte message head, or 6 with creation order). A wrong guess is
    harmless: every chunk's checksum is checked before it is used."""
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


def _checksum(image: np.ndarray, chunks: Sequence[tuple[int, int, int]]) -> None:
    """Recompute the lookup3 checksum of every ``(start, end, checksum offset)`` block."""
    if not chunks:
        return
    at = np.array([c for _, _, c in chunks], np.int64)[:, None] + np.arange(4)
    image[at] = 0  # (inside a direct block, the checksum is taken with its field zeroed)
    digests = lookup3_many(image, [(s, e) for s, e, _ in chunks])
    image[at] = digests.astype("<u4").view(np.uint8).reshape(-1, 4)


@dataclass
class IndexSkeleton:
    """The bytes of one structure's index file, with where its changing values sit."""

    key: Any
    image: np.ndarray  # the whole file (uint8), holding the values of the last save
    prefix: bytes  # the link folder the image holds now
    prefix_at: np.ndarray  # where every link's folder starts
    values: dict[str, tuple[int, np.dtype]]  # header value name -> (offset, dtype)
    chunks: list[tuple[int, int, int]]  # (start, end, checksum offset): see _header_chunk
    value_chunks: list[int]  # the chunks holding the header values (a subset of chunks)
    index_offset: int
    index_capacity: int
    template: str
    lock: threading.Lock = field(default_factory=threading.Lock)

    def write(
        self, fd: int, prefix: bytes, crcs: Sequence[int], values: dict[str, Any], index_crc: str
    ) -> None:
        """Write the file of this structure to ``fd``: links to the rank files under
        ``prefix`` (of the structure's length), the index with ``crcs``, header ``values``
        (``values[index_crc]`` is set to the index document's checksum)."""
        with self.lock:
            raw = (self.template % tuple(crcs)).encode("utf-8").ljust(self.index_capacity, b" ")
            values[index_crc] = np.int64(_crc32c.crc32c(raw))
            self._put(raw, self.index_offset)
            self._set(prefix, values)
            pwrite_all(fd, memoryview(self.image), 0)  # type: ignore[arg-type]

    def _set(self, prefix: bytes, values: Mapping[str, Any]) -> None:
        """Put ``prefix`` and the header ``values`` in the image; recompute the checksums of
        the chunks that changed."""
        dirty = list(self.value_chunks)
        if prefix != self.prefix:
            # (the structure's key holds the folder's length)
            assert len(prefix) == len(self.prefix), "a folder of another length"
            if self.prefix_at.size:
                at = self.prefix_at[:, None] + np.arange(len(prefix))
                self.image[at] = np.frombuffer(prefix, np.uint8)
            self.prefix = prefix
            dirty = list(range(len(self.chunks)))
        for name, value in values.items():
            offset, dtype = self.values[name]
            self._put(np.asarray(value, dtype).tobytes(), offset)
        _checksum(self.image, [self.chunks[i] for i in dirty])

    def _put(self, data: bytes, offset: int) -> None:
        self.image[offset : offset + len(data)] = np.frombuffer(data, np.uint8)


def capture(
    path: str,
    key: Any,
    sentinel_prefix: bytes,
    links: int,
    sentinels: Mapping[str, np.generic],
    index: tuple[int, int, str],
) -> IndexSkeleton | None:
    """The skeleton of the index file HDF5 just wrote at ``path`` with ``sentinel_prefix`` as
    the folder of its ``links`` external links and ``sentinels`` as its header values, or None
    when any of them is not found where it can be checked. ``index``: the index document's
    offset, capacity and template."""
    if os.path.getsize(path) > MAX_IMAGE_BYTES:  # kept in memory: as a file's skeleton is
        return None
    with open(path, "rb") as f:
        image = f.read()
    spots: list[tuple[int, int]] = []  # (position, length) of every value to patch
    prefix_at: list[int] = []
    if sentinel_prefix:
        at = image.find(sentinel_prefix)
        while at >= 0:
            prefix_at.append(at)
            spots.append((at, len(sentinel_prefix)))
            at = image.find(sentinel_prefix, at + len(sentinel_prefix))
        if len(prefix_at) != links:
            return None
    value_at: dict[str, tuple[int, np.dtype]] = {}
    for name, value in sentinels.items():
        raw = np.asarray(value).tobytes()
        at = image.find(raw)
        if at < 0 or image.find(raw, at + 1) >= 0:
            return None
        value_at[name] = (at, np.asarray(value).dtype)
    signatures = _signatures(image)
    continuations = _continuations(image) if signatures[b"OCHK"] else {}
    chunk_of: dict[tuple[int, int, int], int] = {}
    spot_chunk: list[int] = []
    for pos, length in spots + [(at, dt.itemsize) for at, dt in value_at.values()]:
        chunk = _header_chunk(image, pos, pos + length, continuations, signatures)
        if chunk is None:
            return None
        spot_chunk.append(chunk_of.setdefault(chunk, len(chunk_of)))
    chunks = list(chunk_of)
    offset, capacity, template = index
    # The blocks and the index document are disjoint, so patching one never touches another.
    extents = sorted([(s, max(e, c + 4)) for s, e, c in chunks] + [(offset, offset + capacity)])
    if offset < 0 or offset + capacity > len(image):
        return None
    if any(nxt[0] < cur[1] for cur, nxt in itertools.pairwise(extents)):
        return None
    whole = np.frombuffer(image, np.uint8).copy()
    stored = whole.copy()
    _checksum(stored, chunks)
    if not np.array_equal(stored, whole):  # every block's checksum, as HDF5 computed it
        return None
    return IndexSkeleton(
        key=key,
        image=whole,
        prefix=sentinel_prefix,
        prefix_at=np.array(prefix_at, np.int64),
        values=value_at,
        chunks=chunks,
        value_chunks=sorted(set(spot_chunk[len(spots) :])),
        index_offset=offset,
        index_capacity=capacity,
        template=template,
    )


@dataclass
class NoSkeleton:
    """Cached for a structure whose index file cannot be a skeleton: HDF5 writes every save."""

    key: Any
