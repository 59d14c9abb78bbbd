"""TensorFlow ``DataType`` numbers and their numpy (and ml_dtypes) counterparts.

Quantized types (``DT_QINT8`` ...) read as their storage integer type; the TensorFlow type is
kept by the reader in ``attrs["tf_dtype"]`` so a writer can put it back. The 4- and 2-bit types
and ``float4_e2m1fn`` are stored one element per byte, as TensorFlow holds them in memory (and
as ml_dtypes does). ``DT_RESOURCE`` and ``DT_VARIANT`` hold graph handles and serialized C++
objects that only TensorFlow can interpret; they are refused.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "DT_STRING",
    "DT_NAMES",
    "numpy_dtype",
    "tf_dtype",
    "tf_type_name",
    "byteswap_inplace",
]

DT_STRING = 7
DT_RESOURCE = 20
DT_VARIANT = 21

_OBJECT = np.dtype(object)

# number -> (TensorFlow name, numpy dtype or None when numpy cannot hold it)
_TABLE: dict[int, tuple[str, np.dtype | None]] = {
    1: ("DT_FLOAT", np.dtype(np.float32)),
    2: ("DT_DOUBLE", np.dtype(np.float64)),
    3: ("DT_INT32", np.dtype(np.int32)),
    4: ("DT_UINT8", np.dtype(np.uint8)),
    5: ("DT_INT16", np.dtype(np.int16)),
    6: ("DT_INT8", np.dtype(np.int8)),
    7: ("DT_STRING", _OBJECT),
    8: ("DT_COMPLEX64", np.dtype(np.complex64)),
    9: ("DT_INT64", np.dtype(np.int64)),
    10: ("DT_BOOL", np.dtype(np.bool_)),
    11: ("DT_QINT8", np.dtype(np.int8)),
    12: ("DT_QUINT8", np.dtype(np.uint8)),
    13: ("DT_QINT32", np.dtype(np.int32)),
    14: ("DT_BFLOAT16", np.dtype(ml_dtypes.bfloat16)),
    15: ("DT_QINT16", np.dtype(np.int16)),
    16: ("DT_QUINT16", np.dtype(np.uint16)),
    17: ("DT_UINT16", np.dtype(np.uint16)),
    18: ("DT_COMPLEX128", np.dtype(np.complex128)),
    19: ("DT_HALF", np.dtype(np.float16)),
    20: ("DT_RESOURCE", None),
    21: ("DT_VARIANT", None),
    22: ("DT_UINT32", np.dtype(np.uint32)),
    23: ("DT_UINT64", np.dtype(np.uint64)),
    24: ("DT_FLOAT8_E5M2", np.dtype(ml_dtypes.float8_e5m2)),
    25: ("DT_FLOAT8_E4M3FN", np.dtype(ml_dtypes.float8_e4m3fn)),
    26: ("DT_FLOAT8_E4M3FNUZ", np.dtype(ml_dtypes.float8_e4m3fnuz)),
    27: ("DT_FLOAT8_E4M3B11FNUZ", np.dtype(ml_dtypes.float8_e4m3b11fnuz)),
    28: ("DT_FLOAT8_E5M2FNUZ", np.dtype(ml_dtypes.float8_e5m2fnuz)),
    29: ("DT_INT4", np.dtype(ml_dtypes.int4)),
    30: ("DT_UINT4", np.dtype(ml_dtypes.uint4)),
    31: ("DT_INT2", np.dtype(ml_dtypes.int2)),
    32: ("DT_UINT2", np.dtype(ml_dtypes.uint2)),
    33: ("DT_FLOAT4_E2M1FN", np.dtype(ml_dtypes.float4_e2m1fn)),
}

DT_NAMES: dict[int, str] = {num: name for num, (name, _) in _TABLE.items()}
_QUANTIZED = {11, 12, 13, 15, 16}
_BY_NAME = {name: num for num, name in DT_NAMES.items()}

# numpy dtype -> number, for the unambiguous (non-quantized) types
_FROM_NUMPY: dict[np.dtype, int] = {
    dt: num for num, (_, dt) in _TABLE.items() if dt is not None and num not in _QUANTIZED
}


def tf_type_name(num: int) -> str:
    """``"DT_FLOAT"`` for 1, ``"DataType(99)"`` for numbers TensorFlow does not define here."""
    return DT_NAMES.get(num, f"DataType({num})")


def numpy_dtype(num: int) -> np.dtype | None:
    """The numpy dtype that holds TensorFlow type ``num`` (object for strings), else None."""
    entry = _TABLE.get(num)
    return entry[1] if entry else None


def tf_dtype(dtype: np.dtype, hint: str | None = None) -> int | None:
    """The TensorFlow type number for a numpy dtype, or None when TensorFlow has none.

    Args:
        dtype: a numpy dtype; byte order is ignored (data is written little-endian);
            object, bytes (``S``) and str (``U``) arrays become ``DT_STRING``.
        hint: a TensorFlow type name (``"DT_QINT8"``) used when it is stored as ``dtype``.
    """
    dtype = np.dtype(dtype)
    if hint is not None:
        num = _BY_NAME.get(hint)
        if num is not None and _TABLE[num][1] == _native(dtype):
            return num
    if dtype.kind in "OSU":
        return DT_STRING
    return _FROM_NUMPY.get(_native(dtype))


def _native(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("=") if dtype.byteorder == ">" or dtype.byteorder == "<" else dtype


def byteswap_inplace(flat: np.ndarray, dtype: np.dtype) -> None:
    """Swap the byte order of every element of ``flat`` (a 1-D uint8 view of ``dtype`` data)."""
    unit = dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize
    if unit > 1:
        flat.view(f"u{unit}").byteswap(inplace=True)
