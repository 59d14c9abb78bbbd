"""Shard geometry: how one axis of ``length`` rows is split over ``n`` devices, in one place.

The split is ``numpy.array_split``'s: the first ``length % n`` shards get one row more (10 rows
over 4 devices: 3, 3, 2, 2). A layout is given by its start offsets along the axis; offsets are
valid when there is one per shard, the first is 0 and they never go back or past the end, so the
shards cover the axis exactly (empty shards allowed). Sharded variables, distributed batches,
the checkpoint reader and writer, every format and the re-split onto M devices use these.

Example:
    >>> shard_sizes(10, 4), shard_offsets(10, 4)
    ([3, 3, 2, 2], [0, 3, 6, 8])
    >>> shard_shapes((10, 2), 0, [0, 3, 6, 8])
    [(3, 2), (3, 2), (2, 2), (2, 2)]
    >>> list(overlapping_shards([0, 5], 10, 3, 7))
    [(0, 3, 5), (1, 5, 7)]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

__all__ = [
    "offsets_problem",
    "overlapping_shards",
    "shard_bounds",
    "shard_index",
    "shard_offsets",
    "shard_shapes",
    "shard_sizes",
    "shard_slices",
]


def shard_sizes(length: int, n: int) -> list[int]:
    """Sizes of ``n`` shards of ``length`` rows, as ``numpy.array_split`` makes them.

    >>> shard_sizes(10, 4)
    [3, 3, 2, 2]
    """
    q, r = divmod(int(length), int(n))
    return [q + 1] * r + [q] * (int(n) - r)


def shard_offsets(length: int, n: int) -> list[int]:
    """Start offsets of the ``n`` shards of :func:`shard_sizes` (``[0, 3, 6, 8]`` for 10 over 4)."""
    return [0, *itertools.accumulate(shard_sizes(length, n))][:-1]


def shard_bounds(offsets: Sequence[int], length: int) -> list[int]:
    """``offsets`` followed by ``length``: shard ``i`` is rows ``bounds[i]:bounds[i + 1]``."""
    return [*(int(o) for o in offsets), int(length)]


def offsets_problem(offsets: Sequence[int], length: int, n: int) -> str | None:
    """What is wrong with ``offsets`` as the layout of ``n`` shards of an axis of ``length``
    rows (the expected form, for an error message), or None when they cover it exactly."""
    if len(offsets) != n:
        return f"{n} offsets, one per shard"
    bounds = shard_bounds(offsets, length)
    if n and (bounds[0] != 0 or any(b < a for a, b in itertools.pairwise(bounds))):
        return f"{n} non-decreasing offsets from 0 within the {length} rows"
    return None


def shard_index(ndim: int, axis: int, start: int, stop: int) -> tuple[slice, ...]:
    """The index of rows ``start:stop`` along ``axis`` of an ``ndim``-d array."""
    index = [slice(None)] * ndim
    index[axis] = slice(int(start), int(stop))
    return tuple(index)


def shard_shapes(shape: Sequence[int], axis: int, offsets: Sequence[int]) -> list[tuple[int, ...]]:
    """The shape of each shard of a value of ``shape`` split at ``offsets`` along ``axis``."""
    bounds = shard_bounds(offsets, shape[axis])
    out = []
    for lo, hi in itertools.pairwise(bounds):
        s = [int(d) for d in shape]
        s[axis] = hi - lo
        out.append(tuple(s))
    return out


def shard_slices(
    shape: Sequence[int], axis: int, offsets: Sequence[int]
) -> list[tuple[slice, ...]]:
    """The index of each shard within the full value (see :func:`shard_index`)."""
    bounds = shard_bounds(offsets, shape[axis])
    return [shard_index(len(shape), axis, lo, hi) for lo, hi in itertools.pairwise(bounds)]


def overlapping_shards(
    offsets: Sequence[int], length: int, lo: int, hi: int
) -> Iterator[tuple[int, int, int]]:
    """``(j, a, b)`` for each shard ``j`` of the layout ``offsets`` that holds rows of
    ``lo:hi``: rows ``a:b`` of the axis are in it (re-splitting onto another layout)."""
    bounds = shard_bounds(offsets, length)
    for j, (start, stop) in enumerate(itertools.pairwise(bounds)):
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            yield j, a, b
