"""NumPy ``.npz``: read member by member without unpickling anything, written streaming.

Reading never calls ``np.load``. The zip's central directory is read with :mod:`zipfile`; each
``<key>.npy`` member's header is parsed by numpy's own header reader
(:func:`numpy.lib.format.read_magic`, ``read_array_header_1_0`` / ``_2_0``) through a stream
that refuses to read past ``MAX_HEADER_SIZE`` bytes of header, and a member whose dtype holds
Python objects (``|O``, which ``np.save`` pickles) is refused with
:class:`~parallelvars.errors.UnsupportedDtypeError` before any of its data is touched.
Tensor bytes are read on demand: straight from the file for STORED members (``np.savez``),
through the zip stream for DEFLATED ones (``np.savez_compressed``).

Writing streams each array into its own STORED member (a zip64 field in each local header, as
``zipfile`` writes them with ``force_zip64``), in runs of tensors read into one buffer whose
members go out in a few large writes (:class:`~parallelvars.formats._zip.StoredZipWriter`: the
bytes ``zipfile`` writes, the CRC-32 of each member taken as it is written). Our files hold:

* ``<key>.npy`` per stored tensor, keys in style ``names`` (default ``"slash"``, see
  :mod:`._names`): every variable's primary under its own key, extra components under
  ``<key>/parallel_component_<i>``, a sharded variable once as its stitched value;
* ``__parallelvars__.json`` (the first member): the parallel info (see :mod:`._info`), the
  file metadata under ``"metadata"`` and the names of all other members under ``"members"``.
  ``np.load`` lists it as an ordinary member; it is not a tensor.

Integrity: every member carries the zip's CRC-32, and the reader verifies it on every read
(the first partial read of a tensor checks the whole member once). The member list catches a
damaged directory that lost or reordered members. Every error of :mod:`zipfile`, :mod:`zlib`
and numpy's header parser on a damaged archive is raised as ours, naming the file and member.

dtypes: numpy's own dtypes are stored as they are. bfloat16 and the other ml_dtypes types,
which ``.npy`` cannot name, are stored as unsigned integers of the same width holding the raw
bits, with the real dtype recorded in the parallel info. The convention of files like
``torch_expected.npz`` is understood as well: a member ``"<key>#dtype"`` holding a dtype name
(``"BF16"``, ``"F8_E4M3"`` or a numpy name) gives the dtype of the raw bits in ``<key>``.
String tensors are stored as fixed-width ``bytes`` (``|S``) arrays; unicode (``<U``) members of
other files are read as UTF-8 ``bytes``.
"""

from __future__ import annotations

import io
import math
import os
import struct
import threading
import time
import tokenize
import zipfile
import zlib
from collections.abc import Callable, Mapping
from typing import IO, Any

import numpy as np

from parallelvars._fileio import Scratch, atomic_path, load_json, open_input_file
from parallelvars._geometry import shard_index
from parallelvars._ints import is_index
from parallelvars.checkpoint.entry import naming_file
from parallelvars.errors import (
    ClosedCheckpointError,
    CorruptCheckpointError,
    InvalidEntryError,
    LimitExceededError,
    ParallelVarsError,
    TruncatedFileError,
    UnsupportedDtypeError,
)

from ._dtypes import dtype_from_name, is_ml_dtype, is_string_dtype
from ._info import StoreView, build_entries
from ._json import carried_metadata, dumps, jsonable
from ._names import check_names
from ._plan import plan_tensors, read_batches, read_run
from ._registry import FormatSpec
from ._store import ByteStore, little_endian, read_exact_into
from ._view import CheckpointView, Entry
from ._zip import MAX_DEFLATE_RATIO, ZIP_ERRORS, StoredZipWriter, check_members, open_zip

__all__ = [
    "FORMAT",
    "INFO_MEMBER",
    "MAX_DEFLATE_RATIO",
    "MAX_HEADER_SIZE",
    "open_npz",
    "write_npz",
]

