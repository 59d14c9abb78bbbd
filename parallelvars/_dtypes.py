"""dtype helpers: names as stored in checkpoints, and the ml_dtypes extension types."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ml_dtypes
import numpy as np

from parallelvars.errors import UnsupportedDtypeError

__all__ = [
    "as_dtype",
    "dtype_name",
    "is_extension_dtype",
    "is_float_dtype",
    "sum_dtype",
    "EXTENSION_DTYPES",
]

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
_FLOAT32 = np.dtype(np.float32)


def is_extension_dtype(dtype: np.dtype) -> bool:
    """True for dtypes that come from ml_dtypes (bfloat16, float8, int4 ...)."""
    return np.dtype(dtype) in _BY_TYPE


def is_float_dtype(dtype: Any) -> bool:
    """True for floating-point dtypes: numpy's and ml_dtypes' (bfloat16, the float8 types ...)."""
    dt = np.dtype(dtype)
    return dt.kind == "f" or _BY_TYPE.get(dt, "").startswith(("float", "bfloat"))


def sum_dtype(values: Iterable[Any]) -> np.dtype:
    """The dtype in which ``values`` (arrays or dtypes) of several dtypes are added together:
    numpy's common dtype (``np.result_type``), as ``add_n`` promotes them. Where numpy has none
    because of an ml_dtypes float (bfloat16 with float16, a float8 type with another float8
    type or with float16, bfloat16 with int64), that float counts as float32, which holds each
    of its values exactly: bfloat16 with float16 are added in float32, bfloat16 with int64 in
    float64. The sum is then rounded once to the variable's dtype, as any gradient of another
    dtype is.

    Raises:
        TypeError: numpy's ``DTypePromotionError``, for dtypes that have no common one even so
            (a datetime with a number, say).
    """
    items = list(values)
    try:
        return np.result_type(*items)
    except TypeError:
        dtypes = [v.dtype if hasattr(v, "dtype") else np.dtype(v) for v in items]
        return np.result_type(
            *(_FLOAT32 if d in _BY_TYPE and is_float_dtype(d) else d for d in dtypes)
        )


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
