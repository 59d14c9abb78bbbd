"""One variable of a native checkpoint file (:class:`StoredVariable`): layout validation,
component reads straight into the destination buffer, and checksum verification.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import crc32c as _crc32c
import h5py
import numpy as np

from parallelvars._aggregate import has_logical_value, no_value_error, read_logical_into
from parallelvars._dtypes import as_dtype, dtype_name
from parallelvars._fileio import byte_view, checksum
from parallelvars._geometry import shard_shapes
from parallelvars.checkpoint import _h5policy
from parallelvars.checkpoint.entry import Entry, check_entry, check_name_text
from parallelvars.checkpoint.h5io.attributes import _decode
from parallelvars.checkpoint.h5io.layout import _H5_ERRORS, _MAX_COMPRESSION
from parallelvars.checkpoint.registry import component_name
from parallelvars.errors import (
    ChecksumMismatchError,
    ConcurrentWriteError,
    CorruptCheckpointError,
    DtypeMismatchError,
    ShapeMismatchError,
    TruncatedFileError,
    UnsupportedDtypeError,
)

if TYPE_CHECKING:
    from parallelvars.checkpoint.h5io._global_heap import GlobalHeapCheck


class OpenFile(Protocol):
    """What a :class:`StoredVariable` reads through: the open file of its
    :class:`~parallelvars.checkpoint.h5io.read.H5Reader` (which holds the variables, so this
    module names only the protocol)."""

    path: str
    file_size: int

    def _open_dataset(self, path: str, dtype: np.dtype) -> Any: ...

    def _holds(self, dsid: Any) -> bool: ...

    def _reached(self, name: str) -> bool: ...

    def _h5(self) -> h5py.File: ...

    def _buffer(self, nbytes: int) -> np.ndarray: ...

    def _chunk(self, nbytes: int) -> np.ndarray: ...

    def _fd(self) -> int: ...

    def _read_fully(
        self, view: memoryview, offset: int, variable: str | None = None, *, crc: bool = False
    ) -> int: ...

    def _staged_bytes(self, offset: int, nbytes: int) -> np.ndarray | None: ...

    _prefetched: dict[str, list[np.ndarray]]

    def _slot(self, offset: int, nbytes: int) -> np.ndarray | None: ...

    def _keep(self, offset: int, data: np.ndarray, crc: int) -> None: ...

    def _kept_crc(self, offset: int, nbytes: int) -> int | None: ...

    def _reading(self, offset: int) -> AbstractContextManager[object]: ...

    def _note_crc(self, offset: int, nbytes: int, crc: int) -> None: ...

    def _keep_copy(self, offset: int, data: np.ndarray, crc: int) -> None: ...

    def _keep_value(self, key: tuple[str, int], value: np.ndarray) -> None: ...

    def _kept_value(self, key: tuple[str, int]) -> np.ndarray | None: ...


# dtype name -> dtype, for the first names met (an index names one per variable, mostly the
# same few); bounded, so a crafted index of many distinct names cannot grow it.
_DTYPES: dict[str, np.dtype] = {}


def _dtype_named(name: str) -> np.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = as_dtype(name)
        if len(_DTYPES) < 64:
            _DTYPES[name] = dtype
    return dtype


def _is_variable_length(tid: Any) -> bool:
    if tid.get_class() == h5py.h5t.VLEN:
        return True
    return bool(tid.get_class() == h5py.h5t.STRING and tid.is_variable_str())


# HDF5 memory types by numpy dtype string ("str": a variable-length string), made once
_MEMORY_TYPES: dict[str, Any] = {}


def _memory_type(key: str, dtype: Any) -> Any:
    mtype = _MEMORY_TYPES.get(key)
    if mtype is None:
        mtype = _MEMORY_TYPES[key] = h5py.h5t.py_create(dtype)
    return mtype


def _elements(shape: tuple[int, ...] | None) -> int:
    """The number of elements of an attribute's dataspace (None: a null dataspace)."""
    return 0 if shape is None else math.prod(shape)


_UNHELD = object()


def _held_value(elements: list[bytes], shape: tuple[int, ...] | None, tid: Any) -> Any:
    """A variable-length string attribute's value, decoded as h5py decodes it, from the heap
    objects our parser validated (the bytes HDF5's read returns for it, at a fraction of an
    HDF5 read's cost); ``_UNHELD`` for other types and shapes, which HDF5 then reads."""
    if shape is None or len(shape) > 1 or tid.get_class() != h5py.h5t.STRING:
        return _UNHELD
    text = [b.decode("utf-8", "surrogateescape") for b in elements]
    return _decode(text[0]) if not shape else [_decode(v) for v in text]


