"""HDF5 attributes and JSON metadata documents: encoding on write, decoding on read."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import crc32c as _crc32c
import h5py
import numpy as np

from parallelvars._fileio import load_json
from parallelvars.checkpoint import _h5policy
from parallelvars.checkpoint.h5io.layout import _H5_ERRORS, _file_size
from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    TruncatedFileError,
)


def _root_attr_value(value: Any) -> Any:
    """Like :func:`_attr_value`, with strings as fixed-length UTF-8 bytes.

    The reader reads the root attributes on every open; fixed-length values live inside the
    (checksummed) root object header, while variable-length strings would send it to HDF5's
    global heap, which has no checksum and whose damage can make the C library loop. (Group
    attributes stay variable-length ``str`` for plain h5py users: the reader takes those
    values from the checksummed index instead.)
    """
    value = _attr_value(value)
    if isinstance(value, str) and not value.endswith("\x00"):
        return np.bytes_(value.encode("utf-8"))
    return value


def _attr_value(value: Any) -> Any:
    if isinstance(value, (bool, np.bool_)):
        return np.bool_(value)
    if isinstance(value, (int, np.integer)):
        return np.int64(value)
    if isinstance(value, (float, np.floating)):
        return np.float64(value)
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, str) for v in value):
            return (
                np.array(list(value), dtype=h5py.string_dtype()) if value else np.zeros(0, np.int64)
            )
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            return np.asarray(value, dtype=np.int64)
    if isinstance(value, np.ndarray) and value.dtype.kind in "iuf":
        return value
    return "json:" + json.dumps(value)


_PLAIN_ATTR_TYPES = (str, int, float, bool)


def attribute_problem(attrs: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """``(what, expected, found)`` for the first attribute of ``attrs`` an HDF5 file of ours
    cannot hold (a name that is not text, a value that is neither a number, text, a list of
    numbers or of text, a numeric array nor a JSON value), else None."""
    for name, value in attrs.items():
        if type(name) is not str:
            return (
                f"attribute name {name!r} is not text",
                "text attribute names",
                f"a name of type {type(name).__name__}",
            )
        if type(value) in _PLAIN_ATTR_TYPES:
            continue
        if type(value) is list and all(
            type(v) is str for v in value
        ):  # (a list of text: always storable)
            continue
        try:
            _attr_value(value)
        except (TypeError, ValueError):
            return (
                f"attribute {name!r} cannot be stored",
                "a number, text, a list of numbers or of text, a numeric array or a JSON value",
                f"a value of type {type(value).__name__}",
            )
    return None


# (dtype or "str", shape) -> (file type, memory type, dataspace), made once.
_ATTR_TYPES: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}
# Prepared string values (kinds, dtype names, device lists recur on every variable).
_STRING_ATTRS: dict[Any, tuple[np.ndarray, tuple[Any, Any, Any]]] = {}


def _prepared(value: Any) -> tuple[np.ndarray, tuple[Any, Any, Any]]:
    """An attribute value as a contiguous array, with its HDF5 types and dataspace."""
    arr = (
        np.asarray(value, dtype=h5py.string_dtype())
        if isinstance(value, str) or (isinstance(value, np.ndarray) and value.dtype.kind == "O")
        else np.asarray(value)
    )
    if arr.dtype.kind == "U":
        arr = arr.astype(h5py.string_dtype())
    if not arr.flags.c_contiguous:  # (not np.ascontiguousarray: it makes scalars 1-d)
        arr = arr.copy()
    key = ("str" if arr.dtype.kind == "O" else arr.dtype.str, arr.shape)
    types = _ATTR_TYPES.get(key)
    if types is None:
        space = (
            h5py.h5s.create(h5py.h5s.SCALAR) if arr.ndim == 0 else h5py.h5s.create_simple(arr.shape)
        )
        # The file type is the logical one (variable-length UTF-8 for strings); the memory type
        # is what h5py converts from (Python objects for strings).
        types = _ATTR_TYPES[key] = (
            h5py.h5t.py_create(arr.dtype, logical=True),
            h5py.h5t.py_create(arr.dtype),
            space,
        )
    return arr, types


def _set_attr(oid: Any, name: str, value: Any) -> None:
    """Write one attribute through the low-level API.

    A checkpoint writes a few thousand attributes, so this skips what ``obj.attrs[name] = v``
    does each time: the HDF5 types and dataspace are made once per (dtype, shape) and reused,
    and recurring string values are converted once.
    """
    key: Any = None
    if isinstance(value, str):
        key = value
    elif isinstance(value, np.ndarray) and value.dtype.kind == "O" and value.ndim == 1:
        key = tuple(value)
    if key is not None:
        prepared = _STRING_ATTRS.get(key)
        if prepared is None:
            prepared = _prepared(value)
            if len(_STRING_ATTRS) < 1024:
                _STRING_ATTRS[key] = prepared
    else:
        prepared = _prepared(value)
    arr, (ftype, mtype, space) = prepared
    bname = name.encode()
    try:
        attr = h5py.h5a.create(oid, bname, ftype, space)
    except _H5_ERRORS:  # it exists already: replace it
        h5py.h5a.delete(oid, bname)
        attr = h5py.h5a.create(oid, bname, ftype, space)
    if arr.size:
        attr.write(arr, mtype=mtype)


def _write_json(
    f: h5py.File,
    name: str,
    value: Any = None,
    *,
    text: str | None = None,
    capacity: int = 0,
    crc_value: Any = None,
) -> tuple[h5py.Dataset, int]:
    """A JSON document as a fixed-length string dataset with its own CRC-32C.

    Fixed length keeps the bytes out of HDF5's unchecksummed global heap; the checksum covers
    the document itself (with its padding: spaces, which JSON ignores), which HDF5 does not.
    Returns the dataset and the checksum (the attribute holds ``crc_value`` when given).
    """
    raw = (json.dumps(value) if text is None else text).encode("utf-8").ljust(capacity, b" ")
    ds = f.create_dataset(name, data=np.bytes_(raw), track_times=False)
    crc = int(_crc32c.crc32c(raw))
    ds.attrs["crc32c"] = np.int64(crc if crc_value is None else crc_value)
    return ds, crc


def _read_json(
    f: h5py.File,
    name: str,
    file: str,
    *,
    required: bool = False,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """Read a document written by :func:`_write_json` (or an older variable-length one);
    ``object_pairs_hook`` as :func:`json.loads` takes it."""
    dsid = _h5policy.open_dataset(f.id, f"/{name}", file)
    if dsid is None:
        if required:
            raise CorruptCheckpointError(
                "a metadata document is missing or unreadable",
                file=file,
                variable=name,
                expected="the document the root attribute lists",
                found="no such dataset",
            )
        return None
    ds = h5py.Dataset(dsid)
    _check_document(ds, file, name)
    raw = ds[()]
    raw = bytes(raw) if isinstance(raw, bytes) else str(raw).encode("utf-8")
    stored = ds.attrs.get("crc32c")
    if stored is not None and int(stored) != _crc32c.crc32c(raw):
        raise ChecksumMismatchError(
            "checksum mismatch: a metadata document is damaged",
            file=file,
            variable=name,
            expected=f"crc32c {int(stored):#010x}",
            found=f"crc32c {_crc32c.crc32c(raw):#010x}",
        )
    return load_json(
        raw,
        file=file,
        variable=name,
        what="metadata document",
        object_pairs_hook=object_pairs_hook,
    )


def _check_document(ds: h5py.Dataset, file: str, name: str) -> None:
    """Refuse a metadata document of a type or size we never write, before reading it."""
    dt, shape = ds.dtype, ds.shape
    vlen = h5py.check_string_dtype(dt) is not None and h5py.check_string_dtype(dt).length is None
    if shape != () or not (vlen or dt.kind == "S"):
        raise CorruptCheckpointError(
            "a metadata document has the wrong type",
            file=file,
            variable=name,
            expected="a scalar string",
            found=f"{dt} of shape {shape}",
        )
    if dt.itemsize > _file_size(file) and not vlen:
        raise TruncatedFileError(
            "a metadata document claims more bytes than the file holds",
            file=file,
            variable=name,
            expected=f"<= {_file_size(file)} bytes",
            found=f"{dt.itemsize} bytes",
        )


def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str) and value.startswith("json:"):
        try:
            return json.loads(value[5:])
        except (ValueError, RecursionError):
            return value
    if isinstance(value, np.ndarray):
        if value.dtype.kind in ("O", "S", "U"):
            return [_decode(v) for v in value.tolist()]
        return value.tolist()
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value
