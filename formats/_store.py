"""Stored tensors of a flat-tensor file, read lazily: :class:`TensorStore`, the byte-offset
:class:`ByteStore`, exact reads into a buffer, and little-endian writes.
"""

from __future__ import annotations

import abc
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import IO, Any

import crc32c as _crc32c
import numpy as np

from parallelvars._spans import coalesce
from parallelvars.errors import (
    ChecksumMismatchError,
    TruncatedFileError,
    UnsupportedDtypeError,
)

# Reads of a strided slice go through a bounce buffer of at most this many bytes.
_BLOCK = 16 << 20


class TensorStore(abc.ABC):
    """Stored tensors of one file (or shard set): names, dtypes and shapes known, bytes lazy."""

    file: str

    @abc.abstractmethod
    def keys(self) -> Sequence[str]:
        """Stored tensor keys in file order."""

    @abc.abstractmethod
    def stored(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape the tensor ``key`` is stored with."""

    @abc.abstractmethod
    def read_into(
        self, key: str, out: np.ndarray, region: tuple[int, int, int] | None = None
    ) -> None:
        """Read tensor ``key`` (or the slice ``region = (axis, start, stop)``) into ``out``.

        ``out`` is C-contiguous with the stored dtype and the shape of what is read.
        """

    def read_objects(self, key: str, region: tuple[int, int, int] | None = None) -> np.ndarray:
        """Read a string tensor as an object array of ``bytes``."""
        raise UnsupportedDtypeError(
            "string tensors are not supported by this format", file=self.file, variable=key
        )

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release open files."""


def _region_shape(shape: tuple[int, ...], region: tuple[int, int, int] | None) -> tuple[int, ...]:
    if region is None:
        return shape
    axis, start, stop = region
    return (*shape[:axis], stop - start, *shape[axis + 1 :])


class ByteStore(TensorStore):
    """A store whose tensors are raw little-endian C-order bytes reached by ``_read_bytes``.

    A store that knows a checksum of a tensor's bytes (``_expected_crc``) has every read
    verified: a whole-tensor read checks the bytes it read; the first partial read of a tensor
    checks the whole tensor once, streamed through a bounded buffer.
    """

    @abc.abstractmethod
    def _read_bytes(self, key: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with bytes ``offset:offset + len(buf)`` of tensor ``key``'s data."""

    def _expected_crc(self, key: str) -> int | None:
        """The stored checksum of tensor ``key``'s bytes, or None when the file has none."""
        return None

    def _place(self, key: str) -> tuple[int, int] | None:
        """Where tensor ``key``'s bytes lie: ``(descriptor, file offset)`` of a store whose
        tensors are plain byte ranges of open files (None: read through ``_read_bytes``)."""
        return None

    def read_many(self, keys: Sequence[str], sizes: Sequence[int]) -> list[np.ndarray | None]:
        """The bytes of the tensors ``keys`` (``sizes[k]`` bytes each, as the store holds
        them), read together (:func:`parallelvars._spans.coalesce`: the ranges of each file in
        offset order, near neighbours in one ``pread``), each tensor checked against its stored checksum. An entry is None for a tensor the store
        does not place (:meth:`_place`), that the file does not hold whole, or whose bytes do
        not match their checksum: the caller reads that one through :meth:`read_into`, which
        names the damage. The arrays are read-only views of one buffer."""
        out: list[np.ndarray | None] = [None] * len(keys)
        places = self._places(keys)
        expected = self._expected_crcs(keys)
        fds = np.array([-1 if w is None else w[0] for w in places], np.int64)
        offsets = np.array([0 if w is None else w[1] for w in places], np.int64)
        crcs = np.array([-1 if c is None else c for c in expected], np.int64)
        # (CRC-32C from 0, the default, checked in bulk; a store of another checksum checks
        # each tensor through its own two methods)
        plain = (
            type(self)._crc_start is ByteStore._crc_start
            and type(self)._crc_update is ByteStore._crc_update
        )

        def check(k: int, data: np.ndarray) -> bool:
            return self._crc_update(data, self._crc_start(keys[k])) == expected[k]

        buf, at, ok = read_spans(
            fds, offsets, np.asarray(sizes, np.int64).reshape(-1), crcs, None if plain else check
        )
        for k, a, n in zip(
            np.flatnonzero(ok).tolist(),
            at[ok].tolist(),
            np.asarray(sizes)[ok].tolist(),
            strict=True,
        ):
            out[k] = buf[a : a + n]
        return out

    def _places(self, keys: Sequence[str]) -> list[tuple[int, int] | None]:
        """:meth:`_place` of each of ``keys`` (a store may answer for many at once)."""
        return list(map(self._place, keys))

    def _expected_crcs(self, keys: Sequence[str]) -> list[int | None]:
        """:meth:`_expected_crc` of each of ``keys`` (a store may answer for many at once)."""
        return list(map(self._expected_crc, keys))

    def _crc_start(self, key: str) -> int:
        """The checksum's running value before the tensor's first byte."""
        return 0

    def _crc_update(self, data: Any, crc: int) -> int:
        """The running checksum ``crc`` continued over ``data`` (CRC-32C by default)."""
        return int(_crc32c.crc32c(data, crc))

    def _crc_name(self) -> str:
        return "crc32c"

    def _verified_keys(self) -> set[str]:
        verified: set[str] | None = self.__dict__.get("_verified")
        if verified is None:
            verified = self.__dict__["_verified"] = set()
        return verified

    def _check_crc(self, key: str, crc: int) -> None:
        expected = self._expected_crc(key)
        if expected is not None and crc != expected:
            raise ChecksumMismatchError(
                "the tensor's bytes do not match their stored checksum",
                file=self.file,
                variable=key,
                expected=f"{self._crc_name()} {expected:#010x}",
                found=f"{self._crc_name()} {crc:#010x}",
                hint="the bytes or the checksum stored for them were damaged",
            )
        self._verified_keys().add(key)

    def verify(self, key: str) -> None:
        """Check tensor ``key``'s bytes against its stored checksum (once per store)."""
        if self._expected_crc(key) is None or key in self._verified_keys():
            return
        dtype, shape = self.stored(key)
        total = math.prod(shape) * dtype.itemsize
        bounce = np.empty(min(total, _BLOCK), np.uint8)
        crc = self._crc_start(key)
        for start in range(0, total, _BLOCK):
            block = bounce[: min(_BLOCK, total - start)]
            self._read_bytes(key, start, block.data)
            crc = self._crc_update(block, crc)
        self._check_crc(key, crc)

    def read_into(
        self, key: str, out: np.ndarray, region: tuple[int, int, int] | None = None
    ) -> None:
        dtype, shape = self.stored(key)
        flat = out.reshape(-1).view(np.uint8)
        if region is None or flat.size == 0:
            if region is None and self._expected_crc(key) is not None:
                if flat.size:
                    self._read_bytes(key, 0, flat.data)
                self._check_crc(key, self._crc_update(flat, self._crc_start(key)))
                return
            if flat.size:
                self._read_bytes(key, 0, flat.data)
            return
        self.verify(key)
        axis, start, stop = region
        outer = math.prod(shape[:axis])
        inner = math.prod(shape[axis + 1 :]) * dtype.itemsize
        run = (stop - start) * inner  # bytes of the slice in one outer row
        stride = shape[axis] * inner  # bytes of one outer row
        if outer == 1 or run == stride:
            self._read_bytes(key, start * inner, flat.data)
            return
        if run >= (64 << 10):  # long runs: read each straight into place
            for o in range(outer):
                self._read_bytes(
                    key, o * stride + start * inner, flat[o * run : (o + 1) * run].data
                )
            return
        rows = max(1, _BLOCK // stride)
        bounce = np.empty(min(rows, outer) * stride, np.uint8)
        for o0 in range(0, outer, rows):
            o1 = min(outer, o0 + rows)
            block = bounce[: (o1 - o0) * stride]
            self._read_bytes(key, o0 * stride, block.data)
            flat[o0 * run : o1 * run] = block.reshape(o1 - o0, stride)[
                :, start * inner : start * inner + run
            ].reshape(-1)


def read_spans(
    fds: np.ndarray,
    offsets: np.ndarray,
    sizes: np.ndarray,
    crcs: np.ndarray,
    check: Callable[[int, np.ndarray], bool] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read byte ranges of open files together: range ``k`` is ``sizes[k]`` bytes at
    ``offsets[k]`` of descriptor ``fds[k]`` (-1: none, not read), checked against its CRC-32C
    ``crcs[k]`` (-1: none) or, given ``check``, by ``check(k, bytes)`` where it has one.

    Each file's ranges are read in offset order, near neighbours in one ``pread``
    (:func:`parallelvars._spans.coalesce`), into one read-only buffer. Returns ``(buf, at,
    ok)``: range ``k``'s bytes are ``buf[at[k] : at[k] + sizes[k]]`` where ``ok[k]``; False
    where there is no descriptor, the file ends first or the bytes do not match their
    checksum (an empty range is ok when its CRC is none or 0, CRC-32C's value for no
    bytes)."""
    count = len(sizes)
    at = np.zeros(count, np.int64)
    ok = np.zeros(count, bool)
    placed = fds >= 0
    ok[placed & (sizes == 0) & ((crcs == -1) | (crcs == 0))] = True
    index = np.flatnonzero(placed & (sizes > 0))
    if not index.size:
        return np.empty(0, np.uint8), at, ok
    spans = coalesce(offsets[index], sizes[index], keys=fds[index])
    span_fds = np.empty(spans.starts.size, np.int64)
    span_fds[spans.span_of] = fds[index][spans.order]
    buf = np.empty(spans.total, np.uint8)
    view = memoryview(buf)  # type: ignore[arg-type]
    filled = np.empty(spans.starts.size, np.int64)  # where each span's bytes end in buf
    for s, (fd, start, size, base) in enumerate(
        zip(
            span_fds.tolist(),
            spans.starts.tolist(),
            spans.sizes.tolist(),
            spans.bases.tolist(),
            strict=True,
        )
    ):
        filled[s] = base + _pread_fully(fd, view[base : base + size], start)
    buf.flags.writeable = False
    ordered = index[spans.order]
    at[ordered] = spans.at
    whole = spans.at + sizes[ordered] <= filled[spans.span_of]  # (else the file ended first)
    crc32c = _crc32c.crc32c
    for k, pos, size, want in zip(
        ordered[whole].tolist(),
        spans.at[whole].tolist(),
        sizes[ordered][whole].tolist(),
        crcs[ordered][whole].tolist(),
        strict=True,
    ):
        if want >= 0:
            data = buf[pos : pos + size]
            if check is not None:
                if not check(k, data):
                    continue
            elif crc32c(data) != want:  # type: ignore[arg-type]
                continue
        ok[k] = True
    return buf, at, ok


def _pread_fully(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``fd`` at ``offset``; the bytes read (fewer: the file ended)."""
    done = 0
    while done < len(buf):
        try:
            n = os.preadv(fd, [buf[done:]], offset + done)
        except OSError:  # the ranges not filled come back as None, and their reader says why
            break
        if n <= 0:
            break
        done += n
    return done


def little_endian(array: np.ndarray) -> np.ndarray:
    """``array`` as C-ordered little-endian values of its shape (itself when it already is)."""
    a = array if array.flags.c_contiguous else np.array(array, order="C")
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not _LITTLE):
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


_LITTLE = np.little_endian


def read_exact_into(
    f: IO[bytes], lock: threading.Lock, offset: int, buf: memoryview, *, file: str, key: str
) -> None:
    """Fill ``buf`` from ``f`` at ``offset``; TruncatedFileError when the file ends early."""
    with lock:
        f.seek(offset)
        done = 0
        while done < len(buf):
            n = f.readinto(buf[done:])  # type: ignore[attr-defined]
            if not n:
                raise TruncatedFileError(
                    "the file ends inside the tensor's data",
                    file=file,
                    variable=key,
                    expected=f"{len(buf)} bytes at offset {offset}",
                    found=f"{done} bytes",
                )
            done += n
