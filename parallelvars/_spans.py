"""Coalesced reads: many byte ranges of a file read in a few large ``pread``s.

The one rule for every reader that takes many tensors at once (the native reader's bulk reads,
a flat-tensor store's ``read_many``): ranges sorted by offset, neighbours less than
:data:`BULK_GAP` apart read together (the gap bytes are read and dropped), and without gaps when
they would double what is read; at most :data:`BULK_BYTES` of tensor bytes held per batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

#: Neighbouring ranges less than this apart share one read (an HDF5 object header between two
#: datasets, a safetensors' alignment padding).
BULK_GAP = 64 << 10

#: The most tensor bytes a bulk read holds at once (a larger tensor is read alone).
BULK_BYTES = 32 << 20


def batches(items: Sequence[int], sizes: Sequence[int], limit: int) -> Iterator[list[int]]:
    """``items`` in runs of at most ``limit`` bytes (``sizes[item]`` each; a larger one alone)."""
    batch: list[int] = []
    total = 0
    for item in items:
        size = sizes[item]
        if batch and total + size > limit:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size
    if batch:
        yield batch


class Spans:
    """Where a set of ranges is read: ``order`` sorts the ranges by (``keys``, offset);
    ``starts``/``sizes`` are the spans' places in the file; ``bases`` where each span starts
    in one buffer of ``total`` bytes; ``at`` where each range (in sorted order) starts in it;
    ``span_of`` the span of each range (sorted order)."""

    __slots__ = ("at", "bases", "order", "sizes", "span_of", "starts", "total")

    def __init__(
        self,
        order: np.ndarray,
        starts: np.ndarray,
        sizes: np.ndarray,
        bases: np.ndarray,
        at: np.ndarray,
        span_of: np.ndarray,
    ) -> None:
        self.order, self.starts, self.sizes = order, starts, sizes
        self.bases, self.at, self.span_of = bases, at, span_of
        self.total = int(sizes.sum())


def coalesce(
    offsets: np.ndarray,
    nbytes: np.ndarray,
    keys: np.ndarray | None = None,
    gap: int = BULK_GAP,
    *,
    tight: bool = True,
) -> Spans:
    """The spans that read the ranges ``[offsets[k], offsets[k] + nbytes[k])`` (of the file
    ``keys[k]``, when several files are read: a span never crosses files).

    Overlapping or repeated ranges share their bytes. With ``tight``, the spans are at most
    twice the ranges' bytes plus 1 MiB (past that they are merged without gaps); without, every
    gap under ``gap`` is read (at most ``gap`` bytes per range).
    """
    offsets = np.asarray(offsets, np.int64)
    nbytes = np.asarray(nbytes, np.int64)
    order = (
        np.argsort(offsets, kind="stable")
        if keys is None
        else np.lexsort((offsets, np.asarray(keys, np.int64)))
    )
    starts, sizes = offsets[order], nbytes[order]
    n = starts.size
    if n == 0:
        empty = np.zeros(0, np.int64)
        return Spans(order, empty, empty, empty, empty, empty)
    if keys is None:
        ends = np.maximum.accumulate(starts + sizes)
        other = np.zeros(n - 1, bool)
    else:
        sorted_keys = np.asarray(keys, np.int64)[order]
        other = sorted_keys[1:] != sorted_keys[:-1]
        # The running end restarts with each file: shift each file's ends past the last one's.
        ends = starts + sizes
        heads = np.flatnonzero(np.concatenate(([True], other)))
        for a, b in zip(heads.tolist(), [*heads[1:].tolist(), n], strict=True):
            ends[a:b] = np.maximum.accumulate(ends[a:b])
    total = int(sizes.sum())
    for g in (gap, 0):
        new = np.empty(n, bool)
        new[:1] = True
        new[1:] = (starts[1:] - ends[:-1] > g) | other
        heads = np.flatnonzero(new)
        span_starts = starts[heads]
        span_ends = ends[np.append(heads[1:], n) - 1]
        spans = span_ends - span_starts
        if not tight or int(spans.sum()) <= 2 * total + (1 << 20):
            break
    bases = np.zeros(spans.size, np.int64)
    np.cumsum(spans[:-1], out=bases[1:])
    span_of = np.cumsum(new) - 1
    at = starts - span_starts[span_of] + bases[span_of]
    return Spans(order, span_starts, spans, bases, at, span_of)
