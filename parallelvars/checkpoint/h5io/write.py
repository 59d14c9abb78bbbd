"""Writing the native layout: :func:`write_h5` (one file) and :func:`write_h5_index` (an index
file whose components are external links into per-process part files).
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import h5py
import numpy as np

from parallelvars._dtypes import dtype_name
from parallelvars._fileio import DataWriter, Scratch, atomic_path, checksum
from parallelvars._geometry import shard_shapes, shard_slices
from parallelvars.checkpoint import _skeleton
from parallelvars.checkpoint._skeleton import SkeletonCache
from parallelvars.checkpoint.entry import Entry
from parallelvars.checkpoint.h5io import _index_skeleton
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


def check_component(
    arr: np.ndarray, path: str, i: int, cshape: tuple[int, ...], dt: np.dtype, file: str
) -> None:
    """Component ``i`` of the variable at ``path`` has the shape and dtype its layout gives:
    every writer of the native layout checks a component here before writing it."""
    if arr.shape != cshape:
        raise ShapeMismatchError(
            "component has the wrong shape",
            file=file,
            variable=f"{path}[{i}]",
            expected=cshape,
            found=arr.shape,
        )
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
    skeletons: SkeletonCache | None = None,
    checksums: dict[str, list[int]] | None = None,
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
    key = _structure_key(items, object_graph, metadata) if skeletons is not None else None
    if key is not None and skeletons is not None:
        cached = skeletons.get(key)
        comps = None if cached is None else _flat_components(items)
        if cached is not None and comps is not None and cached.fits(comps):
            flat: list[int] = []
            atomic_write(
                p,
                lambda tmp: flat.extend(
                    _write_from_skeleton(tmp, p, cached, items, comps, metadata)
                ),
            )
            if checksums is not None:
                starts = _component_starts(items)
                for n, e in enumerate(items):
                    checksums[e.path] = flat[starts[n] : starts[n + 1]]
            return p
    captured: list[_skeleton.Skeleton | None] = []

    written: dict[str, Any] = {}

    def write(tmp: str) -> None:
        index: dict[str, Any] = {}
        # With a skeleton to capture, the header values that change between saves are written
        # as random sentinels first (to find them in the file), then patched to their values.
        values = _header_values(metadata, columns=True) if key is not None else {}
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
            where, columns = _finish_metadata(
                f,
                index,
                object_graph,
                crc_sentinel=sentinels.get(_INDEX_CRC),
                template=template,
                columns=True,
                columns_sentinel=sentinels.get(_COLUMNS_CRC),
            )
        if key is not None:
            captured.append(
                _capture(tmp, key, items, index, where, columns, template, values, sentinels)
            )
        if checksums is not None:
            written.update(index)

    atomic_write(p, write)
    if skeletons is not None and key is not None:
        skeletons.put(captured[0] if captured else None)
    if checksums is not None:
        checksums.update((path, list(meta["crc32c"])) for path, meta in written.items())
    return p


# The header value names a skeleton patches: the root attributes that change between saves,
# and the index and columns documents' checksums.
_INDEX_CRC = "/_parallelvars/index:crc32c"
_COLUMNS_CRC = "/_parallelvars/columns:crc32c"


def _header_values(metadata: Mapping[str, Any] | None, *, columns: bool = False) -> dict[str, Any]:
    """The root attribute values of a save that live in its object header and change between
    saves: ``created`` and every integer or float of the metadata (``save_counter``,
    ``step``), by name (the index checksum, and with ``columns`` the columns', are added once
    known)."""
    values: dict[str, Any] = {"created": np.float64(time.time())}
    for key, value in dict(metadata or {}).items():
        stored = None if value is None else _root_attr_value(value)
        if isinstance(stored, (np.int64, np.float64)):
            values[key] = stored
    values[_INDEX_CRC] = np.int64(0)
    if columns:
        values[_COLUMNS_CRC] = np.int64(0)
    return values


class RecordList(list):
    """Save records that keep what writing their structure again needs, made on first use:
    their part of the structure key and the flat list of their components.

    A checkpoint hands the same records to every save while its object graph is unchanged
    (``Checkpoint._gather``), so a repeated save does this per-record work once per
    structure. The records must not change once written (what is kept would be stale); their
    components' values may, they are read at every write.
    """

    __slots__ = ("_flat", "_key", "_like", "_starts", "replicas", "token")

    def __init__(self, records: Iterable[Any] = (), *, like: RecordList | None = None) -> None:
        """``like``: records of the same structure (a snapshot's copies are like the live
        records): their key and token are these records' too."""
        super().__init__(records)
        self._key: Any = None
        self._like = like
        self._flat: tuple[list[np.ndarray], list[int]] | None = None
        self._starts: list[int] | None = None
        # The plan the writer compares the records' replicas by (runs of their buffers: set by
        # the checkpoint's writer, read by h5raw.native): None, False after a first save, then
        # the plan.
        self.replicas: Any = None
        # Stands for the records' structure: records with the same token have the same
        # structure, so a writer's cache can tell a repeated structure without its key.
        self.token: object = object() if like is None else like.token

    def starts(self) -> list[int]:
        """The number of each record's first component in write order (then the total)."""
        if self._starts is None:
            self._starts = list(itertools.accumulate((len(r.components) for r in self), initial=0))
        return self._starts

    def structure(self) -> Any:
        """The records' part of :func:`_structure_key` (None: not all are arrays in memory)."""
        if self._key is None:
            self._key = _records_key(self) if self._like is None else self._like.structure()
        return self._key

    def components(self) -> list[np.ndarray]:
        """Every record's components in write order, C-contiguous (strided ones copied now)."""
        if self._flat is None:
            comps = [c for r in self for c in r.components]
            self._flat = (comps, [i for i, c in enumerate(comps) if not c.flags.c_contiguous])
        comps, strided = self._flat
        if not strided:
            return comps
        out = list(comps)
        for i in strided:
            out[i] = np.ascontiguousarray(out[i])
        return out


