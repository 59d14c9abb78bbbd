"""Zip archives: the one policy for every archive a reader opens or a writer copies from.

``.npz`` files, Keras ``.keras`` archives and the ``.keras`` templates a writer copies
(``like=``, ``--like``) are zip archives. A zip's central directory can lie: list one member's
bytes under many entries (one 64 MiB member inflated forty times from a 78 KB file), claim
sizes its compressed data cannot hold, name members twice, mark them encrypted or compressed
by methods we do not read. Before any member is read or copied, :func:`check_members` refuses,
with errors of :mod:`parallelvars.errors` naming the archive and the member:

* more than :data:`MAX_MEMBERS` members (:class:`~parallelvars.errors.LimitExceededError`);
* two members of the same name, or two whose bytes overlap (each member's local header and
  data must lie in the archive before the directory, apart from every other's);
* a member marked encrypted, or compressed otherwise than STORED or DEFLATED
  (:class:`~parallelvars.errors.NotACheckpointError`: nothing we can read);
* a STORED member whose two sizes differ, a DEFLATED member claiming more than
  :data:`MAX_DEFLATE_RATIO` bytes per compressed byte (deflate's own limit), so the bytes all
  members expand to are at most that ratio times the archive's size
  (:class:`~parallelvars.errors.LimitExceededError`).

:func:`copy_members` copies members under those checks, each read to its end so its CRC-32 is
checked; every error of :mod:`zipfile` and :mod:`zlib` (a bad CRC, a stream that ends early)
and every warning they would print are raised as ours.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import sys
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any

import numpy as np

from parallelvars._fileio import IOV_MAX, byte_view, pwritev_all
from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    LimitExceededError,
    NotACheckpointError,
    ParallelVarsError,
    TruncatedFileError,
)

__all__ = [
    "MAX_DEFLATE_RATIO",
    "MAX_MEMBERS",
    "StoredZipWriter",
    "ZIP_ERRORS",
    "check_members",
    "copy_members",
    "open_zip",
    "zip_errors",
]

#: Most members an archive may list (an npz of a model's tensors has one per tensor).
MAX_MEMBERS = 1_000_000
#: Most bytes a DEFLATED member may claim per compressed byte (deflate's own limit is 1032).
MAX_DEFLATE_RATIO = 1032
#: A DEFLATED member's slack over the ratio (the smallest streams' fixed overhead).
_DEFLATE_SLACK = 1024
_LOCAL_HEADER_SIZE = 30
_BLOCK = 1 << 20
#: What zipfile, zlib and the struct module raise on a damaged archive (mapped to our errors).
ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    zlib.error,
    OSError,
    EOFError,
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    struct.error,
    NotImplementedError,
    RuntimeError,
    OverflowError,
    UnicodeDecodeError,
    Warning,
)


@contextlib.contextmanager
def zip_errors(what: str, file: str, member: str | None = None) -> Iterator[None]:
    """Inside the block, zipfile's and zlib's errors and warnings are raised as ours: a bad
    CRC-32 as :class:`~parallelvars.errors.ChecksumMismatchError`, everything else as
    :class:`~parallelvars.errors.CorruptCheckpointError` naming ``file`` and ``member``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # zipfile's warnings (duplicate names) are errors
            yield
    except ParallelVarsError:
        raise
    except ZIP_ERRORS as exc:
        text = f"{type(exc).__name__}: {exc}"
        cls = ChecksumMismatchError if "CRC" in str(exc) else CorruptCheckpointError
        raise cls(f"{what} ({text[:200]})", file=file, variable=member) from None


