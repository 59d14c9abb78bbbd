"""The native layout's constants: format version, metadata paths, the documented kinds and
aggregations, limits, variable-path validation and the storage dtype of each numpy dtype.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import h5py
import numpy as np

from parallelvars._dtypes import is_extension_dtype
from parallelvars._spans import BULK_GAP
from parallelvars.checkpoint import entry as _entry
from parallelvars.checkpoint._h5policy import H5_ERRORS, MAX_COMPRESSION
from parallelvars.checkpoint._h5policy import HDF5_SIGNATURE as HDF5_SIGNATURE
from parallelvars.errors import InvalidEntryError

FORMAT_VERSION = 1
META_GROUP = "_parallelvars"
GRAPH_DATASET = f"{META_GROUP}/object_graph"
# Per-variable attributes and checksums in one JSON document, so opening a file costs one read
# instead of one HDF5 attribute call per attribute.
INDEX_DATASET = f"{META_GROUP}/index"
# The index again, column by column (see docs/FORMAT.md): what a reader that knows it reads at
# open instead of the index. ``COLUMNS_ROW_ATTRS``: the attributes our writer keeps per row
# (they differ between most variables); every other attribute is part of a row's layout.
COLUMNS_DATASET = f"{META_GROUP}/columns"
COLUMNS_VERSION = 1
COLUMNS_ROW_ATTRS = ("name", "slot_of")
DOCUMENTS_ATTR = "parallelvars_documents"
# The documented variable kinds and on-read aggregations: the entry model's.
KINDS = _entry.KINDS
AGGREGATIONS = _entry.AGGREGATIONS
_MAX_COMPONENTS = _entry.MAX_COMPONENTS
# H5Reader.stage: when a restore has at least STAGE_MIN_COMPONENTS components under
# STAGE_COMPONENT bytes, they are read ahead in spans, neighbours under STAGE_GAP apart in one
# read, at most STAGE_LIMIT bytes in all.
STAGE_COMPONENT = 64 << 10
STAGE_MIN_COMPONENTS = 512
STAGE_GAP = BULK_GAP  # (every bulk reader's gap: parallelvars._spans)
STAGE_LIMIT = 256 << 20
# The HDF5 constants every reader shares, under the names the h5io modules use.
_MAX_COMPRESSION = MAX_COMPRESSION
_H5_ERRORS = H5_ERRORS


def _library_version() -> str:
    from parallelvars._version import __version__

    return __version__


def _storage_dtype(dt: np.dtype) -> np.dtype:
    if dt.kind == "O":
        return h5py.vlen_dtype(bytes)
    if is_extension_dtype(dt):
        return h5py.opaque_dtype(np.dtype(f"V{dt.itemsize}"))
    return dt.newbyteorder("<") if dt.byteorder == ">" else dt


# Kept in the (checksummed) index only: the design's group attributes are the kind, dtype,
# shape, devices, aggregation and sharding; these three would only cost time per variable.
_INDEX_ONLY_ATTRS = frozenset({"name", "synchronization", "trainable"})


def _validate_path(path: str) -> None:
    # (no part empty or "."; said with string searches, as a save checks every path)
    if (
        not isinstance(path, str)
        or not path
        or path[0] == "/"
        or path[-1] == "/"
        or "//" in path
        or path == "."
        or path.startswith("./")
        or path.endswith("/.")
        or "/./" in path
        or path.partition("/")[0] == META_GROUP
    ):
        raise InvalidEntryError("invalid variable path for the HDF5 layout", variable=path)


def validate_paths(paths: Sequence[str]) -> None:
    """:func:`_validate_path` of each of ``paths``, said of all of them at once: the same
    string searches over their text joined by newlines (a path's first and last characters
    are those next to a newline), then path by path only where one finds something (or a path
    holds a newline itself, or is no string), to name the first invalid one."""
    try:
        text = "\n" + "\n".join(paths) + "\n"
    except TypeError:  # (a path that is no string: named below)
        text = ""
    if text.count("\n") == len(paths) + 1 and not any(
        mark in text
        for mark in (
            "\n\n",
            "\n/",
            "/\n",
            "//",
            "\n.\n",
            "\n./",
            "/.\n",
            "/./",
            f"\n{META_GROUP}/",
            f"\n{META_GROUP}\n",
        )
    ):
        return
    for path in paths:
        _validate_path(path)


def _file_size(file: str) -> int:
    try:
        return os.path.getsize(file)
    except OSError:
        return 0