INFO_MEMBER = "__parallelvars__.json"
MAX_HEADER_SIZE = 10_000  # numpy's own default limit for .npy headers
MAX_INFO_SIZE = 100_000_000
DEFAULT_NAMES = "slash"
_MAGIC = b"\x93NUMPY"
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
#: Per .npy major version: bytes of the header-length field and numpy's header reader. 3.0
#: differs from 2.0 only in encoding the header as UTF-8 instead of latin-1, which only
#: non-ASCII field names of structured dtypes need (refused either way), so 2.0's reader reads it.
_HEADER_READERS: dict[int, tuple[int, Callable[..., tuple[Any, Any, np.dtype]]]] = {
    1: (2, np.lib.format.read_array_header_1_0),
    2: (4, np.lib.format.read_array_header_2_0),
    3: (4, np.lib.format.read_array_header_2_0),
}
#: What numpy's header reader raises on a damaged header: its own ValueError; the tokenizer's
#: error from its fallback parse of Python 2 headers; that fallback's UserWarning where warnings
#: are errors; a recursion or memory error of ``ast.literal_eval``.
_HEADER_ERRORS = (
    ValueError,
    SyntaxError,
    tokenize.TokenError,
    UserWarning,
    RecursionError,
    MemoryError,
)
#: What zipfile, zlib and numpy raise on a damaged archive (mapped to our errors).
_ZIP_ERRORS = ZIP_ERRORS


class _HeaderStream:
    """The member's stream as numpy's header reader sees it.

    Keeps every byte read (the zip CRC-32 of the data continues the header's), refuses a read
    that would go past the largest header we accept (``limit``, set once the version is known)
    before reading anything, so a length field claiming gigabytes allocates nothing, and
    reports a short read (the member ends inside its header) as ours.
    """

    def __init__(self, f: IO[bytes], member: str, file: str) -> None:
        self._f = f
        self._member = member
        self._file = file
        self.data = bytearray()
        self.limit = 8  # the magic string, until the version says how long the length field is

    def read(self, n: int = -1, /) -> bytes:
        if n < 0 or len(self.data) + n > self.limit:  # numpy reads exact counts, never "all"
            raise CorruptCheckpointError(
                ".npy header too large",
                file=self._file,
                variable=self._member,
                expected=f"<= {MAX_HEADER_SIZE} bytes",
                found=f"{n} bytes",
            )
        b = self._f.read(n)
        if len(b) < n:  # zipfile's streams return short only at the member's end
            raise TruncatedFileError(
                "the .npy header is cut short", file=self._file, variable=self._member
            )
        self.data += b
        return b


def _uint_of(itemsize: int) -> np.dtype:
    return np.dtype(f"<u{itemsize}") if itemsize in (1, 2, 4, 8) else np.dtype(f"V{itemsize}")


def _dtype_from_tag(tag: str, member: str, file: str) -> np.dtype:
    from parallelvars.formats.safetensors._dtypes import (
        _DTYPES,
    )  # the safetensors names (BF16, F8_E4M3, ...)

    if tag in _DTYPES:
        return _DTYPES[tag]
    return dtype_from_name(tag, file=file, variable=member)


class _Member:
    """One ``.npy`` member: its header facts and where its data starts."""

    __slots__ = (
        "abs_offset",
        "fortran",
        "head_crc",
        "hlen",
        "info",
        "key",
        "shape",
        "stored_dtype",
    )

    def __init__(
        self,
        key: str,
        info: zipfile.ZipInfo,
        dtype: np.dtype,
        shape: tuple[int, ...],
        fortran: bool,
        hlen: int,
        abs_offset: int | None,
        head_crc: int,
    ) -> None:
        self.key = key
        self.info = info
        self.stored_dtype = dtype  # the dtype the .npy header declares
        self.shape = shape
        self.fortran = fortran
        self.hlen = hlen  # bytes of magic + header inside the member
        self.abs_offset = abs_offset  # file offset of the data (STORED members), else None
        self.head_crc = head_crc  # zip CRC-32 of the .npy header bytes: the data's CRC continues it

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.stored_dtype.itemsize