def _component_starts(items: Sequence[Any]) -> list[int]:
    """The number of each entry's first component in write order (then the total)."""
    if isinstance(items, RecordList):
        return items.starts()
    return list(itertools.accumulate((len(e.components) for e in items), initial=0))


def _records_key(items: Sequence[Any]) -> Any:
    """Each entry's path, kind, shape, attributes and components' dtypes and shapes (None for
    entries that are not arrays in memory)."""
    try:
        return tuple(
            (
                e.path,
                e.kind,
                tuple(e.shape),
                dict(e.attrs),
                tuple((c.dtype, c.shape) for c in e.components),
            )
            for e in items
        )
    except AttributeError:
        return None


def _flat_components(items: Sequence[Any]) -> list[np.ndarray] | None:
    """Every entry's components in write order, C-contiguous (None: not arrays in memory)."""
    if isinstance(items, RecordList):
        return items.components()
    try:
        return [np.ascontiguousarray(c) for e in items for c in e.components]
    except AttributeError:
        return None


def metadata_key(metadata: Mapping[str, Any] | None) -> tuple[Any, ...]:
    """What a file's bytes depend on in its metadata: each name, with the type of a number
    (its value is a header value, rewritten in place) and any other value as it is."""
    return tuple(
        (k, type(v).__name__ if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
        for k, v in dict(metadata or {}).items()
        if v is not None
    )


def _structure_key(
    items: Sequence[Any], object_graph: Mapping[str, Any] | None, metadata: Mapping[str, Any] | None
) -> Any:
    """What a file's bytes depend on besides the component values and the header values: the
    library version, the metadata's names and types, the object graph and each entry's path,
    kind, shape, attributes and components' dtypes and shapes. None for entries that are not
    arrays in memory (they are never written from a skeleton)."""
    records = items.structure() if isinstance(items, RecordList) else _records_key(items)
    if records is None:
        return None
    meta = metadata_key(metadata)
    return (_library_version(), meta, object_graph, records)


_CRC_MARK = "\ue000parallelvars-crc32c:{}\ue000"  # stands for a record's checksums


def _index_template(index: Mapping[str, Any]) -> str:
    """The index document with a ``%d`` for every checksum: ``template % crcs`` is
    ``json.dumps(index)`` (the checksums are each record's last field).

    Made with one ``json.dumps`` of the index, each record's checksums replaced by a mark
    (:func:`crc_mark`) then by ``%d``s; a mark found more often than records have it (a value
    of the same text) makes the template record by record instead."""
    marked: dict[str, Any] = {}
    for path, meta in index.items():
        rest = dict(meta)
        rest["crc32c"] = crc_mark(len(rest.pop("crc32c")))
        marked[path] = rest
    template = marked_template(marked)
    return _index_template_by_record(index) if template is None else template


def crc_mark(n: int) -> str:
    """What stands for a record's ``n`` checksums in an index made for :func:`marked_template`."""
    return _CRC_MARK.format(n)


def marked_template(marked: Mapping[str, Any]) -> str | None:
    """The template of :func:`_index_template` from an index whose records' last field,
    ``crc32c``, is its :func:`crc_mark`; None when a mark's text is found elsewhere too."""
    counts: dict[str, int] = {}
    for meta in marked.values():
        mark = meta["crc32c"]
        counts[mark] = counts.get(mark, 0) + 1
    text = json.dumps(marked).replace("%", "%%")
    for mark, count in counts.items():
        quoted = json.dumps(mark)
        if text.count(quoted) != count:
            return None
        n = int(mark.strip("\ue000").rpartition(":")[2])
        text = text.replace(quoted, "[" + ", ".join(["%d"] * n) + "]")
    return text


def _index_template_by_record(index: Mapping[str, Any]) -> str:
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
    columns: ColumnsPlace | None,
    template: str | None,
    values: dict[str, Any],
    sentinels: dict[str, Any],
) -> _skeleton.Skeleton | None:
    """Cache the skeleton of the file HDF5 wrote at ``tmp`` and put the real header values in
    it (patched in place, or through HDF5 when the file cannot be a skeleton)."""
    offset, capacity, crc = where
    values[_INDEX_CRC] = np.int64(crc)
    if columns is not None:
        values[_COLUMNS_CRC] = np.int64(columns.crc)
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
        skel = _skeleton.capture(
            tmp,
            key,
            offsets,
            nbytes,
            offset,
            capacity,
            sentinels,
            columns=None if columns is None else (columns.offset, columns.capacity),
        )
        if skel is not None and not (
            skel.set_template(template)
            and (columns is None or skel.set_columns(columns.head, columns.tail))
        ):
            skel = None
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
            elif name == _COLUMNS_CRC:
                f[COLUMNS_DATASET].attrs.modify("crc32c", value)
            else:
                f.attrs.modify(name, value)
    return None


