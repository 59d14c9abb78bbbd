"""Reading and writing the native HDF5 layout (version 1).

The layout (documented with an ``h5dump``-style example in ``docs/FORMAT.md``):

* root attributes ``parallelvars_format`` (= 1), ``parallelvars_version``, ``created`` and
  whatever the writer knows (``save_counter``, ``step``);
* one group per variable at its object path, with attributes ``kind``, ``dtype``, ``shape``,
  ``num_components``, ``devices``, ``aggregation`` and, for sharded variables, ``shard_axis``
  and ``shard_offsets`` (``name``, ``synchronization`` and ``trainable`` are in the index only);
* in it one dataset per component, ``primary`` and ``parallel_component_1`` ..., each with a
  ``crc32c`` attribute (CRC-32C of its C-order bytes);
* for sharded variables a virtual dataset ``value`` stitching the shards together;
* the object graph as JSON in the dataset ``/_parallelvars/object_graph``, and an index of every
  variable (attributes, checksums, data offsets) as JSON in ``/_parallelvars/index``.

bfloat16 and the float8 family are stored as HDF5 opaque types of their size, with the
``dtype`` group attribute naming them (the convention Keras uses); strings as variable-length
bytes.

Reading is lazy and fast: contiguous datasets are read with ``pread`` straight into the
destination buffer and checksummed there (a verification pass streams in bounded chunks). The
file is never memory-mapped, so a file truncated while it is read is an error, not SIGBUS.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import crc32c as _crc32c
import h5py
import numpy as np

from parallelvars._dtypes import as_dtype, dtype_name, is_extension_dtype
from parallelvars._fileio import DataWriter, Scratch, atomic_path, byte_view, checksum, load_json
from parallelvars.checkpoint import _h5policy, _skeleton
from parallelvars.checkpoint._skeleton import SkeletonCache
from parallelvars.checkpoint.registry import component_name
from parallelvars.enums import Aggregation
from parallelvars.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ClosedCheckpointError,
    CorruptCheckpointError,
    DtypeMismatchError,
    FormatVersionError,
    InvalidEntryError,
    NotACheckpointError,
    ShapeMismatchError,
    TruncatedFileError,
    UnsupportedDtypeError,
)

__all__ = [
    "FORMAT_VERSION",
    "META_GROUP",
    "H5Reader",
    "StoredVariable",
    "write_h5",
    "write_h5_index",
    "ComponentLink",
    "LinkedVariable",
    "checksum",
    "is_native_checkpoint",
]

FORMAT_VERSION = 1
META_GROUP = "_parallelvars"
GRAPH_DATASET = f"{META_GROUP}/object_graph"
# Per-variable attributes and checksums in one JSON document, so opening a file costs one read
# instead of one HDF5 attribute call per attribute.
INDEX_DATASET = f"{META_GROUP}/index"
DOCUMENTS_ATTR = "parallelvars_documents"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
# The documented variable kinds and on-read aggregations (the enums' values).
KINDS = ("single", "mirrored", "on_read", "independent", "sharded")
AGGREGATIONS = tuple(a.value for a in Aggregation)
_MAX_COMPONENTS = 1 << 16
# H5Reader.stage: components under this size are read ahead in spans, neighbours under
# STAGE_GAP apart in one read, at most STAGE_LIMIT bytes in all.
STAGE_COMPONENT = 1 << 20
STAGE_GAP = 64 << 10
STAGE_LIMIT = 256 << 20
# deflate's best case is about 1032:1; no compressed dataset can expand more than this.
_MAX_COMPRESSION = 1100
_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError, AttributeError)


def _library_version() -> str:
    from parallelvars import __version__

    return __version__


# ----------------------------------------------------------------------------- dtypes
def _storage_dtype(dt: np.dtype) -> np.dtype:
    if dt.kind == "O":
        return h5py.vlen_dtype(bytes)
    if is_extension_dtype(dt):
        return h5py.opaque_dtype(np.dtype(f"V{dt.itemsize}"))
    return dt.newbyteorder("<") if dt.byteorder == ">" else dt


# ----------------------------------------------------------------------------- writing
def atomic_write(path: str, write: Any) -> str:
    """Call ``write(tmp_path)`` and put the result at ``path`` atomically (see ``atomic_path``)."""
    with atomic_path(os.fspath(path)) as tmp:
        write(tmp)
    return os.fspath(path)


def _root_attr_value(value: Any) -> Any:
    """Like :func:`_attr_value`, with strings as fixed-length UTF-8 bytes.

    The reader reads the root attributes on every open; fixed-length values live inside the
    (checksummed) root object header, while variable-length strings would send it to HDF5's
    global heap, which has no checksum and whose damage can make the C library loop. (Group
    attributes stay variable-length ``str`` for plain h5py users: the reader takes those
    values from the checksummed index instead.)
    """
    value = _attr_value(value)
    if isinstance(value, str) and not value.endswith("\x00"):
        return np.bytes_(value.encode("utf-8"))
    return value


def _attr_value(value: Any) -> Any:
    if isinstance(value, (bool, np.bool_)):
        return np.bool_(value)
    if isinstance(value, (int, np.integer)):
        return np.int64(value)
    if isinstance(value, (float, np.floating)):
        return np.float64(value)
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, str) for v in value):
            return (
                np.array(list(value), dtype=h5py.string_dtype()) if value else np.zeros(0, np.int64)
            )
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            return np.asarray(value, dtype=np.int64)
    if isinstance(value, np.ndarray) and value.dtype.kind in "iuf":
        return value
    return "json:" + json.dumps(value)


# (dtype or "str", shape) -> (file type, memory type, dataspace), made once.
_ATTR_TYPES: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}
# Prepared string values (kinds, dtype names, device lists recur on every variable).
_STRING_ATTRS: dict[Any, tuple[np.ndarray, tuple[Any, Any, Any]]] = {}


def _prepared(value: Any) -> tuple[np.ndarray, tuple[Any, Any, Any]]:
    """An attribute value as a contiguous array, with its HDF5 types and dataspace."""
    arr = (
        np.asarray(value, dtype=h5py.string_dtype())
        if isinstance(value, str) or (isinstance(value, np.ndarray) and value.dtype.kind == "O")
        else np.asarray(value)
    )
    if arr.dtype.kind == "U":
        arr = arr.astype(h5py.string_dtype())
    if not arr.flags.c_contiguous:  # (not np.ascontiguousarray: it makes scalars 1-d)
        arr = arr.copy()
    key = ("str" if arr.dtype.kind == "O" else arr.dtype.str, arr.shape)
    types = _ATTR_TYPES.get(key)
    if types is None:
        space = (
            h5py.h5s.create(h5py.h5s.SCALAR) if arr.ndim == 0 else h5py.h5s.create_simple(arr.shape)
        )
        # The file type is the logical one (variable-length UTF-8 for strings); the memory type
        # is what h5py converts from (Python objects for strings).
        types = _ATTR_TYPES[key] = (
            h5py.h5t.py_create(arr.dtype, logical=True),
            h5py.h5t.py_create(arr.dtype),
            space,
        )
    return arr, types


def _set_attr(oid: Any, name: str, value: Any) -> None:
    """Write one attribute through the low-level API.

    A checkpoint writes a few thousand attributes, so this skips what ``obj.attrs[name] = v``
    does each time: the HDF5 types and dataspace are made once per (dtype, shape) and reused,
    and recurring string values are converted once.
    """
    key: Any = None
    if isinstance(value, str):
        key = value
    elif isinstance(value, np.ndarray) and value.dtype.kind == "O" and value.ndim == 1:
        key = tuple(value)
    if key is not None:
        prepared = _STRING_ATTRS.get(key)
        if prepared is None:
            prepared = _prepared(value)
            if len(_STRING_ATTRS) < 1024:
                _STRING_ATTRS[key] = prepared
    else:
        prepared = _prepared(value)
    arr, (ftype, mtype, space) = prepared
    bname = name.encode()
    try:
        attr = h5py.h5a.create(oid, bname, ftype, space)
    except _H5_ERRORS:  # it exists already: replace it
        h5py.h5a.delete(oid, bname)
        attr = h5py.h5a.create(oid, bname, ftype, space)
    if arr.size:
        attr.write(arr, mtype=mtype)


# Kept in the (checksummed) index only: the design's group attributes are the kind, dtype,
# shape, devices, aggregation and sharding; these three would only cost time per variable.
_INDEX_ONLY_ATTRS = frozenset({"name", "synchronization", "trainable"})


def _validate_path(path: str) -> None:
    parts = path.split("/")
    if (
        not path
        or path.startswith("/")
        or any(p in ("", ".") for p in parts)
        or parts[0] == META_GROUP
    ):
        raise InvalidEntryError("invalid variable path for the HDF5 layout", variable=path)


def _early_dcpl() -> Any:
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)  # no clock in the file: a structure's bytes are its own
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # the bytes get an offset now ...
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # ... and are written once, by us
    return dcpl


def _write_entry(
    f: h5py.File, writer: _DataWriter, entry: Any, file: str, dcpl: Any, scratch: Scratch
) -> dict[str, Any]:
    """Create the group, attributes and datasets of one entry and write its component bytes.

    Each component's bytes go to the storage HDF5 allocated for its dataset, checksummed on
    the way (see :class:`_DataWriter`). Returns the entry's record for the index.
    """
    path = entry.path
    dt = np.dtype(entry.dtype)
    storage = _storage_dtype(dt)
    shape = tuple(int(s) for s in entry.shape)
    grp, meta = _write_group(f, path, entry.kind, dt, shape, int(entry.num_components), entry.attrs)
    # Where each component's bytes start, so a reader need not open every dataset; the
    # component's checksum guards the value (a reader falls back to HDF5's own answer).
    offsets: list[int | None] = []
    crcs: list[int] = []
    meta["offsets"] = offsets
    meta["crc32c"] = crcs
    in_memory = _holds_arrays(entry)
    for i in range(entry.num_components):
        cshape = tuple(int(d) for d in entry.component_shape(i))
        name = component_name(i)
        if dt.kind == "O":
            ds = grp.create_dataset(name, shape=cshape, dtype=storage, track_times=False)
            arr = _checked(entry, i, cshape, dt, file)
            if arr.size:
                ds[...] = arr
            crc = checksum(arr)
            dsid = ds.id
            offsets.append(None)
        else:
            dsid = h5py.h5d.create(
                grp.id, name.encode(), _file_type(storage), writer.space(cshape), dcpl=dcpl
            )
            offset = dsid.get_offset()
            offsets.append(None if offset is None else int(offset))
            if in_memory:  # live buffers or arrays: written as they are
                arr = np.ascontiguousarray(_checked(entry, i, cshape, dt, file))
            else:  # read from another file: through one reused buffer
                arr = scratch.array(dt, cshape)
                entry.read_component_into(i, arr)
            if arr.nbytes and offset is None:
                raise RuntimeError(f"{file}: HDF5 allocated no storage for {path!r}[{i}]")
            crc = writer.write(arr, 0 if offset is None else int(offset))
            if in_memory:
                writer.check_unchanged(arr, crc, path)
            del arr
        crcs.append(crc)  # in the (checksummed) index, not in the dataset's object header
    if entry.kind == "sharded" and entry.num_components:
        axis = int(entry.attrs["shard_axis"])
        layout = h5py.VirtualLayout(shape=shape, dtype=storage)
        for i, start in enumerate(entry.attrs["shard_offsets"]):
            cshape = tuple(entry.component_shape(i))
            index: list[Any] = [slice(None)] * len(shape)
            index[axis] = slice(int(start), int(start) + cshape[axis])
            layout[tuple(index)] = h5py.VirtualSource(
                ".", f"{grp.name}/{component_name(i)}", shape=cshape
            )
        vdcpl = layout._get_dcpl(f.filename)
        vdcpl.set_obj_track_times(False)
        h5py.h5d.create(
            grp.id, b"value", _file_type(storage), h5py.h5s.create_simple(shape), dcpl=vdcpl
        )
    return meta


def _write_group(
    f: h5py.File,
    path: str,
    kind: str,
    dt: np.dtype,
    shape: tuple[int, ...],
    num_components: int,
    attrs: Mapping[str, Any],
) -> tuple[h5py.Group, dict[str, Any]]:
    """Create a variable's group with its layout attributes; returns it and its index record."""
    _validate_path(path)
    grp = _new_group(f, path)
    meta: dict[str, Any] = {
        "kind": kind,
        "dtype": dtype_name(dt),
        "shape": list(shape),
        "num_components": num_components,
    }
    for key in ("kind", "dtype", "shape", "num_components"):
        _set_attr(grp.id, key, _attr_value(meta[key]))
    extra: dict[str, Any] = {}
    for key, value in dict(attrs).items():
        if value is None or key in meta:
            continue
        stored = _attr_value(value)
        if key not in _INDEX_ONLY_ATTRS:
            _set_attr(grp.id, key, stored)
        extra[key] = _decode(stored)
    meta["attrs"] = extra
    return grp, meta


