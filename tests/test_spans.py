"""Coalesced reads (``parallelvars._spans.coalesce``): every range is found whole in the one
buffer its spans fill, a span never crosses files, and the gaps read stay bounded."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelvars.testing import coalesce

_RANGES = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 1 << 20), st.integers(0, 1 << 17)),
    max_size=40,
)

# Three files' bytes, each a function of its offset.
_FILES = [
    (np.arange(1 << 20 | 1 << 18, dtype=np.int64) * (7 + f) % 251).astype(np.uint8)
    for f in range(3)
]


@settings(max_examples=100, deadline=None)
@given(_RANGES)
def test_every_range_lies_whole_in_the_buffer_its_spans_fill(ranges) -> None:
    # Three "files" whose bytes are a function of (file, offset): the buffer filled span by
    # span must hold each range's own bytes where ``at`` says.
    keys = np.array([r[0] for r in ranges], np.int64)
    offsets = np.array([r[1] for r in ranges], np.int64)
    sizes = np.array([r[2] for r in ranges], np.int64)
    spans = coalesce(offsets, sizes, keys=keys)
    span_keys = np.full(spans.starts.size, -1, np.int64)
    span_keys[spans.span_of] = keys[spans.order]
    buf = np.zeros(spans.total, np.uint8)
    for key, start, n, base in zip(span_keys, spans.starts, spans.sizes, spans.bases, strict=True):
        buf[base : base + n] = _FILES[key][start : start + n]
    for j, k in enumerate(spans.order.tolist()):
        assert keys[k] == span_keys[spans.span_of[j]]  # (a span never crosses files)
        got = buf[spans.at[j] : spans.at[j] + sizes[k]]
        assert np.array_equal(got, _FILES[keys[k]][offsets[k] : offsets[k] + sizes[k]])
    assert spans.total <= max(2 * int(sizes.sum()) + (1 << 20), _gapless(keys, offsets, sizes))


def _gapless(keys, offsets, sizes) -> int:
    """The bytes of the spans merged without gaps: the union of each file's ranges."""
    total = 0
    for key in set(keys.tolist()):
        end = -1
        for start, stop in sorted(
            (int(o), int(o + n)) for o, n, k in zip(offsets, sizes, keys, strict=True) if k == key
        ):
            total += max(0, stop - max(start, end))
            end = max(end, stop)
    return total


def test_near_neighbours_share_a_read_and_far_ones_do_not() -> None:
    spans = coalesce(np.array([1000, 0, 1 << 30]), np.array([10, 100, 10]), gap=4096)
    assert spans.starts.tolist() == [0, 1 << 30]
    assert spans.sizes.tolist() == [1010, 10]
    assert spans.order.tolist() == [1, 0, 2]
    assert spans.at.tolist() == [0, 1000, 1010]
    # Gaps that would more than double what is read: no gaps at all.
    wide = coalesce(np.array([0, 60 << 10]), np.array([1 << 20, 1 << 20]), gap=64 << 10)
    assert wide.sizes.tolist() == [(60 << 10) + (1 << 20)]
    sparse = coalesce(np.arange(0, 64 * 50_000, 50_000), np.full(64, 8), gap=64 << 10)
    assert sparse.total == 64 * 8 and sparse.starts.size == 64