def _attribute_value(group: h5py.Group, key: str, attr: Any, tid: Any) -> Any:
    """The decoded value of ``group.attrs[key]`` (``attr`` opened already): plain numbers,
    fixed-length strings and variable-length strings, scalar or 1-d, are read through the
    low-level API (a fraction of the high-level read's cost, a few thousand times per
    verify); anything else through h5py's high-level read."""
    shape = attr.shape
    if shape is None or len(shape) > 1:
        return _decode(group.attrs[key])
    if tid.get_class() == h5py.h5t.STRING and tid.is_variable_str():
        raw = np.empty(shape, object)
        attr.read(raw, mtype=_memory_type("str", h5py.string_dtype()))
        text = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in raw.ravel()]
        return _decode(text[0]) if raw.ndim == 0 else [_decode(v) for v in text]
    dtype = attr.dtype
    if dtype.kind not in "iufbS" or dtype.fields is not None or dtype.subdtype is not None:
        return _decode(group.attrs[key])
    arr = np.empty(shape, dtype)
    attr.read(arr, mtype=_memory_type(dtype.str, dtype))
    return _decode(arr[()] if arr.ndim == 0 else arr)


class StoredVariable(Entry):
    """One variable of a checkpoint file: an :class:`~parallelvars.checkpoint.entry.Entry`
    whose components are read from the file and verified against their checksums."""

    #: Whether its name and layout were checked when it was made (``__init__`` through
    #: ``_validated_layout``, ``from_row`` through the index's table): ``check_entry`` then
    #: passes it without checking again (a forwarding entry, which may change them, is checked).
    layout_checked = False

    def __init__(self, reader: OpenFile, path: str, meta: Mapping[str, Any]) -> None:
        self._reader = reader
        self.path = path
        file = reader.path
        try:
            self.kind = str(meta["kind"])
            dname = str(meta["dtype"])
            self.shape = tuple(map(int, meta["shape"]))
            self.num_components = int(meta["num_components"])
            self.attrs: dict[str, Any] = dict(meta.get("attrs") or {})
            offsets = meta.get("offsets")
            self._index_offsets: list[int | None] | None = (
                None if offsets is None else [None if o is None else int(o) for o in offsets]
            )
            crcs = meta.get("crc32c")
            self._crcs: list[int | None] | None = None if crcs is None else list(map(int, crcs))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(
                "variable lacks its layout attributes",
                file=file,
                variable=path,
                found=f"missing {exc}",
            ) from None
        if dname == "bytes":
            self.dtype = np.dtype(object)
        else:
            try:
                self.dtype = _dtype_named(dname)
            except UnsupportedDtypeError:
                raise UnsupportedDtypeError(
                    "unknown dtype",
                    file=file,
                    variable=path,
                    expected="a numpy dtype name (float32, int64, ...), bfloat16 or bytes",
                    found=dname,
                ) from None
        self._shapes: list[tuple[int, ...]] = self._validated_layout()
        self.layout_checked = True
        # The components verified, whose storage was checked, placed by the index: dicts used
        # as sets (an empty dict is a third of an empty set's size, and a reader may hold
        # 100,000 variables).
        self._verified: dict[int, None] = {}
        self._storage_ok: dict[int, None] = {}
        self._datasets: dict[int, Any] = {}
        self._locations: dict[int, tuple[int, int] | None] = {}
        self._from_index: dict[int, None] = {}

    @classmethod
    def from_row(
        cls,
        reader: OpenFile,
        path: str,
        kind: str,
        dtype: np.dtype,
        shape: tuple[int, ...],
        attrs: dict[str, Any],
        offsets: list[int | None],
        crcs: list[int],
    ) -> StoredVariable:
        """A variable of a row of the index's table (not sharded, not byte strings), whose
        fields the table validated at open (kind, number of components, aggregation, devices,
        dimensions, offsets and checksums in range, one offset and checksum per component):
        made without parsing and checking them again; its name is checked as any other's."""
        check_name_text(path, reader.path, error=CorruptCheckpointError)
        self = cls.__new__(cls)
        self._reader = reader
        self.path = path
        self.kind = kind
        self.dtype = dtype
        self.shape = shape
        self.num_components = len(crcs)
        self.attrs = attrs
        self._index_offsets = offsets
        self._crcs = list(crcs)
        self._shapes = [shape] * len(crcs)
        self.layout_checked = True
        self._verified = {}
        self._storage_ok = {}
        self._datasets = {}
        self._locations = {}
        self._from_index = {}
        return self

    @classmethod
    def from_group(cls, reader: OpenFile, path: str, group: h5py.Group) -> StoredVariable:
        """Build from group attributes (files without an index)."""
        attrs = {k: _decode(v) for k, v in group.attrs.items()}
        meta = {k: attrs.pop(k) for k in ("kind", "dtype", "shape", "num_components") if k in attrs}
        meta["attrs"] = attrs
        return cls(reader, path, meta)

    def _dataset(self, i: int) -> Any:
        """The low-level dataset id of component ``i`` (opened once, shape checked)."""
        ds = self._datasets.get(i)
        if ds is None:
            name = component_name(i)
            ds = self._reader._open_dataset(f"/{self.path}/{name}", self.dtype)
            if not isinstance(ds, h5py.h5d.DatasetID):
                raise CorruptCheckpointError(
                    f"dataset {name!r} is missing",
                    file=self._reader.path,
                    variable=self.path,
                    expected=f"{self.num_components} components",
                    found=f"no {name}",
                    hint=self._missing_part_hint(name),
                )
            if tuple(ds.shape) != self._shapes[i]:
                raise CorruptCheckpointError(
                    f"dataset {name!r} has the wrong shape",
                    file=self._reader.path,
                    variable=self.path,
                    expected=self._shapes[i],
                    found=tuple(ds.shape),
                )
            self._datasets[i] = ds
        return ds

    def _missing_part_hint(self, name: str) -> str | None:
        """For a multi-process checkpoint whose rank file is gone: what the file needs."""
        try:
            link = self._reader._h5().get(f"/{self.path}/{name}", getlink=True)
        except Exception:  # the message without a hint is still right
            return None
        if not isinstance(link, h5py.ExternalLink):
            return None
        folder = os.path.dirname(link.filename) or "."
        return (
            f"it lives in {link.filename}, beside the file, which is not there: a checkpoint saved "
            f"by several processes is the file plus its folder {folder}/; copy both, or make a "
            "standalone file where both are with 'parallelvars convert CHECKPOINT standalone.h5'"
        )

    def _bad(self, what: str, expected: Any, found: Any) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            what, file=self._reader.path, variable=self.path, expected=expected, found=found
        )

    def _validated_layout(self) -> list[tuple[int, ...]]:
        """Check every layout field of the variable once, at open; the components' shapes.

        The entry checks every reader shares (:func:`~parallelvars.checkpoint.entry.check_entry`:
        kind, aggregation, components, devices, shard axis and offsets covering the axis
        exactly, so no reader ever leaves a row unwritten), then the index's own lists.
        """
        n = self.num_components
        check_entry(self, self._reader.path, error=CorruptCheckpointError)
        for what, values in (("checksums", self._crcs), ("data offsets", self._index_offsets)):
            if values is not None and len(values) != n:
                raise self._bad(
                    f"the index lists {len(values)} {what}", f"{n} (one per component)", len(values)
                )
        if self.kind != "sharded":
            return [self.shape] * n
        return shard_shapes(self.shape, int(self.attrs["shard_axis"]), self.attrs["shard_offsets"])

    def component_shape(self, i: int) -> tuple[int, ...]:
        return self._shapes[i]

    def component_nbytes(self, i: int) -> int:
        return math.prod(self._shapes[i]) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(self.component_nbytes(i) for i in range(self.num_components))

    @property
    def stored_checksums(self) -> list[int | None]:
        if self._crcs is None:
            crcs: list[int | None] = []
            for i in range(self.num_components):
                v = h5py.Dataset(self._dataset(i)).attrs.get("crc32c")
                crcs.append(None if v is None else int(v))
            self._crcs = crcs
        return self._crcs

    def _fail(self, what: str, i: int, **kw: Any) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            what, file=self._reader.path, variable=f"{self.path}/{component_name(i)}", **kw
        )

    def _check_storage(self, i: int) -> None:
        """Refuse a component whose shape needs more bytes than the file can hold.

        Called before anything is allocated for it, so a damaged or hostile header cannot make
        a reader allocate more than the file's size (times deflate's best compression ratio,
        for compressed datasets).
        """
        if i in self._storage_ok:
            return
        if (
            self.dtype.kind != "O"
            and self._location(i) is not None
            and i in self._from_index
            and self._reader._reached(f"{self.path}/{component_name(i)}")
        ):
            # The index places it and its name is reached by hard links only (the restore
            # path's rule plus the indirection policy's, no dataset opened): ``_location``
            # refused an offset whose bytes pass the end of the file, so nothing larger than
            # the file is allocated for it, and its bytes are checked against the index's
            # checksum as they are read. A mismatch drops the index's place
            # (``_with_bytes``), and the dataset is then checked here like any other.
            return
        dsid = self._dataset(i)
        needed = math.prod(self._shapes[i]) * (
            16 if self.dtype.kind == "O" else self.dtype.itemsize
        )
        try:
            stored = int(dsid.get_storage_size())
            dcpl = dsid.get_create_plist()
            filtered, external = dcpl.get_nfilters() > 0, dcpl.get_external_count() > 0
        except _H5_ERRORS as exc:
            raise self._fail("cannot read the dataset layout", i, found=str(exc)) from None
        if needed and not external:
            limit = stored * _MAX_COMPRESSION if filtered else stored
            held = self._reader.file_size
            if stored > held:  # a component behind an external link: the size of its file
                try:
                    held = int(h5py.h5i.get_file_id(dsid).get_filesize())
                except _H5_ERRORS:
                    pass
            if needed > limit or stored > held:
                raise TruncatedFileError(
                    "the dataset holds fewer bytes than its shape needs",
                    file=self._reader.path,
                    variable=f"{self.path}/{component_name(i)}",
                    expected=f"{needed} bytes{' (uncompressed)' if filtered else ''}",
                    found=f"{stored} bytes stored, file of {held} bytes",
                )
        self._storage_ok[i] = None

    def _location(self, i: int) -> tuple[int, int] | None:
        """(file offset, element count) of a contiguous, unfiltered component, else None."""
        if i in self._locations:
            return self._locations[i]
        indexed = (
            self._index_offsets[i] if self._index_offsets and i < len(self._index_offsets) else None
        )
        if (
            indexed is not None
            and self.dtype.kind != "O"
            and (
                not math.prod(self._shapes[i])
                or self._reader._reached(f"{self.path}/{component_name(i)}")
            )
        ):
            # (the index's place, when the component's name leads there: a link re-pointed
            # to another dataset is read where HDF5 reads it, and checked there against its
            # own checksum, so every reader of the file reads the same bytes)
            size = math.prod(self._shapes[i])
            if indexed < 0 or indexed + size * self.dtype.itemsize > self._reader.file_size:
                raise TruncatedFileError(
                    "file ends inside the data",
                    file=self._reader.path,
                    variable=f"{self.path}/{component_name(i)}",
                    expected=f"{indexed + size * self.dtype.itemsize} bytes",
                    found=f"{self._reader.file_size} bytes",
                )
            self._locations[i] = (indexed, size)
            self._from_index[i] = None
            return self._locations[i]
        return self._location_from_h5(i)

    def _location_from_h5(self, i: int) -> tuple[int, int] | None:
        """The location as HDF5 itself reports it (opens the dataset)."""
        loc: tuple[int, int] | None = None
        dsid = self._dataset(i)
        size = math.prod(self._shapes[i])
        nbytes = size * self.dtype.itemsize
        if self.dtype.kind != "O" and self._reader._holds(dsid):
            try:
                dcpl = dsid.get_create_plist()
                plain = not (
                    dcpl.get_layout() != h5py.h5d.CONTIGUOUS
                    or dcpl.get_nfilters()
                    or dcpl.get_external_count()
                )
                offset = dsid.get_offset() if plain and nbytes else None
                stored = dsid.get_storage_size() if offset is not None else 0
                file_dt = dsid.dtype
            except _H5_ERRORS:
                offset = None
            if nbytes == 0:
                loc = (0, 0)
            elif offset is not None and not (file_dt.kind != "V" and file_dt.byteorder == ">"):
                if stored != nbytes or file_dt.itemsize != self.dtype.itemsize:
                    raise self._fail(
                        "stored size does not match the shape",
                        i,
                        expected=f"{nbytes} bytes",
                        found=f"{stored} bytes",
                    )
                if offset + nbytes > self._reader.file_size:
                    raise TruncatedFileError(
                        "file ends inside the data",
                        file=self._reader.path,
                        variable=f"{self.path}/{component_name(i)}",
                        expected=f"{offset + nbytes} bytes",
                        found=f"{self._reader.file_size} bytes",
                    )
                loc = (int(offset), size)
        self._locations[i] = loc
        return loc

    def _with_bytes(self, i: int, fn: Callable[[np.ndarray], Any]) -> Any:
        """Call ``fn`` with component ``i`` as a read-only array; ``fn`` must not keep it.

        A contiguous component is read with ``pread`` into a reused buffer of this thread (one
        component's size at most, so a reader's memory stays bounded whatever the file's size;
        most reads skip this and go straight into their destination, see
        :meth:`read_component_into`). Other layouts go through h5py.
        """
        try:
            return self._with_located_bytes(i, fn)
        except ChecksumMismatchError:
            if i not in self._from_index:
                raise
            # The index's offset may be stale (a file rewritten by another HDF5 tool): ask
            # HDF5 where the dataset is, and check again there.
            self._from_index.pop(i, None)
            indexed = self._locations.pop(i)
            if self._location_from_h5(i) == indexed:
                raise
            return self._with_located_bytes(i, fn)

    def _with_located_bytes(self, i: int, fn: Callable[[np.ndarray], Any]) -> Any:
        loc = self._location(i)
        if loc is None:
            kept = self._reader._kept_value((self.path, i))  # verified by this restore
            return fn(self._read_h5(i) if kept is None else kept)
        offset, size = loc
        if size == 0:
            return fn(np.empty(self._shapes[i], self.dtype))
        # Read with pread into a buffer of this thread's, never through a memory map: a file
        # truncated while it is being read is then an error (TruncatedFileError), not SIGBUS.
        buf = self._reader._buffer(size * self.dtype.itemsize)
        arr = buf.view(self.dtype).reshape(self._shapes[i])
        self._pread_into(i, arr, offset)
        arr.flags.writeable = False
        try:
            return fn(arr)
        finally:
            del arr

    def _read_h5(self, i: int) -> np.ndarray:
        self._check_storage(i)
        ds = h5py.Dataset(self._dataset(i))
        try:
            data = ds[()]
        except _H5_ERRORS as exc:
            raise self._fail("cannot read the dataset", i, found=str(exc)) from None
        if self.dtype.kind == "O":
            return np.asarray(data, dtype=object).reshape(ds.shape)
        data = np.asarray(data)
        if data.dtype != self.dtype:
            data = (
                data.view(self.dtype)
                if data.dtype.kind == "V"
                else data.astype(self.dtype.newbyteorder("="))
            )
        return data.reshape(ds.shape)

    def read_rows(self, i: int, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (axis 0) of component ``i``, read alone (an HDF5 hyperslab of
        the contiguous dataset), in this variable's dtype.

        Not verified: a component's checksum covers all its bytes. The caller verifies the
        rows with the other rows' checksums (a multi-process restore combines its processes'
        pieces, see ``checkpoint._restore.verify_pieces``).
        """
        self._check_storage(i)
        ds = h5py.Dataset(self._dataset(i))
        if not 0 <= start <= stop <= self._shapes[i][0]:
            raise self._fail("rows out of the component", i, found=f"rows {start}:{stop}")
        try:
            data = np.asarray(ds[start:stop])
        except _H5_ERRORS as exc:
            raise self._fail("cannot read the dataset", i, found=str(exc)) from None
        if data.dtype != self.dtype:
            data = (
                data.view(self.dtype)
                if data.dtype.kind == "V"
                else data.astype(self.dtype.newbyteorder("="))
            )
        return np.ascontiguousarray(data.reshape((stop - start, *self._shapes[i][1:])))

    def _check(self, i: int, data: np.ndarray) -> None:
        self._compare(i, checksum(data))

    def _compare(self, i: int, found: int) -> None:
        expected = self.stored_checksums[i]
        if expected is None:
            raise self._fail("dataset has no crc32c attribute", i)
        if found != expected:
            # (read where the name leads, not where the index places it: say both places)
            offsets = self._index_offsets or ()
            indexed = offsets[i] if i < len(offsets) else None
            loc = self._locations.get(i)
            moved = indexed is not None and loc is not None and loc[0] != indexed
            raise ChecksumMismatchError(
                "checksum mismatch: the stored bytes are damaged",
                file=self._reader.path,
                variable=f"{self.path}/{component_name(i)}",
                expected=f"crc32c {expected:#010x}",
                found=f"crc32c {found:#010x}",
                hint=(
                    f"its name leads to a dataset whose data lies at offset {loc[0]}, "
                    f"the index places it at offset {indexed}"
                    if moved and loc is not None
                    else None
                ),
            )

    def verify(self, i: int) -> None:
        """Check component ``i``'s bytes against its stored checksum.

        The bytes are read with ``pread`` in bounded chunks, so verifying a file never needs
        more memory than one chunk.
        """
        if self._pread_ok(i):
            loc = self._location(i)
            assert loc is not None
            try:
                # (another name of the same dataset, verified on another thread meanwhile,
                # waits here for that read and takes its checksum: the bytes are read once)
                with self._reader._reading(loc[0]):
                    if not self._verify_kept(i):
                        self._check_streamed(i)
            except ChecksumMismatchError:
                if i not in self._from_index:
                    raise
                # the index may be stale: checked (and kept) where HDF5 places the dataset
                self._with_bytes(i, functools.partial(self._check_and_keep, i))
        else:
            self._with_bytes(i, functools.partial(self._check_and_keep, i))
        self._verified[i] = None

    def _check_and_keep(self, i: int, data: np.ndarray) -> None:
        """Check component ``i`` and, during a restore, keep its bytes for the copy: ``data``
        read through HDF5 (a fresh array: :meth:`H5Reader._keep_value`), or read where HDF5
        places the dataset after the index's offset proved stale (a reused buffer: a copy,
        :meth:`H5Reader._keep_copy`), so the copy lands the bytes checked here."""
        found = checksum(data)
        self._compare(i, found)
        loc = self._location(i)
        if loc is None:
            self._reader._keep_value((self.path, i), data)
        elif loc[1]:
            self._reader._keep_copy(loc[0], data, found)

    def verify_group(self, heap: GlobalHeapCheck | None = None) -> None:
        """The variable's group opens through HDF5 and its attributes agree with the index.

        Variable-length values live in HDF5's unchecksummed global heap, whose damage can make
        the C library fail or loop: with ``heap``, every heap object they refer to is first
        validated by our own parser (:mod:`._global_heap`), then the values are read through
        HDF5 and compared too; without it, only their presence is checked.
        """
        try:
            group = _h5policy.get(self._reader._h5(), self.path, self._reader.path)  # links checked
            if not isinstance(group, h5py.Group):
                raise CorruptCheckpointError(
                    "the index lists a variable whose HDF5 group is missing",
                    file=self._reader.path,
                    variable=self.path,
                )
            attrs: dict[str, Any] = {}
            variable: list[tuple[str, Any, Any]] = []
            for key in group.attrs:
                attr = h5py.h5a.open(group.id, key.encode())
                tid = attr.get_type()
                if _is_variable_length(tid):
                    attrs[key] = None
                    variable.append((key, attr, tid))
                else:
                    attrs[key] = _attribute_value(group, key, attr, tid)
            if heap is not None and variable:
                held = heap.check_attributes(
                    group.id,
                    [(key, tid, _elements(attr.shape)) for key, attr, tid in variable],
                    self.path,
                )
                for key, attr, tid in variable:  # validated: HDF5 may read them now
                    if key not in held:
                        continue  # in dense storage, which the parser does not reach
                    attrs[key] = _held_value(held[key], attr.shape, tid)
                    if attrs[key] is _UNHELD:
                        attrs[key] = _attribute_value(group, key, attr, tid)
        except CorruptCheckpointError:
            raise  # refused by the indirection policy or the heap's parser: its own message
        except _H5_ERRORS as exc:
            raise CorruptCheckpointError(
                "the variable's group is unreadable",
                file=self._reader.path,
                variable=self.path,
                found=str(exc),
            ) from None
        if not isinstance(group, h5py.Group):
            raise self._bad("not a group", "a group", type(group).__name__)
        dt = dtype_name(self.dtype)
        want: dict[str, Any] = {
            "kind": self.kind,
            "dtype": dt,
            "shape": list(self.shape),
            "num_components": self.num_components,
            **self.attrs,
        }
        for key, value in attrs.items():
            if key in want and value is not None and value != want[key]:
                raise self._bad(
                    f"group attribute {key!r} disagrees with the index",
                    repr(want[key]),
                    repr(value),
                )
        for key in ("kind", "dtype", "shape", "num_components"):
            if key not in attrs:
                raise self._bad(f"group attribute {key!r} is missing", repr(want[key]), "none")

    def verify_through_h5(self, i: int) -> None:
        """Read component ``i`` through HDF5 (as h5py and every other tool do), in bounded
        blocks, and check those bytes against the stored checksum too."""
        self._check_storage(i)
        if self.dtype.kind == "O":
            self._check(i, self._read_h5(i))
            return
        ds = h5py.Dataset(self._dataset(i))
        shape = self._shapes[i]
        try:
            if ds.dtype.itemsize != self.dtype.itemsize:
                raise self._fail(
                    "stored element size does not match the dtype",
                    i,
                    expected=f"{self.dtype.itemsize} bytes",
                    found=f"{ds.dtype.itemsize} bytes",
                )
            if not shape or math.prod(shape) == 0:
                crc = checksum(self._as_dtype(np.asarray(ds[()])).reshape(shape))
            else:
                row = math.prod(shape[1:]) * self.dtype.itemsize
                step = max(1, (8 << 20) // max(row, 1))
                crc = 0
                for start in range(0, shape[0], step):
                    block = np.ascontiguousarray(
                        self._as_dtype(np.asarray(ds[start : start + step]))
                    )
                    crc = _crc32c.crc32c(byte_view(block), crc)  # type: ignore[arg-type]
        except _H5_ERRORS as exc:
            raise self._fail("HDF5 cannot read the dataset", i, found=str(exc)) from None
        self._compare(i, int(crc))

    def _as_dtype(self, data: np.ndarray) -> np.ndarray:
        if data.dtype == self.dtype:
            return data
        return (
            data.view(self.dtype)
            if data.dtype.kind == "V"
            else data.astype(self.dtype.newbyteorder("="))
        )

    def verify_stitched_value(self, heap: GlobalHeapCheck | None = None) -> None:
        """A sharded variable's ``value`` dataset, when there, reads as its shards put together.

        With ``heap``, a virtual ``value``'s mapping (a global heap object) is validated by our
        own parser before HDF5 opens the dataset.
        """
        try:
            group = _h5policy.get(self._reader._h5(), self.path, self._reader.path)  # links checked
            if not isinstance(group, h5py.Group) or "value" not in group:
                return
            # Our own stitched view may be virtual, with every source in this file; nothing else.
            _h5policy.check_path(group.id, "value", self._reader.path)
            if heap is not None:
                address = int(h5py.h5o.get_info(group.id, b"value").addr)
                heap.check_virtual_layout(address, f"{self.path}/value")
            dataset = group["value"]
            _h5policy.check_dataset(
                dataset.id, self._reader.path, f"{self.path}/value", own_virtual=True
            )
            stitched = self._as_dtype(np.asarray(dataset[()]))
        except CorruptCheckpointError:
            raise  # refused by the indirection policy: its own message
        except _H5_ERRORS as exc:
            raise CorruptCheckpointError(
                "HDF5 cannot read the stitched 'value' dataset",
                file=self._reader.path,
                variable=f"{self.path}/value",
                found=str(exc),
            ) from None
        value = self.value()
        if value.dtype.kind == "O":  # byte strings: compared as the bytes objects they are
            same = stitched.shape == value.shape and bool(np.array_equal(stitched, value))
        else:
            same = stitched.shape == self.shape and np.array_equal(
                byte_view(np.ascontiguousarray(stitched)), byte_view(value)
            )
        if not same:
            raise CorruptCheckpointError(
                "the stitched 'value' dataset differs from the shards",
                file=self._reader.path,
                variable=f"{self.path}/value",
                expected="the shards put together",
                found="other values",
            )

    def _pread_ok(self, i: int) -> bool:
        loc = self._location(i)
        return loc is not None and loc[1] > 0

    def _verify_kept(self, i: int) -> bool:
        """During a restore (``H5Reader.stage``), read component ``i`` into the memory set
        aside for it, verify it there and keep it for the copy; whether it had memory."""
        loc = self._location(i)
        assert loc is not None
        offset, size = loc
        reader = self._reader
        nbytes = size * self.dtype.itemsize
        done = reader._kept_crc(offset, nbytes)
        if done is not None:  # another name of the same dataset (stored once) read it
            self._compare(i, done)
            return True
        slot = reader._slot(offset, nbytes)
        if slot is None:
            return False
        if slot.size > 1 << 20 and hasattr(os, "posix_fadvise"):  # start reading it all ahead
            os.posix_fadvise(reader._fd(), offset, slot.size, os.POSIX_FADV_WILLNEED)
        found = reader._read_fully(
            memoryview(slot),  # type: ignore[arg-type]
            offset,
            f"{self.path}/{component_name(i)}",
            crc=True,
        )
        reader._keep(offset, slot, found)
        self._compare(i, found)
        return True

    def _check_streamed(self, i: int) -> None:
        loc = self._location(i)
        assert loc is not None
        offset, size = loc
        remaining = size * self.dtype.itemsize
        staged = self._reader._staged_bytes(offset, remaining)
        if staged is not None:
            self._compare(i, int(_crc32c.crc32c(staged)))  # type: ignore[arg-type]
            return
        if remaining > 1 << 20 and hasattr(os, "posix_fadvise"):  # start reading it all ahead
            os.posix_fadvise(self._reader._fd(), offset, remaining, os.POSIX_FADV_WILLNEED)
        start, nbytes = offset, remaining
        buf = self._reader._chunk(remaining)
        crc = 0
        while remaining:
            n = os.preadv(self._reader._fd(), [memoryview(buf)[: min(remaining, len(buf))]], offset)  # type: ignore[arg-type]
            if n <= 0:
                raise TruncatedFileError(
                    "file ends inside the data",
                    file=self._reader.path,
                    variable=f"{self.path}/{component_name(i)}",
                    found=f"{self._reader.file_size} bytes",
                )
            crc = _crc32c.crc32c(memoryview(buf)[:n], crc)  # type: ignore[arg-type]
            offset += n
            remaining -= n
        self._reader._note_crc(start, nbytes, crc)  # (the other names of this dataset)
        self._compare(i, crc)

    def read_component_into(
        self, i: int, out: np.ndarray, *, verify: bool = True, cast: bool = False
    ) -> None:
        """Read component ``i`` straight into ``out`` (same shape; same dtype, byte order aside,
        unless ``cast``). An ``out`` of the other byte order takes the values converted."""
        if tuple(out.shape) != self.component_shape(i):
            raise ShapeMismatchError(
                "shape mismatch",
                file=self._reader.path,
                variable=self.path,
                expected=tuple(out.shape),
                found=self.component_shape(i),
            )
        if out.dtype.newbyteorder("=") != self.dtype.newbyteorder("=") and not cast:
            raise DtypeMismatchError(
                "dtype mismatch",
                file=self._reader.path,
                variable=self.path,
                expected=dtype_name(out.dtype),
                found=dtype_name(self.dtype),
                hint="pass allow_cast=True to convert",
            )

        pre = self._reader._prefetched.get(self.path)
        if pre is not None and verify:  # read in bulk and checked just now (H5Reader.prefetch)
            data = pre[i]
            if out.dtype == data.dtype:
                np.copyto(out, data)
            else:
                out[...] = data.astype(out.dtype)
            return

        # Every byte that lands in ``out`` is checked against the checksum, even when the
        # component was verified before (a restore verifies everything before it writes): a
        # file rewritten in between must not land unchecked bytes (see _check_landed).
        def copy(data: np.ndarray) -> None:
            if verify:
                self._check_landed(i, checksum(data))
            if out.dtype == data.dtype:
                np.copyto(out, data)
            else:
                out[...] = data.astype(out.dtype)

        direct = out.dtype == self.dtype and out.flags.c_contiguous and self._pread_ok(i)
        if direct and verify and i in self._verified:
            # Verified before (a restore's first pass): its bytes land only from the verified
            # copy kept in memory, or read again into a buffer and checked there first.
            loc = self._location(i)
            assert loc is not None
            kept = self._reader._staged_bytes(loc[0], byte_view(out).size)
            if kept is not None:
                np.copyto(byte_view(out), kept)
                return
            direct = False
        if direct:
            # Straight from the file into ``out`` (a fresh array, not a live variable: nothing
            # verified it yet), checksummed chunk by chunk as it arrives.
            loc = self._location(i)
            assert loc is not None
            found = self._pread_into(i, out, loc[0], crc=verify)
            if not verify:
                return
            try:
                if found is not None:
                    self._check_landed(i, found)
                elif i not in self._verified:  # staged, without an index checksum
                    self._check(i, out)
            except ChecksumMismatchError:
                if i not in self._from_index:
                    raise
                self._with_bytes(i, copy)  # the index may be stale: HDF5's location
            return
        self._with_bytes(i, copy)

    def _check_landed(self, i: int, found: int) -> None:
        """Check the CRC-32C ``found`` of component ``i``'s bytes as they were copied. When the
        component was verified before (by this restore's first pass), a mismatch means the
        file changed since: :class:`~parallelvars.errors.ConcurrentWriteError`."""
        try:
            self._compare(i, found)
        except ChecksumMismatchError as exc:
            if i not in self._verified:
                raise
            raise ConcurrentWriteError(
                "its bytes read again do not match the checksum verified before",
                file=self._reader.path,
                variable=f"{self.path}/{component_name(i)}",
                expected=exc.expected,
                found=exc.found,
                hint="another process is writing it; nothing unchecked was copied",
            ) from None

    def _pread_into(self, i: int, out: np.ndarray, offset: int, *, crc: bool = False) -> int | None:
        """Read component ``i`` into ``out``: its bytes' CRC-32C taken as they arrive when
        ``crc``; None when they came from the verified read-ahead (:meth:`H5Reader.stage`)."""
        flat = byte_view(out)
        staged = self._reader._staged_bytes(offset, flat.size)
        if staged is not None:  # read with its neighbours already (see H5Reader.stage)
            np.copyto(flat, staged)
            return None
        return self._reader._read_fully(
            memoryview(flat),  # type: ignore[arg-type]
            offset,
            f"{self.path}/{component_name(i)}",
            crc=crc,
        )

    def component(self, i: int) -> np.ndarray:
        pre = self._reader._prefetched.get(self.path)
        if pre is not None:  # read in bulk, checked, its name reached (H5Reader.prefetch)
            return np.array(pre[i])
        self._check_storage(i)
        out = np.empty(self.component_shape(i), self.dtype)
        self.read_component_into(i, out)
        return out

    def value(self) -> np.ndarray:
        if not has_logical_value(self):
            raise no_value_error(self, file=self._reader.path)
        for i in range(self.num_components):
            self._check_storage(i)
        out = np.empty(self.shape, self.dtype)
        read_logical_into(self, out, file=self._reader.path)
        return out

    def prefetcher(self) -> Any:
        """The open file this variable is read from when it reads many variables' components
        in bulk (``prefetch(paths)``, :meth:`H5Reader.prefetch`), else None."""
        return self._reader if hasattr(self._reader, "prefetch") else None

    def __repr__(self) -> str:
        return (
            f"<StoredVariable {self.path!r} kind={self.kind} dtype={dtype_name(self.dtype)} "
            f"shape={self.shape} components={self.num_components}>"
        )