def _new_group(f: h5py.File, path: str) -> h5py.Group:
    """The group at ``path``, created with its missing parents (it usually does not exist)."""
    lcpl, gcpl = _LCPL.get("lcpl"), _LCPL.get("gcpl")
    if lcpl is None or gcpl is None:
        lcpl = _LCPL["lcpl"] = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        lcpl.set_create_intermediate_group(True)
        gcpl = _LCPL["gcpl"] = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
        gcpl.set_obj_track_times(False)  # (intermediate groups are made with it too)
    try:
        return h5py.Group(h5py.h5g.create(f.id, path.encode(), lcpl=lcpl, gcpl=gcpl))
    except _H5_ERRORS:  # it exists: a parent of a variable written before
        return f.require_group(path)


_LCPL: dict[str, Any] = {}


def _checked(entry: Any, i: int, cshape: tuple[int, ...], dt: np.dtype, file: str) -> np.ndarray:
    arr = np.asarray(entry.component(i))
    if arr.shape != cshape:
        raise ShapeMismatchError(
            "component has the wrong shape",
            file=file,
            variable=f"{entry.path}[{i}]",
            expected=cshape,
            found=arr.shape,
        )
    if arr.dtype != dt:
        raise DtypeMismatchError(
            "component has the wrong dtype",
            file=file,
            variable=f"{entry.path}[{i}]",
            expected=dt,
            found=arr.dtype,
        )
    return arr


