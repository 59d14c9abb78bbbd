"""JSON in metadata documents: values made JSON-safe, compact dumps, and the file metadata a
converter carries over.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from parallelvars._dtypes import dtype_name

# Values that are JSON as they are (a float may be NaN or infinite: not one of them).
_LEAVES = frozenset({str, int, bool, type(None)})


def jsonable(value: Any) -> Any:
    """``value`` as plain, strict JSON data: the one converter of every metadata writer and of
    the CLI's ``--json``.

    Mappings become objects with string keys; lists, tuples and sets arrays; numpy arrays and
    scalars their Python values; a dtype its checkpoint name (``float32``, ``bfloat16``);
    ``bytes`` text (UTF-8, other bytes as ``\\xNN`` escapes, so the result always encodes);
    non-finite floats the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (strict JSON has no
    spelling for them); paths their text; anything else ``str(value)``.
    """
    t = type(value)
    if t is str or t is int or t is bool or value is None:  # the common leaves, at once
        return value
    if t is dict or t is list:  # (plain containers: no ABC check, text and ints kept as they are)
        if t is list:
            return [v if type(v) in _LEAVES else jsonable(v) for v in value]
        return {
            (k if type(k) is str else str(k)): (v if type(v) in _LEAVES else jsonable(v))
            for k, v in value.items()
        }
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="backslashreplace")
    if isinstance(value, np.dtype):
        return dtype_name(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
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
