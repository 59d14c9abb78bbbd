"""Where the byte-level parsers read from, and what they raise.

Every parser of this package reads through a :class:`Source` (a file by descriptor, or bytes
in memory) whose reads are checked against its size before anything is read or allocated,
and refuses what it does not accept with :class:`Refused` (what, expected, found), which the
caller turns into a :class:`~parallelvars.errors.CorruptCheckpointError` naming the file and
the variable (:meth:`Refused.error`).
"""

from __future__ import annotations

import abc
import os
from typing import Any

import numpy as np

from parallelvars.errors import CorruptCheckpointError

__all__ = ["FileSource", "ImageSource", "Refused", "Source", "WindowSource"]


class Refused(Exception):
    """What a parser refuses, with what it expected and found."""

    def __init__(self, what: str, expected: Any = None, found: Any = None) -> None:
        super().__init__(what)
        self.what, self.expected, self.found = what, expected, found

    def error(self, prefix: str, file: str, variable: str | None) -> CorruptCheckpointError:
        """This refusal as the documented error, naming ``file`` and ``variable``."""
        return CorruptCheckpointError(
            f"{prefix}: {self.what}",
            file=file,
            variable=variable,
            expected=self.expected,
            found=self.found,
        )


class Source(abc.ABC):
    """Bytes ``[0, size)`` to parse; :meth:`read` refuses any range outside them."""

    size: int

    def read(self, offset: int, n: int, what: str) -> bytes:
        """Exactly ``n`` bytes at ``offset``; :class:`Refused` (naming ``what``) when they do
        not all lie inside the source."""
        if offset < 0 or n < 0 or offset + n > self.size:
            raise Refused(
                f"{what} lies outside the file",
                f"bytes {offset}..{offset + n} inside a file of {self.size} bytes",
                f"a file of {self.size} bytes",
            )
        data = self._read(offset, n)
        if len(data) != n:  # (a file cut since its size was taken)
            raise Refused(f"{what} lies outside the file", f"{n} bytes", f"{len(data)} bytes")
        return data

    def read_into(self, buf: memoryview, offset: int, what: str) -> None:
        """Fill ``buf`` with the bytes at ``offset``; :class:`Refused` as :meth:`read`."""
        buf[:] = self.read(offset, len(buf), what)

    def read_upto(self, offset: int, n: int, what: str) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at the end of the source)."""
        return self.read(offset, max(0, min(n, self.size - offset)), what)

    @abc.abstractmethod
    def _read(self, offset: int, n: int) -> bytes:
        """The bytes at ``offset`` (fewer at the end of the source)."""


class FileSource(Source):
    """An open file, read with ``pread`` (``size``: its size when it was opened)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    def _read(self, offset: int, n: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def read_into(self, buf: memoryview, offset: int, what: str) -> None:
        n = len(buf)
        if offset < 0 or offset + n > self.size:
            self.read(offset, n, what)  # (refused, naming what)
        done = 0
        while done < n:
            got = os.preadv(self.fd, [buf[done:]], offset + done)
            if got <= 0:
                raise Refused(f"{what} lies outside the file", f"{n} bytes", f"{done} bytes")
            done += got


class WindowSource(FileSource):
    """An open file read through one window of ``window`` bytes: reads of neighbouring
    structures (the object headers a walk reads in file order) cost one ``pread`` a window,
    and the memory held is one window, whatever the file's size."""

    def __init__(self, fd: int, size: int, window: int = 1 << 20) -> None:
        super().__init__(fd, size)
        self.window = window
        self._start = 0
        self._data = b""

    def _read(self, offset: int, n: int) -> bytes:
        at = offset - self._start
        if at >= 0 and at + n <= len(self._data):
            return self._data[at : at + n]
        if n >= self.window:
            return os.pread(self.fd, n, offset)
        self._start, self._data = offset, os.pread(self.fd, self.window, offset)
        return self._data[:n]


class ImageSource(Source):
    """Bytes in memory (a file's image)."""

    def __init__(self, image: bytes | bytearray | memoryview | np.ndarray) -> None:
        self.image: bytes | memoryview = (
            image if isinstance(image, bytes) else memoryview(image).cast("B")  # type: ignore[arg-type]
        )
        self.size = len(self.image)

    def _read(self, offset: int, n: int) -> bytes:
        return bytes(self.image[offset : offset + n])
