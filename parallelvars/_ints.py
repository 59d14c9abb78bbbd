"""Integer checks on decoded values (JSON documents, HDF5 attributes, npz headers), and the
distinct values of an integer array."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["is_int", "is_index", "unique_ints"]


def is_int(value: Any) -> bool:
    """True for a Python or numpy integer; ``bool`` and ``numpy.bool_`` are not integers here."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_index(value: Any) -> bool:
    """True for an integer (by :func:`is_int`) that is ``>= 0``: a size, an offset, an index."""
    return is_int(value) and value >= 0


def unique_ints(a: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(a, return_inverse=True, return_counts=True)`` of a 1-D integer array (the
    same three arrays: the sorted distinct values, each element's place among them, each
    value's count), from one stable sort. ``np.unique`` imports ``numpy.ma`` on its first
    call, tens of milliseconds that a command would pay once per process."""
    a = np.asarray(a).reshape(-1)
    n = a.shape[0]
    order = np.argsort(a, kind="stable")
    ranked = a[order]
    head = np.empty(n, bool)
    head[:1] = True
    np.not_equal(ranked[1:], ranked[:-1], out=head[1:])
    first = np.flatnonzero(head)
    inverse = np.empty(n, np.intp)
    inverse[order] = np.cumsum(head) - 1
    return ranked[first], inverse, np.diff(first, append=n)
