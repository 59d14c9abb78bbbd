"""Writing the native layout: :func:`write_h5` (one file) and :func:`write_h5_index` (an index
file whose components are external links into per-process part files).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import h5py
import numpy as np

from parallelvars._dtypes import dtype_name
from parallelvars._fileio import DataWriter, Scratch, atomic_path, checksum
from parallelvars._geometry import shard_shapes, shard_slices
from parallelvars.checkpoint.entry import Entry
from parallelvars.checkpoint.h5io.attributes import (
    _attr_value,
    _decode,
    _root_attr_value,
    _set_attr,
    _write_json,
)
from parallelvars.checkpoint.h5io.columns import _columns_parts
from parallelvars.checkpoint.h5io.layout import (
    _H5_ERRORS,
    _INDEX_ONLY_ATTRS,
    COLUMNS_DATASET,
    DOCUMENTS_ATTR,
    FORMAT_VERSION,
    GRAPH_DATASET,
    INDEX_DATASET,
    _library_version,
    _storage_dtype,
    _validate_path,
)
from parallelvars.checkpoint.h5io.records import RecordList as RecordList
from parallelvars.checkpoint.h5io.records import crc_mark as crc_mark
from parallelvars.checkpoint.h5io.records import index_capacity
from parallelvars.checkpoint.h5io.records import marked_template as marked_template
from parallelvars.checkpoint.h5io.records import metadata_key as metadata_key
from parallelvars.checkpoint.registry import component_name
from parallelvars.errors import (
    DtypeMismatchError,
    InvalidEntryError,
    ShapeMismatchError,
)


def atomic_write(path: str, write: Any) -> str:
    """Call ``write(tmp_path)`` and put the result at ``path`` atomically (see ``atomic_path``)."""
    with atomic_path(os.fspath(path)) as tmp:
        write(tmp)
    return os.fspath(path)


def _early_dcpl() -> Any:
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)  # no clock in the file: a structure's bytes are its own
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # the bytes get an offset now ...
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # ... and are written once, by us
    return dcpl


def _write_entry(
    f: h5py.File, writer: _DataWriter, entry: Entry, file: str, dcpl: Any, scratch: Scratch
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
        slices = shard_slices(shape, axis, entry.attrs["shard_offsets"])
        for i, index in enumerate(slices):
            cshape = tuple(entry.component_shape(i))
            layout[index] = h5py.VirtualSource(".", f"{grp.name}/{component_name(i)}", shape=cshape)
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
    meta: dict[str, Any] = {
        "kind": kind,
        "dtype": dtype_name(dt),
        "shape": list(shape),
        "num_components": num_components,
    }
    # The other attributes, as stored; the group gets those that are not kept in the index only.
    extra = {
        key: _attr_value(value)
        for key, value in dict(attrs).items()
        if value is not None and key not in meta
    }
    on_group = [key for key in extra if key not in _INDEX_ONLY_ATTRS]
    grp = _new_group(f, path, wide=len(meta) + len(on_group) > _COMPACT_ATTRS)
    for key in meta:
        _set_attr(grp.id, key, _attr_value(meta[key]))
    for key in on_group:
        _set_attr(grp.id, key, extra[key])
    meta["attrs"] = {key: _decode(stored) for key, stored in extra.items()}
    return grp, meta


# HDF5 keeps at most 8 attributes in a group's object header by default and moves them all
# to "dense" storage (a fractal heap and a B-tree) past that. A group of more attributes (an
# optimizer slot of a sharded variable has 10) is created keeping up to _WIDE_ATTRS in the
# header, so every group's attributes sit in its checksummed object header, where verify
# reads them (h5io/_global_heap.py); readers see the same attributes either way.
_COMPACT_ATTRS = 8
_WIDE_ATTRS = 32


def _new_group(f: h5py.File, path: str, *, wide: bool = False) -> h5py.Group:
    """The group at ``path``, created with its missing parents (it usually does not exist);
    ``wide``: keeping up to ``_WIDE_ATTRS`` attributes in its object header."""
    lcpl, gcpl = _LCPL.get("lcpl"), _LCPL.get("gcpl")
    if lcpl is None or gcpl is None:
        lcpl = _LCPL["lcpl"] = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        lcpl.set_create_intermediate_group(True)
        gcpl = _LCPL["gcpl"] = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
        gcpl.set_obj_track_times(False)  # (intermediate groups are made with it too)
        wide_gcpl = _LCPL["wide"] = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
        wide_gcpl.set_obj_track_times(False)
        wide_gcpl.set_attr_phase_change(_WIDE_ATTRS, _WIDE_ATTRS - 2)
    if wide:
        gcpl = _LCPL["wide"]
    try:
        return h5py.Group(h5py.h5g.create(f.id, path.encode(), lcpl=lcpl, gcpl=gcpl))
    except _H5_ERRORS:  # it exists: a parent of a variable written before
        return f.require_group(path)


_LCPL: dict[str, Any] = {}


def wrong_shape(
    file: str, path: str, i: int, expected: tuple[int, ...], found: tuple[int, ...]
) -> ShapeMismatchError:
    """The error of component ``i`` of the variable at ``path`` having another shape than its
    layout gives (every writer raises this one)."""
    return ShapeMismatchError(
        "component has the wrong shape",
        file=file,
        variable=f"{path}[{i}]",
        expected=expected,
        found=found,
    )


def check_component(
    arr: np.ndarray, path: str, i: int, cshape: tuple[int, ...], dt: np.dtype, file: str
) -> None:
    """Component ``i`` of the variable at ``path`` has the shape and dtype its layout gives:
    every writer of the native layout checks a component here before writing it."""
    if arr.shape != cshape:
        raise wrong_shape(file, path, i, cshape, arr.shape)
    if arr.dtype != dt:
        raise DtypeMismatchError(
            "component has the wrong dtype",
            file=file,
            variable=f"{path}[{i}]",
            expected=dt,
            found=arr.dtype,
        )


def _checked(entry: Entry, i: int, cshape: tuple[int, ...], dt: np.dtype, file: str) -> np.ndarray:
    arr = np.asarray(entry.component(i))
    check_component(arr, entry.path, i, cshape, dt, file)
    return arr


def _holds_arrays(entry: Entry) -> bool:
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
    entries: Iterable[Entry] | Mapping[str, Entry],
    *,
    object_graph: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    checksums: dict[str, list[int]] | None = None,
) -> str:
    """Write entries (neutral-view entries or save records) to ``path`` in the native layout,
    through libhdf5.

    The generator (``h5raw/native.py``: ``save_native``) writes every save; this writer is
    the reference the generated files are compared with (what h5py reads of both is the
    same), and writes what the generator cannot express (``save_native`` says what).

    One pass over the entries and one HDF5 session on a temporary file: for each entry HDF5
    creates the group, attributes and datasets with their storage allocated up front, and the
    component bytes are written straight to that storage with ``pwrite``, one component at a
    time, from the entries (for live variables, from their buffers; for other files, through
    one reused buffer), checksummed as they go. Last come the index and the object graph. The
    file appears under ``path`` only once complete and flushed to disk.

    ``checksums``, when given, receives each entry's component checksums by path, as the
    file's index records them (a multi-process save gathers them for its index file).

    Returns:
        ``path``.
    """
    p = os.fspath(path)
    if isinstance(entries, RecordList):
        items: Sequence[Any] = entries
    else:
        items = list(entries.values()) if isinstance(entries, Mapping) else list(entries)
    written: dict[str, Any] = {}

    def write(tmp: str) -> None:
        index: dict[str, Any] = {}
        with _new_file(tmp, metadata) as f:
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
            _finish_metadata(f, index, object_graph, columns=True)
        if checksums is not None:
            written.update(index)

    atomic_write(p, write)
    if checksums is not None:
        checksums.update((path, list(meta["crc32c"])) for path, meta in written.items())
    return p


def _new_file(tmp: str, metadata: Mapping[str, Any] | None) -> h5py.File:
    """A new file of our layout with its root attributes.

    libver "latest": superblock v3 and v2 object headers, B-trees and heaps, which all carry
    checksums, so a damaged metadata byte is an error rather than a wrong value. No object
    records times, so the same content makes the same bytes.
    """
    f = h5py.File(tmp, "w", libver="latest")
    f.attrs["parallelvars_format"] = np.int64(FORMAT_VERSION)  # few: the high-level API is fine
    f.attrs["parallelvars_version"] = _root_attr_value(_library_version())
    f.attrs["created"] = np.float64(time.time())
    for key, value in dict(metadata or {}).items():
        if value is not None:
            f.attrs[key] = _root_attr_value(value)
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
    """Write, through libhdf5, the index file of a checkpoint whose component bytes live in
    other files.

    The same layout as :func:`write_h5` (root attributes, one group per variable with its
    attributes, the checksummed fixed-length index and object graph, the document list, the
    newest HDF5 file format), with each component dataset an external link to
    ``component.file:component.dataset`` and its checksum taken from the link record. The
    file appears under ``path`` only once complete and flushed to disk.

    The generator (``h5raw/index_file.py``: ``write_native_index``) writes every index file but
    one whose variable has more components than a generated group keeps links in its header:
    HDF5's dense link storage, which this writer makes, is what holds that many external
    links. This writer is also the reference the generated files are compared with.

    Returns:
        ``path``.
    """
    p = os.fspath(path)
    items = list(variables)
    return atomic_write(p, lambda tmp: _write_index_file(tmp, p, items, object_graph, metadata))


def _write_index_file(
    tmp: str,
    file: str,
    items: Sequence[LinkedVariable],
    object_graph: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
) -> None:
    """The index file written by HDF5 at ``tmp``."""
    index: dict[str, Any] = {}
    with _new_file(tmp, metadata) as f:
        for var in items:
            if var.path in index:
                raise InvalidEntryError("is written twice", file=file, variable=var.path)
            shape = tuple(int(s) for s in var.shape)
            n = len(var.components)
            grp, meta = _write_group(
                f, var.path, var.kind, np.dtype(var.dtype), shape, n, var.attrs
            )
            meta["offsets"] = [None] * n
            meta["crc32c"] = [int(c.crc32c) for c in var.components]
            links, lcpl, lapl = grp.id.links, grp._lcpl, grp._lapl
            for i, link in enumerate(var.components):
                links.create_external(
                    component_name(i).encode(),
                    link.file.encode(),
                    link.dataset.encode(),
                    lcpl=lcpl,
                    lapl=lapl,
                )
            if var.kind == "sharded" and n:
                # The stitched value, as a one-process file has, over the parts' shards.
                axis = int(var.attrs["shard_axis"])
                storage = _storage_dtype(np.dtype(var.dtype))
                layout = h5py.VirtualLayout(shape=shape, dtype=storage)
                offsets = var.attrs["shard_offsets"]
                slices = shard_slices(shape, axis, offsets)
                cshapes = shard_shapes(shape, axis, offsets)
                for index_, link, cshape in zip(slices, var.components, cshapes, strict=True):
                    layout[index_] = h5py.VirtualSource(link.file, link.dataset, shape=cshape)
                vdcpl = layout._get_dcpl(file)
                vdcpl.set_obj_track_times(False)
                h5py.h5d.create(
                    grp.id, b"value", _file_type(storage), h5py.h5s.create_simple(shape), dcpl=vdcpl
                )
            index[var.path] = meta
        _finish_metadata(f, index, object_graph)


def _finish_metadata(
    f: h5py.File,
    index: dict[str, Any],
    object_graph: Any,
    *,
    columns: bool = False,
) -> None:
    """Record the index (with every component's checksum), with ``columns`` the columns
    document (the same, column by column), and the object graph.

    Each document is padded with spaces to a capacity that any later one of the same structure
    fits in (only checksums change, and each has at most 10 digits).
    """
    text = json.dumps(index)
    # The capacity depends on the structure alone (not on the checksums' digits), so every save
    # of a structure has the same bytes outside the data, whoever writes it.
    crcs = [c for m in index.values() for c in m["crc32c"]]
    digits = ", ".join(map(str, crcs))  # (the columns' checksum list)
    separators = 2 * max(len(crcs) - 1, 0)
    capacity = index_capacity(len(text) - (len(digits) - separators), len(crcs))
    _write_json(f, INDEX_DATASET, text=text, capacity=capacity)
    documents = [INDEX_DATASET]
    if columns:
        head, tail = _columns_parts(index)
        room = index_capacity(len(head) + len(tail) + separators, len(crcs))
        _write_json(f, COLUMNS_DATASET, text=head + digits + tail, capacity=room)
        documents.append(COLUMNS_DATASET)
    if object_graph is not None:
        _write_json(f, GRAPH_DATASET, object_graph)
        documents.append(GRAPH_DATASET)
    # Which documents exist, in the checksummed root header: h5py's get() answers None for a
    # link it cannot follow, so a damaged link would otherwise look like "no graph".
    f.attrs[DOCUMENTS_ATTR] = np.array([d.encode() for d in documents])