def open_zip(f: IO[bytes], file: str, *, expected: str) -> zipfile.ZipFile:
    """The archive in the open file ``f`` (``file``: its name in errors; ``expected``: what it
    should have been, for the error when it is no zip at all)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return zipfile.ZipFile(f)
    except ZIP_ERRORS as exc:
        f.seek(0)
        head = f.read(4)
        if head == b"PK\x03\x04":  # a zip that lost its end: the central directory
            raise TruncatedFileError(
                f"the zip archive is truncated or damaged ({exc})",
                file=file,
                expected="a zip central directory at the end",
                found="none",
            ) from None
        raise NotACheckpointError(
            f"not a readable zip archive ({exc})",
            file=file,
            expected=expected,
            found=f"first bytes {head!r}",
        ) from None


def check_members(zf: zipfile.ZipFile, file: str, size: int) -> list[zipfile.ZipInfo]:
    """Every member of ``zf`` (the archive ``file`` of ``size`` bytes) in directory order,
    checked as the module says before any is read."""
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise LimitExceededError(
            "the archive lists too many members",
            file=file,
            expected=f"<= {MAX_MEMBERS} members",
            found=f"{len(infos)} members",
        )
    seen: set[str] = set()
    end = zf.start_dir  # members lie before the central directory
    for info in infos:
        name = info.filename
        if name in seen:
            raise CorruptCheckpointError("two members have the same name", file=file, variable=name)
        seen.add(name)
        if info.flag_bits & 0x1:
            raise NotACheckpointError(
                "the member is encrypted", file=file, variable=name, expected="no encryption"
            )
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise NotACheckpointError(
                "unsupported zip compression",
                file=file,
                variable=name,
                expected="STORED or DEFLATED",
                found=f"method {info.compress_type}",
            )
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise CorruptCheckpointError(
                "STORED member with differing sizes",
                file=file,
                variable=name,
                expected=f"{info.compress_size} bytes",
                found=f"{info.file_size} bytes",
            )
        limit = info.compress_size * MAX_DEFLATE_RATIO + _DEFLATE_SLACK
        if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > limit:
            # Deflate cannot expand beyond ~1032:1: a directory claiming more lies, and no
            # buffer is sized from it.
            raise LimitExceededError(
                "member claims more bytes than its compressed data can expand to",
                file=file,
                variable=name,
                expected=f"<= {limit} bytes",
                found=f"{info.file_size} bytes",
            )
        stop = info.header_offset + _LOCAL_HEADER_SIZE + info.compress_size
        if stop > min(end, size):
            raise TruncatedFileError(
                "the file ends inside a member",
                file=file,
                variable=name,
                expected=f">= {stop} bytes",
                found=f"{min(end, size)} bytes",
            )
    # Apart from each other: in file order, each member starts after the last one's bytes.
    ordered = sorted(infos, key=lambda i: i.header_offset)
    for before, info in itertools.pairwise(ordered):
        stop = before.header_offset + _LOCAL_HEADER_SIZE + before.compress_size
        if info.header_offset < stop:
            raise CorruptCheckpointError(
                "two members share bytes of the archive",
                file=file,
                variable=info.filename,
                expected=f"its bytes after those of {before.filename!r} (from offset {stop})",
                found=f"offset {info.header_offset}",
            )
    return infos


def copy_members(
    zin: zipfile.ZipFile,
    infos: Iterable[zipfile.ZipInfo],
    zout: zipfile.ZipFile,
    file: str,
    *,
    replace: Callable[[zipfile.ZipInfo], bool] = lambda info: False,
    replaced: Callable[[zipfile.ZipFile, zipfile.ZipInfo], None] | None = None,
) -> None:
    """Copy ``infos`` (checked by :func:`check_members`) from ``zin`` (the archive ``file``)
    into ``zout`` in their order, each read to its end (its CRC-32 checked) and written under
    a fresh entry with its name, time, compression and attributes; a member for which
    ``replace(info)`` holds is written by ``replaced(zout, info)`` instead."""
    for info in infos:
        if replace(info):
            assert replaced is not None
            replaced(zout, info)
            continue
        entry = zipfile.ZipInfo(info.filename, date_time=info.date_time)
        entry.compress_type = info.compress_type
        entry.external_attr = info.external_attr
        entry.create_system = info.create_system
        with zip_errors("cannot read the member", file, info.filename):
            src = zin.open(info)
        try:
            with zout.open(entry, "w", force_zip64=info.file_size >= 1 << 31) as dst:
                while True:
                    with zip_errors("cannot read the member", file, info.filename):
                        chunk = src.read(_BLOCK)  # the last read checks the CRC-32
                    if not chunk:
                        break
                    dst.write(chunk)  # (a failed write is the writer's error, not the file's)
        finally:
            src.close()


# The zip records a writer of STORED members makes (the layouts of APPNOTE.TXT 4.3, as
# :mod:`zipfile` packs them).
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_END = struct.Struct("<4s4H2LH")
_END64 = struct.Struct("<4sQ2H2L4Q")
_END64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EXTRA = struct.Struct("<HHQQ")
_ZIP64_LIMIT = (1 << 31) - 1  # (zipfile's: past it, sizes and offsets go to zip64 fields)
_COUNT_LIMIT = (1 << 16) - 1
_VERSION, _VERSION64 = 20, 45
_SYSTEM = 0 if sys.platform == "win32" else 3
_READ_WRITE = 0o600 << 16  # a member's permissions: rw-------
_FLUSH_BYTES = 8 << 20


class StoredZipWriter:
    """Writes a zip archive of STORED members into an open descriptor: each member's local
    header and data gathered with its neighbours' into large writes (``pwritev``), the central
    directory at :meth:`finish`.

    The bytes are those :mod:`zipfile` writes for the same members (``ZipFile.open(name, "w",
    force_zip64=...)``: local headers with a zip64 extra field when asked, zip64 fields and end
    records past its limits, dates, versions and permissions as it sets them); a member's
    CRC-32 is taken here, over the bytes written, with :func:`zlib.crc32` (what every zip
    reader checks). ``fd`` is written from offset 0 and owned by the caller.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.offset = 0  # where the next member's local header goes
        # (every member's directory record back to back, as written at the end: one buffer,
        # not an object per member)
        self._central = bytearray()
        self._count = 0
        self._pending: list[Any] = []
        self._pending_bytes = 0
        self._at = 0  # where the pending buffers go

    def add(
        self,
        name: str,
        pieces: Sequence[Any],
        *,
        zip64: bool = True,
        date_time: tuple[int, int, int, int, int, int] = (1980, 1, 1, 0, 0, 0),
    ) -> None:
        """Add the member ``name`` whose bytes are ``pieces`` (buffers, written in order; they
        must stay unchanged until the next :meth:`flush`)."""
        views = [_raw_bytes(p) for p in pieces]
        size = sum(v.nbytes for v in views)
        crc = 0
        for v in views:
            crc = zlib.crc32(v, crc)
        try:
            raw, flags = name.encode("ascii"), 0
        except UnicodeEncodeError:
            raw, flags = name.encode("utf-8"), 0x800
        zip64 = zip64 or size * 1.05 > _ZIP64_LIMIT
        big = size > _ZIP64_LIMIT
        dosdate = (date_time[0] - 1980) << 9 | date_time[1] << 5 | date_time[2]
        dostime = date_time[3] << 11 | date_time[4] << 5 | (date_time[5] // 2)
        # A local header with a zip64 field says so in its sizes and version (its real sizes
        # are in the field); the directory gives a member's sizes and place in zip64 fields
        # only past the limit, and the version the member's header needed.
        extra = _ZIP64_EXTRA.pack(1, 16, size, size) if zip64 else b""
        local_size = 0xFFFFFFFF if zip64 else size
        version = _VERSION64 if zip64 else _VERSION
        header = _LOCAL.pack(
            b"PK\x03\x04", version, 0, flags, 0, dostime, dosdate, crc, local_size, local_size,
            len(raw), len(extra),
        )  # fmt: skip
        fields = [size, size] if big else []
        if self.offset > _ZIP64_LIMIT:
            fields.append(self.offset)
        central_extra = b""
        if fields:
            central_extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields)
            version = _VERSION64
        shown = 0xFFFFFFFF if big else size
        self._count += 1
        self._central += (
            _CENTRAL.pack(
                b"PK\x01\x02", version, _SYSTEM, version, 0, flags, 0, dostime, dosdate, crc,
                shown, shown, len(raw), len(central_extra), 0, 0, 0, _READ_WRITE,
                min(self.offset, 0xFFFFFFFF),
            )
            + raw
            + central_extra
        )  # fmt: skip
        self._queue([header + raw + extra, *views])
        self.offset += len(header) + len(raw) + len(extra) + size

    def _queue(self, buffers: list[Any]) -> None:
        if len(self._pending) + len(buffers) > IOV_MAX:  # (one gathered write takes IOV_MAX)
            self.flush()
        for b in buffers:
            n = memoryview(b).nbytes
            if n:
                self._pending.append(b)
                self._pending_bytes += n
        if self._pending_bytes >= _FLUSH_BYTES or len(self._pending) >= IOV_MAX:
            self.flush()

    def flush(self) -> None:
        """Write what the added members left pending."""
        if self._pending:
            pwritev_all(self.fd, self._pending, self._at, self._pending_bytes)
            self._at += self._pending_bytes
        self._pending, self._pending_bytes = [], 0

    def finish(self) -> int:
        """Write the central directory and the end records; the archive's size."""
        self.flush()
        start = self.offset
        directory = self._central
        count, size = self._count, len(directory)
        tail = b""
        if count > _COUNT_LIMIT or start > _ZIP64_LIMIT or size > _ZIP64_LIMIT:
            tail += _END64.pack(
                b"PK\x06\x06", 44, _VERSION64, _VERSION64, 0, 0, count, count, size, start
            )
            tail += _END64_LOCATOR.pack(b"PK\x06\x07", 0, start + size, 1)
            count, size, start = min(count, 0xFFFF), min(size, 0xFFFFFFFF), min(start, 0xFFFFFFFF)
        tail += _END.pack(b"PK\x05\x06", 0, 0, count, count, size, start, 0)
        self._queue([directory, tail])
        self.flush()
        return self.offset + len(directory) + len(tail)


def _raw_bytes(piece: Any) -> memoryview:
    """A buffer's bytes as a flat byte view (an array of any dtype through its bytes: a
    bfloat16 array has no buffer format of its own)."""
    try:
        return memoryview(piece).cast("B")
    except (TypeError, ValueError, BufferError):  # (an extension dtype, or not C-contiguous)
        return memoryview(byte_view(np.ascontiguousarray(piece)))  # type: ignore[arg-type]