def _parse_npy_header(
    f: IO[bytes], member: str, file: str
) -> tuple[np.dtype, tuple[int, ...], bool, bytes]:
    """(dtype, shape, fortran_order, header bytes) of the .npy stream ``f``.

    numpy's own reader parses the header (:func:`numpy.lib.format.read_magic`,
    ``read_array_header_1_0`` / ``_2_0``, ``ast.literal_eval`` on at most ``MAX_HEADER_SIZE``
    bytes); what it raises on a damaged header is raised as ours, and what it lets through
    (negative or bool dimensions, object, structured and other dtypes we do not store) is
    refused here.
    """
    stream = _HeaderStream(f, member, file)
    try:
        major, minor = np.lib.format.read_magic(stream)
    except ParallelVarsError:  # the stream's own: the member ends inside the magic string
        raise
    except ValueError:  # not the magic string
        raise CorruptCheckpointError(
            "member is not a .npy array",
            file=file,
            variable=member,
            expected=repr(_MAGIC),
            found=repr(bytes(stream.data[:6])),
        ) from None
    if major not in _HEADER_READERS:
        raise CorruptCheckpointError(
            "unknown .npy format version",
            file=file,
            variable=member,
            expected="1.0, 2.0 or 3.0",
            found=f"{major}.{minor}",
        )
    length_field, read_header = _HEADER_READERS[major]
    stream.limit = 8 + length_field + MAX_HEADER_SIZE
    try:
        shape, fortran, dtype = read_header(stream, max_header_size=MAX_HEADER_SIZE)
    except ParallelVarsError:  # the stream's own: too large or cut short
        raise
    except _HEADER_ERRORS as exc:
        if isinstance(exc, ValueError) and isinstance(exc.__cause__, TypeError):
            # numpy's "descr is not a valid dtype descriptor": a header that parsed, naming a
            # dtype numpy does not know.
            raise UnsupportedDtypeError(
                "unknown .npy dtype",
                file=file,
                variable=member,
                expected="a numpy type string",
                found=str(exc),
            ) from None
        raise CorruptCheckpointError(
            "cannot parse the .npy header",
            file=file,
            variable=member,
            expected="a dict literal of descr, fortran_order and shape",
            found=f"{str(exc)[:200]} (header {bytes(stream.data[8 + length_field :][:80])!r})",
        ) from None
    if not all(is_index(d) for d in shape):
        raise CorruptCheckpointError(
            "bad shape in the .npy header",
            file=file,
            variable=member,
            expected="a tuple of ints >= 0",
            found=repr(shape),
        )
    if dtype.hasobject:
        # np.save pickles object arrays; we never unpickle, so refuse before reading the data.
        raise UnsupportedDtypeError(
            "object arrays (pickled data) are not supported",
            file=file,
            variable=member,
            expected="a numeric, bool or bytes dtype",
            found=str(dtype),
        )
    if dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in "biufcSU":
        raise UnsupportedDtypeError(
            "only plain numeric, bool and string arrays are supported",
            file=file,
            variable=member,
            expected="a numeric, bool or bytes dtype",
            found=str(dtype),
        )
    return dtype, tuple(shape), fortran, bytes(stream.data)


