"""JSON in metadata documents: values made JSON-safe, compact dumps, and the file metadata a
converter carries over.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data (numpy scalars and arrays, tuples and bytes converted)."""
    if isinstance(value, np.ndarray):
        return [jsonable(v) for v in value.tolist()] if value.ndim else jsonable(value.item())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# Root attributes of our HDF5 layout that describe that file (who wrote it, when), not the data:
# a converted file does not inherit them.
FILE_ATTRS = frozenset({"parallelvars_format", "parallelvars_version", "created"})


def carried_metadata(metadata: Mapping[str, Any] | None, *drop: str) -> dict[str, Any]:
    """The file metadata a writer carries over: ``metadata`` without :data:`FILE_ATTRS`
    and without the keys in ``drop``."""
    return {
        str(k): v for k, v in dict(metadata or {}).items() if k not in FILE_ATTRS and k not in drop
    }


def dumps(doc: Any) -> str:
    """Compact JSON for metadata documents."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