def _holds_arrays(entry: Any) -> bool:
    """True when an entry's components are arrays in memory (save records, array entries)."""
    return hasattr(entry, "components") or hasattr(entry, "component_array")


def _file_type(storage: np.dtype) -> Any:
    """The HDF5 type of a storage dtype, made once per dtype."""
    tid = _FILE_TYPES.get(storage)
    if tid is None:
        tid = _FILE_TYPES[storage] = h5py.h5t.py_create(storage, logical=True)
    return tid


_FILE_TYPES: dict[np.dtype, Any] = {}


class _DataWriter(DataWriter):
    """The component bytes of a save, written into the storage HDF5 allocated for them.

    HDF5 allocates each dataset's storage up front and never writes it itself (fill time
    "never"); the bytes go there through a descriptor of our own, so HDF5 only ever handles
    metadata. Also caches the dataspaces of a save.
    """

    def __init__(self, path: str, file: str) -> None:
        super().__init__(path, file)
        self._spaces: dict[tuple[int, ...], Any] = {}

    def space(self, shape: tuple[int, ...]) -> Any:
        """An HDF5 dataspace of ``shape``, made once per shape in a save."""
        space = self._spaces.get(shape)
        if space is None:
            space = h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR)
            self._spaces[shape] = space
        return space


def write_h5(
    path: str | os.PathLike[str],
    entries: Iterable[Any] | Mapping[str, Any],
    *,
    object_graph: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    skeletons: SkeletonCache | None = None,
) -> str:
    """Write entries (neutral-view entries or save records) to ``path`` in the native layout.

    One pass over the entries and one HDF5 session on a temporary file: for each entry HDF5
    creates the group, attributes and datasets with their storage allocated up front, and the
    component bytes are written straight to that storage with ``pwrite``, one component at a
    time, from the entries (for live variables, from their buffers; for other files, through
    one reused buffer), checksummed as they go. The disk writes start while later entries are
    still being prepared. Last come the index and the object graph. The file appears under
    ``path`` only once complete and flushed to disk.

    With ``skeletons`` (a checkpoint's cache), a save of the structure the cache holds is
    written from the cached skeleton: the first save's bytes with the new component data,
    index and header values (see ``_skeleton``); byte for byte what HDF5 writes. Any other
    save is written by HDF5 and its skeleton cached.

    Returns:
        ``path``.
    """
    p = os.fspath(path)
    items = list(entries.values()) if isinstance(entries, Mapping) else list(entries)
    key = _structure_key(items, object_graph, metadata) if skeletons is not None else None
    if key is not None and skeletons is not None:
        cached = skeletons.get(key)
        if cached is not None:
            return atomic_write(
                p, lambda tmp: _write_from_skeleton(tmp, p, cached, items, metadata)
            )
    captured: list[_skeleton.Skeleton | None] = []

    def write(tmp: str) -> None:
        index: dict[str, Any] = {}
        # With a skeleton to capture, the header values that change between saves are written
        # as random sentinels first (to find them in the file), then patched to their values.
        values = _header_values(metadata) if key is not None else {}
        sentinels = {name: _skeleton.sentinel(np.asarray(v).dtype) for name, v in values.items()}
        with _new_file(tmp, metadata, sentinels) as f:
            dcpl = _early_dcpl()
            writer, scratch, ok = _DataWriter(tmp, p), Scratch(), False
            try:
                for entry in items:
                    if entry.path in index:
                        raise InvalidEntryError("is written twice", file=p, variable=entry.path)
                    index[entry.path] = _write_entry(f, writer, entry, p, dcpl, scratch)
                ok = True
            finally:
                writer.close(raise_errors=ok)
            template = _index_template(index) if key is not None else None
            where = _finish_metadata(
                f, index, object_graph, crc_sentinel=sentinels.get(_INDEX_CRC), template=template
            )
        if key is not None:
            captured.append(_capture(tmp, key, items, index, where, template, values, sentinels))

    atomic_write(p, write)
    if skeletons is not None and key is not None:
        skeletons.put(captured[0] if captured else None)
    return p


# The header value names a skeleton patches: the root attributes that change between saves,
# and the index document's checksum.
_INDEX_CRC = "/_parallelvars/index:crc32c"


