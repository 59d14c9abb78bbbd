"""Skeleton reuse: repeated saves of one structure written from the first save's bytes.

A training run saves the same structure (paths, kinds, shapes, dtypes, devices, slots, object
graph) again and again; only the values change. The first save of a structure is written by
HDF5, as every save was; its bytes are then kept as the structure's *skeleton*: everything in
the file but the component data. A later save of the same structure writes the skeleton, the
component bytes at the offsets HDF5 gave their datasets, the index document (with the new
checksums) at its dataset's offset, and the few values that live in HDF5 object headers (the
root attributes ``created``, ``save_counter``, ``step`` and the index's ``crc32c``), each
patched in place with the header's Jenkins lookup3 checksum recomputed. The result is byte for
byte the file HDF5 writes for that content (the writer makes HDF5's output deterministic: no
object times, component checksums in the index rather than in object headers).

Only what can be checked is reused: a value is patched only where it sits, once, inside an
object header chunk whose stored lookup3 checksum this module reproduces; anything else (an
attribute in dense storage, a value found twice) means no skeleton, and the save is written by
HDF5 as before.
"""

from __future__ import annotations

import math
import operator
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c
import numpy as np

from parallelvars._fileio import IOV_MAX, pwrite_all, pwritev_all
from parallelvars.checkpoint.h5raw.header import v2_prefix
from parallelvars.checkpoint.h5raw.lookup3 import lookup3

__all__ = [
    "Patch",
    "Skeleton",
    "SkeletonCache",
    "header_chunk",
    "lookup3",
    "sentinel",
]

# Component data smaller than this is copied into the skeleton image and written with it;
# larger components are written straight from their buffers.
INLINE_BYTES = 64 << 10
# A skeleton keeps at most this many bytes of image (metadata and small components).
MAX_IMAGE_BYTES = 256 << 20


def header_chunk(image: bytes | memoryview, pos: int) -> tuple[int, int] | None:
    """The (start, checksum offset) of the version-2 object header chunk 0 holding ``pos``.

    The nearest ``OHDR`` signature before ``pos`` is parsed (:func:`~.h5raw.header.v2_prefix`)
    and accepted only when ``pos`` lies in its chunk and the chunk's stored lookup3 checksum is
    reproduced; else None.
    """
    buf = bytes(image[max(0, pos - (1 << 16)) : pos])
    base = max(0, pos - (1 << 16))
    at = buf.rfind(b"OHDR")
    while at >= 0:
        start = base + at
        prefix = v2_prefix(image[start : start + 32])
        if prefix is not None:
            end = start + prefix[1] + prefix[2]  # the checksum's offset
            if start < pos < end and end + 4 <= len(image):
                stored = int.from_bytes(bytes(image[end : end + 4]), "little")
                if lookup3(image[start:end]) == stored:
                    return start, end
        at = buf.rfind(b"OHDR", 0, at)
    return None


_SENTINEL_LOCK = threading.Lock()


def sentinel(dtype: np.dtype) -> np.generic:
    """A value of ``dtype`` (int64 or float64) with random bytes, to find where HDF5 put it."""
    with _SENTINEL_LOCK:
        raw = os.urandom(8)
    if np.dtype(dtype).kind == "f":
        # A normal float: random mantissa, exponent of 2**40.
        bits = (int.from_bytes(raw, "little") & ((1 << 52) - 1)) | (1063 << 52)
        return np.frombuffer(bits.to_bytes(8, "little"), np.float64)[0]
    value = int.from_bytes(raw, "little") & ((1 << 62) - 1) | (1 << 61)
    return np.int64(value)


@dataclass
class Patch:
    """A value inside an object header: its offset, dtype and the header chunk around it."""

    offset: int
    dtype: np.dtype
    chunk_start: int
    chunk_end: int


