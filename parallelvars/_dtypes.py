"""dtype helpers: names as stored in checkpoints, and the ml_dtypes extension types."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from parallelvars.errors import UnsupportedDtypeError

__all__ = ["as_dtype", "dtype_name", "is_extension_dtype", "EXTENSION_DTYPES"]

# Types numpy itself lacks; ml_dtypes provides them as real numpy dtypes.
EXTENSION_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(getattr(ml_dtypes, name))
    for name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e4m3b11fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e4m3",
        "float8_e3m4",
        "float8_e8m0fnu",
        "float4_e2m1fn",
        "float6_e2m3fn",
        "float6_e3m2fn",
        "int2",
        "int4",
        "uint2",
        "uint4",
    )
    if hasattr(ml_dtypes, name)
}
_BY_TYPE = {dt: name for name, dt in EXTENSION_DTYPES.items()}


def is_extension_dtype(dtype: np.dtype) -> bool:
    """True for dtypes that come from ml_dtypes (bfloat16, float8, int4 ...)."""
    return np.dtype(dtype) in _BY_TYPE


def as_dtype(value: Any) -> np.dtype:
    """A numpy dtype from a dtype, a type or a name (``"bfloat16"`` and friends included)."""
    if isinstance(value, str) and value in EXTENSION_DTYPES:
        return EXTENSION_DTYPES[value]
    try:
        dt = np.dtype(value)
    except TypeError as exc:
        raise UnsupportedDtypeError(f"unknown dtype {value!r}") from exc
    return dt


# The names of the dtypes met (a checkpoint has a few, asked for once per variable); bounded.
_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype as stored in checkpoints (``"float32"``, ``"bfloat16"``)."""
    if type(dtype) is not str:  # (a name is looked up as the dtype it names)
        try:
            known = _NAMES.get(dtype)
        except TypeError:  # an unhashable dtype specification
            known = None
        if known is not None:
            return known
    dt = np.dtype(dtype)
    if dt in _BY_TYPE:
        name = _BY_TYPE[dt]
    elif dt.kind == "O":
        name = "bytes"
    else:
        name = dt.newbyteorder("=").name if dt.byteorder not in ("=", "|") else dt.name
    if isinstance(dtype, np.dtype) and len(_NAMES) < 256:
        _NAMES[dtype] = name
    return name
