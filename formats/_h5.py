"""HDF5 helpers shared by the HDF5-based adapters: detection, opening with clear errors,
attribute decoding."""

from __future__ import annotations

import os
from typing import Any

import h5py
import numpy as np

from parallelvars.errors import CorruptCheckpointError, NotACheckpointError, TruncatedFileError

__all__ = ["HDF5_SIGNATURE", "attr_to_python", "is_hdf5", "open_h5", "read_split_attr"]

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def is_hdf5(path: str, head: bytes) -> bool:
    """True when ``path`` is an HDF5 file (signature at 0, or after a user block)."""
    if os.path.isdir(path):
        return False
    if head.startswith(HDF5_SIGNATURE):
        return True
    if len(head) < 512:
        return False
    try:
        return bool(h5py.is_hdf5(path))
    except OSError:
        return False


def open_h5(path: str) -> h5py.File:
    """Open ``path`` read-only, turning h5py's errors into ours (naming the file)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    try:
        ok = bool(h5py.is_hdf5(path))
    except OSError:
        ok = False
    if not ok:
        with open(path, "rb") as f:
            head = f.read(len(HDF5_SIGNATURE))
        raise NotACheckpointError("not an HDF5 file", file=path, expected=repr(HDF5_SIGNATURE),
                                  found=repr(head))
    return _open(path)


def _open(path: str) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        text = str(exc)
        if "truncated" in text.lower() or "eof" in text.lower():
            raise TruncatedFileError(f"the HDF5 file is truncated ({text})", file=path) from None
        raise CorruptCheckpointError(f"h5py cannot open the file ({text})", file=path) from None


def attr_to_python(value: Any) -> Any:
    """An HDF5 attribute value as plain Python (strings decoded, arrays as lists)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    if isinstance(value, np.ndarray):
        return [attr_to_python(v) for v in value.tolist()] if value.ndim else attr_to_python(value.item())
    if isinstance(value, np.generic):
        return attr_to_python(value.item())
    if isinstance(value, (list, tuple)):
        return [attr_to_python(v) for v in value]
    return value


def read_split_attr(group: h5py.Group, name: str) -> list[str]:
    """Read a Keras string-list attribute that may be split into ``name0``, ``name1``, ...

    Keras splits an attribute bigger than the 64 KB HDF5 object-header limit into numbered
    parts; this concatenates them.
    """
    if name in group.attrs:
        parts = [group.attrs[name]]
    else:
        parts = []
        i = 0
        while f"{name}{i}" in group.attrs:
            parts.append(group.attrs[f"{name}{i}"])
            i += 1
    out: list[str] = []
    for part in parts:
        values = attr_to_python(part)
        if isinstance(values, str):
            values = [values]
        for v in values:
            if not isinstance(v, str):  # an empty list is stored as an empty float64 array
                continue
            out.append(v)
    return out
