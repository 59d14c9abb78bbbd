"""HDF5 helpers shared by the HDF5-based adapters: detection, opening with clear errors,
attribute decoding."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np

from parallelvars._fileio import open_input
from parallelvars.checkpoint._h5policy import H5_ERRORS, HDF5_SIGNATURE
from parallelvars.errors import (
    CorruptCheckpointError,
    NotACheckpointError,
    ParallelVarsError,
    TruncatedFileError,
)

__all__ = [
    "H5_ERRORS",
    "HDF5_SIGNATURE",
    "attr_to_python",
    "h5_errors",
    "is_hdf5",
    "open_h5",
    "read_split_attr",
]


@contextlib.contextmanager
def h5_errors(file: str, what: str, variable: str | None = None) -> Iterator[None]:
    """Raise h5py's errors inside the block as :class:`CorruptCheckpointError` (ours pass)."""
    try:
        yield
    except ParallelVarsError:
        raise
    except H5_ERRORS as exc:
        text = f"{type(exc).__name__}: {exc}"
        cls = (
            TruncatedFileError
            if "eof" in text.lower() or "truncated" in text.lower()
            else CorruptCheckpointError
        )
        raise cls(f"{what} ({text[:200]})", file=file, variable=variable) from None


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
    fd = open_input(path)  # a FIFO or a device would block or never end
    try:
        head = os.pread(fd, len(HDF5_SIGNATURE), 0)
    finally:
        os.close(fd)
    try:
        ok = bool(h5py.is_hdf5(path))
    except H5_ERRORS:
        ok = False
    if not ok:
        raise NotACheckpointError(
            "not an HDF5 file", file=path, expected=repr(HDF5_SIGNATURE), found=repr(head)
        )
    return _open(path)


def _open(path: str) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except H5_ERRORS as exc:
        text = str(exc)
        if "truncated" in text.lower() or "eof" in text.lower():
            raise TruncatedFileError(f"the HDF5 file is truncated ({text})", file=path) from None
        raise CorruptCheckpointError(f"h5py cannot open the file ({text})", file=path) from None


def attr_to_python(value: Any) -> Any:
    """An HDF5 attribute value as plain Python (strings decoded, arrays as lists)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    if isinstance(value, np.ndarray):
        return (
            [attr_to_python(v) for v in value.tolist()]
            if value.ndim
            else attr_to_python(value.item())
        )
    if isinstance(value, np.generic):
        return attr_to_python(value.item())
    if isinstance(value, (list, tuple)):
        return [attr_to_python(v) for v in value]
    return value


def read_split_attr(group: h5py.Group, name: str, file: str) -> list[str]:
    """Read a Keras list-of-names attribute that may be split into ``name0``, ``name1``, ...

    Keras splits an attribute bigger than the 64 KB HDF5 object-header limit into numbered
    parts; this concatenates them. Each is a layer's or weight's name: one that is not UTF-8
    text is refused (:class:`~parallelvars.errors.CorruptCheckpointError` naming ``file``), as
    every reader refuses such a name.
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
            if not v.isascii():
                try:
                    v.encode("utf-8")  # (attr_to_python kept undecodable bytes as surrogates)
                except UnicodeEncodeError:
                    raw = v.encode("utf-8", "surrogateescape")
                    raise CorruptCheckpointError(
                        f"a name in the attribute {name!r} is not UTF-8 text",
                        file=file,
                        variable=group.name,
                        found=repr(raw),
                        hint="names must be valid Unicode text in every format",
                    ) from None
            out.append(v)
    return out
