"""Object headers made from templates, many rows at once.

Headers of one layout (a variable's group or a component's dataset: same messages, same
sizes) differ only in a few fixed-width fields (a shape, string references, link addresses,
dimensions, a data offset). A :class:`Template` is such a header encoded with every field
zero, where the fields lie (found by encoding it a second time with every field's bytes 0xFF:
:func:`runs`) and its chunks. :meth:`Template.rows` makes the headers of all the objects of
the layout as one ``(objects, bytes)`` array: the template repeated, the fields laid in
column-wise and every chunk's checksum computed for all rows together
(:func:`~.lookup3.lookup3_rows`, the chunk's bytes before its first field mixed once:
:func:`~.lookup3.prefix_state`). :func:`place` copies the rows to their addresses in the
file's metadata image.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from parallelvars.checkpoint.h5raw.lookup3 import lookup3_rows, prefix_state
from parallelvars.errors import InvalidArgumentError

__all__ = ["Template", "place", "place_rows", "runs"]

# The most headers made at once by :func:`place_rows` (their rows and the checksums'
# temporaries: bounded by the batch, not by the objects of a layout).
_BATCH_ROWS = 1 << 14


def runs(zeros: bytes, ones: bytes) -> list[tuple[int, int]]:
    """The (start, length) of every run of bytes that differ between two encodings."""
    a = np.frombuffer(zeros, np.uint8)
    b = np.frombuffer(ones, np.uint8)
    assert a.size == b.size
    diff = np.concatenate(([False], a != b, [False]))
    edges = np.flatnonzero(diff[1:] != diff[:-1])
    return [(int(s), int(e - s)) for s, e in zip(edges[0::2], edges[1::2], strict=True)]


@dataclass
class Template:
    """A header with its fields zero (``data``), its chunks ``(start, checksum offset)`` and
    its fields' runs ``(start, length)``, in the order the fields are given."""

    data: bytes
    chunks: list[tuple[int, int]]
    fields: list[tuple[int, int]]

    _states: list[tuple[int, tuple[int, int, int] | None]] | None = None

    def _prefixes(self) -> list[tuple[int, tuple[int, int, int] | None]]:
        """Per chunk: its bytes before its first field (whole blocks), every row's, and the
        lookup3 state after them (mixed once per template)."""
        if self._states is None:
            self._states = []
            for start, end in self.chunks:
                length = end - start
                first = min((s for s, _ in self.fields if start <= s < end), default=end) - start
                prefix = min(first, length - 1) // 12 * 12
                state = prefix_state(self.data[start : start + prefix], length) if prefix else None
                self._states.append((prefix if prefix else 0, state))
        return self._states

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def width(self) -> int:
        """The bytes of fields in one row."""
        return sum(n for _, n in self.fields)

    def rows(self, fields: np.ndarray) -> np.ndarray:
        """The headers with ``fields`` (a ``(rows, width)`` uint8 array, each row's fields
        in order) laid into the template, their chunks' checksums computed."""
        count = fields.shape[0]
        assert fields.shape == (count, self.width), (fields.shape, self.width)
        out = np.empty((count, self.size), np.uint8)
        out[:] = np.frombuffer(self.data, np.uint8)
        at = 0
        for start, length in self.fields:
            out[:, start : start + length] = fields[:, at : at + length]
            at += length
        for (start, end), (prefix, state) in zip(self.chunks, self._prefixes(), strict=True):
            prefix, state = _common_prefix(out[:, start:end], prefix, state)
            sums = lookup3_rows(out[:, start:end], end - start, start=prefix, state=state)
            out[:, end : end + 4] = sums.astype("<u4").view(np.uint8).reshape(count, 4)
        return out


def _common_prefix(
    chunk: np.ndarray, prefix: int, state: tuple[int, int, int] | None
) -> tuple[int, tuple[int, int, int] | None]:
    """The whole blocks every row of ``chunk`` (a header chunk of many rows, before its
    checksum) begins with, ``prefix`` bytes of them mixed already into ``state``: the rows'
    lookup3 state after them, mixed once (rows of one shape differ only from their data
    offsets on: the blocks before are the same in every row)."""
    count, length = chunk.shape
    if count < 2:
        return prefix, state
    rest = chunk[:, prefix:]
    differs = np.flatnonzero((rest[1:] != rest[0]).any(axis=0))
    same = prefix + (int(differs[0]) if differs.size else length - prefix)
    common = min(same, length - 1) // 12 * 12
    if common <= prefix:
        return prefix, state
    return common, prefix_state(chunk[0, :common].tobytes(), length)


def place(image: np.ndarray, addresses: np.ndarray, rows: np.ndarray) -> None:
    """Copy each row of ``rows`` to ``image`` at its address, one copy per run of rows whose
    addresses step by the same amount: rows laid one after another (the variables of a group,
    the components of the variables), and rows laid at a fixed stride with other headers
    between them (the slot variables of a variable after its slots' group).

    Raises:
        InvalidArgumentError: (a ``ValueError``) a row would lie outside ``image`` (before a byte is copied: the strided
            copy does not check its view's bounds itself).
    """
    count, size = rows.shape
    if count == 0:
        return
    if count == 1:
        a = int(addresses[0])
        _check_inside(image, a, a, size)
        image[a : a + size] = rows[0]
        return
    _check_inside(image, int(addresses.min()), int(addresses.max()), size)
    steps = np.diff(addresses)
    # runs of equal steps: rows p..q (steps[p:q] equal), the rows between runs in both
    bounds = [0, *(np.flatnonzero(steps[1:] != steps[:-1]) + 1).tolist(), count - 1]
    at = addresses.tolist()
    for p, q in itertools.pairwise(bounds):
        step = at[p + 1] - at[p]
        if step == size:
            image[at[p] : at[p] + (q + 1 - p) * size] = rows[p : q + 1].reshape(-1)
        elif step > size:
            view = np.lib.stride_tricks.as_strided(
                image[at[p] :], shape=(q + 1 - p, size), strides=(step, 1), writeable=True
            )
            view[:] = rows[p : q + 1]
        else:  # (not in increasing order: one row at a time)
            for r in range(p, q + 1):
                image[at[r] : at[r] + size] = rows[r]


def _check_inside(image: np.ndarray, lowest: int, highest: int, size: int) -> None:
    """Raise :class:`~parallelvars.errors.InvalidArgumentError` (a ``ValueError``) unless rows
    of ``size`` bytes at ``lowest`` .. ``highest`` lie inside ``image``."""
    if lowest < 0 or highest + size > image.size:
        raise InvalidArgumentError(
            f"rows of {size} bytes at addresses {lowest}..{highest} do not fit an image of "
            f"{image.size} bytes"
        )


def place_rows(
    image: np.ndarray, addresses: np.ndarray, template: Template, fields: np.ndarray
) -> None:
    """:func:`place` of ``template.rows(fields)``, :data:`_BATCH_ROWS` headers at a time."""
    count = fields.shape[0]
    for lo in range(0, count, _BATCH_ROWS):
        hi = min(count, lo + _BATCH_ROWS)
        place(image, addresses[lo:hi], template.rows(fields[lo:hi]))
