"""Integer checks on decoded values (JSON documents, HDF5 attributes, npz headers)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["is_int", "is_index"]


def is_int(value: Any) -> bool:
    """True for a Python or numpy integer; ``bool`` and ``numpy.bool_`` are not integers here."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_index(value: Any) -> bool:
    """True for an integer (by :func:`is_int`) that is ``>= 0``: a size, an offset, an index."""
    return is_int(value) and value >= 0
