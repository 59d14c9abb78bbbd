"""Reading and writing a TensorFlow tensor bundle: ``<prefix>.index`` + ``<prefix>.data-*``.

:class:`BundleReader` parses and validates the whole index when opened (every entry's dtype,
shape, size, shard and byte range against the shard's real size, every slice of a partitioned
tensor), and reads tensor bytes only when asked, straight into the destination array
(``preadv`` into the array's buffer, then the checksum over that same buffer: no extra copy).

:class:`BundleWriter` appends tensors to one data file in the order they are added and writes
the sorted index at :meth:`BundleWriter.finish`, through temporary files renamed into place, so
a reader never sees a half-written bundle.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import Any, BinaryIO, cast

import numpy as np

from parallelvars._fileio import (
    MAX_JSON_BYTES,
    atomic_path,
    make_folder,
    open_input_file,
    read_input,
    remove_made,
    write_error,
)
from parallelvars.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ClosedCheckpointError,
    CorruptCheckpointError,
    FormatVersionError,
    InvalidEntryError,
    NotACheckpointError,
    ParallelVarsError,
    TruncatedFileError,
    UnsupportedDtypeError,
)

from ._crc import crc32c, mask, unmask
from ._dtypes import DT_STRING, byteswap_inplace, numpy_dtype, tf_dtype, tf_type_name
from ._ordered_code import decode_slice_key, encode_slice_key
from ._proto import (
    BundleEntry,
    BundleHeader,
    DecodeError,
    SliceSpec,
    decode_entry,
    decode_header,
    encode_entry,
    encode_header,
    encode_stored,
)
from ._sstable import TableBuilder, TableReader
from ._strings import StringChecksumError, decode_strings, encode_strings

__all__ = ["BundleReader", "BundleWriter", "data_filename", "slice_region", "slice_shape"]

_BIG = 1
#: The largest index a reader takes (read whole): about two million tensors' entries, as the
#: largest JSON document a reader parses (``parallelvars._fileio.MAX_JSON_BYTES``).
MAX_INDEX_BYTES = MAX_JSON_BYTES
_HAS_PREADV = hasattr(os, "preadv")
_PRODUCER = 1  # TensorFlow's kTensorBundleVersion
_MIN_CONSUMER = 0


def data_filename(prefix: str, shard_id: int, num_shards: int) -> str:
    """``<prefix>.data-00000-of-00001``."""
    return f"{prefix}.data-{shard_id:05d}-of-{num_shards:05d}"


def key_str(key: bytes) -> str:
    """A bundle key as text (undecodable bytes kept via surrogate escapes)."""
    return key.decode("utf-8", "surrogateescape")


def spec_text(spec: SliceSpec) -> str:
    """A slice's extent as TensorFlow writes slice specs: ``start,length`` per axis, ``-`` for
    a whole axis."""
    return ":".join("-" if length is None else f"{start},{length}" for start, length in spec)


def _display(key: bytes) -> str:
    """A bundle key as a person reads it: a slice's key (ordered-code bytes) as its tensor's
    name and the slice's extent (``start,length`` per axis, ``-`` for a whole axis, as
    TensorFlow writes slice specs), any other key as text."""
    if key[:1] == b"\x00":
        try:
            name, spec = decode_slice_key(key)
        except DecodeError:
            pass
        else:
            return f"{name.decode('utf-8', 'backslashreplace')} (slice {spec_text(spec)})"
    return key.decode("utf-8", "backslashreplace")


def _nelements(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_MAX_RANK = 64 if int(np.__version__.split(".")[0]) >= 2 else 32
_MAX_BYTES = (1 << 63) - 1


def _shape_problem(shape: Sequence[int], itemsize: int) -> str | None:
    """Why numpy could not even describe an array of ``shape`` (empty or not), or None."""
    if len(shape) > _MAX_RANK:
        return f"rank {len(shape)} exceeds numpy's limit of {_MAX_RANK}"
    n = itemsize
    for d in shape:
        n *= d or 1
    return f"a shape of {n} bytes (zero dimensions aside)" if n > _MAX_BYTES else None


def slice_shape(spec: SliceSpec, full_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the slice ``spec`` of a tensor of ``full_shape``."""
    return tuple(
        d if length is None else length for (_, length), d in zip(spec, full_shape, strict=True)
    )


