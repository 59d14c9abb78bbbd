"""safetensors dtype strings and the numpy / ml_dtypes dtypes they map to, bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np

# safetensors dtype string -> (numpy dtype, bits)
_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "F32": np.dtype(np.float32),
    "C64": np.dtype(np.complex64),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):
    _DTYPES["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)
# Known to the reference implementation but packed below a byte: refused, with a clear error.
_SUB_BYTE = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
_NAME_OF = {dtype: name for name, dtype in _DTYPES.items()}


# The answers of _st_name by (dtype, scalar type): a writer asks once per tensor; bounded.
_ST_NAMES: dict[tuple[np.dtype, type], str | None] = {}


def _st_name(dtype: np.dtype) -> str | None:
    dtype = np.dtype(dtype)
    key = (dtype, dtype.type)
    if key in _ST_NAMES:
        return _ST_NAMES[key]
    found = None
    for candidate, name in _NAME_OF.items():
        if candidate == dtype and candidate.type is dtype.type:
            found = name
            break
    if len(_ST_NAMES) < 256:
        _ST_NAMES[key] = found
    return found
