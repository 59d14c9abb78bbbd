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
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c
import numpy as np

from parallelvars._fileio import pwrite_all
from parallelvars.checkpoint._skeleton import MAX_IMAGE_BYTES
from parallelvars.checkpoint.h5raw.fractal_heap import direct_block_extent
from parallelvars.checkpoint.h5raw.header import continuation_candidates, v2_prefix
from parallelvars.checkpoint.h5raw.lookup3 import lookup3_many

__all__ = ["IndexSkeleton", "NoSkeleton", "capture", "link_sentinel", "lookup3_many"]


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
        block = direct_block_extent(image, fhdb)
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
        prefix = v2_prefix(image[ohdr : ohdr + 32])
        if prefix is None:
            return None
        start = ohdr
        end = ohdr + prefix[1] + prefix[2]
    if start < pos and end_of <= end and end + 4 <= len(image):
        return start, end, end
    return None


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
    continuations = continuation_candidates(image) if signatures[b"OCHK"] else {}
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