def slice_region(spec: SliceSpec, full_shape: Sequence[int]) -> tuple[slice, ...]:
    """The numpy index of the slice ``spec`` in the full tensor."""
    return tuple(
        slice(start, start + (d if length is None else length))
        for (start, length), d in zip(spec, full_shape, strict=True)
    )


def _overlap(a: SliceSpec, b: SliceSpec, shape: Sequence[int]) -> bool:
    for (s1, l1), (s2, l2), d in zip(a, b, shape, strict=True):
        e1 = s1 + (d if l1 is None else l1)
        e2 = s2 + (d if l2 is None else l2)
        if e1 <= s2 or e2 <= s1:
            return False
    return True


#: Most cells of the grid that the slice boundaries of a tensor sliced along several axes
#: draw (one byte each) before :func:`find_overlap` refuses to check the slicing.
MAX_SLICE_GRID = 1 << 24


def find_overlap(specs: Sequence[SliceSpec], shape: Sequence[int]) -> tuple[int, int] | None:
    """Indices ``(j, i)``, ``j < i``, of two slices of ``specs`` that overlap, else None.

    Linear in the number of slices (after a sort) when the slices are partial along at most one
    axis, as every TensorFlow partitioner writes them; otherwise a count over the grid the
    slice boundaries draw, of at most :data:`MAX_SLICE_GRID` cells (a ``ValueError`` beyond).
    Empty slices overlap nothing.
    """
    boxes: list[tuple[int, list[tuple[int, int]]]] = []
    for i, spec in enumerate(specs):
        box = [(s, s + (d if n is None else n)) for (s, n), d in zip(spec, shape, strict=True)]
        if all(e > s for s, e in box):
            boxes.append((i, box))
    if len(boxes) < 2:
        return None
    partial = {d for _, box in boxes for d, (s, e) in enumerate(box) if (s, e) != (0, shape[d])}
    if len(partial) <= 1:
        axis = partial.pop() if partial else 0
        order = sorted(boxes, key=lambda b: b[1][axis][0])
        for (j, prev), (i, cur) in itertools.pairwise(order):
            if cur[axis][0] < prev[axis][1]:
                return (min(i, j), max(i, j))
        return None
    axes = sorted(partial)
    edges = [sorted({x for _, box in boxes for x in box[d]}) for d in axes]
    cells = 1
    for e in edges:
        cells *= len(e) - 1
        if cells > MAX_SLICE_GRID:
            raise ValueError(f"the slices draw a grid of more than {MAX_SLICE_GRID} cells")
    where = [{x: k for k, x in enumerate(e)} for e in edges]
    grid = np.zeros([len(e) - 1 for e in edges], np.uint8)
    for i, box in boxes:
        region = tuple(slice(w[box[d][0]], w[box[d][1]]) for d, w in zip(axes, where, strict=True))
        if grid[region].any():
            for j, _ in boxes:
                if j < i and _overlap(specs[i], specs[j], shape):
                    return (j, i)
        grid[region] = 1
    return None


