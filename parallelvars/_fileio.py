"""Writing array bytes to files: checksummed in one pass, with the disk started early.

Shared by the native checkpoint writer and the format writers, so every writer streams its
tensors the same way (see :class:`DataWriter`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import re
import secrets
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import crc32c as _crc32c
import numpy as np

from parallelvars._threads import submit_or_run, thread_count
from parallelvars.errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    ConcurrentWriteError,
    CorruptCheckpointError,
    ForeignReferenceError,
    LimitExceededError,
    NotACheckpointError,
    ParallelVarsError,
)

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "MEMCMP",
    "DataWriter",
    "Scratch",
    "atomic_path",
    "byte_view",
    "check_input",
    "checkpoint_root",
    "checksum",
    "json_depth",
    "load_json",
    "make_folder",
    "open_input",
    "open_input_file",
    "read_input",
    "remove_made",
    "same_bytes",
    "stat_input",
    "pwrite_all",
    "pwritev_all",
    "start_writeback",
    "temp_path_for",
    "write_error",
]

#: Deepest nesting of objects and arrays accepted in any JSON document a reader parses (ours
#: are at most 6 deep; safetensors headers and shard indexes 3).
MAX_JSON_DEPTH = 64
#: Largest JSON document a reader parses, unless the format has its own cap (the safetensors
#: header's is 100,000,000 bytes, the reference implementation's).
MAX_JSON_BYTES = 256_000_000
_JSON_KEEP = bytes(range(256)).translate(None, b'"[]{}')
_DEPTH_CHUNK = 1 << 20  # bytes of brackets and quotes per step: ~30 MB of temporaries
#: errno values that mean the write itself failed (not a wrong path or a permission).
_WRITE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EFBIG", "EDQUOT", "EIO") if hasattr(errno, name)
)


def json_depth(raw: bytes) -> int:
    """How deeply the arrays and objects of the JSON text ``raw`` nest, without parsing it.

    Linear, in chunks of bounded memory: escapes are dropped (a backslash and the byte after
    it), then everything but quotes and brackets; brackets between quotes do not count. Only
    meaningful for valid JSON (the parser rejects the rest).
    """
    if b"\\" in raw:  # (one memchr; our documents rarely have an escape)
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    text = raw.translate(None, _JSON_KEEP)
    opening, closing = ord("["), ord("]")
    inside, depth, deepest = 0, 0, 0
    for start in range(0, len(text), _DEPTH_CHUNK):
        arr = np.frombuffer(text, np.uint8, min(_DEPTH_CHUNK, len(text) - start), start)
        quotes = np.cumsum(arr == 34, dtype=np.int64) + inside
        outside = (quotes & 1) == 0
        step = np.zeros(arr.shape, np.int64)
        step[((arr == opening) | (arr == ord("{"))) & outside] = 1
        step[((arr == closing) | (arr == ord("}"))) & outside] = -1
        levels = np.cumsum(step) + depth
        if levels.size:
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
        inside = int(quotes[-1]) & 1 if quotes.size else inside
    return deepest


def load_json(
    raw: bytes,
    *,
    file: str,
    variable: str | None = None,
    what: str = "JSON document",
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """Parse UTF-8 JSON read from ``file`` within the caps, every failure as our error.

    Raises:
        LimitExceededError: ``raw`` is larger than ``max_bytes`` or nests deeper than
            ``max_depth``.
        CorruptCheckpointError: not UTF-8, not JSON.
    """
    if len(raw) > max_bytes:
        raise LimitExceededError(
            f"the {what} is too large",
            file=file,
            variable=variable,
            expected=f"<= {max_bytes} bytes",
            found=f"{len(raw)} bytes",
        )
    depth = json_depth(raw)
    if depth > max_depth:
        raise LimitExceededError(
            f"the {what} nests too deeply",
            file=file,
            variable=variable,
            expected=f"<= {max_depth} levels",
            found=f"{depth} levels",
        )
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=object_pairs_hook)
    except ParallelVarsError:
        raise
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(
            f"the {what} is not UTF-8 ({exc.reason})", file=file, variable=variable
        ) from None
    except (ValueError, RecursionError, MemoryError) as exc:  # JSONDecodeError is a ValueError
        raise CorruptCheckpointError(
            f"the {what} is not valid JSON, or not JSON at all ({type(exc).__name__}: {exc})",
            file=file,
            variable=variable,
        ) from None
    if _SURROGATE_ESCAPE.search(raw):  # (UTF-8 itself cannot hold one: only an escape can)
        # (a hook may have dropped or replaced the decoded strings: then the text is decoded
        # again as it is, to look at every key and value; only a file with such an escape
        # pays for it)
        plain = doc if object_pairs_hook is None else json.loads(raw.decode("utf-8"))
        bad = _lone_surrogate(plain)
        if bad is not None:
            raise CorruptCheckpointError(
                f"the {what} holds text that is not valid Unicode",
                file=file,
                variable=variable,
                expected="no lone surrogate (as the reference JSON parsers refuse them)",
                found=ascii(bad[:80]),
            )
    return doc


#: A JSON escape of a UTF-16 surrogate: only through one can decoded text hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(doc: Any) -> str | None:
    """The first string (key or value) of the decoded JSON ``doc`` that cannot be encoded as
    UTF-8 (a lone surrogate, which ``json`` decodes and serde_json, the safetensors reference,
    refuses), or None."""
    stack = [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def value_types(values: Iterable[Any]) -> set[type]:
    """The types among ``values`` (one C loop): how a decoded JSON document's columns are
    checked in bulk (``value_types(kinds) - {str}`` is empty when every kind is a string)."""
    return set(map(type, values))


# ------------------------------------------------------------------ files a reader opens
# The one rule for every file a reader opens, named by the user or found next to a checkpoint
# (a TF data shard, index or state file, a safetensors shard or index, a multi-process part):
# see open_input. Every reader of every format opens its files through it.

#: Repository folders of a Hugging Face cache (``<cache>/models--org--name``), whose
#: ``snapshots/<revision>/`` files are symbolic links into the repository's ``blobs/``.
_HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def checkpoint_root(folder: str) -> str:
    """The real folder that the files found next to a checkpoint in ``folder`` must stay in.

    ``folder`` itself with symbolic links resolved; but for a folder inside a Hugging Face
    cache snapshot (``<cache>/models--org--name/snapshots/<revision>/``), whose files are
    symbolic links into the repository's own ``blobs/`` (a real folder, not a link), the
    repository folder: a set downloaded with ``huggingface_hub`` opens where it lies.
    """
    real = os.path.realpath(folder or os.curdir)
    parts = real.split(os.sep)
    for k in range(len(parts) - 2, 0, -1):  # the nearest ancestor named "snapshots"
        if parts[k] != "snapshots":
            continue
        repo = os.sep.join(parts[:k]) or os.sep
        if os.path.basename(repo).startswith(_HF_REPO_PREFIXES):
            try:
                blobs = os.lstat(os.path.join(repo, "blobs"))
            except OSError:
                break
            if stat.S_ISDIR(blobs.st_mode):
                return repo
        break
    return real


def _inside(root: str, real: str) -> bool:
    try:
        return os.path.commonpath([root, real]) == root
    except ValueError:  # different drives
        return False


def _opened_path(fd: int, path: str) -> str:
    """The real path of the file open at ``fd`` (Linux says which file was opened, whatever
    was swapped in since; elsewhere the path resolved again)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)