def _write_from_skeleton(
    tmp: str,
    file: str,
    skel: _skeleton.Skeleton,
    items: Sequence[Any],
    comps: Sequence[np.ndarray],
    metadata: Mapping[str, Any] | None,
) -> list[int]:
    """Write a save of the skeleton's structure to ``tmp``: the skeleton's bytes, the component
    data (``comps``: every entry's components, C-contiguous) at its datasets' offsets, the
    index, and the header values patched. Returns the components' checksums in write order."""
    values = _header_values(metadata, columns=skel.columns_capacity > 0)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    os.close(fd)
    writer, ok = _DataWriter(tmp, file), False
    starts: list[int] = []  # the first component number of each entry, once a name is needed

    def check(arr: np.ndarray, crc: int, i: int) -> None:
        if not starts:
            starts.extend(_component_starts(items))
        j = bisect.bisect_right(starts, i) - 1
        writer.check_unchanged(arr, crc, f"{items[j].path}[{i - starts[j]}]")

    try:
        os.ftruncate(writer.fd, skel.file_size)
        crcs = skel.write(
            writer.fd,
            comps,
            values,
            write=writer.write,
            check=check,
            index_crc=_INDEX_CRC,
            columns_crc=_COLUMNS_CRC,
        )
        ok = True
    finally:
        writer.close(raise_errors=ok)
    return crcs


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
    skeletons: SkeletonCache | None = None,
) -> str:
    """Write the index file of a checkpoint whose component bytes live in other files.

    The same layout as :func:`write_h5` (root attributes, one group per variable with its
    attributes, the checksummed fixed-length index and object graph, the document list, the
    newest HDF5 file format), with each component dataset an external link to
    ``component.file:component.dataset`` and its checksum taken from the link record. The
    file appears under ``path`` only once complete and flushed to disk.

    With ``skeletons`` (a cache kept for the index files of one checkpoint), a save of the
    structure the cache holds is written from the cached bytes of the first: the links' folder
    (the part of every ``component.file`` up to its last ``/``, one for all links, of the same
    length), the index's checksums and the header values put in, the header checksums
    recomputed (see ``_index_skeleton``); byte for byte what HDF5 writes. Any other save is
    written by HDF5 and its skeleton cached.

    Returns:
        ``path``.
    """
    p = os.fspath(path)
    items = list(variables)
    prefix, key = (
        ("", None) if skeletons is None else _index_structure(items, object_graph, metadata)
    )
    cached = None if key is None or skeletons is None else skeletons.get(key)
    if isinstance(cached, _index_skeleton.IndexSkeleton):
        skel = cached

        def repeat(tmp: str) -> None:
            crcs = [int(c.crc32c) for v in items for c in v.components]
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                skel.write(fd, prefix.encode(), crcs, _header_values(metadata), _INDEX_CRC)
            finally:
                os.close(fd)

        return atomic_write(p, repeat)
    if cached is not None:  # a structure known to have no skeleton: HDF5 writes it
        return atomic_write(
            p,
            lambda tmp: _write_index_file(tmp, p, items, object_graph, metadata, {}, "", ""),
        )
    captured: list[Any] = []

    def write(tmp: str) -> None:
        if key is None:
            _write_index_file(tmp, p, items, object_graph, metadata, {}, prefix, prefix)
            return
        values = _header_values(metadata)
        sentinels = {name: _skeleton.sentinel(np.asarray(v).dtype) for name, v in values.items()}
        stand_in = _index_skeleton.link_sentinel(len(prefix.encode()))
        index, (offset, capacity, crc), template = _write_index_file(
            tmp, p, items, object_graph, metadata, sentinels, prefix, stand_in.decode()
        )
        crcs = [c for m in index.values() for c in m["crc32c"]]
        skel = None
        if (
            template is not None
            and template % tuple(crcs) == json.dumps(index)
            and len(template) + 8 * len(crcs) <= capacity  # any checksums fit
        ):
            links = sum(len(v.components) for v in items) if prefix else 0
            skel = _index_skeleton.capture(
                tmp, key, stand_in, links, sentinels, (offset, capacity, template)
            )
        if skel is None:  # the file gets its real values through HDF5; so will later saves
            _write_index_file(tmp, p, items, object_graph, metadata, {}, prefix, prefix)
            captured.append(_index_skeleton.NoSkeleton(key))
            return
        values[_INDEX_CRC] = np.int64(crc)
        fd = os.open(tmp, os.O_WRONLY)
        try:
            skel.write(fd, prefix.encode(), crcs, values, _INDEX_CRC)
        finally:
            os.close(fd)
        captured.append(skel)

    atomic_write(p, write)
    if skeletons is not None:
        # (the cache compares keys only, whatever it holds)
        skeletons.put(cast(Any, captured[0] if captured else None))
    return p