class BundleReader:
    """A bundle opened for reading; tensors are read on demand.

    Attributes:
        prefix: the checkpoint prefix (``dir/ckpt-1``).
        index_path: ``prefix + ".index"``.
        header: the bundle header.
        entries: bundle key -> :class:`BundleEntry`, every key of the index but the header.
        slice_keys: keys that hold one slice of a partitioned tensor.
        unsupported: key -> reason, for entries whose dtype numpy cannot hold (never read).
        verify: whether reads check the stored checksums.
    """

    def __init__(
        self,
        prefix: str,
        *,
        verify: bool = True,
        folder: str | None = None,
        index_named: bool = False,
    ) -> None:
        self.prefix = prefix
        self.index_path = prefix + ".index"
        self.verify = verify
        # The checkpoint's folder: the index (unless the user named it) and the data shards
        # are files found there, opened under the rule of every file a reader opens.
        self.folder = folder if folder is not None else os.path.dirname(prefix) or os.curdir
        self._files: dict[int, BinaryIO] = {}
        self._shard_sizes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._seek_lock = threading.Lock()
        try:
            data = read_input(
                self.index_path,
                max_bytes=MAX_INDEX_BYTES,
                what="checkpoint index",
                within=None if index_named else self.folder,
            )
        except (CheckpointNotFoundError, NotADirectoryError):
            raise NotACheckpointError(
                "no TensorFlow checkpoint index", file=self.index_path
            ) from None
        table = TableReader(data, file=self.index_path)
        items = iter(table)
        first = next(items, None)
        if first is None or first[0] != b"":
            raise CorruptCheckpointError(
                "the index does not start with the bundle header (empty key)",
                file=self.index_path,
                found=None if first is None else repr(_display(first[0])),
            )
        try:
            self.header = decode_header(first[1])
        except DecodeError as exc:
            raise CorruptCheckpointError(
                f"bad bundle header: {exc}", file=self.index_path
            ) from None
        self._check_header()
        self.big_endian = self.header.endianness == _BIG
        self._swap = self.big_endian != (sys.byteorder == "big")
        self.entries: dict[bytes, BundleEntry] = {}
        for key, value in items:
            try:
                self.entries[key] = decode_entry(value)
            except DecodeError as exc:
                raise CorruptCheckpointError(
                    f"bad index entry: {exc}", file=self.index_path, variable=_display(key)
                ) from None
        self.slice_keys: set[bytes] = set()
        self.unsupported: dict[bytes, str] = {}
        try:
            self._validate()  # (opens the data shards: closed again if it fails)
        except BaseException:
            self.close()
            raise

    # --- validation at open -------------------------------------------------------------------

    def _check_header(self) -> None:
        h = self.header
        if h.num_shards < 1:
            raise CorruptCheckpointError(
                "bad shard count in the bundle header",
                file=self.index_path,
                expected=">= 1",
                found=h.num_shards,
            )
        if h.endianness not in (0, 1):
            raise CorruptCheckpointError(
                "bad byte order in the bundle header",
                file=self.index_path,
                expected="0 or 1",
                found=h.endianness,
            )
        if h.min_consumer > _PRODUCER or _PRODUCER in h.bad_consumers:
            raise FormatVersionError(
                "the bundle needs a newer reader",
                file=self.index_path,
                expected=f"min_consumer <= {_PRODUCER}, not in bad_consumers",
                found=f"min_consumer {h.min_consumer}, bad_consumers {list(h.bad_consumers)}",
            )

    def _corrupt(self, key: bytes, what: str, **kw: Any) -> CorruptCheckpointError:
        return CorruptCheckpointError(what, file=self.index_path, variable=_display(key), **kw)

    def _validate(self) -> None:
        for key, e in self.entries.items():
            if e.slices:
                self._validate_sliced(key, e)
        for key, e in self.entries.items():
            if not e.slices:
                self._validate_stored(key, e)

    def _validate_sliced(self, key: bytes, e: BundleEntry) -> None:
        dt = numpy_dtype(e.dtype)
        if dt is None:
            self.unsupported[key] = _unsupported(e.dtype)
        problem = _shape_problem(e.shape, dt.itemsize if dt is not None else 1)
        if problem:
            raise self._corrupt(key, f"impossible tensor shape: {problem}", found=e.shape)
        total = 0
        for spec in e.slices:
            for (start, length), d in zip(spec, e.shape, strict=True):
                if start + (d if length is None else length) > d:
                    raise self._corrupt(
                        key,
                        "slice extent outside the tensor",
                        expected=f"within {e.shape}",
                        found=spec,
                    )
            skey = encode_slice_key(key, spec)
            s = self.entries.get(skey)
            if s is None:
                raise self._corrupt(key, f"the entry of slice {_spec_text(spec)} is missing")
            want = slice_shape(spec, e.shape)
            if s.slices or s.dtype != e.dtype or s.shape != want:
                raise self._corrupt(
                    key,
                    f"slice {_spec_text(spec)} does not match its tensor",
                    expected=f"{tf_type_name(e.dtype)} {want}",
                    found=f"{tf_type_name(s.dtype)} {s.shape}"
                    + (" with slices" if s.slices else ""),
                )
            self.slice_keys.add(skey)
            total += _nelements(want)
        if total != _nelements(e.shape):
            raise self._corrupt(
                key,
                "the slices do not cover the tensor",
                expected=_nelements(e.shape),
                found=f"{total} elements",
            )
        specs = e.slices
        try:
            pair = find_overlap(specs, e.shape)
        except ValueError as exc:
            raise self._corrupt(
                key, f"the slicing is too irregular to check ({exc})", found=f"{len(specs)} slices"
            ) from None
        if pair is not None:
            j, i = pair
            raise self._corrupt(
                key, f"slices {_spec_text(specs[j])} and {_spec_text(specs[i])} overlap"
            )

    def _validate_stored(self, key: bytes, e: BundleEntry) -> None:
        dt = numpy_dtype(e.dtype)
        if dt is None:
            self.unsupported[key] = _unsupported(e.dtype)
            return
        problem = _shape_problem(e.shape, dt.itemsize)
        if problem:
            raise self._corrupt(key, f"impossible tensor shape: {problem}", found=e.shape)
        n = _nelements(e.shape)
        if e.dtype == DT_STRING:
            if e.size < n + 4:
                raise self._corrupt(
                    key,
                    "string tensor entry too small for its element count",
                    expected=f">= {n + 4} bytes",
                    found=e.size,
                )
        elif e.size != n * dt.itemsize:
            raise self._corrupt(
                key,
                f"entry size does not match {tf_type_name(e.dtype)} {e.shape}",
                expected=f"{n * dt.itemsize} bytes",
                found=f"{e.size} bytes",
            )
        if e.shard_id >= self.header.num_shards:
            raise self._corrupt(
                key,
                "shard id out of range",
                expected=f"< {self.header.num_shards}",
                found=e.shard_id,
            )
        size = self._shard_size(e.shard_id, key)
        if e.offset + e.size > size:
            raise TruncatedFileError(
                "tensor bytes run past the end of the data file",
                file=self.shard_path(e.shard_id),
                variable=_display(key),
                expected=f"{e.offset + e.size} bytes",
                found=f"{size} bytes",
            )

    def shard_path(self, shard_id: int) -> str:
        return data_filename(self.prefix, shard_id, self.header.num_shards)

    def _shard_size(self, shard_id: int, key: bytes) -> int:
        size = self._shard_sizes.get(shard_id)
        if size is None:
            size = self._shard_sizes[shard_id] = os.fstat(
                self._file(shard_id, key).fileno()
            ).st_size
        return size

    # --- reading ------------------------------------------------------------------------------

    def dtype(self, key: bytes) -> np.dtype:
        """The numpy dtype of ``key``'s tensor; UnsupportedDtypeError when numpy cannot hold it."""
        e = self.entries[key]
        dt = numpy_dtype(e.dtype)
        if dt is None or key in self.unsupported:
            raise UnsupportedDtypeError(
                self.unsupported.get(key, f"{tf_type_name(e.dtype)} tensors cannot be read"),
                file=self.index_path,
                variable=_display(key),
            )
        return dt

    def read(self, key: bytes) -> np.ndarray:
        """The whole tensor stored under ``key`` (partitioned tensors assembled), checked."""
        e = self.entries[key]
        dt = self.dtype(key)
        out = np.empty(e.shape, dt)
        self._fill(key, e, out)
        return out

    def read_into(self, key: bytes, out: np.ndarray) -> None:
        """Read ``key``'s tensor into ``out`` (its shape); in place when ``out`` is contiguous."""
        e = self.entries[key]
        dt = self.dtype(key)
        if tuple(out.shape) != e.shape:
            raise InvalidEntryError(
                f"{_display(key)}: output shape {out.shape} != tensor shape {e.shape}"
            )
        if out.dtype == dt and out.flags.c_contiguous and dt.kind != "O":
            self._fill(key, e, out)
        else:
            out[...] = self.read(key)

    def _fill(self, key: bytes, e: BundleEntry, out: np.ndarray) -> None:
        if e.slices:
            for spec in e.slices:
                skey = encode_slice_key(key, spec)
                target = out[slice_region(spec, e.shape)]
                if target.flags.c_contiguous and out.dtype.kind != "O":
                    self._fill(skey, self.entries[skey], target)
                else:
                    target[...] = self.read(skey)
        elif e.dtype == DT_STRING:
            out.reshape(-1)[:] = self._read_strings(key, e)
        else:
            self._read_raw(key, e, out.reshape(-1).view(np.uint8), out.dtype)

    def _read_raw(self, key: bytes, e: BundleEntry, flat: np.ndarray, dtype: np.dtype) -> None:
        if e.size:
            self._pread(e.shard_id, e.offset, flat, key)
        if self.verify:
            actual = crc32c(flat)
            if actual != unmask(e.crc32c):
                raise ChecksumMismatchError(
                    "checksum does not match",
                    file=self.shard_path(e.shard_id),
                    variable=_display(key),
                    expected=hex(unmask(e.crc32c)),
                    found=hex(actual),
                )
        if self._swap:
            byteswap_inplace(flat, dtype)
        if dtype.kind == "b":  # any nonzero byte is true, as in TensorFlow; numpy wants 0/1
            np.minimum(flat, 1, out=flat)

    def _read_strings(self, key: bytes, e: BundleEntry) -> list[bytes]:
        buf = np.empty(e.size, np.uint8)
        self._pread(e.shard_id, e.offset, buf, key)
        try:
            return decode_strings(
                buf.tobytes(),
                _nelements(e.shape),
                "big" if self.big_endian else "little",
                unmask(e.crc32c) if self.verify else None,
            )
        except StringChecksumError as exc:
            raise ChecksumMismatchError(
                exc.what,
                file=self.shard_path(e.shard_id),
                variable=_display(key),
                expected=hex(exc.expected),
                found=hex(exc.found),
            ) from None
        except DecodeError as exc:
            raise CorruptCheckpointError(
                f"bad string tensor: {exc}",
                file=self.shard_path(e.shard_id),
                variable=_display(key),
            ) from None

    def _file(self, shard_id: int, key: bytes) -> BinaryIO:
        f = self._files.get(shard_id)
        if f is None:
            with self._lock:  # several threads may read the first tensors of a shard at once
                f = self._files.get(shard_id)
                if f is None:
                    path = self.shard_path(shard_id)
                    try:  # kept open until close(); a found file: not a FIFO, no link out
                        opened = open_input_file(
                            path,
                            buffering=0,
                            within=self.folder,
                            referrer=self.index_path,
                            variable=_display(key),
                        )
                    except CheckpointNotFoundError:
                        raise CorruptCheckpointError(
                            "data shard is missing", file=path, variable=_display(key)
                        ) from None
                    f = self._files[shard_id] = cast(BinaryIO, opened)
        return f

    def _pread(self, shard_id: int, offset: int, flat: np.ndarray, key: bytes) -> None:
        f = self._file(shard_id, key)
        view = flat.data.cast("B")
        total = len(view)
        done = 0
        if _HAS_PREADV:
            fd = f.fileno()
            while done < total:
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    break
                done += n
        else:  # pragma: no cover - platforms without preadv
            with self._seek_lock:
                f.seek(offset)
                while done < total:
                    n = f.readinto(view[done:])  # type: ignore[attr-defined]
                    if not n:
                        break
                    done += n
        if done < total:
            raise TruncatedFileError(
                "data file ends inside a tensor",
                file=self.shard_path(shard_id),
                variable=_display(key),
                expected=f"{offset + total} bytes",
                found=f"{offset + done} bytes",
            )

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> BundleReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unsupported(num: int) -> str:
    if tf_type_name(num).startswith("DT_"):
        return f"{tf_type_name(num)} tensors cannot be read without TensorFlow"
    return f"unknown TensorFlow dtype number {num}"


