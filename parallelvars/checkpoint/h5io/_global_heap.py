"""The global heap check verify runs before HDF5 reads a variable-length value: it lives in
:mod:`parallelvars.checkpoint.h5raw.global_heap` (the byte-level HDF5 layer) and is imported
from there under this module's name by the readers."""

from __future__ import annotations

from parallelvars.checkpoint.h5raw.global_heap import GlobalHeapCheck

__all__ = ["GlobalHeapCheck"]
