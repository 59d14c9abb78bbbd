"""dtype names in flat-tensor formats: the names our parallel info records and parses back."""

from __future__ import annotations

from typing import Any

import numpy as np

from parallelvars._dtypes import EXTENSION_DTYPES, dtype_name, is_extension_dtype
from parallelvars.errors import UnsupportedDtypeError


def is_string_dtype(dtype: np.dtype) -> bool:
    """True for our string tensors (object arrays of ``bytes``)."""
    return np.dtype(dtype).kind == "O"


def is_ml_dtype(dtype: np.dtype) -> bool:
    """True for the ml_dtypes types (bfloat16, the float8 family, int4, ...)."""
    return is_extension_dtype(np.dtype(dtype))


def tensor_dtype_name(
    dtype: np.dtype, *, file: str | None = None, variable: str | None = None
) -> str:
    """The checkpoint name of ``dtype`` (``float32``, ``bfloat16``; ``bytes`` for strings), for
    tensor dtypes only: :func:`parallelvars._dtypes.dtype_name` after refusing records and
    other non-tensor dtypes with UnsupportedDtypeError naming ``file`` and ``variable``."""
    dtype = np.dtype(dtype)
    if not (
        is_string_dtype(dtype)
        or is_ml_dtype(dtype)
        or (dtype.kind in "biufc" and dtype.fields is None)
    ):
        raise UnsupportedDtypeError(
            "a variable's dtype is not a tensor dtype",
            file=file,
            variable=variable,
            expected="numbers, bool, an ml_dtypes type or object (bytes) strings",
            found=str(dtype),
        )
    return dtype_name(dtype)


# The dtypes of the names met (a file names a few, once per variable); bounded.
_NAMED: dict[str, np.dtype] = {}


def dtype_from_name(name: Any, *, file: str | None = None, variable: str | None = None) -> np.dtype:
    """The numpy dtype named ``name`` by :func:`tensor_dtype_name`; UnsupportedDtypeError otherwise."""
    if type(name) is str:
        known = _NAMED.get(name)
        if known is None:
            known = _dtype_from_name(name, file=file, variable=variable)
            if len(_NAMED) < 256:
                _NAMED[name] = known
        return known
    return _dtype_from_name(name, file=file, variable=variable)


def _dtype_from_name(name: Any, *, file: str | None, variable: str | None) -> np.dtype:
    if name == "bytes":
        return np.dtype(object)
    if isinstance(name, str) and name in EXTENSION_DTYPES:
        return EXTENSION_DTYPES[name]
    try:
        dtype = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biufc" or dtype.name != name:
        raise UnsupportedDtypeError(
            "unknown dtype",
            file=file,
            variable=variable,
            expected="a numpy or ml_dtypes dtype name",
            found=repr(name),
        )
    return dtype
