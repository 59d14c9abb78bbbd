"""Writing helpers shared by both Keras layouts: dtypes Keras can hold, datasets with their
checksums, fixed-length string attributes, carried metadata and the parallel info.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import h5py
import numpy as np

from parallelvars._fileio import Scratch, checksum
from parallelvars.checkpoint.entry import naming_file
from parallelvars.errors import (
    UnsupportedDtypeError,
)
from parallelvars.formats._dtypes import is_ml_dtype, is_string_dtype, tensor_dtype_name
from parallelvars.formats._json import carried_metadata, dumps, jsonable
from parallelvars.formats._plan import PlannedTensor
from parallelvars.formats.keras._integrity import _structure_crc
from parallelvars.formats.keras._layout import CRC_ATTR, INFO_ATTR, STRUCTURE_ATTR
from parallelvars.formats.keras._read import _info
from parallelvars.formats.keras._store import _H5Store

# Keras splits string-list attributes above the HDF5 object header limit.
_HEADER_LIMIT = 64512


def _seal(h5: h5py.File, tmp: str, scan: Any) -> None:
    """Store the structure checksum of the file being written (read back as the reader will)."""
    datasets, layout = scan(h5, tmp)
    store = _H5Store(tmp, h5, datasets)
    h5.attrs[STRUCTURE_ATTR] = np.int64(_structure_crc(store, layout, _info(h5, tmp)))


def _to_h5(array: np.ndarray, file: str, variable: str) -> np.ndarray:
    if is_string_dtype(array.dtype):
        raise UnsupportedDtypeError(
            "Keras weight files cannot hold string tensors",
            file=file,
            variable=variable,
            expected="a numeric dtype",
            found="bytes",
        )
    if is_ml_dtype(array.dtype):
        return array.view(f"V{array.dtype.itemsize}")  # HDF5 OPAQUE, as Keras stores bfloat16
    return array


def _check_dtypes(planned: list[PlannedTensor], file: str) -> None:
    for t in planned:
        if is_string_dtype(t.dtype):
            raise UnsupportedDtypeError(
                "Keras weight files cannot hold string tensors",
                file=file,
                variable=t.entry.path,
                expected="a numeric dtype",
                found="bytes",
            )
        if t.dtype.kind not in "biufc" and not is_ml_dtype(t.dtype):
            raise UnsupportedDtypeError(
                "Keras weight files cannot hold this dtype",
                file=file,
                variable=t.entry.path,
                expected="a numeric dtype",
                found=str(t.dtype),
            )


def _write_dataset(
    h5: h5py.File | h5py.Group, name: str, t: PlannedTensor, file: str, scratch: Scratch
) -> None:
    with naming_file(file):
        value = t.read_with(scratch)
    value = _to_h5(value, file, t.entry.path)
    ds = h5.create_dataset(name, data=value)
    if is_ml_dtype(t.dtype):
        # (a str: Keras compares it with "bfloat16")
        ds.attrs["dtype"] = tensor_dtype_name(t.dtype, file=file, variable=t.entry.path)
    ds.attrs[CRC_ATTR] = np.int64(checksum(value))


def _fixed_strings(values: str | list[str]) -> np.ndarray:
    """Strings as fixed-length UTF-8 bytes (``|S``), as Keras 2 writes its name lists.

    Variable-length strings would live in HDF5's global heap, which has no checksum and whose
    parser can loop forever on a damaged file; fixed-length values stay in the (checksummed)
    object header. Readers get the same strings back (:func:`._h5.attr_to_python`).
    """
    if isinstance(values, str):
        raw = values.encode("utf-8", "surrogateescape")
        return np.array(raw, dtype=f"S{max(1, len(raw))}")
    encoded = [v.encode("utf-8", "surrogateescape") for v in values]
    return np.array(encoded, dtype=f"S{max((len(b) for b in encoded), default=1) or 1}")


def _set_keras_attr(obj: h5py.Group | h5py.File, name: str, value: Any) -> None:
    """Set one attribute as Keras writes it: strings fixed-length UTF-8, an empty list as an
    empty float64 array, None not at all (the native layout's writer is h5io.attributes)."""
    if isinstance(value, list):
        if not value:
            obj.attrs[name] = np.zeros(0, np.float64)  # what Keras writes for an empty list
        elif all(isinstance(v, str) for v in value):
            obj.attrs[name] = _fixed_strings(value)
        else:
            obj.attrs[name] = np.asarray(value)
    elif value is None:
        return
    elif isinstance(value, str):
        obj.attrs[name] = _fixed_strings(value)
    else:
        obj.attrs[name] = value


def _set_name_list(obj: h5py.Group | h5py.File, name: str, values: list[str]) -> None:
    """Write a string-list attribute, split into ``name0``, ``name1``... as Keras does when
    the list would overflow the object header."""
    per_chunk = max(
        1,
        _HEADER_LIMIT // max((len(v.encode("utf-8", "surrogateescape")) for v in values), default=1)
        or 1,
    )
    if len(values) <= per_chunk:
        _set_keras_attr(obj, name, list(values))
        return
    for i in range(0, len(values), per_chunk):
        _set_keras_attr(obj, f"{name}{i // per_chunk}", list(values[i : i + per_chunk]))


def _user_metadata(metadata: Mapping[str, Any], own: str) -> dict[str, Any]:
    return jsonable(carried_metadata(metadata, own))


def _layout(metadata: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    raw = metadata.get(key)
    if raw is None:
        return None
    try:
        layout = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return None
    return layout if isinstance(layout, dict) else None


def _write_info(h5: h5py.File, info: dict[str, Any], user: dict[str, Any]) -> None:
    if info["variables"] or user:
        _set_keras_attr(h5, INFO_ATTR, dumps({**info, "checksums": "crc32c", "metadata": user}))