def _not_regular(
    path: str, kind: str, within: str | None, referrer: str | None, variable: str | None
) -> ParallelVarsError:
    if within is None:
        return NotACheckpointError(f"is {kind}, not a regular file", file=path)
    return CorruptCheckpointError(
        f"a file of the checkpoint is {kind}, not a regular file",
        file=path,
        variable=variable,
        expected="a regular file",
        found=kind,
        hint=f"found next to {referrer}" if referrer else None,
    )


def _outside(
    path: str, root: str, real: str, referrer: str | None, variable: str | None
) -> ForeignReferenceError:
    return ForeignReferenceError(
        "a file of the checkpoint is a symbolic link out of the checkpoint's folder",
        file=path,
        variable=variable,
        expected=f"a file inside {root}",
        found=f"a symbolic link to {real}",
        hint=(f"found next to {referrer}; " if referrer else "")
        + "copy the file into the folder instead of linking it",
    )


def _stat_input(
    path: str,
    root: str | None,
    within: str | None,
    referrer: str | None,
    variable: str | None,
    what: str,
) -> os.stat_result:
    """The part of :func:`open_input`'s rule checked before anything is opened."""
    try:
        st = os.lstat(path) if root is not None else os.stat(path)
        if root is not None and stat.S_ISLNK(st.st_mode):
            real = os.path.realpath(path)
            if not _inside(root, real):
                raise _outside(path, root, real, referrer, variable)
            st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no such {what}", file=path, variable=variable) from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise _not_regular(path, "a loop of symbolic links", within, referrer, variable) from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, _kind_of(st.st_mode), within, referrer, variable)
    return st