@dataclass
class Skeleton:
    """The bytes of one structure's file but the component data (see the module docstring).

    ``pieces`` are the file's byte ranges ``(offset, bytes)`` outside the components written
    straight from their buffers; ``offsets``/``nbytes`` give every component's data range in
    write order; ``inline`` says which components are copied into the pieces instead.
    """

    key: Any
    file_size: int
    pieces: list[tuple[int, np.ndarray]]
    offsets: np.ndarray
    nbytes: np.ndarray
    inline: np.ndarray
    index_offset: int
    index_capacity: int
    patches: dict[str, Patch] = field(default_factory=dict)
    # (piece number, start in the piece) of every inline component, in write order.
    inline_at: list[tuple[int, int]] = field(default_factory=list)
    template: str = ""
    # The columns document (docs/FORMAT.md): its data offset and capacity (0: none), and its
    # bytes before and after the checksums.
    columns_offset: int = -1
    columns_capacity: int = 0
    _columns_head: bytes = field(default=b"", repr=False)
    _columns_tail: bytes = field(default=b"", repr=False)
    _between: list[str] = field(default_factory=list, repr=False)
    _between_bytes: list[bytes] | None = field(default=None, repr=False)
    # The last component list that fitted (a checkpoint hands the same list while its
    # structure is unchanged).
    _fitted: Sequence[np.ndarray] | None = field(default=None, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _write_plan: _Plan | None = field(default=None, repr=False)

    def set_template(self, template: str) -> bool:
        """Keep the index document's template (``template % crcs`` is the document); False
        when a document of this structure might not fit the capacity."""
        self.template = template
        # The text between the checksums, so that a document is one join (``%`` formatting
        # scans every character of the template, megabytes at 50,000 variables).
        parts = [""]
        for token in _TEMPLATE_TOKEN.split(template):
            if token == "%d":
                parts.append("")
            else:
                parts[-1] += "%" if token == "%%" else token
        if len(parts) != len(self.offsets) + 1:
            return False
        self._between = parts
        # Each "%d" (2 characters) becomes a checksum of at most 10 digits.
        return len(template) + 8 * len(self.offsets) <= self.index_capacity

    def set_columns(self, head: str, tail: str) -> bool:
        """Keep the columns document's text before and after its checksums; False when a
        document of this structure might not fit its capacity."""
        self._columns_head, self._columns_tail = head.encode("utf-8"), tail.encode("utf-8")
        n = len(self.offsets)
        # Each checksum takes at most 10 digits, and 2 more for the ", " before it.
        room = len(self._columns_head) + len(self._columns_tail) + 12 * n
        return self.columns_capacity > 0 and room <= self.columns_capacity

    def _document(self, digits: bytes) -> bytes:
        """``template % crcs``, encoded, from ``digits`` (the checksums' digits joined by
        spaces): one join of the text between the checksums (as bytes, made once) and the
        checksums' digits."""
        between = self._between_bytes
        if between is None:
            between = self._between_bytes = [t.encode("utf-8") for t in self._between]
        if len(between) == 1:
            return between[0]
        parts: list[bytes] = [b""] * (2 * len(between) - 1)
        parts[0::2] = between
        parts[1::2] = digits.split(b" ")
        return b"".join(parts)

    def _put_document(self, doc: bytes, offset: int, capacity: int) -> int:
        """Put a document into the image at ``offset``, padded with spaces to ``capacity``;
        returns the padded document's checksum."""
        span = self._span(offset, offset + capacity)
        span[: len(doc)] = np.frombuffer(doc, np.uint8)
        span[len(doc) :] = 0x20
        return int(_CRC(span))

    def _put_documents(
        self, crcs: Sequence[int], values: dict[str, Any], index_crc: str, columns_crc: str
    ) -> None:
        """Put the index and the columns with ``crcs`` into the image, their checksums into
        ``values`` (one conversion of the checksums to digits serves both)."""
        digits = " ".join(map(str, crcs)).encode("ascii")
        doc = self._document(digits)
        values[index_crc] = np.int64(
            self._put_document(doc, self.index_offset, self.index_capacity)
        )
        if self.columns_capacity:
            doc = self._columns_head + digits.replace(b" ", b", ") + self._columns_tail
            values[columns_crc] = np.int64(
                self._put_document(doc, self.columns_offset, self.columns_capacity)
            )

    def fits(self, components: Sequence[np.ndarray]) -> bool:
        """Whether ``components`` (in write order) have the sizes this structure's have."""
        if components is self._fitted:  # the same arrays again (an array's size is fixed)
            return True
        n = len(components)
        if n != self.nbytes.size:
            return False
        sizes = np.fromiter(map(_NBYTES, components), np.int64, n)
        if not np.array_equal(sizes, self.nbytes):
            return False
        self._fitted = components
        return True

    def write(
        self,
        fd: int,
        components: Sequence[np.ndarray],
        values: dict[str, Any],
        *,
        write: Callable[[np.ndarray, int], int],
        check: Callable[[np.ndarray, int, int], None],
        index_crc: str,
        columns_crc: str = "",
    ) -> list[int]:
        """Write a file of this structure to ``fd`` (of ``file_size`` bytes): its components
        (C-contiguous, in write order, the sizes :meth:`fits` checks), the index and the
        columns with their checksums and the header ``values`` (``values[index_crc]`` and
        ``values[columns_crc]`` are set to the documents' checksums). Returns the components'
        checksums, in write order (as the index records them).

        Components under ``INLINE_BYTES`` go out with the skeleton's image in a few gathered
        writes (``pwritev``: the image's bytes between them and their buffers, in file order),
        each checksummed before and again after (a live buffer changed meanwhile fails the
        save through ``check(arr, crc, i)``); larger ones through ``write(arr, offset) -> crc``
        and then ``check``.
        """
        with self.lock:
            plan = self._plan()
            crcs = [0] * len(components)
            for i in plan.big:
                crcs[i] = write(components[i], int(self.offsets[i]))
                check(components[i], crcs[i], i)
            small = plan.pick(components)
            before = list(map(_CRC, small))
            if plan.every:  # all of them, in write order
                crcs = before
            else:
                for i, crc in zip(plan.small, before, strict=True):
                    crcs[i] = crc
            self._put_documents(crcs, values, index_crc, columns_crc)
            self._patch(values)
            plan.write(fd, small)
            after = list(map(_CRC, small))
            if after != before:  # a buffer changed while it was written: name the first
                for j, (crc, arr) in enumerate(zip(before, small, strict=True)):
                    if after[j] != crc:
                        check(arr, crc, plan.small[j])
            return crcs

    def _plan(self) -> _Plan:
        """How :meth:`write` writes this structure (made on its first write, then reused)."""
        plan = self._write_plan
        if plan is None:
            plan = self._write_plan = _Plan.make(self)
        return plan

    def patch_file(self, fd: int, values: dict[str, Any]) -> None:
        """Put ``values`` into the file HDF5 wrote (with sentinels there): the patched header
        chunks only."""
        with self.lock:
            for start, end in self._patch(values):
                pwrite_all(fd, memoryview(self._span(start, end + 4)), start)  # type: ignore[arg-type]

    def _patch(self, values: dict[str, Any]) -> set[tuple[int, int]]:
        """Set the header values in the image and recompute their chunks' checksums."""
        for name, value in values.items():
            patch = self.patches[name]
            self._put(np.asarray(value, patch.dtype).tobytes(), patch.offset)
        chunks = {(p.chunk_start, p.chunk_end) for p in self.patches.values()}
        for start, end in chunks:
            image = self._span(start, end + 4)
            digest = lookup3(image[: end - start].tobytes())
            image[end - start :] = np.frombuffer(digest.to_bytes(4, "little"), np.uint8)
        return chunks

    def _find(self, start: int, end: int) -> np.ndarray | None:
        """The image bytes ``[start, end)``, or None when no piece holds them all."""
        for offset, piece in self.pieces:
            if offset <= start and end <= offset + piece.size:
                return piece[start - offset : end - offset]
        return None

    def _span(self, start: int, end: int) -> np.ndarray:
        """The image bytes ``[start, end)``, which :func:`capture` checked lie in one piece."""
        found = self._find(start, end)
        assert found is not None
        return found

    def _put(self, data: bytes, offset: int) -> None:
        self._span(offset, offset + len(data))[...] = np.frombuffer(data, np.uint8)


_NBYTES = operator.attrgetter("nbytes")
# The template's placeholders (a checksum) and escapes, and the text between them.
_TEMPLATE_TOKEN = re.compile(r"(%d|%%)")
# CRC-32C of a C-contiguous array's bytes (any dtype: the buffer is read as bytes).
_CRC: Callable[[Any], int] = _crc32c.crc32c


class _Plan:
    """A skeleton's gathered writes: every image piece with the small components inside it.

    ``small`` lists the components written with the pieces, in file order; ``big`` the
    others (written from their buffers), empty ones in neither. ``runs`` are the writes:
    ``(file offset, byte count, image segments, first and end position in small)``; each
    run's buffers are its segments and its components alternating, segment first, at most
    :data:`IOV_MAX` of them.
    """

    def __init__(
        self,
        small: list[int],
        big: list[int],
        runs: list[tuple[int, int, list[np.ndarray], int, int]],
        count: int,
    ) -> None:
        self.small = small
        self.big = big
        self.runs = runs
        # whether the small components are all ``count`` components, in write order
        self.every = small == list(range(count))
        if len(small) > 1:
            getter = operator.itemgetter(*small)
            self.pick: Callable[[Sequence[np.ndarray]], Sequence[np.ndarray]] = getter
        else:
            self.pick = lambda comps: [comps[i] for i in small]

    @classmethod
    def make(cls, skel: Skeleton) -> _Plan:
        lens = skel.nbytes.tolist()
        inline = skel.inline.tolist()
        at = iter(skel.inline_at)
        inside: list[list[tuple[int, int, int]]] = [[] for _ in skel.pieces]
        big: list[int] = []
        for i, (small, size) in enumerate(zip(inline, lens, strict=True)):
            if small:
                piece, start = next(at)
                if size:
                    inside[piece].append((start, size, i))
            else:
                big.append(i)
        order: list[int] = []
        runs: list[tuple[int, int, list[np.ndarray], int, int]] = []
        per_run = (IOV_MAX - 1) // 2  # components per write: 2 buffers each, plus a segment
        for (offset, image), comps in zip(skel.pieces, inside, strict=True):
            comps.sort()
            if not comps:
                runs.append((offset, image.size, [image], len(order), len(order)))
                continue
            cursor = 0  # in the piece
            for k in range(0, len(comps), per_run):
                chunk = comps[k : k + per_run]
                first = len(order)
                segments = []
                run_start = cursor
                for start, size, i in chunk:
                    segments.append(image[cursor:start])
                    order.append(i)
                    cursor = start + size
                last = k + per_run >= len(comps)
                end = image.size if last else cursor
                segments.append(image[cursor:end])
                cursor = end
                runs.append((offset + run_start, end - run_start, segments, first, len(order)))
        return cls(order, big, runs, len(lens))

    def write(self, fd: int, small: Sequence[np.ndarray]) -> None:
        """The runs' gathered writes, with ``small`` (:attr:`pick` of the components)."""
        for offset, size, segments, first, end in self.runs:
            buffers: list[Any] = [None] * (len(segments) + end - first)
            buffers[0::2] = segments
            buffers[1::2] = small[first:end]
            pwritev_all(fd, buffers, offset, size)


def capture(
    path: str,
    key: Any,
    offsets: Sequence[int],
    nbytes: Sequence[int],
    index_offset: int,
    index_capacity: int,
    sentinels: dict[str, np.generic],
    *,
    columns: tuple[int, int] | None = None,
) -> Skeleton | None:
    """The skeleton of the file HDF5 just wrote at ``path`` (closed, not yet renamed), or None.

    ``offsets``/``nbytes``: every component's data range, in write order; ``columns``: the
    columns document's data offset and capacity, when the file has one. ``sentinels``: the
    header values written with random bytes, by name; each must be found exactly once, inside
    a header chunk whose checksum :func:`header_chunk` reproduces.
    """
    size = os.path.getsize(path)
    offs = np.asarray(offsets, np.int64)
    lens = np.asarray(nbytes, np.int64)
    if offs.size and (offs.min() < 0 or int((offs + lens).max()) > size):
        return None
    with open(path, "rb") as f:
        image = f.read()
    patches: dict[str, Patch] = {}
    for name, value in sentinels.items():
        raw = np.asarray(value).tobytes()
        at = image.find(raw)
        if at < 0 or image.find(raw, at + 1) >= 0:
            return None
        chunk = header_chunk(image, at)
        if chunk is None:
            return None
        patches[name] = Patch(at, np.asarray(value).dtype, *chunk)
    inline = lens < INLINE_BYTES
    # The file minus the components written from their buffers, as pieces.
    order = np.argsort(offs, kind="stable")
    pieces: list[tuple[int, np.ndarray]] = []
    cursor = 0
    whole = np.frombuffer(image, np.uint8)
    for j in order:
        if inline[j] or lens[j] == 0:
            continue
        start = int(offs[j])
        if start > cursor:
            pieces.append((cursor, whole[cursor:start].copy()))
        cursor = max(cursor, start + int(lens[j]))
    if cursor < size:
        pieces.append((cursor, whole[cursor:size].copy()))
    if sum(p.size for _, p in pieces) > MAX_IMAGE_BYTES:
        return None
    skeleton = Skeleton(
        key=key,
        file_size=size,
        pieces=pieces,
        offsets=offs,
        nbytes=lens,
        inline=inline,
        index_offset=index_offset,
        index_capacity=index_capacity,
        patches=patches,
    )
    if columns is not None:
        skeleton.columns_offset, skeleton.columns_capacity = columns
    starts = [p[0] for p in pieces]
    for j in range(offs.size):
        if inline[j]:
            k = int(np.searchsorted(starts, int(offs[j]), side="right")) - 1
            if k < 0 or int(offs[j]) + int(lens[j]) > starts[k] + pieces[k][1].size:
                return None
            skeleton.inline_at.append((k, int(offs[j]) - starts[k]))
    spans = [(index_offset, index_offset + index_capacity)]
    if columns is not None:
        if columns[0] < 0:
            return None
        spans.append((columns[0], columns[0] + columns[1]))
    spans += [(p.chunk_start, p.chunk_end + 4) for p in patches.values()]
    if any(skeleton._find(start, end) is None for start, end in spans):
        return None
    # Every component's bytes are written over the image's, so none may overlap another, the
    # index or a patched header (never so in a file HDF5 wrote; checked, not assumed).
    used = lens > 0
    o, n = offs[used], lens[used]
    sort = np.argsort(o, kind="stable")
    o, n = o[sort], n[sort]
    if np.any(o[1:] < o[:-1] + n[:-1]):
        return None
    if any(np.any((o < end) & (o + n > start)) for start, end in spans):
        return None
    return skeleton


class SkeletonCache:
    """The skeleton of the last structure a checkpoint saved (one per checkpoint object)."""

    def __init__(self) -> None:
        self._skeleton: Skeleton | None = None
        self._lock = threading.Lock()

    def get(self, key: Any) -> Skeleton | None:
        """The cached skeleton when ``key`` (the structure) is the cached one's."""
        with self._lock:
            skel = self._skeleton
        if skel is None:
            return None
        try:
            same = bool(skel.key == key)
        except (ValueError, TypeError):  # attributes that do not compare (arrays): a new one
            same = False
        return skel if same else None

    def put(self, skeleton: Skeleton | None) -> None:
        with self._lock:
            self._skeleton = skeleton

    def clear(self) -> None:
        self.put(None)


def index_capacity(length: int, checksums: int) -> int:
    """Room for an index document of ``length`` bytes besides its ``checksums`` (each written
    in at most 10 digits), rounded up to 64 bytes."""
    return int(math.ceil((length + 10 * checksums + 64) / 64) * 64)