def _header_values(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The root attribute values of a save that live in its object header and change between
    saves: ``created`` and every integer or float of the metadata (``save_counter``,
    ``step``), by name (the index checksum is added once known)."""
    values: dict[str, Any] = {"created": np.float64(time.time())}
    for key, value in dict(metadata or {}).items():
        stored = None if value is None else _root_attr_value(value)
        if isinstance(stored, (np.int64, np.float64)):
            values[key] = stored
    values[_INDEX_CRC] = np.int64(0)
    return values


def _structure_key(
    items: Sequence[Any], object_graph: Mapping[str, Any] | None, metadata: Mapping[str, Any] | None
) -> Any:
    """What a file's bytes depend on besides the component values and the header values: the
    library version, the metadata's names and types, the object graph and each entry's path,
    kind, shape, attributes and components' dtypes and shapes. None for entries that are not
    arrays in memory (they are never written from a skeleton)."""
    try:
        records = [
            (e.path, e.kind, e.shape, e.attrs, [(c.dtype, c.shape) for c in e.components])
            for e in items
        ]
    except AttributeError:
        return None
    meta = tuple(
        (k, type(v).__name__ if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
        for k, v in dict(metadata or {}).items()
        if v is not None
    )
    return (_library_version(), meta, object_graph, records)


def _index_template(index: Mapping[str, Any]) -> str:
    """The index document with a ``%d`` for every checksum: ``template % crcs`` is
    ``json.dumps(index)`` (the checksums are each record's last field)."""
    parts = []
    for path, meta in index.items():
        rest = {k: v for k, v in meta.items() if k != "crc32c"}
        body = json.dumps(rest).replace("%", "%%")
        crcs = ", ".join(["%d"] * len(meta["crc32c"]))
        parts.append(f'{json.dumps(path).replace("%", "%%")}: {body[:-1]}, "crc32c": [{crcs}]}}')
    return "{" + ", ".join(parts) + "}"


def _capture(
    tmp: str,
    key: Any,
    items: Sequence[Any],
    index: Mapping[str, Any],
    where: tuple[int, int, int],
    template: str | None,
    values: dict[str, Any],
    sentinels: dict[str, Any],
) -> _skeleton.Skeleton | None:
    """Cache the skeleton of the file HDF5 wrote at ``tmp`` and put the real header values in
    it (patched in place, or through HDF5 when the file cannot be a skeleton)."""
    offset, capacity, crc = where
    values[_INDEX_CRC] = np.int64(crc)
    offsets, nbytes = [], []
    for e in items:
        meta = index[e.path]
        for i, c in enumerate(e.components):
            offsets.append(meta["offsets"][i] or 0)
            nbytes.append(c.nbytes)
    skel = None
    objects = any(c.dtype.kind == "O" for e in items for c in e.components)
    if (
        template is not None
        and not objects
        and template % tuple(c for m in index.values() for c in m["crc32c"]) == json.dumps(index)
    ):
        skel = _skeleton.capture(tmp, key, offsets, nbytes, offset, capacity, sentinels)
        skel = skel if skel is not None and skel.set_template(template) else None
    if skel is not None:
        fd = os.open(tmp, os.O_WRONLY)
        try:
            skel.patch_file(fd, values)
        finally:
            os.close(fd)
        return skel
    with h5py.File(tmp, "r+") as f:
        for name, value in values.items():
            if name == _INDEX_CRC:
                f[INDEX_DATASET].attrs.modify("crc32c", value)
            else:
                f.attrs.modify(name, value)
    return None


def _write_from_skeleton(
    tmp: str,
    file: str,
    skel: _skeleton.Skeleton,
    items: Sequence[Any],
    metadata: Mapping[str, Any] | None,
) -> None:
    """Write a save of the skeleton's structure to ``tmp``: the skeleton's bytes, the component
    data at its datasets' offsets, the index, and the header values patched."""
    values = _header_values(metadata)
    comps = [np.ascontiguousarray(c) for e in items for c in e.components]
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    os.close(fd)
    writer, ok = _DataWriter(tmp, file), False
    names = [f"{e.path}[{i}]" for e in items for i in range(len(e.components))]
    try:
        os.ftruncate(writer.fd, skel.file_size)
        skel.write(
            writer.fd,
            comps,
            values,
            write=writer.write,
            check=lambda arr, crc, i: writer.check_unchanged(arr, crc, names[i]),
            index_crc=_INDEX_CRC,
        )
        ok = True
    finally:
        writer.close(raise_errors=ok)


def _new_file(
    tmp: str, metadata: Mapping[str, Any] | None, values: Mapping[str, Any] | None = None
) -> h5py.File:
    """A new file of our layout with its root attributes (``values`` overrides some).

    libver "latest": superblock v3 and v2 object headers, B-trees and heaps, which all carry
    checksums, so a damaged metadata byte is an error rather than a wrong value. No object
    records times, so the same content makes the same bytes.
    """
    values = values or {}
    f = h5py.File(tmp, "w", libver="latest")
    f.attrs["parallelvars_format"] = np.int64(FORMAT_VERSION)  # few: the high-level API is fine
    f.attrs["parallelvars_version"] = _root_attr_value(_library_version())
    f.attrs["created"] = values.get("created", np.float64(time.time()))
    for key, value in dict(metadata or {}).items():
        if value is not None:
            f.attrs[key] = values.get(key, _root_attr_value(value))
    return f


class ComponentLink(NamedTuple):
    """Where one component of a multi-process checkpoint lives: ``file`` (relative to the
    index file's folder), the ``dataset`` path in it, and the CRC-32C of its bytes."""

    file: str
    dataset: str
    crc32c: int


class LinkedVariable(NamedTuple):
    """One variable of a multi-process checkpoint's index file (see :func:`write_h5_index`)."""

    path: str
    kind: str
    dtype: Any
    shape: tuple[int, ...]
    attrs: Mapping[str, Any]
    components: Sequence[ComponentLink]


def write_h5_index(
    path: str | os.PathLike[str],
    variables: Iterable[LinkedVariable],
    *,
    object_graph: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> str:
    """Write the index file of a checkpoint whose component bytes live in other files.

    The same layout as :func:`write_h5` (root attributes, one group per variable with its
    attributes, the checksummed fixed-length index and object graph, the document list, the
    newest HDF5 file format), with each component dataset an external link to
    ``component.file:component.dataset`` and its checksum taken from the link record. The
    file appears under ``path`` only once complete and flushed to disk.

    Returns:
        ``path``.
    """
    p = os.fspath(path)
    items = list(variables)

    def write(tmp: str) -> None:
        index: dict[str, Any] = {}
        with _new_file(tmp, metadata) as f:
            for var in items:
                if var.path in index:
                    raise InvalidEntryError("is written twice", file=p, variable=var.path)
                shape = tuple(int(s) for s in var.shape)
                grp, meta = _write_group(
                    f,
                    var.path,
                    var.kind,
                    np.dtype(var.dtype),
                    shape,
                    len(var.components),
                    var.attrs,
                )
                meta["offsets"] = [None] * len(var.components)
                meta["crc32c"] = [int(c.crc32c) for c in var.components]
                for i, link in enumerate(var.components):
                    grp[component_name(i)] = h5py.ExternalLink(link.file, link.dataset)
                index[var.path] = meta
            _finish_metadata(f, index, object_graph)

    return atomic_write(p, write)


def _finish_metadata(
    f: h5py.File,
    index: dict[str, Any],
    object_graph: Any,
    *,
    crc_sentinel: Any = None,
    template: str | None = None,
) -> tuple[int, int, int]:
    """Record the index (with every component's checksum) and the object graph.

    The index is padded with spaces to a capacity that any later index of the same structure
    fits in (only checksums change, and each has at most 10 digits). Returns the index's data
    offset, its capacity and its checksum (the attribute holds ``crc_sentinel`` when given).
    """
    text = json.dumps(index)
    # The capacity depends on the structure alone (not on the checksums' digits), so every save
    # of a structure has the same bytes outside the data, whoever writes it.
    crcs = [c for m in index.values() for c in m["crc32c"]]
    capacity = _skeleton.index_capacity(len(text) - len("".join(map(str, crcs))), len(crcs))
    ds, crc = _write_json(f, INDEX_DATASET, text=text, capacity=capacity, crc_value=crc_sentinel)
    offset = ds.id.get_offset()
    documents = [INDEX_DATASET]
    if object_graph is not None:
        _write_json(f, GRAPH_DATASET, object_graph)
        documents.append(GRAPH_DATASET)
    # Which documents exist, in the checksummed root header: h5py's get() answers None for a
    # link it cannot follow, so a damaged link would otherwise look like "no graph".
    f.attrs[DOCUMENTS_ATTR] = np.array([d.encode() for d in documents])
    return (-1 if offset is None else int(offset)), capacity, crc


def _write_json(
    f: h5py.File,
    name: str,
    value: Any = None,
    *,
    text: str | None = None,
    capacity: int = 0,
    crc_value: Any = None,
) -> tuple[h5py.Dataset, int]:
    """A JSON document as a fixed-length string dataset with its own CRC-32C.

    Fixed length keeps the bytes out of HDF5's unchecksummed global heap; the checksum covers
    the document itself (with its padding: spaces, which JSON ignores), which HDF5 does not.
    Returns the dataset and the checksum (the attribute holds ``crc_value`` when given).
    """
    raw = (json.dumps(value) if text is None else text).encode("utf-8").ljust(capacity, b" ")
    ds = f.create_dataset(name, data=np.bytes_(raw), track_times=False)
    crc = int(_crc32c.crc32c(raw))
    ds.attrs["crc32c"] = np.int64(crc if crc_value is None else crc_value)
    return ds, crc


def _read_json(f: h5py.File, name: str, file: str, *, required: bool = False) -> Any:
    """Read a document written by :func:`_write_json` (or an older variable-length one)."""
    dsid = _h5policy.open_dataset(f.id, f"/{name}", file)
    if dsid is None:
        if required:
            raise CorruptCheckpointError(
                "a metadata document is missing or unreadable",
                file=file,
                variable=name,
                expected="the document the root attribute lists",
                found="no such dataset",
            )
        return None
    ds = h5py.Dataset(dsid)
    _check_document(ds, file, name)
    raw = ds[()]
    raw = bytes(raw) if isinstance(raw, bytes) else str(raw).encode("utf-8")
    stored = ds.attrs.get("crc32c")
    if stored is not None and int(stored) != _crc32c.crc32c(raw):
        raise ChecksumMismatchError(
            "checksum mismatch: a metadata document is damaged",
            file=file,
            variable=name,
            expected=f"crc32c {int(stored):#010x}",
            found=f"crc32c {_crc32c.crc32c(raw):#010x}",
        )
    return load_json(raw, file=file, variable=name, what="metadata document")


def _check_document(ds: h5py.Dataset, file: str, name: str) -> None:
    """Refuse a metadata document of a type or size we never write, before reading it."""
    dt, shape = ds.dtype, ds.shape
    vlen = h5py.check_string_dtype(dt) is not None and h5py.check_string_dtype(dt).length is None
    if shape != () or not (vlen or dt.kind == "S"):
        raise CorruptCheckpointError(
            "a metadata document has the wrong type",
            file=file,
            variable=name,
            expected="a scalar string",
            found=f"{dt} of shape {shape}",
        )
    if dt.itemsize > _file_size(file) and not vlen:
        raise TruncatedFileError(
            "a metadata document claims more bytes than the file holds",
            file=file,
            variable=name,
            expected=f"<= {_file_size(file)} bytes",
            found=f"{dt.itemsize} bytes",
        )


def _file_size(file: str) -> int:
    try:
        return os.path.getsize(file)
    except OSError:
        return 0


# ----------------------------------------------------------------------------- reading
def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str) and value.startswith("json:"):
        try:
            return json.loads(value[5:])
        except (ValueError, RecursionError):
            return value
    if isinstance(value, np.ndarray):
        if value.dtype.kind in ("O", "S", "U"):
            return [_decode(v) for v in value.tolist()]
        return value.tolist()
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def _is_variable_length(tid: Any) -> bool:
    if tid.get_class() == h5py.h5t.VLEN:
        return True
    return bool(tid.get_class() == h5py.h5t.STRING and tid.is_variable_str())


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_native_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is an HDF5 file with our root attribute (any version)."""
    p = os.fspath(path)
    try:
        if not os.path.isfile(p) or not h5py.is_hdf5(p):
            return False
        with h5py.File(p, "r") as f:
            return "parallelvars_format" in f.attrs
    except _H5_ERRORS:
        return False


class StoredVariable:
    """One variable of a checkpoint file; duck-types the neutral view's ``Entry``."""

    def __init__(self, reader: H5Reader, path: str, meta: Mapping[str, Any]) -> None:
        self._reader = reader
        self.path = path
        file = reader.path
        try:
            self.kind = str(meta["kind"])
            dname = str(meta["dtype"])
            self.shape = tuple(int(s) for s in meta["shape"])
            self.num_components = int(meta["num_components"])
            self.attrs: dict[str, Any] = dict(meta.get("attrs") or {})
            offsets = meta.get("offsets")
            self._index_offsets: list[int | None] | None = (
                None if offsets is None else [None if o is None else int(o) for o in offsets]
            )
            crcs = meta.get("crc32c")
            self._crcs: list[int | None] | None = None if crcs is None else [int(c) for c in crcs]
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
                self.dtype = as_dtype(dname)
            except UnsupportedDtypeError:
                raise UnsupportedDtypeError(
                    "unknown dtype", file=file, variable=path, found=dname
                ) from None
        self._shapes: list[tuple[int, ...]] = self._validated_layout()
        self._verified: set[int] = set()
        self._storage_ok: set[int] = set()
        self._datasets: dict[int, Any] = {}
        self._locations: dict[int, tuple[int, int] | None] = {}
        self._from_index: set[int] = set()

    @classmethod
    def from_group(cls, reader: H5Reader, path: str, group: h5py.Group) -> StoredVariable:
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

        The kind and aggregation are in their documented sets, the counts of components,
        checksums, offsets and devices agree, and a sharded variable's ``shard_offsets`` start
        at 0 and cover its shard axis exactly, so no reader ever leaves a row unwritten.
        """
        n = self.num_components
        if self.kind not in KINDS:
            raise self._bad("unknown variable kind", f"one of {', '.join(KINDS)}", repr(self.kind))
        if not 1 <= n <= _MAX_COMPONENTS or (self.kind == "single" and n != 1):
            raise self._bad(
                "impossible number of components",
                "1" if self.kind == "single" else f"1 to {_MAX_COMPONENTS}",
                n,
            )
        for what, values in (("checksums", self._crcs), ("data offsets", self._index_offsets)):
            if values is not None and len(values) != n:
                raise self._bad(
                    f"the index lists {len(values)} {what}", f"{n} (one per component)", len(values)
                )
        if any(d < 0 for d in self.shape):
            raise self._bad("negative dimension", "dimensions >= 0", self.shape)
        aggregation = self.attrs.get("aggregation")
        if aggregation is not None and str(aggregation).lower() not in AGGREGATIONS:
            raise self._bad(
                "unknown aggregation", f"one of {', '.join(AGGREGATIONS)}", repr(aggregation)
            )
        devices = self.attrs.get("devices")
        if devices is not None and (
            not isinstance(devices, list)
            or len(devices) != n
            or not all(isinstance(d, str) for d in devices)
        ):
            raise self._bad(
                "devices do not match the components", f"{n} device names", repr(devices)
            )
        if self.kind != "sharded":
            return [self.shape] * n
        axis_value: Any = self.attrs.get("shard_axis")
        offsets_value: Any = self.attrs.get("shard_offsets")
        if not _is_int(axis_value) or not 0 <= int(axis_value) < len(self.shape):
            raise self._bad(
                "shard_axis out of range", f"an axis of shape {self.shape}", repr(axis_value)
            )
        axis = int(axis_value)
        if not isinstance(offsets_value, list) or not all(_is_int(o) for o in offsets_value):
            raise self._bad(
                "shard_offsets is not a list of integers", f"{n} offsets", repr(offsets_value)
            )
        offsets = [int(o) for o in offsets_value]
        if len(offsets) != n:
            raise self._bad(
                "shard offsets do not match the components", f"{n} offsets", len(offsets)
            )
        bounds = [*offsets, self.shape[axis]]
        if offsets[0] != 0 or any(bounds[i + 1] < bounds[i] for i in range(n)):
            raise self._bad(
                "shard_offsets do not cover the shard axis exactly (gap, overlap or past the end)",
                f"offsets from 0, non-decreasing, within {self.shape[axis]} rows of axis {axis}",
                offsets,
            )
        shapes = []
        for i in range(n):
            shape = list(self.shape)
            shape[axis] = bounds[i + 1] - bounds[i]
            shapes.append(tuple(shape))
        return shapes

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
            if needed > limit or stored > self._reader.file_size:
                raise TruncatedFileError(
                    "the dataset holds fewer bytes than its shape needs",
                    file=self._reader.path,
                    variable=f"{self.path}/{component_name(i)}",
                    expected=f"{needed} bytes{' (uncompressed)' if filtered else ''}",
                    found=f"{stored} bytes stored, file of {self._reader.file_size} bytes",
                )
        self._storage_ok.add(i)

    def _location(self, i: int) -> tuple[int, int] | None:
        """(file offset, element count) of a contiguous, unfiltered component, else None."""
        if i in self._locations:
            return self._locations[i]
        indexed = (
            self._index_offsets[i] if self._index_offsets and i < len(self._index_offsets) else None
        )
        if indexed is not None and self.dtype.kind != "O":
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
            self._from_index.add(i)
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
            self._from_index.discard(i)
            indexed = self._locations.pop(i)
            if self._location_from_h5(i) == indexed:
                raise
            return self._with_located_bytes(i, fn)

    def _with_located_bytes(self, i: int, fn: Callable[[np.ndarray], Any]) -> Any:
        loc = self._location(i)
        if loc is None:
            return fn(self._read_h5(i))
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

    def _check(self, i: int, data: np.ndarray) -> None:
        self._compare(i, checksum(data))

    def _compare(self, i: int, found: int) -> None:
        expected = self.stored_checksums[i]
        if expected is None:
            raise self._fail("dataset has no crc32c attribute", i)
        if found != expected:
            raise ChecksumMismatchError(
                "checksum mismatch: the stored bytes are damaged",
                file=self._reader.path,
                variable=f"{self.path}/{component_name(i)}",
                expected=f"crc32c {expected:#010x}",
                found=f"crc32c {found:#010x}",
            )

    def verify(self, i: int) -> None:
        """Check component ``i``'s bytes against its stored checksum.

        The bytes are read with ``pread`` in bounded chunks, so verifying a file never needs
        more memory than one chunk.
        """
        if self._pread_ok(i):
            try:
                self._check_streamed(i)
            except ChecksumMismatchError:
                if i not in self._from_index:
                    raise
                self._with_bytes(i, lambda data: self._check(i, data))  # the index may be stale
        else:
            self._with_bytes(i, lambda data: self._check(i, data))
        self._verified.add(i)

    def verify_group(self) -> None:
        """The variable's group opens through HDF5 and its attributes agree with the index."""
        try:
            group = _h5policy.get(self._reader._h5(), self.path, self._reader.path)  # links checked
            if not isinstance(group, h5py.Group):
                raise CorruptCheckpointError(
                    "the index lists a variable whose HDF5 group is missing",
                    file=self._reader.path,
                    variable=self.path,
                )
            attrs: dict[str, Any] = {}
            for key in group.attrs:
                # Variable-length values live in HDF5's unchecksummed global heap, whose damage
                # can make the C library loop: only their presence is checked (the reader takes
                # the values from the checksummed index).
                if _is_variable_length(h5py.h5a.open(group.id, key.encode()).get_type()):
                    attrs[key] = None
                else:
                    attrs[key] = _decode(group.attrs[key])
        except CorruptCheckpointError:
            raise  # refused by the indirection policy: its own message
        except _H5_ERRORS as exc:
            raise CorruptCheckpointError(
                "the variable's group is unreadable",
                file=self._reader.path,
                variable=self.path,
                found=str(exc),
            ) from None
        if not isinstance(group, h5py.Group):
            raise self._bad("not a group", "a group", type(group).__name__)
        dt = "bytes" if self.dtype.kind == "O" else dtype_name(self.dtype)
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

    def verify_stitched_value(self) -> None:
        """A sharded variable's ``value`` dataset, when there, reads as its shards put together."""
        try:
            group = _h5policy.get(self._reader._h5(), self.path, self._reader.path)  # links checked
            if not isinstance(group, h5py.Group) or "value" not in group:
                return
            # Our own stitched view may be virtual, with every source in this file; nothing else.
            _h5policy.check_path(group.id, "value", self._reader.path)
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
        if stitched.shape != self.shape or not np.array_equal(
            byte_view(np.ascontiguousarray(stitched)), byte_view(self.value())
        ):
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
        self._compare(i, crc)

    def read_component_into(
        self, i: int, out: np.ndarray, *, verify: bool = True, cast: bool = False
    ) -> None:
        """Read component ``i`` straight into ``out`` (same shape; same dtype unless ``cast``)."""
        if tuple(out.shape) != self.component_shape(i):
            raise ShapeMismatchError(
                "shape mismatch",
                file=self._reader.path,
                variable=self.path,
                expected=tuple(out.shape),
                found=self.component_shape(i),
            )
        if out.dtype != self.dtype and not cast:
            raise DtypeMismatchError(
                "dtype mismatch",
                file=self._reader.path,
                variable=self.path,
                expected=dtype_name(out.dtype),
                found=dtype_name(self.dtype),
                hint="pass allow_cast=True to convert",
            )

        def copy(data: np.ndarray) -> None:
            if verify and i not in self._verified:
                self._check(i, data)
            if out.dtype == data.dtype:
                np.copyto(out, data)
            else:
                out[...] = data.astype(out.dtype)

        if out.dtype == self.dtype and out.flags.c_contiguous and self._pread_ok(i):
            # Straight from the file into ``out``, then its checksum there: no extra copy.
            loc = self._location(i)
            assert loc is not None
            self._pread_into(i, out, loc[0])
            if verify and i not in self._verified:
                try:
                    self._check(i, out)
                except ChecksumMismatchError:
                    if i not in self._from_index:
                        raise
                    self._with_bytes(i, copy)  # the index may be stale: HDF5's location
            return
        self._with_bytes(i, copy)

    def _pread_into(self, i: int, out: np.ndarray, offset: int) -> None:
        flat = byte_view(out)
        staged = self._reader._staged_bytes(offset, flat.size)
        if staged is not None:  # read with its neighbours already (see H5Reader.stage)
            np.copyto(flat, staged)
            return
        view = memoryview(flat)  # type: ignore[arg-type]
        fd = self._reader._fd()
        while len(view):
            n = os.preadv(fd, [view], offset)
            if n <= 0:
                raise TruncatedFileError(
                    "file ends inside the data",
                    file=self._reader.path,
                    variable=f"{self.path}/{component_name(i)}",
                    found=f"{self._reader.file_size} bytes",
                )
            view, offset = view[n:], offset + n

    def component(self, i: int) -> np.ndarray:
        self._check_storage(i)
        out = np.empty(self.component_shape(i), self.dtype)
        self.read_component_into(i, out)
        return out

    def value(self) -> np.ndarray:
        from parallelvars.checkpoint._restore import read_logical_into

        for i in range(self.num_components):
            self._check_storage(i)
        out = np.empty(self.shape, self.dtype)
        read_logical_into(self, out, file=self._reader.path, cast=False)
        return out

    def __repr__(self) -> str:
        return (
            f"<StoredVariable {self.path!r} kind={self.kind} dtype={dtype_name(self.dtype)} "
            f"shape={self.shape} components={self.num_components}>"
        )


class H5Reader(Mapping[str, StoredVariable]):
    """A checkpoint file in the native layout, opened read-only: a Mapping path -> variable.

    Raises:
        FileNotFoundError: no such file.
        NotACheckpointError: not HDF5, or HDF5 without our layout.
        FormatVersionError: written by a newer, incompatible layout version.
        TruncatedFileError / CorruptCheckpointError: damaged file.
    """

    def __init__(self, path: str | os.PathLike[str], *, map_file: bool = False) -> None:
        self.path = os.fspath(path)
        self._file: h5py.File | None = None
        self._raw_fd: int | None = None
        # map_file: accepted for compatibility; the file is never memory-mapped (a mapped file
        # truncated by another process kills the reader with SIGBUS): every read is a pread.
        del map_file
        self._local = threading.local()
        self._lock = threading.RLock()
        self._own_name: bytes | None = None
        # Parts of a multi-process checkpoint (reached by external link), opened by us.
        self._parts: dict[str, h5py.File] = {}
        self._checked_groups: set[str] = set()
        # Small components read ahead in a few large reads (see stage()): the start of each
        # staged span, its end, and its bytes.
        self._staged: tuple[list[int], list[int], list[np.ndarray]] | None = None
        if not os.path.exists(self.path):
            raise CheckpointNotFoundError("no such checkpoint file", file=self.path)
        if os.path.isdir(self.path):
            raise NotACheckpointError("is a directory, not a checkpoint file", file=self.path)
        self.file_size = _h5policy.check_regular_file(self.path).st_size  # a FIFO would block
        with open(self.path, "rb") as fh:
            head = fh.read(8)
        if not h5py.is_hdf5(self.path):
            raise NotACheckpointError(
                "not an HDF5 file",
                file=self.path,
                expected=f"HDF5 signature {HDF5_SIGNATURE!r}",
                found=f"{head!r}",
            )
        try:
            self._file = h5py.File(self.path, "r")
        except _H5_ERRORS as exc:
            msg = str(exc)
            if "truncated" in msg.lower():
                raise TruncatedFileError("file is truncated", file=self.path, found=msg) from None
            raise CorruptCheckpointError(
                "HDF5 file cannot be opened", file=self.path, found=msg
            ) from None
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    def _load(self) -> None:
        f = self._file
        assert f is not None
        try:
            version = f.attrs.get("parallelvars_format")
        except _H5_ERRORS as exc:
            raise CorruptCheckpointError(
                "root attributes unreadable", file=self.path, found=str(exc)
            ) from None
        if version is None:
            raise NotACheckpointError(
                "an HDF5 file, but not a parallelvars checkpoint",
                file=self.path,
                expected="root attribute 'parallelvars_format'",
                found="none",
            )
        try:
            version = int(version)
        except (TypeError, ValueError):
            raise CorruptCheckpointError(
                "bad format version attribute", file=self.path, found=repr(version)
            ) from None
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                "checkpoint written by a newer layout version",
                file=self.path,
                expected=f"version <= {FORMAT_VERSION}",
                found=f"version {version}",
                hint="upgrade parallelvars to read it",
            )
        self.format_version = version
        try:
            self.metadata: dict[str, Any] = {k: _decode(v) for k, v in f.attrs.items()}
            listed = self.metadata.pop(
                DOCUMENTS_ATTR, None
            )  # layout bookkeeping, not user metadata
            required = set(listed) if isinstance(listed, list) else set()
            metas = _read_json(f, INDEX_DATASET, self.path, required=INDEX_DATASET in required)
            if metas is not None:
                if not isinstance(metas, dict):
                    raise CorruptCheckpointError("index is not a mapping", file=self.path)
                self._variables = {
                    name: StoredVariable(self, name, metas[name]) for name in sorted(metas)
                }
            else:
                groups = {
                    name: obj
                    for name, obj in _h5policy.walk(f, self.path, own_virtual="value")
                    if isinstance(obj, h5py.Group)
                    and "kind" in obj.attrs
                    and not name.startswith(META_GROUP)
                }
                self._variables = {
                    name: StoredVariable.from_group(self, name, groups[name])
                    for name in sorted(groups)
                }
            self.object_graph: dict[str, Any] | None = _read_json(
                f, GRAPH_DATASET, self.path, required=GRAPH_DATASET in required
            )
        except (CorruptCheckpointError, UnsupportedDtypeError):
            raise
        except (*_H5_ERRORS, json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise CorruptCheckpointError(
                "damaged file structure", file=self.path, found=str(exc)
            ) from None

    def _open_dataset(self, path: str, dtype: np.dtype) -> Any:
        """The dataset id at ``path`` under the indirection policy (see ``_h5policy``), its
        stored type checked for ``dtype``; None when there is no such dataset.

        A component that is an external link into this checkpoint's own ``.parts`` folder (a
        multi-process save) is opened in that part by us, after the link is validated; no
        other link is ever followed.
        """
        f = self._h5()
        link = _h5policy.check_path(
            f.id, path, self.path, checked=self._checked_groups, last_external=True
        )
        if link is None:
            try:  # the low-level open: a fraction of the cost of Group.__getitem__
                dsid = h5py.h5d.open(f.id, path.encode())
            except _H5_ERRORS:
                return None
            _h5policy.check_dataset(dsid, self.path, path.lstrip("/"), dtype=dtype)
            return dsid
        part_path = _h5policy.part_file(self.path, link, path.lstrip("/"))
        with self._lock:
            part = self._parts.get(part_path)
            if part is None:
                try:
                    part = self._parts[part_path] = h5py.File(part_path, "r")
                except _H5_ERRORS as exc:
                    raise CorruptCheckpointError(
                        "a part of the checkpoint cannot be opened",
                        file=self.path,
                        variable=path.lstrip("/"),
                        found=f"{part_path}: {exc}",
                    ) from None
        return _h5policy.open_dataset(part.id, os.fsdecode(link[1]), part_path, dtype=dtype)

    def _holds(self, dsid: Any) -> bool:
        """Whether a dataset lives in this file (not behind an external link: those are read
        through HDF5, not from this file's map)."""
        if self._own_name is None:
            self._own_name = h5py.h5f.get_name(self._h5().id)
        try:
            return bool(h5py.h5f.get_name(dsid) == self._own_name)
        except _H5_ERRORS:
            return False

    def _h5(self) -> h5py.File:
        if self._file is None:
            raise ClosedCheckpointError("the reader is closed", file=self.path)
        return self._file

    # Components may be verified and copied from several threads at once (a restore does):
    # the lazily opened descriptor is made under a lock, the read buffers are per thread.
    def _buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes to read a component into: this thread's reused buffer, or a fresh
        one for a component over 64 MiB (so a reader does not keep that much memory)."""
        if nbytes > 64 << 20:
            return np.empty(nbytes, np.uint8)
        buf: np.ndarray | None = getattr(self._local, "component", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.component = np.empty(max(nbytes, 1 << 16), np.uint8)
        return buf[:nbytes]

    def _chunk(self, nbytes: int) -> np.ndarray:
        """A reusable buffer for streamed checks: the component's size, at most 8 MiB."""
        want = min(nbytes, 8 << 20)
        buf: np.ndarray | None = getattr(self._local, "chunk", None)
        if buf is None or len(buf) < want:
            buf = self._local.chunk = np.empty(want, np.uint8)
        return buf

    def _fd(self) -> int:
        """A read-only descriptor of the file, for the reads with pread."""
        if self._raw_fd is None:
            with self._lock:
                if self._raw_fd is None:
                    fd = os.open(self.path, os.O_RDONLY)
                    if hasattr(os, "posix_fadvise"):  # read front to back: a larger readahead
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    self._raw_fd = fd
        return self._raw_fd

    def stage(self, variables: Iterable[StoredVariable]) -> None:
        """Read the small components of ``variables`` now, with a few large reads.

        A restore of many small variables would otherwise pay two system calls per component
        (one to verify it, one to copy it). Components under ``STAGE_COMPONENT`` bytes whose
        offsets the index gives are sorted by offset and read in spans (neighbours less than
        ``STAGE_GAP`` apart share one read), at most ``STAGE_LIMIT`` bytes in all; verification
        and copies then work from memory, on the bytes that were read once. Released by
        :meth:`unstage`.
        """
        ranges: list[tuple[int, int]] = []
        total = 0
        for var in variables:
            if var.dtype.kind == "O" or var._index_offsets is None:
                continue
            for i in range(var.num_components):
                nbytes = var.component_nbytes(i)
                if 0 < nbytes < STAGE_COMPONENT and total + nbytes <= STAGE_LIMIT:
                    loc = var._location(i)  # checked against the file's size
                    if loc is not None and i in var._from_index:
                        ranges.append((loc[0], nbytes))
                        total += nbytes
        if len(ranges) < 2:
            return
        ranges.sort()
        starts: list[int] = []
        ends: list[int] = []
        for offset, nbytes in ranges:
            if starts and offset - ends[-1] <= STAGE_GAP and offset >= starts[-1]:
                ends[-1] = max(ends[-1], offset + nbytes)
            else:
                starts.append(offset)
                ends.append(offset + nbytes)
        bufs = []
        for start, end in zip(starts, ends, strict=True):
            buf = np.empty(end - start, np.uint8)
            view, at = memoryview(buf), start  # type: ignore[arg-type]
            while len(view):
                n = os.preadv(self._fd(), [view], at)
                if n <= 0:
                    raise TruncatedFileError(
                        "file ends inside the data",
                        file=self.path,
                        expected=f"{end} bytes",
                        found=f"{self.file_size} bytes",
                    )
                view, at = view[n:], at + n
            bufs.append(buf)
        self._staged = (starts, ends, bufs)

    def unstage(self) -> None:
        """Drop what :meth:`stage` read."""
        self._staged = None

    def _staged_bytes(self, offset: int, nbytes: int) -> np.ndarray | None:
        """The staged bytes ``[offset, offset + nbytes)`` of the file, when staged."""
        staged = self._staged
        if staged is None:
            return None
        starts, ends, bufs = staged
        k = bisect.bisect_right(starts, offset) - 1
        if k < 0 or offset + nbytes > ends[k]:
            return None
        return bufs[k][offset - starts[k] : offset - starts[k] + nbytes]

    def __getitem__(self, key: str) -> StoredVariable:
        try:
            return self._variables[key]
        except KeyError:
            from parallelvars.errors import MissingVariableError

            raise MissingVariableError(
                "no such variable in the checkpoint", file=self.path, variable=key
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._variables)

    def __len__(self) -> int:
        return len(self._variables)

    def verify_all(self) -> list[str]:
        """Check every variable; the problems found (empty when sound).

        Every component's bytes against its checksum, and the file's structure as any HDF5
        reader sees it: each variable's group and attributes (equal to the index), each
        component dataset read through HDF5 (its bytes again against the checksum) and a
        sharded variable's ``value`` (equal to its shards), so a file that h5py or ``extract``
        cannot read never passes.
        """
        problems = []
        for var in self._variables.values():
            try:
                var.verify_group()
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
                continue
            sound = True
            for i in range(var.num_components):
                try:
                    var.verify(i)
                    var.verify_through_h5(i)
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
                    sound = False
            if sound and var.kind == "sharded":
                try:
                    var.verify_stitched_value()
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
        return problems

    def close(self) -> None:
        # Drop the dataset ids first: those reached through external links keep their own
        # (linked) file open until they are released.
        for var in getattr(self, "_variables", {}).values():
            var._datasets.clear()
        if self._raw_fd is not None:
            os.close(self._raw_fd)
            self._raw_fd = None
        for part in getattr(self, "_parts", {}).values():
            try:
                part.close()
            except _H5_ERRORS:
                pass
        self._parts = {}
        if self._file is not None:
            try:
                self._file.close()
            except _H5_ERRORS:
                pass
            self._file = None

    def __enter__(self) -> H5Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<H5Reader {self.path!r} variables={len(self._variables)}>"