def _link_prefix(items: Sequence[LinkedVariable]) -> str | None:
    """The folder part (up to the last ``/``) shared by every link's file, or None."""
    first = next((c.file for v in items for c in v.components), "")
    prefix = first[: first.rfind("/") + 1]
    for v in items:
        for c in v.components:
            if not c.file.startswith(prefix) or "/" in c.file[len(prefix) :]:
                return None
    return prefix


def _index_structure(
    items: Sequence[LinkedVariable],
    object_graph: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
) -> tuple[str, Any]:
    """The links' shared folder and what an index file's bytes depend on besides it, the
    component checksums and the header values (None when its links share no folder)."""
    prefix = _link_prefix(items)
    if prefix is None or any(v.kind == "sharded" for v in items):
        # (a sharded variable's stitched value names the parts outside the links: HDF5 writes)
        return "", None
    n = len(prefix)
    records = [
        (
            v.path,
            v.kind,
            np.dtype(v.dtype),
            tuple(v.shape),
            dict(v.attrs),
            [(c.file[n:], c.dataset) for c in v.components],
        )
        for v in items
    ]
    meta = metadata_key(metadata)
    return prefix, (_library_version(), len(prefix.encode()), meta, object_graph, records)


def _write_index_file(
    tmp: str,
    file: str,
    items: Sequence[LinkedVariable],
    object_graph: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    values: Mapping[str, Any],
    prefix: str,
    stand_in: str,
) -> tuple[dict[str, Any], tuple[int, int, int], str | None]:
    """The index file written by HDF5 at ``tmp`` (``values`` override header values, and
    ``stand_in`` replaces every link's folder ``prefix``); returns the index, where its
    document lies (offset, capacity, checksum) and its template (None without ``values``)."""
    index: dict[str, Any] = {}
    with _new_file(tmp, metadata, values) as f:
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
                target = stand_in + link.file[len(prefix) :]
                links.create_external(
                    component_name(i).encode(),
                    target.encode(),
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
        template = _index_template(index) if values else None
        where, _ = _finish_metadata(
            f, index, object_graph, crc_sentinel=values.get(_INDEX_CRC), template=template
        )
    return index, where, template


class ColumnsPlace(NamedTuple):
    """Where a file's columns document lies (data offset, capacity), its checksum, and its
    text before and after the checksums (see :func:`_columns_parts`)."""

    offset: int
    capacity: int
    crc: int
    head: str
    tail: str


def _finish_metadata(
    f: h5py.File,
    index: dict[str, Any],
    object_graph: Any,
    *,
    crc_sentinel: Any = None,
    template: str | None = None,
    columns: bool = False,
    columns_sentinel: Any = None,
) -> tuple[tuple[int, int, int], ColumnsPlace | None]:
    """Record the index (with every component's checksum), with ``columns`` the columns
    document (the same, column by column), and the object graph.

    Each document is padded with spaces to a capacity that any later one of the same structure
    fits in (only checksums change, and each has at most 10 digits). Returns the index's data
    offset, its capacity and its checksum (the attribute holds ``crc_sentinel`` when given),
    and where the columns are (their attribute holds ``columns_sentinel`` when given).
    """
    text = json.dumps(index)
    # The capacity depends on the structure alone (not on the checksums' digits), so every save
    # of a structure has the same bytes outside the data, whoever writes it.
    crcs = [c for m in index.values() for c in m["crc32c"]]
    digits = ", ".join(map(str, crcs))  # (the columns' checksum list)
    separators = 2 * max(len(crcs) - 1, 0)
    capacity = _skeleton.index_capacity(len(text) - (len(digits) - separators), len(crcs))
    ds, crc = _write_json(f, INDEX_DATASET, text=text, capacity=capacity, crc_value=crc_sentinel)
    offset = ds.id.get_offset()
    documents = [INDEX_DATASET]
    place = None
    if columns:
        head, tail = _columns_parts(index)
        room = _skeleton.index_capacity(len(head) + len(tail) + separators, len(crcs))
        cds, ccrc = _write_json(
            f, COLUMNS_DATASET, text=head + digits + tail, capacity=room, crc_value=columns_sentinel
        )
        coffset = cds.id.get_offset()
        place = ColumnsPlace(-1 if coffset is None else int(coffset), room, ccrc, head, tail)
        documents.append(COLUMNS_DATASET)
    if object_graph is not None:
        _write_json(f, GRAPH_DATASET, object_graph)
        documents.append(GRAPH_DATASET)
    # Which documents exist, in the checksummed root header: h5py's get() answers None for a
    # link it cannot follow, so a damaged link would otherwise look like "no graph".
    f.attrs[DOCUMENTS_ATTR] = np.array([d.encode() for d in documents])
    return ((-1 if offset is None else int(offset)), capacity, crc), place