def _spec_text(spec: SliceSpec) -> str:
    """SaveV2's slice notation: ``start,length`` per dimension, ``-`` for a full one."""
    return ":".join("-" if length is None else f"{start},{length}" for start, length in spec)


_INT = frozenset({int})


class BundleWriter:
    """Writes a single-shard bundle; tensors go to the data file in the order they are added.

    Example:
        >>> import numpy as np, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> with BundleWriter(os.path.join(d, "ckpt")) as w:
        ...     _ = w.add(b"x", np.array([1.0, 2.0], np.float32))
        >>> os.path.getsize(os.path.join(d, "ckpt.index"))
        121
    """

    def __init__(self, prefix: str, *, big_endian: bool = False) -> None:
        self.prefix = prefix
        self.big_endian = big_endian
        self._swap = big_endian != (sys.byteorder == "big")
        self.index_path = prefix + ".index"
        parent = os.path.dirname(os.path.abspath(prefix))
        self._made = make_folder(parent, self.index_path)  # taken back by abort()
        # All or nothing over a checkpoint at the same prefix: TensorFlow names the data files
        # after their count, so the new one takes the other count (one file, or two with the
        # second empty) and never replaces a file the old index names; the index's rename is
        # the commit, and the old data files go after it.
        self.num_shards = 2 if _shard_count(self.index_path) == 1 else 1
        self.data_path = data_filename(prefix, 0, self.num_shards)
        tag = uuid.uuid4().hex
        self._tmp_data = f"{self.data_path}.tempstate{tag}"
        self._tmp_index = f"{self.index_path}.tempstate{tag}"
        self._f: BinaryIO | None = open(self._tmp_data, "wb")  # noqa: SIM115 - closed in finish()/abort()
        self._offset = 0
        # The (type number, shape, size) triples already found sound (exact ints only), with
        # the shape _check_tensor returns for them: most tensors of a file share a few.
        self._sound: dict[tuple[Any, ...], tuple[int, ...]] = {}
        # The index to write, by key: each tensor stored whole as its entry's encoded bytes
        # (a few dozen bytes per tensor, not an object), a partitioned tensor's entry (the
        # list of its slices, which grows as they are added) as a BundleEntry.
        self._stored: dict[bytes, bytes] = {}
        self._sliced: dict[bytes, BundleEntry] = {}
        self._done = False

    @property
    def swaps(self) -> bool:
        """Whether tensors are byte-swapped on their way to the data file."""
        return self._swap

    def _check_key(self, key: bytes) -> None:
        if not key:
            raise InvalidEntryError("the empty key is reserved for the bundle header")
        if key in self._stored or key in self._sliced:
            raise InvalidEntryError(f"key {_display(key)!r} added twice")

    def _open_file(self) -> BinaryIO:
        if self._f is None:
            raise ClosedCheckpointError(
                "the bundle writer is already finished", file=self.index_path
            )
        return self._f

    def _check_tensor(self, key: bytes, num: Any, shape: Any, size: int | None) -> tuple[int, ...]:
        """Check one tensor before it is written: a new key, a TensorFlow type number this
        module can write, dimensions that are non-negative integers and, but for strings
        (``size`` None), ``size`` bytes being the shape's elements times the type's itemsize.
        Returns the shape as a tuple of ints (the index encodes it; list shapes are fine)."""
        self._check_key(key)
        known = None
        if type(num) is int and type(shape) is tuple and set(map(type, shape)) <= _INT:
            known = (num, shape, size)
            dims = self._sound.get(known)
            if dims is not None:
                return dims
        dims = self._checked_tensor(key, num, shape, size)
        if known is not None and len(self._sound) < 4096:
            self._sound[known] = dims
        return dims

    def _checked_tensor(
        self, key: bytes, num: Any, shape: Any, size: int | None
    ) -> tuple[int, ...]:
        """:meth:`_check_tensor` past the key: the checks of a triple not met before."""
        name = _display(key)
        if isinstance(num, bool) or not isinstance(num, (int, np.integer)):
            raise InvalidEntryError(
                "a TensorFlow type number must be an integer",
                file=self.index_path,
                variable=name,
                found=repr(num),
            )
        dt = numpy_dtype(int(num))
        if dt is None:
            raise UnsupportedDtypeError(
                _unsupported(int(num)), file=self.index_path, variable=name, found=int(num)
            )
        try:
            dims = tuple(shape)
        except TypeError:
            dims = None
        if dims is None or any(
            isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in dims
        ):
            raise InvalidEntryError(
                "a tensor's dimensions must be non-negative integers",
                file=self.index_path,
                variable=name,
                found=repr(shape),
            )
        dims = tuple(int(d) for d in dims)
        problem = _shape_problem(dims, dt.itemsize)
        if problem is not None:
            raise InvalidEntryError(
                "a tensor shape numpy cannot describe",
                file=self.index_path,
                variable=name,
                found=problem,
            )
        if size is not None and int(num) != DT_STRING:
            want = _nelements(dims) * dt.itemsize
            if size != want:
                raise InvalidEntryError(
                    f"a {tf_type_name(int(num))} tensor of shape {dims} has another size",
                    file=self.index_path,
                    variable=name,
                    expected=f"{want} bytes",
                    found=f"{size} bytes",
                )
        return dims

    def add(self, key: bytes, value: np.ndarray, *, dtype: int | None = None) -> BundleEntry:
        """Append one tensor; ``dtype`` forces a TensorFlow type number (quantized types)."""
        self._check_key(key)
        value = np.asarray(value)
        num = dtype if dtype is not None else tf_dtype(value.dtype)
        if num is None:
            raise UnsupportedDtypeError(
                "TensorFlow checkpoints cannot hold this dtype",
                file=self.index_path,
                variable=_display(key),
                found=value.dtype,
            )
        f = self._open_file()
        self._check_tensor(
            key, num, value.shape, None if value.dtype.kind in "OSU" else value.nbytes
        )
        if num == DT_STRING:
            data, crc = encode_strings(
                _string_elements(value, key, self.index_path),
                "big" if self.big_endian else "little",
            )
            f.write(data)
            size = len(data)
        else:
            arr = value
            if arr.dtype.byteorder == ">" or arr.dtype.byteorder == "<":
                arr = arr.astype(arr.dtype.newbyteorder("="), copy=False)
            arr = np.ascontiguousarray(arr)
            flat = arr.reshape(-1).view(np.uint8)
            if self._swap:
                flat = flat.copy()
                byteswap_inplace(flat, arr.dtype)
            f.write(flat.data)
            crc = crc32c(flat)
            size = flat.size
        entry = BundleEntry(
            num, tuple(int(d) for d in value.shape), 0, self._offset, size, mask(crc)
        )
        self._offset += size
        self._stored[key] = encode_stored(
            entry.dtype, entry.shape, entry.offset, size, entry.crc32c
        )
        return entry

    def add_run(self, tensors: Sequence[tuple[bytes, int, Sequence[int], int]], data: Any) -> None:
        """Append tensors whose bytes lie back to back in ``data`` (a uint8 array or any
        bytes-like object, each tensor's elements in C order and this machine's byte order),
        in one write.

        ``tensors`` gives each one's key, TensorFlow type number, shape and size in bytes (its
        share of ``data``, in turn); each is checked as :meth:`add` checks it (size against
        the shape and the type's itemsize). The entries are those :meth:`add` makes of the
        same tensors: only the write and the index's bookkeeping are gathered. Not for string
        tensors. A writer that swaps byte order swaps a copy of ``data``.
        """
        f = self._open_file()
        if isinstance(data, np.ndarray):
            flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        else:
            flat = np.ascontiguousarray(np.asarray(memoryview(data))).reshape(-1).view(np.uint8)
        shapes = []
        for key, num, shape, size in tensors:
            shapes.append(self._check_tensor(key, num, shape, size))
            if num == DT_STRING:
                raise UnsupportedDtypeError(
                    "string tensors are written one by one, not in a gathered run",
                    file=self.index_path,
                    variable=_display(key),
                    found="DT_STRING",
                )
        if sum(t[3] for t in tensors) != flat.size:
            raise InvalidEntryError(
                "a gathered run's bytes do not add up to its tensors' sizes",
                file=self.index_path,
                expected=f"{sum(t[3] for t in tensors)} bytes",
                found=f"{flat.size} bytes",
            )
        keys = [t[0] for t in tensors]
        if len(set(keys)) != len(keys):
            seen: set[bytes] = set()
            for key in keys:
                if key in seen:
                    raise InvalidEntryError(f"key {_display(key)!r} added twice")
                seen.add(key)
        if self._swap:  # into the file's byte order, tensor by tensor
            flat = flat.copy()
            pos = 0
            for _key, num, _shape, size in tensors:
                byteswap_inplace(flat[pos : pos + size], cast(np.dtype, numpy_dtype(num)))
                pos += size
        view = flat.data  # (a memoryview of the bytes, C-contiguous)
        pos, offset, stored = 0, self._offset, self._stored
        for (key, num, _, size), shape in zip(tensors, shapes, strict=True):
            crc = mask(crc32c(view[pos : pos + size]))
            stored[key] = encode_stored(num, shape, offset + pos, size, crc)
            pos += size
        f.write(view)
        self._offset = offset + pos

    def add_slice(
        self,
        key: bytes,
        full_shape: Sequence[int],
        spec: SliceSpec,
        value: np.ndarray,
        *,
        dtype: int | None = None,
    ) -> BundleEntry:
        """Append one slice of the partitioned tensor ``key`` of ``full_shape``.

        ``spec`` gives ``(start, length)`` per dimension, or ``(0, None)`` for a full one.
        """
        full_shape = tuple(int(d) for d in full_shape)
        want = slice_shape(spec, full_shape)
        value = np.asarray(value)
        if tuple(value.shape) != want:
            raise InvalidEntryError(
                f"{_display(key)}: slice {_spec_text(spec)} has shape {value.shape}, expected {want}"
            )
        slice_entry = self.add(encode_slice_key(key, spec), value, dtype=dtype)
        full = self._sliced.get(key)
        if full is None and key not in self._stored:
            full = BundleEntry(slice_entry.dtype, full_shape)
        elif (
            full is None
            or not full.slices
            or full.dtype != slice_entry.dtype
            or full.shape != full_shape
        ):
            raise InvalidEntryError(
                f"{_display(key)}: slice does not match the tensor's earlier slices"
            )
        self._sliced[key] = BundleEntry(full.dtype, full.shape, slices=(*full.slices, spec))
        return slice_entry

    def finish(self) -> None:
        """Write the index and move both files into place."""
        assert self._f is not None, "writer already finished"
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        table = TableBuilder()
        header = BundleHeader(self.num_shards, int(self.big_endian), _PRODUCER, _MIN_CONSUMER)
        table.add(b"", encode_header(header))
        stored, sliced = self._stored, self._sliced
        for key in sorted(stored.keys() | sliced.keys() if sliced else stored):
            value = stored.get(key)
            table.add(key, value if value is not None else encode_entry(sliced[key]))
        with open(self._tmp_index, "wb") as f:
            f.write(table.finish())
            f.flush()
            os.fsync(f.fileno())
        for shard in range(1, self.num_shards):  # the empty second data file of a pair
            with atomic_path(data_filename(self.prefix, shard, self.num_shards)) as tmp:
                open(tmp, "xb").close()
        os.replace(self._tmp_data, self.data_path)  # a name the old index does not use
        _fsync_dir(os.path.dirname(os.path.abspath(self.prefix)))
        os.replace(self._tmp_index, self.index_path)  # the commit
        _fsync_dir(os.path.dirname(os.path.abspath(self.prefix)))
        self._done = True
        folder, base = os.path.split(self.prefix)
        for name in os.listdir(folder or os.curdir):  # the old checkpoint's data files
            m = _DATA_SUFFIX.fullmatch(name[len(base) :]) if name.startswith(base) else None
            if m is not None and int(m.group(1)) != self.num_shards:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))

    def abort(self) -> None:
        """Drop everything written so far."""
        if self._f is not None:
            self._f.close()
            self._f = None
        for p in (self._tmp_data, self._tmp_index):
            if os.path.exists(p):
                os.remove(p)
        remove_made(self._made)

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        # A write the system refused (disk full, file too large) is our CheckpointWriteError;
        # the temporaries go, the last good checkpoint stays.
        if exc_type is None:
            if not self._done:
                try:
                    self.finish()
                except BaseException as exc:
                    self.abort()
                    mapped = write_error(exc, self.prefix)
                    if mapped is not exc:
                        raise mapped from exc
                    raise
        else:
            self.abort()
            failure = rest[0] if rest else None
            if isinstance(failure, BaseException):
                mapped = write_error(failure, self.prefix)
                if mapped is not failure:
                    raise mapped from failure


_DATA_SUFFIX = re.compile(r"\.data-\d{5}-of-(\d{5})")


def _shard_count(index: str) -> int | None:
    """The data file count the index at ``index`` names, or None (no index, or not one we can
    read: nothing it names needs keeping)."""
    try:
        data = read_input(index, max_bytes=MAX_INDEX_BYTES, what="checkpoint index")
        first = next(iter(TableReader(data, file=index)), None)
        if first is None or first[0] != b"":
            return None
        return decode_header(first[1]).num_shards
    except (OSError, ParallelVarsError, DecodeError, ValueError):
        return None


def _string_elements(value: np.ndarray, key: bytes, file: str) -> list[bytes]:
    out = []
    for item in value.reshape(-1).tolist() if value.dtype.kind != "O" else value.reshape(-1):
        if isinstance(item, (bytes, bytearray, memoryview)):
            out.append(bytes(item))
        elif isinstance(item, str):
            out.append(item.encode("utf-8"))
        else:
            raise UnsupportedDtypeError(
                "string tensors hold bytes or str elements",
                file=file,
                variable=_display(key),
                found=type(item).__name__,
            )
    return out


def _fsync_dir(path: str) -> None:
    if os.name != "posix":  # pragma: no cover
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
