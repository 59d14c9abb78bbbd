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
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import IO

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
