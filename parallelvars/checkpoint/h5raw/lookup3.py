"""Bob Jenkins' lookup3 ``hashlittle``: HDF5's metadata checksum (``H5_checksum_lookup3``).

Every checksummed HDF5 structure we read or write (object header chunks, fractal heap and
B-tree blocks, the superblock, a virtual dataset's mapping) ends with, or holds, the lookup3 of
its bytes with initial value 0, as a little-endian ``uint32``. One scalar function
(:func:`lookup3`) serves a single block; the vectorised ones hash many blocks at once, each
lookup3 round a handful of numpy operations over all of them:

* :func:`lookup3_many`: spans of one image, of any lengths;
* :func:`lookup3_rows`: the rows of a matrix, all of one length, optionally starting from a
  state shared by every row (:func:`prefix_state`: the first blocks of a template that every
  row shares are mixed once, not once per row).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence

import numpy as np

from parallelvars._ints import unique_ints

__all__ = ["lookup3", "lookup3_many", "lookup3_rows", "prefix_state"]

_MASK = 0xFFFFFFFF
_U32 = np.uint32


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _MASK


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    a = (a - c) & _MASK
    a ^= _rot(c, 4)
    c = (c + b) & _MASK
    b = (b - a) & _MASK
    b ^= _rot(a, 6)
    a = (a + c) & _MASK
    c = (c - b) & _MASK
    c ^= _rot(b, 8)
    b = (b + a) & _MASK
    a = (a - c) & _MASK
    a ^= _rot(c, 16)
    c = (c + b) & _MASK
    b = (b - a) & _MASK
    b ^= _rot(a, 19)
    a = (a + c) & _MASK
    c = (c - b) & _MASK
    c ^= _rot(b, 4)
    b = (b + a) & _MASK
    return a, b, c


def _final(a: int, b: int, c: int) -> int:
    c ^= b
    c = (c - _rot(b, 14)) & _MASK
    a ^= c
    a = (a - _rot(c, 11)) & _MASK
    b ^= a
    b = (b - _rot(a, 25)) & _MASK
    c ^= b
    c = (c - _rot(b, 16)) & _MASK
    a ^= c
    a = (a - _rot(c, 4)) & _MASK
    b ^= a
    b = (b - _rot(a, 14)) & _MASK
    c ^= b
    c = (c - _rot(b, 24)) & _MASK
    return c


def lookup3(data: bytes | bytearray | memoryview | np.ndarray, initval: int = 0) -> int:
    """The lookup3 ``hashlittle`` of ``data`` (HDF5 uses ``initval`` 0)."""
    k = bytes(data)
    n = len(k)
    a = b = c = (0xDEADBEEF + n + initval) & _MASK
    if n == 0:
        return c
    blocks = (n - 1) // 12  # the full blocks before the last (which may be short)
    words = struct.unpack_from(f"<{3 * blocks}I", k) if blocks else ()
    for j in range(0, 3 * blocks, 3):
        a, b, c = _mix(
            (a + words[j]) & _MASK, (b + words[j + 1]) & _MASK, (c + words[j + 2]) & _MASK
        )
    x, y, z = struct.unpack("<III", k[12 * blocks :].ljust(12, b"\x00"))
    return _final((a + x) & _MASK, (b + y) & _MASK, (c + z) & _MASK)


def prefix_state(data: bytes, length: int) -> tuple[int, int, int]:
    """The state (a, b, c) after mixing the first ``len(data) // 12`` blocks of any input of
    ``length`` bytes that starts with ``data`` (those blocks must not be its last)."""
    blocks = len(data) // 12
    assert not blocks or 12 * blocks < length, "a prefix state cannot include the last block"
    a = b = c = (0xDEADBEEF + length) & _MASK
    words = struct.unpack_from(f"<{3 * blocks}I", data) if blocks else ()
    for j in range(0, 3 * blocks, 3):
        a, b, c = _mix(
            (a + words[j]) & _MASK, (b + words[j + 1]) & _MASK, (c + words[j + 2]) & _MASK
        )
    return a, b, c


class _Kernel:
    """lookup3's ``mix`` and ``final`` on uint32 arrays, in place, with wrapping arithmetic
    and the rotations computed into two reused buffers (no temporaries per operation)."""

    def __init__(self, n: int) -> None:
        self._p = np.empty(n, np.uint32)
        self._q = np.empty(n, np.uint32)

    def _rot(self, v: np.ndarray, k: int) -> np.ndarray:
        p, q = self._p[: v.size], self._q[: v.size]
        np.left_shift(v, _U32(k), out=p)
        np.right_shift(v, _U32(32 - k), out=q)
        np.bitwise_or(p, q, out=p)
        return p

    def mix(self, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
        rot = self._rot
        a -= c
        a ^= rot(c, 4)
        c += b
        b -= a
        b ^= rot(a, 6)
        a += c
        c -= b
        c ^= rot(b, 8)
        b += a
        a -= c
        a ^= rot(c, 16)
        c += b
        b -= a
        b ^= rot(a, 19)
        a += c
        c -= b
        c ^= rot(b, 4)
        b += a

    def final(self, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
        rot = self._rot
        c ^= b
        c -= rot(b, 14)
        a ^= c
        a -= rot(c, 11)
        b ^= a
        b -= rot(a, 25)
        c ^= b
        c -= rot(b, 16)
        a ^= c
        a -= rot(c, 4)
        b ^= a
        b -= rot(a, 14)
        c ^= b
        c -= rot(b, 24)


# Rows hashed together: enough for numpy's per-call cost to vanish, few enough that the
# state and the block being mixed stay in cache.
_BATCH = 16384


def lookup3_rows(
    rows: np.ndarray,
    length: int,
    *,
    start: int = 0,
    state: tuple[int, int, int] | None = None,
) -> np.ndarray:
    """The lookup3 of ``rows[i, :length]`` for every row of a 2-D uint8 array (a uint32 array).

    With ``state`` (:func:`prefix_state` of the rows' common first ``start`` bytes, a multiple
    of 12), mixing starts at byte ``start``; the rows' bytes before it are not read.
    """
    n = rows.shape[0]
    out = np.empty(n, np.uint32)
    if n == 0:
        return out
    if length == 0:
        out[:] = 0xDEADBEEF
        return out
    if state is None:
        start = 0
        init = (0xDEADBEEF + length) & _MASK
        state = (init, init, init)
    assert start % 12 == 0 and 0 <= start < length, "a prefix ends on a block before the last"
    blocks = -(-(length - start) // 12)
    batch = min(n, _BATCH)
    data = np.zeros((batch, blocks * 12), np.uint8)
    kernel = _Kernel(batch)
    with np.errstate(over="ignore"):
        for s in range(0, n, batch):
            m = min(batch, n - s)
            data[:m, : length - start] = rows[s : s + m, start:length]
            # block-major: each word of a block is one contiguous array over the rows
            words = np.ascontiguousarray(
                data[:m].view("<u4").reshape(m, blocks, 3).transpose(1, 2, 0)
            )
            a = np.full(m, state[0], np.uint32)
            b = np.full(m, state[1], np.uint32)
            c = np.full(m, state[2], np.uint32)
            for j in range(blocks):
                a += words[j, 0]
                b += words[j, 1]
                c += words[j, 2]
                if j < blocks - 1:
                    kernel.mix(a, b, c)
                else:
                    kernel.final(a, b, c)
            out[s : s + m] = c
    return out


def lookup3_many(image: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """The lookup3 (initial value 0) of ``image[start:end]`` for every span, computed for all
    spans together (a uint32 array).

    Spans of similar lengths (within a factor of two) are hashed together: sorted by length,
    longest first, so the rows still mixing at any block are a leading slice and each lookup3
    round is a handful of numpy operations over all of them.
    """
    n = len(spans)
    out = np.empty(n, np.uint32)
    if n == 0:
        return out
    bounds = np.asarray(spans, np.int64).reshape(n, 2)
    blocks = (bounds[:, 1] - bounds[:, 0] + 11) // 12
    bucket = np.ceil(np.log2(np.maximum(blocks, 1))).astype(np.int64)
    for b in unique_ints(bucket)[0].tolist():
        rows = np.flatnonzero(bucket == b)
        out[rows] = _lookup3_spans(image, bounds[rows])
    return out


def _lookup3_spans(image: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """:func:`lookup3_many` of spans of any lengths, all mixed together."""
    n = len(spans)
    out = np.empty(n, np.uint32)
    if n == 0:
        return out
    bounds = np.asarray(spans, np.int64).reshape(n, 2)
    lengths = bounds[:, 1] - bounds[:, 0]
    order = np.argsort(-lengths, kind="stable")
    lens = lengths[order]
    starts = bounds[order, 0]
    blocks = max(1, int(-(-int(lens[0]) // 12)))
    data = np.zeros((n, blocks * 12), np.uint8)
    # Every span's bytes into its (zero-padded) row: one gather per run of equal lengths.
    flat = np.asarray(image, np.uint8).reshape(-1)
    runs = [0, *(np.flatnonzero(np.diff(lens)) + 1).tolist(), n]
    for lo, hi in itertools.pairwise(runs):
        size = int(lens[lo])
        if size:
            windows = np.lib.stride_tricks.sliding_window_view(flat, size)
            data[lo:hi, :size] = windows[starts[lo:hi]]
    words = np.ascontiguousarray(data.view("<u4").reshape(n, blocks, 3).transpose(1, 2, 0))
    kernel = _Kernel(n)
    a = ((0xDEADBEEF + lens) & _MASK).astype(np.uint32)
    b = a.copy()
    c = a.copy()
    with np.errstate(over="ignore"):
        for j in range(blocks):
            rest = lens - 12 * j
            mixing = int(np.count_nonzero(rest > 12))  # a leading slice: lens is descending
            last = int(np.count_nonzero(rest > 0))
            if mixing:
                x, y, z = a[:mixing], b[:mixing], c[:mixing]
                x += words[j, 0, :mixing]
                y += words[j, 1, :mixing]
                z += words[j, 2, :mixing]
                kernel.mix(x, y, z)
            if last > mixing:  # the rows whose last (zero-padded) block is block j
                sl = slice(mixing, last)
                x, y, z = a[sl], b[sl], c[sl]
                x += words[j, 0, sl]
                y += words[j, 1, sl]
                z += words[j, 2, sl]
                kernel.final(x, y, z)
            if last == 0:
                break
    out[order] = c
    return out