def stat_input(
    path: str,
    *,
    within: str | None = None,
    referrer: str | None = None,
    variable: str | None = None,
    what: str = "file",
) -> os.stat_result:
    """:func:`open_input`'s rule as far as it is checked without opening ``path`` (for a
    listing that picks files it will open later, through :func:`open_input` or by name);
    its ``stat``."""
    root = None if within is None else checkpoint_root(within)
    return _stat_input(path, root, within, referrer, variable, what)


def open_input(
    path: str,
    *,
    within: str | None = None,
    referrer: str | None = None,
    variable: str | None = None,
    max_bytes: int | None = None,
    what: str = "file",
) -> int:
    """Open a file a reader reads, under the one rule for every file: a read-only descriptor.

    * It must be a regular file: a FIFO, socket, device or directory is refused before
      anything opens it (opening a FIFO blocks), and the descriptor is opened non-blocking and
      checked again (``fstat``), so a swap in between cannot block either.
    * ``within``: the file was *found* next to a checkpoint in that folder (a data shard, an
      index, a state file, a part), not named by the user. It may be a symbolic link only
      when it resolves inside the checkpoint's folder (:func:`checkpoint_root`); a link out
      of it is refused with :class:`~parallelvars.errors.ForeignReferenceError` (checked on
      the path and again on the file actually opened). A file the user named may be a link:
      they chose it.
    * ``max_bytes``: a file larger than this (a document the reader takes whole) is refused
      with :class:`~parallelvars.errors.LimitExceededError` before anything is read.

    Errors name the file (``variable``: what the reader was after; ``referrer``: the file it
    was found through). A missing file is
    :class:`~parallelvars.errors.CheckpointNotFoundError`; a file that is not regular is
    :class:`~parallelvars.errors.NotACheckpointError` when named,
    :class:`~parallelvars.errors.CorruptCheckpointError` when found.
    """
    root = None if within is None else checkpoint_root(within)
    _stat_input(path, root, within, referrer, variable, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:  # gone since
        raise CheckpointNotFoundError(f"no such {what}", file=path, variable=variable) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped since the check
            raise _not_regular(path, _kind_of(st.st_mode), within, referrer, variable)
        if root is not None:
            real = _opened_path(fd, path)
            if not _inside(root, real):
                raise _outside(path, root, real, referrer, variable)
        if max_bytes is not None and st.st_size > max_bytes:
            raise LimitExceededError(
                f"the {what} is too large",
                file=path,
                variable=variable,
                expected=f"<= {max_bytes} bytes",
                found=f"{st.st_size} bytes",
            )
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_input_file(path: str, *, buffering: int = -1, **rule: Any) -> IO[bytes]:
    """:func:`open_input` as a binary file object (``rule``: its keyword arguments)."""
    fd = open_input(path, **rule)
    try:
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def check_input(path: str, **rule: Any) -> os.stat_result:
    """Check ``path`` against :func:`open_input`'s rule without keeping it open (for a reader
    that then opens it by name, such as h5py); its ``fstat``."""
    fd = open_input(path, **rule)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def read_input(path: str, *, max_bytes: int, what: str, **rule: Any) -> bytes:
    """The whole of a small file (an index, a state file) under :func:`open_input`'s rule, at
    most ``max_bytes`` (:class:`~parallelvars.errors.LimitExceededError` beyond, before
    reading; a file that grows meanwhile is read to ``max_bytes + 1`` and refused too)."""
    fd = open_input(path, max_bytes=max_bytes, what=what, **rule)
    try:
        chunks = []
        left = max_bytes + 1
        step = os.fstat(fd).st_size + 1  # one read of what is there (no larger buffer)
        while left > 0:
            chunk = os.read(fd, min(left, step))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
            step = 1 << 20  # it grew meanwhile
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > max_bytes:
        raise LimitExceededError(
            f"the {what} is too large",
            file=path,
            variable=rule.get("variable"),
            expected=f"<= {max_bytes} bytes",
            found=f"more than {max_bytes} bytes",
        )
    return raw


def _errno_of(exc: BaseException | None) -> int | None:
    """The errno of ``exc``, or of the ``OSError`` it was raised from or while handling. Only
    the exceptions' ``errno`` counts: an error that carries none (h5py's own, whose message
    may quote the C library's) is not taken for a failed write by its text."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return int(exc.errno)
        exc = exc.__cause__ or exc.__context__
    return None


def write_error(exc: BaseException, file: str) -> BaseException:
    """``exc`` as :class:`~parallelvars.errors.CheckpointWriteError` naming ``file`` when it is
    a failed write (disk full, file too large, quota, I/O error), else ``exc`` itself."""
    if not isinstance(exc, OSError) or isinstance(exc, ParallelVarsError):
        return exc
    code = _errno_of(exc)
    if code is None or code not in _WRITE_ERRNOS:
        return exc
    err = CheckpointWriteError(
        "cannot write the file",
        file=file,
        found=os.strerror(code),
        hint="the last good file at this path is unchanged",
    )
    err.errno, err.strerror, err.filename = code, os.strerror(code), file
    return err


def byte_view(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (any dtype, 0-d included)."""
    return arr.reshape(-1).view(np.uint8)


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _memcmp() -> Callable[..., int] | None:
    """libc's ``memcmp``, or None where ctypes cannot find it."""
    try:
        lib = ctypes.CDLL(None) if sys.platform != "win32" else ctypes.cdll.msvcrt
        fn = lib.memcmp
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


#: libc's ``memcmp(a, b, n)`` on addresses (releases the GIL), or None where there is none:
#: for comparing pieces of long buffers in place (see :func:`same_bytes` for whole arrays).
MEMCMP = _memcmp()
# Arrays up to this many bytes are compared as copies (``tobytes``): a copy of a few KiB costs
# less than finding the arrays' addresses; larger ones by ``memcmp`` (no copy, no temporary).
_COPY_COMPARE_BYTES = 1 << 16
_COMPARE_CHUNK = 4 << 20  # without memcmp: bytes compared at a time


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the arrays hold the same bytes in C order (NaNs included: bits, not values).

    Shapes and dtypes are the caller's to compare. Small arrays are compared as copies; large
    C-contiguous ones in place with ``memcmp`` (releases the GIL; several times faster than
    ``np.array_equal``, which also allocates a boolean array of their size). The one byte
    comparison of the writers and the snapshot of a non-blocking save."""
    n = a.nbytes
    if n != b.nbytes:
        return False
    if a.dtype.kind == "O" or b.dtype.kind == "O":  # (compares the objects, not pointers)
        return a.shape == b.shape and bool(np.array_equal(a, b))
    if n <= _COPY_COMPARE_BYTES:
        return a.tobytes() == b.tobytes()
    if not (a.flags.c_contiguous and b.flags.c_contiguous):
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if MEMCMP is not None:
        return MEMCMP(a.__array_interface__["data"][0], b.__array_interface__["data"][0], n) == 0
    x, y = byte_view(a), byte_view(b)
    return all(
        np.array_equal(x[k : k + _COMPARE_CHUNK], y[k : k + _COMPARE_CHUNK])
        for k in range(0, n, _COMPARE_CHUNK)
    )


def checksum_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``A + B`` from ``crc1`` of ``A``, ``crc2`` of ``B`` and ``len2`` (B's
    length in bytes), without the bytes (zlib's ``crc32_combine``, for the Castagnoli
    polynomial): pieces of one component checksummed by several readers verify it whole."""
    if len2 <= 0:
        return crc1
    odd = [0x82F63B78] + [1 << k for k in range(31)]  # the operator for one zero bit
    even = [_gf2_times(odd, v) for v in odd]  # two zero bits
    odd = [_gf2_times(even, v) for v in even]  # four zero bits
    while True:  # apply len2 zero bytes to crc1, squaring the operator as we go
        even = [_gf2_times(odd, v) for v in odd]
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = [_gf2_times(even, v) for v in even]
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def checksum(arr: np.ndarray) -> int:
    """CRC-32C of an array's C-order bytes; for byte strings, of each length (u64 LE) and bytes."""
    if arr.dtype.kind == "O":
        crc = 0
        for item in arr.reshape(-1):
            b = bytes(item)
            crc = _crc32c.crc32c(len(b).to_bytes(8, "little"), crc)
            crc = _crc32c.crc32c(b, crc)
        return crc
    a = np.ascontiguousarray(arr)
    return int(_crc32c.crc32c(byte_view(a)))  # type: ignore[arg-type]


class Scratch:
    """One buffer reused for every tensor a writer streams, grown to the largest one.

    Reading each tensor into fresh memory costs a page fault per page every time; reusing one
    buffer pays that once, and memory stays at the largest tensor.
    """

    def __init__(self) -> None:
        self._buf = np.empty(0, np.uint8)

    def array(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A C-contiguous array of ``dtype`` and ``shape`` over the buffer (contents undefined)."""
        dtype = np.dtype(dtype)
        n = math.prod(shape) * dtype.itemsize
        if n > self._buf.size:
            self._buf = np.empty(0, np.uint8)  # free the old buffer before the new one
            self._buf = np.empty(n, np.uint8)
        return self._buf[:n].view(dtype).reshape(shape)


def _fsync_path(path: str, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:
            return  # some platforms cannot open directories; the rename is still atomic
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path_for(path: str) -> str:
    """A temporary name in the same directory, recognisable as ours (``.NAME.tmp-PID-HEX``)."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def make_folder(directory: str, path: str) -> list[str]:
    """Make ``directory`` (and its parents) for a write at ``path``; returns the folders it
    made, deepest first, for :func:`remove_made`.

    The one folder rule of the library and the command line: a write makes the folders its
    output goes into (as TensorFlow's savers do: ``save("ckpts/run")`` makes ``ckpts/``), and
    a write that fails or is interrupted takes back the folders it made. A folder that cannot
    be made (no permission, a file in the way, a read-only or virtual file system) is a
    :class:`~parallelvars.errors.CheckpointWriteError` naming ``path``, never a builtin
    ``OSError``."""
    missing: list[str] = []
    up = os.path.abspath(directory)
    while not os.path.lexists(up) and os.path.dirname(up) != up:
        missing.append(up)
        up = os.path.dirname(up)
    if not missing:
        return []
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        code = _errno_of(exc)
        err = CheckpointWriteError(
            "cannot make the folder to write into",
            file=path,
            expected=f"a writable folder {directory}",
            found=os.strerror(code) if code is not None else str(exc),
        )
        if code is not None:
            err.errno, err.strerror = code, os.strerror(code)
        err.filename = path
        raise err from None
    return missing


def remove_made(made: list[str]) -> None:
    """Take back the folders :func:`make_folder` made (deepest first), each only while it is
    still empty: a failed or interrupted write leaves no folder it made behind, and never
    removes anything else."""
    for folder in made:
        try:
            os.rmdir(folder)
        except OSError:
            return  # not empty (or gone): it and the folders above it stay


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path``; on success fsync it and rename it onto ``path``.

    A reader (or a crash) sees either the old file or the complete new one, never a torn one;
    a failed write removes the temporary and leaves ``path`` as it was (a full disk or a file
    over a size limit is raised as :class:`~parallelvars.errors.CheckpointWriteError`). The directory is made
    if missing (:func:`make_folder`'s rule: like TensorFlow, ``save("ckpts/run")`` creates
    ``ckpts/``, and a failed write takes back the folders it made) and fsynced after the rename.
    """
    directory = os.path.dirname(os.path.abspath(path))
    made = make_folder(directory, path)
    tmp = temp_path_for(path)
    try:
        yield tmp
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        remove_made(made)
        mapped = write_error(exc, path)
        if mapped is not exc:
            raise mapped from exc
        raise
    _fsync_path(directory, directory=True)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``os.pwrite`` may write less than asked)."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _iov_max() -> int:
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        n = -1
    return n if n > 0 else 16


# The most buffers one gathered write takes (Linux: 1024).
IOV_MAX = min(_iov_max(), 1024)


def pwritev_all(fd: int, buffers: Sequence[Any], offset: int, size: int) -> None:
    """Write the bytes of C-contiguous buffers (arrays or memoryviews) one after another from
    ``offset`` (``size`` bytes in all, at most :data:`IOV_MAX` buffers): one gathered write, a
    short one resumed (Linux writes at most about 2 GiB in one call; a network file system may
    write less)."""
    done = os.pwritev(fd, buffers, offset) if _PWRITEV else 0
    if done == size:
        return
    at = offset
    for buf in buffers:  # a short write (or no pwritev): the rest buffer by buffer
        # (an array through its bytes: a bfloat16 array has no buffer format of its own)
        data = memoryview(byte_view(buf) if isinstance(buf, np.ndarray) else buf).cast("B")  # type: ignore[arg-type]
        n = data.nbytes
        if done >= n:
            done -= n
        else:
            pwrite_all(fd, data[done:], at + done)
            done = 0
        at += n


_PWRITEV = hasattr(os, "pwritev")


def _sync_file_range() -> Callable[..., int] | None:
    """libc's ``sync_file_range`` (Linux), or None where it is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writing the dirty pages; do not wait
#: Bytes written between two :func:`start_writeback` hints of a writer.
WRITEBACK_STEP = 8 << 20


def start_writeback(fd: int, offset: int, size: int) -> None:
    """Ask the kernel to start writing ``size`` bytes of ``fd`` from ``offset`` to disk now
    (Linux's ``sync_file_range``; elsewhere nothing), so the disk works while a save goes on
    and its final ``fsync`` has little left to wait for. Only a hint (it may block while the
    disk's queue is full, so writers call it off the saving thread where they can): the
    ``fsync`` guarantees durability either way."""
    if _SYNC_FILE_RANGE is not None and size > 0:
        _SYNC_FILE_RANGE(fd, offset, size, _SYNC_FILE_RANGE_WRITE)


class DataWriter:
    """Writes arrays' bytes at given offsets of a file being saved, checksummed on the way.

    * Each chunk of ``CHUNK`` bytes is checksummed and then written while it is in the CPU
      cache: the buffer is read from memory once, and the checksum describes the bytes written.
    * Every ``WRITEBACK_STEP`` bytes the kernel is asked to start writing them to disk (Linux's
      ``sync_file_range``; elsewhere nothing), so the disk works while the save goes on and the
      final ``fsync`` has little left to wait for. Only a hint: the ``fsync`` guarantees
      durability either way.
    * A live buffer is checksummed again once written (:meth:`check_unchanged`): another thread
      writing to it meanwhile would leave a mix of two values in the file under a matching
      checksum, so that fails the save instead.

    The second checksums of large buffers and the writeback hints (which can block while the
    disk is busy) run on a helper thread (a one-worker ``ThreadPoolExecutor``) when the
    machine has more than one core; both release the GIL, so they overlap with the next
    variables' metadata. :meth:`close` waits for them and raises the first error. A save
    still running at interpreter exit, when ``concurrent.futures`` takes no new work, does
    that work inline (:func:`~parallelvars._threads.submit_or_run`).
    """

    CHUNK = 1 << 20
    WRITEBACK_STEP = WRITEBACK_STEP
    ASYNC_CHECK = 256 << 10  # smaller buffers are checked inline: cheaper than a hand-off

    def __init__(self, path: str, file: str) -> None:
        """Open ``path`` (which exists) for writing; ``file`` is the name errors give."""
        self.file = file
        self.fd = os.open(path, os.O_WRONLY)
        self._helper = thread_count() > 1
        self._lo = self._hi = -1
        self._pool: ThreadPoolExecutor | None = None  # one worker: the work runs in order
        self._error: BaseException | None = None

    def write(self, arr: np.ndarray, offset: int) -> int:
        """Write a C-contiguous array's bytes at ``offset``; return their CRC-32C."""
        data = memoryview(byte_view(arr))  # type: ignore[arg-type]
        crc = 0
        for start in range(0, len(data), self.CHUNK):
            piece = data[start : start + self.CHUNK]
            crc = _crc32c.crc32c(piece, crc)
            pwrite_all(self.fd, piece, offset + start)
        if len(data) and _SYNC_FILE_RANGE is not None:
            lo, hi = offset, offset + len(data)
            self._lo, self._hi = (
                (lo, hi) if self._lo < 0 else (min(self._lo, lo), max(self._hi, hi))
            )
            if self._hi - self._lo >= self.WRITEBACK_STEP:
                self._start_writeback()
        return crc

    def check_unchanged(self, arr: np.ndarray, crc: int, variable: str) -> None:
        """Fail the save if ``arr`` no longer has checksum ``crc``."""
        if arr.nbytes >= self.ASYNC_CHECK:
            self._submit(self._check, arr, crc, variable)
        elif arr.nbytes:
            self._check(arr, crc, variable)

    def _check(self, arr: np.ndarray, crc: int, variable: str) -> None:
        if checksum(arr) != crc:
            raise ConcurrentWriteError(
                "changed while it was being saved",
                file=self.file,
                variable=variable,
                hint="write from a single thread, or save with blocking=False, which snapshots",
            )

    def _start_writeback(self) -> None:
        if self._lo >= 0:
            self._submit(start_writeback, self.fd, self._lo, self._hi - self._lo)
            self._lo = self._hi = -1

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._error is not None:
            raise self._error
        if not self._helper:
            fn(*args)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parallelvars-save")
        submit_or_run(self._pool, self._run, fn, args)

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if self._error is None:  # after the first error the rest is skipped
            try:
                fn(*args)
            except BaseException as exc:  # handed to the saving thread by close()
                self._error = exc

    def close(self, *, raise_errors: bool) -> None:
        """Finish the helper's work, close the descriptor, raise the first error if asked.

        Closing again does nothing.
        """
        if self.fd < 0:
            return
        try:
            if raise_errors:
                self._start_writeback()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            fd, self.fd = self.fd, -1
            os.close(fd)
        if raise_errors and self._error is not None:
            raise self._error