class _Store(ByteStore):
    def __init__(self, file: str) -> None:
        self.file = file
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._dtype_tags: dict[str, np.dtype] = {}
        self.info_raw: bytes | None = None
        self.names: list[str] = []  # every member but the parallel info, in directory order
        self._f: IO[bytes] | None = None
        try:
            self._f = open_input_file(file)  # closed by close(); never a FIFO or device
            self._size = os.fstat(self._f.fileno()).st_size
            self._zip = open_zip(self._f, file, expected="an .npz (zip of .npy members)")
        except BaseException:
            self.close()
            raise
        self._all: dict[str, _Member] = {}  # every .npy member, #dtype tags included
        self._current = ""
        try:
            self._scan()
        except ParallelVarsError:
            self.close()
            raise
        except _ZIP_ERRORS as exc:
            self.close()
            raise CorruptCheckpointError(
                f"damaged zip archive ({type(exc).__name__}: {exc})",
                file=file,
                variable=self._current or None,
            ) from None
        except BaseException:
            self.close()
            raise

    def _scan(self) -> None:
        tags: set[str] = set()
        infos = self._zip.infolist()
        if not infos and self._zip.start_dir > 0:
            raise CorruptCheckpointError(
                "the zip directory lists no members but the archive holds data",
                file=self.file,
                expected="members before the directory",
                found=f"{self._zip.start_dir} unlisted bytes",
            )
        for info in check_members(self._zip, self.file, self._size):  # the one zip policy
            name = info.filename
            self._current = name
            if name == INFO_MEMBER:
                if info.file_size > MAX_INFO_SIZE:
                    raise LimitExceededError(
                        "metadata member too large",
                        file=self.file,
                        variable=name,
                        expected=f"<= {MAX_INFO_SIZE} bytes",
                        found=f"{info.file_size} bytes",
                    )
                self.info_raw = self._read_small(info)
                continue
            self.names.append(name)
            if not name.endswith(".npy"):
                self._zip.open(
                    info
                ).close()  # zipfile checks the local header's name against the directory
                continue  # np.load does not treat these as arrays either
            key = name[:-4]
            start = self._data_start(info)
            with self._zip.open(info) as f:  # checks the local header's name against the directory
                dtype, shape, fortran, head = _parse_npy_header(f, key, self.file)
            hlen = len(head)
            if dtype.kind == "U" and key.endswith("#dtype") and shape == ():
                tags.add(key[: -len("#dtype")])  # resolved below
            need = hlen + math.prod(shape) * dtype.itemsize
            if info.file_size != need:
                cls = TruncatedFileError if info.file_size < need else CorruptCheckpointError
                raise cls(
                    "member size does not match its .npy header",
                    file=self.file,
                    variable=key,
                    expected=f"{need} bytes",
                    found=f"{info.file_size} bytes",
                )
            self._members[key] = self._all[key] = _Member(
                key,
                info,
                dtype,
                shape,
                fortran,
                hlen,
                None if start is None else start + hlen,
                zlib.crc32(head),
            )
        self._current = ""
        for base in tags:
            if base in self._members:
                tag_member = self._members.pop(f"{base}#dtype")
                raw = self._read_whole(tag_member)
                tag = str(np.frombuffer(raw, tag_member.stored_dtype).reshape(()).item())
                real = _dtype_from_tag(tag, base, self.file)
                m = self._members[base]
                if real.itemsize != m.stored_dtype.itemsize:
                    raise CorruptCheckpointError(
                        "#dtype does not match the width of the stored bits",
                        file=self.file,
                        variable=base,
                        expected=str(real),
                        found=str(m.stored_dtype),
                    )
                self._dtype_tags[base] = real

    def _data_start(self, info: zipfile.ZipInfo) -> int | None:
        """Absolute offset of a STORED member's data (after the local header), else None."""
        if info.compress_type != zipfile.ZIP_STORED or self._f is None:
            return None
        raw = bytearray(30)
        read_exact_into(
            self._f,
            self._lock,
            info.header_offset,
            memoryview(raw),
            file=self.file,
            key=info.filename,
        )
        fields = _LOCAL_HEADER.unpack(bytes(raw))
        if fields[0] != 0x04034B50:
            raise CorruptCheckpointError(
                "bad zip local header", file=self.file, variable=info.filename
            )
        start = info.header_offset + 30 + fields[9] + fields[10]
        if start + info.file_size > self._size:
            raise TruncatedFileError(
                "the file ends inside a member",
                file=self.file,
                variable=info.filename,
                expected=f"{start + info.file_size} bytes",
                found=f"{self._size} bytes",
            )
        return start

    def _read_small(self, info: zipfile.ZipInfo) -> bytes:
        try:
            with self._zip.open(info) as f:
                return f.read()
        except ParallelVarsError:
            raise
        except _ZIP_ERRORS as exc:  # zipfile checks the CRC-32 once the member is read to its end
            raise CorruptCheckpointError(
                f"cannot read member ({type(exc).__name__}: {exc})",
                file=self.file,
                variable=info.filename,
            ) from None

    def _read_whole(self, m: _Member) -> bytes:
        buf = bytearray(m.nbytes)
        self._read_bytes_member(m, 0, memoryview(buf))
        self._check_crc(m.key, self._crc_update(buf, self._crc_start(m.key)))
        return bytes(buf)

    # -- checksums: the zip's own CRC-32 of each member (the .npy header, then the data) ------

    def _expected_crc(self, key: str) -> int | None:
        return self._all[key].info.CRC

    def _crc_start(self, key: str) -> int:
        return self._all[key].head_crc

    def _crc_update(self, data: Any, crc: int) -> int:
        return zlib.crc32(data, crc)

    def _crc_name(self) -> str:
        return "zip CRC-32"

    # -- TensorStore --------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._members)

    def stored(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        m = self._members[key]
        if m.stored_dtype.kind in "SU":
            return np.dtype(object), m.shape
        return self._dtype_tags.get(key, m.stored_dtype.newbyteorder("=")), m.shape

    def read_objects(self, key: str, region: tuple[int, int, int] | None = None) -> np.ndarray:
        m = self._members[key]
        if m.stored_dtype.kind not in "SU":
            return super().read_objects(key, region)
        raw = self._read_whole(m)
        arr = np.frombuffer(raw, m.stored_dtype).reshape(m.shape, order="F" if m.fortran else "C")
        if region is not None:
            axis, start, stop = region
            arr = arr[shard_index(arr.ndim, axis, start, stop)]
        out = np.empty(arr.shape, object)
        for idx, value in np.ndenumerate(arr):
            out[idx] = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        return out

    def read_into(
        self, key: str, out: np.ndarray, region: tuple[int, int, int] | None = None
    ) -> None:
        m = self._members[key]
        native = (
            m.stored_dtype.byteorder in ("=", "|")
            or (m.stored_dtype.byteorder == "<") == np.little_endian
        )
        if m.fortran or not native:
            # Rare layouts: read the whole member, then reorder into place.
            raw = self._read_whole(m)
            arr = np.frombuffer(raw, m.stored_dtype).reshape(
                m.shape, order="F" if m.fortran else "C"
            )
            if region is not None:
                axis, start, stop = region
                arr = arr[shard_index(arr.ndim, axis, start, stop)]
            out.reshape(-1).view(np.uint8)[...] = (
                np.ascontiguousarray(arr.astype(m.stored_dtype.newbyteorder("=")))
                .reshape(-1)
                .view(np.uint8)
            )
            return
        super().read_into(key, out, region)

    def _read_bytes(self, key: str, offset: int, buf: memoryview) -> None:
        self._read_bytes_member(self._members[key], offset, buf)

    def _read_bytes_member(self, m: _Member, offset: int, buf: memoryview) -> None:
        if self._f is None:
            raise ClosedCheckpointError("the checkpoint view is closed", file=self.file)
        if m.abs_offset is not None:
            read_exact_into(
                self._f, self._lock, m.abs_offset + offset, buf, file=self.file, key=m.key
            )
            return
        try:
            with self._lock, self._zip.open(m.info) as f:
                f.seek(m.hlen + offset)
                done = 0
                while done < len(buf):
                    n = f.readinto(buf[done:])  # type: ignore[attr-defined]
                    if not n:
                        raise TruncatedFileError(
                            "the member ends early", file=self.file, variable=m.key
                        )
                    done += n
        except ParallelVarsError:
            raise
        except _ZIP_ERRORS as exc:
            raise CorruptCheckpointError(
                f"cannot read member ({type(exc).__name__}: {exc})", file=self.file, variable=m.key
            ) from None

    def close(self) -> None:
        z = getattr(self, "_zip", None)
        if z is not None:
            z.close()
        f = getattr(self, "_f", None)
        if f is not None:
            f.close()
        self._f = None


def _check_members(listed: Any, found: list[str], file: str) -> None:
    """Our files list their members in the parallel info: a damaged zip directory that lost
    or renamed one is caught here (zipfile itself reads what the directory still lists)."""
    if listed is None:
        return  # an .npz from another tool, or from before the list was recorded
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
        raise CorruptCheckpointError(
            "the member list in the parallelvars record is damaged",
            file=file,
            variable=INFO_MEMBER,
            expected="a list of member names",
            found=type(listed).__name__,
        )
    if listed != found:
        missing = [n for n in listed if n not in found]
        extra = [n for n in found if n not in listed]
        what = (
            "a member listed in the parallelvars record is missing"
            if missing
            else (
                "the archive holds a member the parallelvars record does not list"
                if extra
                else "the members are in another order than the parallelvars record lists"
            )
        )
        raise CorruptCheckpointError(
            what,
            file=file,
            variable=(missing or extra or [None])[0],
            expected=f"{len(listed)} members",
            found=f"{len(found)} members",
        )


def open_npz(path: str | os.PathLike[str], *, names: str | None = None) -> CheckpointView:
    """Open an ``.npz`` file lazily.

    Args:
        path: the file.
        names: how to map keys not listed in the parallel info to our paths (default: the
            style recorded in the file, else ``"slash"``).
    """
    p = os.fspath(path)
    store = _Store(p)
    try:
        info: dict[str, Any] | None = None
        metadata: dict[str, Any] = {}
        if store.info_raw is not None:
            info = load_json(
                store.info_raw,
                file=p,
                variable=INFO_MEMBER,
                what="parallelvars metadata",
                max_bytes=MAX_INFO_SIZE,
            )
            if not isinstance(info, dict):
                raise CorruptCheckpointError(
                    "the parallelvars metadata is not an object", file=p, variable=INFO_MEMBER
                )
            raw_meta = info.get("metadata") or {}
            if not isinstance(raw_meta, dict):
                raise CorruptCheckpointError(
                    "the metadata in the parallelvars record is not an object",
                    file=p,
                    variable=INFO_MEMBER,
                )
            metadata = dict(raw_meta)
            _check_members(info.get("members"), store.names, p)
        style = check_names(names or (info or {}).get("names") or DEFAULT_NAMES)
        entries = build_entries(store, info, names=style)
        return StoreView(store, entries, format="npz", path=p, metadata=metadata, info=info)
    except BaseException:
        store.close()
        raise


def _to_npy(array: np.ndarray, path: str, variable: str) -> np.ndarray:
    """The array as .npy can hold it: ml_dtypes as raw unsigned bits, strings as ``|S``."""
    if is_string_dtype(array.dtype):
        flat = array.reshape(-1)
        for item in flat:
            if not isinstance(item, bytes):
                raise UnsupportedDtypeError(
                    "string tensors must hold bytes",
                    file=path,
                    variable=variable,
                    expected="bytes",
                    found=type(item).__name__,
                )
            if item.endswith(b"\0"):
                raise UnsupportedDtypeError(
                    ".npz bytes arrays drop trailing NUL bytes",
                    file=path,
                    variable=variable,
                    expected="no trailing NUL",
                    found=repr(item[-8:]),
                )
        width = max((len(x) for x in flat), default=1) or 1
        return np.array(array.tolist(), dtype=f"S{width}").reshape(array.shape)
    if is_ml_dtype(array.dtype):
        return array.view(_uint_of(array.dtype.itemsize))
    return array


def _npy_header(array: np.ndarray) -> bytes:
    """numpy's own .npy header for ``array``, made once per dtype, shape and order (a
    checkpoint's tensors share a few: numpy's header code is most of a small member's cost)."""
    fortran = bool(array.flags.f_contiguous and not array.flags.c_contiguous)
    key = (array.dtype, array.shape, fortran)
    header = _NPY_HEADERS.get(key)
    if header is None:
        out = io.BytesIO()
        data = np.lib.format.header_data_from_array_1_0(array)
        try:
            np.lib.format.write_array_header_1_0(out, data)
        except ValueError:  # a header over 64 KiB needs format 2.0
            np.lib.format.write_array_header_2_0(out, data)
        header = out.getvalue()
        if len(_NPY_HEADERS) < 4096:  # (bounded: many distinct shapes make each one's own)
            _NPY_HEADERS[key] = header
    return header


_NPY_HEADERS: dict[tuple[np.dtype, tuple[int, ...], bool], bytes] = {}


def write_npz(
    path: str | os.PathLike[str],
    entries: Mapping[str, Entry],
    *,
    names: str = DEFAULT_NAMES,
    metadata: Mapping[str, Any] | None = None,
) -> str:
    """Write ``entries`` as an ``.npz`` (STORED members), streamed in runs of tensors.

    Args:
        path: the output file.
        entries: the entries to write.
        names: key style, ``"slash"`` (default), ``"dotted"`` or ``"tf"``.
        metadata: file metadata (default: the source view's), kept in the parallel info.

    Returns:
        The file written.
    """
    p = os.fspath(path)
    if metadata is None:
        metadata = getattr(entries, "metadata", None) or {}
    planned, info = plan_tensors(
        entries,
        names=names,
        needs_record=lambda e: is_ml_dtype(e.dtype) or is_string_dtype(e.dtype),
        file=p,
        hold_entries=False,  # (read through read_batches only)
    )
    for t in planned:
        if t.key == INFO_MEMBER[:-4] or t.key.endswith("#dtype"):
            raise InvalidEntryError(
                f"key {t.key!r} is reserved in .npz files", file=p, variable=t.path
            )
        if t.dtype.kind not in "biufcO" and not is_ml_dtype(t.dtype):
            raise UnsupportedDtypeError(
                ".npz cannot store this dtype",
                file=p,
                variable=t.path,
                expected="a numeric, bool or bytes dtype",
                found=str(t.dtype),
            )
    info["metadata"] = jsonable(carried_metadata(metadata))
    # Every member, in order: a reader sees a damaged directory that lost one. The record goes
    # first, so a directory cut short loses tensors the record names, not the record.
    info["members"] = [f"{t.key}.npy" for t in planned]
    with atomic_path(p) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            # The bytes zipfile writes for these members (the record as ``writestr`` stores
            # it, each tensor as ``ZipFile.open(name, "w", force_zip64=True)``), written in
            # runs: each run's tensors read into one buffer (the source's files read in bulk),
            # their members' headers and bytes gathered into a few large writes.
            zw = StoredZipWriter(fd)
            zw.add(
                INFO_MEMBER,
                [dumps(info).encode("utf-8")],
                zip64=False,
                date_time=time.localtime(time.time())[:6],
            )
            zw.flush()
            del info  # (the record, its graph and member list: written, not held any longer)
            scratch = Scratch()
            for run in read_batches(planned):
                with naming_file(p):
                    _buf, arrays = read_run(run, scratch)
                for t, array in zip(run, arrays, strict=True):
                    npy = little_endian(_to_npy(array, p, t.path))
                    zw.add(
                        f"{t.key}.npy", [_npy_header(npy), npy] if npy.size else [_npy_header(npy)]
                    )
                zw.flush()  # (before the buffer is read into again)
            zw.finish()
        finally:
            os.close(fd)
    return p


def sniff(path: str, head: bytes) -> bool:
    """True for a readable zip whose members are all ``.npy`` arrays (or our metadata member).

    Strict on purpose: other zip-based formats (PyTorch's ``torch.save``, ``.keras``) have
    other members, and a zip that lost its directory is left to the suffix fallback.
    """
    if not (head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06")):
        return False
    try:
        with open_input_file(path) as f, zipfile.ZipFile(f) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):  # (our refusals are ValueErrors)
        return False
    if not names:  # an empty archive: what np.savez writes for no arrays
        return path.lower().endswith(".npz")
    return all(n.endswith(".npy") or n == INFO_MEMBER for n in names)


FORMAT = FormatSpec(
    name="npz",
    description="NumPy .npz archive of .npy arrays (never unpickled)",
    suffixes=(".npz",),
    sniff=sniff,
    open=open_npz,
    write=write_npz,
    options={"names": "key style: slash (default), dotted or tf"},
)
