"""Datasets of a Keras file as a lazy :class:`~parallelvars.formats._store.TensorStore`."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import h5py
import numpy as np

from parallelvars._fileio import checksum
from parallelvars.checkpoint import _h5policy
from parallelvars.errors import (
    ChecksumMismatchError,
    ClosedCheckpointError,
    TruncatedFileError,
    UnsupportedDtypeError,
)
from parallelvars.formats._h5 import (
    attr_to_python,
    h5_errors,
)
from parallelvars.formats._store import TensorStore
from parallelvars.formats.keras._integrity import _dataset_crc
from parallelvars.formats.keras._layout import _MAX_COMPRESSION


def _dataset_dtype(ds: h5py.Dataset, file: str, key: str) -> np.dtype:
    dt = ds.dtype
    if h5py.check_string_dtype(dt) is not None or h5py.check_vlen_dtype(dt) is not None:
        return np.dtype(object)
    if dt.kind == "V" and dt.fields is None:
        tag = attr_to_python(ds.attrs.get("dtype", ""))
        from parallelvars.formats._dtypes import dtype_from_name

        real = dtype_from_name(tag, file=file, variable=key) if tag else None
        if real is None or real.itemsize != dt.itemsize:
            raise UnsupportedDtypeError(
                "opaque dataset without a matching dtype attribute",
                file=file,
                variable=key,
                expected='attribute dtype="bfloat16"',
                found=f"{dt} with dtype={tag!r}",
            )
        return real
    if dt.kind not in "biufc" or dt.fields is not None:
        raise UnsupportedDtypeError(
            "unsupported HDF5 dataset type",
            file=file,
            variable=key,
            expected="a numeric dtype",
            found=str(dt),
        )
    return dt.newbyteorder("=")


class _H5Store(TensorStore):
    """Datasets of an open h5py file, addressed by our keys."""

    def __init__(self, file: str, h5: h5py.File, datasets: Mapping[str, h5py.Dataset]) -> None:
        self.file = file
        self._h5: h5py.File | None = h5
        self._ds = dict(datasets)
        self._meta = {
            k: (_dataset_dtype(d, file, k), tuple(int(s) for s in d.shape))
            for k, d in self._ds.items()
        }
        self.crcs: dict[str, int | None] = {
            k: _dataset_crc(d, file, k) for k, d in self._ds.items()
        }
        self._verified: set[str] = set()
        size = os.path.getsize(file)
        for k, d in self._ds.items():
            dtype, shape = self._meta[k]
            # No bytes from outside the file; variable-length strings contiguous and unfiltered
            # (their count bounded by the file's size).
            _h5policy.check_dataset(d.id, file, k, dtype=dtype if d.dtype.kind == "O" else None)
            # (the stored size: a fixed-length string's elements may be larger than an object)
            nbytes = math.prod(shape) * max(dtype.itemsize, d.dtype.itemsize)
            limit = size * (_MAX_COMPRESSION if d.chunks is not None else 1)
            if nbytes > limit:  # refused before anything is allocated for it
                raise TruncatedFileError(
                    "the dataset claims more bytes than the file holds",
                    file=file,
                    variable=k,
                    expected=f"<= {limit} bytes",
                    found=f"{nbytes} bytes",
                )

    def keys(self) -> list[str]:
        return list(self._ds)

    def stored(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        return self._meta[key]

    def _dataset(self, key: str) -> h5py.Dataset:
        if self._h5 is None:
            raise ClosedCheckpointError("the checkpoint view is closed", file=self.file)
        return self._ds[key]

    @staticmethod
    def _selection(region: tuple[int, int, int] | None) -> Any:
        if region is None:
            return ()
        axis, start, stop = region
        return (slice(None),) * axis + (slice(start, stop),)

    def read_into(
        self, key: str, out: np.ndarray, region: tuple[int, int, int] | None = None
    ) -> None:
        ds = self._dataset(key)
        with h5_errors(self.file, "h5py cannot read the dataset", key):
            if region is not None:
                self._verify(key)
            if out.size == 0:
                if region is None:
                    self._check(key, out)
                return
            target = out.view(ds.dtype) if ds.dtype.kind == "V" else out
            sel = self._selection(region)
            if ds.shape == ():
                target[()] = ds[()]
            else:
                ds.read_direct(target, source_sel=sel if sel else None)
            if region is None:
                self._check(key, out)

    def _check(self, key: str, value: np.ndarray) -> None:
        expected = self.crcs[key]
        if expected is not None and key not in self._verified:
            found = checksum(value)
            if found != expected:
                raise ChecksumMismatchError(
                    "the dataset's bytes do not match their crc32c attribute",
                    file=self.file,
                    variable=key,
                    expected=f"crc32c {expected:#010x}",
                    found=f"crc32c {found:#010x}",
                )
        self._verified.add(key)

    def _verify(self, key: str) -> None:
        """Check a whole dataset before the first partial read of it (once)."""
        if self.crcs[key] is None or key in self._verified:
            return
        dtype, shape = self._meta[key]
        whole = np.empty(shape, dtype)
        self.read_into(key, whole)

    def read_objects(self, key: str, region: tuple[int, int, int] | None = None) -> np.ndarray:
        ds = self._dataset(key)
        with h5_errors(self.file, "h5py cannot read the dataset", key):
            values = np.asarray(ds[self._selection(region)] if region else ds[()], dtype=object)
        out = np.empty(values.shape, object)
        for idx, v in np.ndenumerate(values):
            out[idx] = v.encode("utf-8") if isinstance(v, str) else bytes(v)
        return out

    def close(self) -> None:
        h5, self._h5 = self._h5, None
        if h5 is not None:
            with h5_errors(self.file, "h5py cannot close the file"):
                h5.close()
