"""A native checkpoint file written through the generator (:mod:`.generate`) instead of
libhdf5: the same content as ``h5io.write.write_h5`` (groups, attributes, datasets, the index,
the columns and the object graph, checksums), for callers and tests that write a whole file
from entries whose components are arrays in memory.

The metadata is generated in one piece and written with one ``pwrite``; the component bytes go
out in gathered writes (``pwritev``) in file order, on a helper thread from the moment the plan
gives their offsets (a first save makes the rest of its metadata meanwhile), the disk asked to
start on them every 8 MiB; then the documents. With
``share_equal``, a component whose bytes equal an earlier component of the same variable (same
shape) is not written again: its name is a hard link to that component's dataset, and the
index records the same offset for both.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import crc32c as _crc32c
import numpy as np

from parallelvars._dtypes import dtype_name
from parallelvars._fileio import (
    atomic_path,
    pwrite_all,
    start_writeback,
)
from parallelvars._geometry import shard_shapes
from parallelvars.checkpoint._gcfreeze import freeze_made_so_far
from parallelvars.checkpoint.h5io.attributes import _attr_value, _decode, _root_attr_value
from parallelvars.checkpoint.h5io.columns import (
    _META_KEYS,
    _copied,
    _value_key,
    index_pieces,
    record_documents,
)
from parallelvars.checkpoint.h5io.layout import (
    COLUMNS_DATASET,
    DOCUMENTS_ATTR,
    FORMAT_VERSION,
    GRAPH_DATASET,
    INDEX_DATASET,
    _library_version,
    _validate_path,
    validate_paths,
)
from parallelvars.checkpoint.h5io.records import (
    RecordList,
    _structure_key,
    crc_mark,
    index_capacity,
    metadata_key,
    record_classes,
)
from parallelvars.checkpoint.h5io.write import _columns_parts, check_component, wrong_shape
from parallelvars.checkpoint.h5raw import generate
from parallelvars.checkpoint.h5raw.component_bytes import (
    Checksums,
    Diverged,
    _checksummed,
    _crc,
    _DataWrite,
    _write_components,
    compares_later,
    replicas_diverged,
    same_arrays,
    settle,
)
from parallelvars.checkpoint.h5raw.generate import FilePlan, SpilledImage, Variable
from parallelvars.checkpoint.h5raw.messages import Unsupported
from parallelvars.errors import InvalidEntryError, UnsupportedDtypeError

_PATH = operator.attrgetter("path")

__all__ = ["Prepared", "index_documents", "save_native", "write_native"]


def write_native(
    path: str | os.PathLike[str],
    entries: Iterable[Any],
    *,
    object_graph: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    share_equal: bool = False,
    created: float | None = None,
) -> str:
    """Write ``entries`` (with ``components``: arrays in memory) to ``path`` in the native
    layout, through the generator; returns ``path``. Raises ``Unsupported`` (from
    :mod:`.messages`) for what the generator cannot express.

    The cyclic garbage collector runs as the program set it (no save pauses it: a pause reaches
    every thread); its walks of the plan's objects are part of the cost measured by
    ``bench/bench_h5raw.py``."""
    return _write_native(
        path,
        entries,
        object_graph=object_graph,
        metadata=metadata,
        share_equal=share_equal,
        created=created,
    )


def _write_native(
    path: str | os.PathLike[str],
    entries: Iterable[Any],
    *,
    object_graph: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    share_equal: bool,
    created: float | None,
) -> str:
    p = os.fspath(path)
    items = list(entries.values()) if isinstance(entries, Mapping) else list(entries)
    comps, crcs, shares, _ = _checksummed(items, share_equal)
    variables = []
    for e, cs, shared in zip(items, comps, shares, strict=True):
        _validate_path(e.path)
        dt = cs[0].dtype if cs else np.dtype(e.dtype)
        vlen = dt.kind == "O"  # (byte strings: each component its own heap objects)
        if vlen:
            shared = None
        variables.append(
            Variable(
                e.path,
                e.kind,
                dt,
                tuple(e.shape),
                len(cs),
                dict(e.attrs),
                shared,
                strings=_strings_of(e, p) if vlen else None,
            )
        )
    documents = [INDEX_DATASET, COLUMNS_DATASET]
    if object_graph is not None:
        documents.append(GRAPH_DATASET)
    root = _root_values(metadata, created)
    root[DOCUMENTS_ATTR] = np.array([d.encode() for d in documents])
    plan = FilePlan(variables, root_attrs=root, documents=documents)
    index: dict[str, Any] = {}
    names: dict[np.dtype, str] = {}
    decoded: dict[Any, Any] = {}  # attribute values recur across variables: converted once
    for e, v, cc in zip(items, variables, crcs, strict=True):
        name = names.get(v.dtype)
        if name is None:
            name = names[v.dtype] = dtype_name(v.dtype)
        meta: dict[str, Any] = {
            "kind": e.kind,
            "dtype": name,
            "shape": [int(d) for d in e.shape],
            "num_components": v.num_components,
        }
        meta["attrs"] = {
            k: _index_value(val, decoded)
            for k, val in dict(e.attrs).items()
            if val is not None and k not in meta
        }
        meta["offsets"] = plan.offsets[e.path]
        meta["crc32c"] = cc
        index[e.path] = meta
    docs = index_documents(index)
    if object_graph is not None:
        docs[GRAPH_DATASET] = json.dumps(object_graph).encode()
    meta_out = plan.chunks(
        {k: len(v) for k, v in docs.items()},
        document_checksums={k: _crc32c.crc32c(v) for k, v in docs.items()},
    )
    with atomic_path(p) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            os.ftruncate(fd, meta_out.file_size)
            for at, chunk in meta_out:  # (each chunk written as it is made)
                pwrite_all(fd, memoryview(chunk), at)
            _write_components(fd, plan, items, comps, crcs, p)
            for offset, data in meta_out.data:  # (after: the gathered writes fill small gaps)
                pwrite_all(fd, memoryview(data), offset)
            for name, data in docs.items():
                pwrite_all(fd, memoryview(data), meta_out.documents[name])
        finally:
            os.close(fd)
    return p


def index_documents(index: Mapping[str, Any], *, columns: bool = True) -> dict[str, bytes]:
    """The index and (unless ``columns`` is false: a multi-process index file has none) the
    columns documents of a file with ``index``, as the writers write them (each padded to its
    capacity); what ``verify`` regenerates and compares."""
    flat = [c for m in index.values() for c in m["crc32c"]]
    text = json.dumps(index)
    digits = ", ".join(map(str, flat))
    parts = _columns_parts(index) if columns else None
    # (the index's length without its checksums' digits: its separators stay)
    room = document_capacities(
        len(text) - len(digits) + _separators(len(flat)),
        None if parts is None else len(parts[0]) + len(parts[1]),
        len(flat),
    )
    docs = {INDEX_DATASET: text.encode().ljust(room[INDEX_DATASET], b" ")}
    if parts is not None:
        head, tail = parts
        docs[COLUMNS_DATASET] = (head + digits + tail).encode().ljust(room[COLUMNS_DATASET], b" ")
    return docs


def _separators(checksums: int) -> int:
    """The length of the ``", "`` between ``checksums`` checksums in a flat list."""
    return 2 * max(checksums - 1, 0)


def document_capacities(
    index_bare: int, columns_bare: int | None, checksums: int
) -> dict[str, int]:
    """The room each writer gives the index document (``index_bare``: its length without
    its ``checksums`` checksums' digits) and, with ``columns_bare`` (the length of the
    columns document's text before and after its checksums), the columns document: a
    function of the structure alone, so every save of a structure has the same bytes outside
    the data."""
    room = {INDEX_DATASET: index_capacity(index_bare, checksums)}
    if columns_bare is not None:
        room[COLUMNS_DATASET] = index_capacity(columns_bare + _separators(checksums), checksums)
    return room


def _index_value(value: Any, seen: dict[Any, Any]) -> Any:
    """An attribute's value as the index records it (``_decode(_attr_value(value))``), looked
    up in ``seen`` for strings, integers, booleans and lists of strings (a list: a fresh
    copy). Floats are converted each time (``-0.0 == 0.0`` would share one key)."""
    t = type(value)
    if t in (str, int, bool):
        key: Any = (t, value)
    elif t is list and all(type(x) is str for x in value):
        key = ("strs", *value)
    else:
        return _decode(_attr_value(value))
    out = seen.get(key, seen)
    if out is seen:
        out = seen[key] = _decode(_attr_value(value))
    return list(out) if isinstance(out, list) else out


# ----------------------------------------------------------------------------- the save path
class Prepared:
    """What a repeated save of one structure reuses (kept in a checkpoint's cache under
    ``key``): the plan, its generated metadata image, the index document as a template in
    runs with a ``%d`` for every checksum (:func:`~.columns.index_pieces`), the columns
    document around its checksums (the text before them in pieces), the object graph
    document, and the data the plan lays itself (``data``: the byte-string components' heap
    references; their values are part of the structure's key). Only the checksums, the root
    header values and the documents' checksum attributes change between two saves of a
    structure."""

    def __init__(
        self,
        key: Any,
        plan: FilePlan,
        image: bytes | memoryview,
        file_size: int,
        documents: dict[str, int],
        template: Sequence[tuple[str, int]],
        capacities: dict[str, int],
        columns: tuple[Sequence[str], str],
        graph: bytes | None,
        data: Sequence[tuple[int, bytes | memoryview]] = (),
    ) -> None:
        self.key = key
        self.data = list(data)
        # an index file's: the folder its links name, and where it lies (see _relinked)
        self.folder: bytes | None = None
        self.relinker: Any = None
        self.first: dict[str, Any] = {}
        self.plan = plan
        # (an index file's is patched in place: see index_file._relink)
        self.image: Any = image  # bytes, a memoryview or a uint8 array
        self.file_size = file_size
        self.documents = documents
        self.template = template
        self.capacities = capacities
        self.columns = columns
        self.graph = graph
        self.lock = threading.Lock()  # the plan's root and document headers are re-encoded
        # the live records last saved with this plan and their gathered writes (reused while
        # the records hold the same arrays: see component_bytes.same_arrays); kept only when
        # they write the records' own arrays, no copy of a strided one
        self.batches: tuple[Any, list[Any]] | None = None


class Unexpressed:
    """A cache marker: the generator cannot express the structure ``key`` (it is written through
    libhdf5; see :func:`save_native`)."""

    def __init__(self, key: Any) -> None:
        self.key = key


def _expected_shapes(e: Any) -> list[tuple[int, ...]]:
    shape = tuple(int(d) for d in e.shape)
    n = int(e.num_components)
    if e.kind != "sharded" or not n:
        return [shape] * n
    return shard_shapes(shape, int(e.attrs["shard_axis"]), e.attrs["shard_offsets"])


def _check_components(e: Any, comps: Sequence[np.ndarray], file: str) -> None:
    """The components of an entry are of its dtype and of the shapes its layout gives."""
    if e.kind != "sharded" and len(comps) == e.num_components:  # every component: the shape
        shape, dt = e.shape, e.dtype
        if type(shape) is not tuple:
            shape = tuple(map(int, shape))
        for c in comps:  # (compared in place: a tuple of numpy integers equals the ints')
            if c.shape != shape or c.dtype != dt:
                break
        else:
            return
    dt = np.dtype(e.dtype)
    for i, (c, want) in enumerate(zip(comps, _expected_shapes(e), strict=True)):
        check_component(c, e.path, i, want, dt, file)


def _root_values(
    metadata: Mapping[str, Any] | None, created: float | None = None
) -> dict[str, Any]:
    """The root attributes of a save, in the order the writer sets them."""
    root: dict[str, Any] = {
        "parallelvars_format": np.int64(FORMAT_VERSION),
        "parallelvars_version": _root_attr_value(_library_version()),
        "created": np.float64(time.time() if created is None else created),
    }
    for key, value in dict(metadata or {}).items():
        if value is not None:
            root[key] = _root_attr_value(value)
    return root


def _changing(root: Mapping[str, Any]) -> dict[str, Any]:
    """The root values a repeated save of one structure may change: ``created`` and the
    metadata's numbers (``save_counter``, ``step``)."""
    return {
        k: v
        for k, v in root.items()
        if k not in ("parallelvars_format", DOCUMENTS_ATTR) and isinstance(v, np.int64 | np.float64)
    }


def save_native(
    path: str | os.PathLike[str],
    entries: Iterable[Any] | Mapping[str, Any],
    *,
    object_graph: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    cache: Any = None,
    checksums: dict[str, list[int]] | None = None,
    share_equal: bool = True,
) -> str:
    """Write a checkpoint file of the native layout at ``path`` through the generator: every
    single-process save (``Checkpoint.write/save``, the manager) and every conversion into
    HDF5 comes here. Returns ``path``.

    Entries whose components are arrays in memory (save records, array entries) are
    checksummed first; with ``share_equal``, components of a variable (not sharded) whose
    bytes are equal are stored once, the other names hard links to the first one's dataset.
    The metadata comes from the generator, or, for a structure written before with the same
    ``cache`` (a :class:`~parallelvars.checkpoint.h5io.records.PlanCache`), from the cached
    :class:`Prepared` with the changing values put in; the component bytes are written in
    gathered ``pwritev`` calls from the arrays themselves (no copy; on a helper thread, from
    the moment the plan gives their offsets, while the metadata and documents are made), then
    checksummed again (a buffer another thread changed meanwhile fails the save). Entries read from other files are
    streamed through one reused buffer per component, checksummed as they are written.

    What the generator cannot express (an attribute message over 64 KiB, byte strings read
    from another file, dtypes without an HDF5 type of ours) is written by
    ``h5io.write.write_h5`` through libhdf5 (the cache then remembers that the structure takes
    that path).
    """
    p = os.fspath(path)
    if isinstance(entries, RecordList):  # (keeps its structure key from save to save)
        items: list[Any] = entries
    else:
        items = list(entries.values()) if isinstance(entries, Mapping) else list(entries)
    from parallelvars.checkpoint.entry import naming_file

    with naming_file(p):  # (an entry's refusal of a component names the file written)
        return _save_native(p, items, object_graph, metadata, cache, checksums, share_equal)


def _plan_key(
    items: Sequence[Any], object_graph: Mapping[str, Any] | None, metadata: Mapping[str, Any] | None
) -> Any:
    """The key a structure's cached plan is found by: for a ``RecordList``, its structure
    token (records with the same token have the same structure) with what else the file's
    bytes depend on; else :func:`~parallelvars.checkpoint.h5io.records._structure_key`."""
    if isinstance(items, RecordList):
        return (_library_version(), metadata_key(metadata), items.token, object_graph)
    return _structure_key(items, object_graph, metadata)


def _save_native(
    p: str,
    items: list[Any],
    object_graph: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    cache: Any,
    checksums: dict[str, list[int]] | None,
    share_equal: bool,
) -> str:
    from parallelvars.checkpoint.h5io.write import write_h5

    in_memory = all(hasattr(e, "components") for e in items)
    skey = _plan_key(items, object_graph, metadata) if in_memory and cache is not None else None
    if cache is not None and skey is not None and cache.get(("unexpressed", skey)) is not None:
        return write_h5(
            p,
            items,
            object_graph=object_graph,
            metadata=metadata,
            checksums=checksums,
        )
    try:
        if in_memory:
            try:
                _save_arrays(
                    p, items, object_graph, metadata, cache, skey, checksums, share_equal, False
                )
            except Diverged:  # (a replica unlike its first: saved again, compared first)
                _save_arrays(
                    p, items, object_graph, metadata, cache, skey, checksums, share_equal, True
                )
        else:
            _save_streamed(p, items, object_graph, metadata, checksums)
    except Unsupported:
        if cache is not None and skey is not None:
            cache.put(Unexpressed(("unexpressed", skey)))
        return write_h5(
            p,
            items,
            object_graph=object_graph,
            metadata=metadata,
            checksums=checksums,
        )
    return p


def _plan_for(
    items: Sequence[Any],
    shared: Sequence[Sequence[int] | None],
    object_graph: Mapping[str, Any] | None,
    root: Mapping[str, Any],
    file: str,
    classes: Any = None,
) -> FilePlan:
    """The plan of a save of ``items`` (records, or entries read from other files), each
    path checked; the records go to the plan as they are (no object made per entry), with
    their ``classes`` (``record_classes(items, shared)``) when given."""
    paths = list(map(_PATH, items))
    validate_paths(paths)
    if len(set(paths)) != len(paths):
        seen: set[str] = set()
        for path in paths:
            if path in seen:
                raise InvalidEntryError("is written twice", file=file, variable=path)
            seen.add(path)
    del paths
    documents = [INDEX_DATASET, COLUMNS_DATASET]
    if object_graph is not None:
        documents.append(GRAPH_DATASET)
    root = dict(root)
    root[DOCUMENTS_ATTR] = np.array([d.encode() for d in documents])
    if any(e.dtype.kind == "O" for e in items):
        # byte strings: their elements are part of the plan (each a global heap object)
        variables = [
            Variable(
                e.path,
                e.kind,
                e.dtype,
                tuple(map(int, e.shape)),
                int(e.num_components),
                e.attrs,  # (read, not kept: the plan copies what it keeps)
                sh,
                strings=_strings_of(e, file) if e.dtype.kind == "O" else None,
            )
            for e, sh in zip(items, shared, strict=True)
        ]
        return FilePlan(variables, root_attrs=root, documents=documents)
    return FilePlan(items, root_attrs=root, documents=documents, shared=shared, classes=classes)


def _strings_of(e: Any, file: str) -> list[list[bytes]]:
    """A byte-string entry's elements, component by component (in C order). An entry read from
    another file is not planned here: its values are not known before it is read.

    HDF5's variable-length strings end at a NUL byte (libhdf5 refuses to write one inside a
    string, and a reader would stop there): an element holding one is refused."""
    comps = getattr(e, "components", None)
    if comps is None:
        raise Unsupported(f"{e.path!r}: byte strings read from another file")
    out = [[bytes(x) for x in np.asarray(c).reshape(-1).tolist()] for c in comps]
    for i, elements in enumerate(out):
        if any(b"\x00" in x for x in elements):
            raise UnsupportedDtypeError(
                "a byte string holding a NUL byte cannot be an HDF5 variable-length string",
                file=file,
                variable=f"{e.path}[{i}]",
                expected="byte strings without NUL bytes",
                found=next(x for x in elements if b"\x00" in x)[:32],
            )
    return out


def _index_of(
    items: Sequence[Any], plan: FilePlan, crcs: Sequence[Sequence[int]] | None
) -> dict[str, Any]:
    """The index of ``items`` as the plan lays them out, as one dict (``crcs`` None: each
    record's checksums are its ``crc_mark``): no writer makes it; the tests' oracle for the
    documents :func:`record_documents` makes in columns (``parallelvars.testing.index_of``)."""
    index: dict[str, Any] = {}
    names: dict[np.dtype, str] = {}
    decoded: dict[Any, Any] = {}
    marks: dict[int, str] = {}
    offsets = plan.offsets
    for k, e in enumerate(items):
        dt = e.dtype
        name = names.get(dt)
        if name is None:
            name = names[dt] = dtype_name(np.dtype(dt))
        n = int(e.num_components)
        attrs: dict[str, Any] = {}
        for key, val in e.attrs.items():
            if val is None or key in _META_KEYS:
                continue
            # what the file's attribute decodes to is the value itself for these (strings
            # that are not "json:" text, booleans, floats, integers of int64)
            t = type(val)
            if (
                (t is str and not val.startswith("json:"))
                or t is bool
                or t is float
                or (t is int and -(1 << 63) <= val < 1 << 63)
            ):
                attrs[key] = val
                continue
            if t is list and all(type(x) is str and not x.startswith("json:") for x in val):
                attrs[key] = list(val)
                continue
            vkey = _value_key(val)
            out = decoded.get(vkey, decoded) if vkey is not None else decoded
            if out is decoded:
                out = _decode(_attr_value(val))
                if vkey is not None:
                    decoded[vkey] = out
            attrs[key] = _copied(out)
        if crcs is None:
            mark = marks.get(n)
            if mark is None:
                mark = marks[n] = crc_mark(n)
            crc: Any = mark
        else:
            crc = list(crcs[k])
        index[e.path] = {
            "kind": e.kind,
            "dtype": name,
            "shape": list(map(int, e.shape)),
            "num_components": n,
            "attrs": attrs,
            "offsets": offsets[e.path],
            "crc32c": crc,
        }
    return index


def _prepare(
    key: Any,
    items: Sequence[Any],
    shared: Sequence[Sequence[int] | None],
    object_graph: Mapping[str, Any] | None,
    root: Mapping[str, Any],
    file: str,
    out: int,
    keep: bool,
    laid_out: Callable[[FilePlan], None] | None = None,
) -> Prepared:
    """A structure's plan, metadata image and document templates; ``laid_out(plan)`` is
    called as soon as the plan gives the components' offsets (a save starts writing their
    bytes then, while the rest is made). The image is written into ``out`` (the file being
    written): kept in memory when ``keep`` (the cache will hold it) and of at most
    ``generate.KEPT_IMAGE_BYTES``, else a chunk at a time as it is made, and spilled to a file
    beside ``file`` only when ``keep`` (the image is None when not kept, or the spill
    failed). The documents' checksums in their headers are 0 until the save puts them in
    (``FilePlan.refresh``), after the documents are written (:func:`_write_documents`)."""
    # (records of a class share their layout in the plan and their texts in the documents)
    classes = record_classes(items, shared, file)
    freeze_made_so_far()
    plan = _plan_for(items, shared, object_graph, root, file, classes)
    if laid_out is not None:
        laid_out(plan)
    freeze_made_so_far()  # (the plan's objects live until the image is made)
    count = sum(int(e.num_components) for e in items)
    # (the index's text is made once the image is written and let go: its length sizes the
    # image's room for it)
    docs = record_documents(items, plan.offsets, classes)
    del classes
    # (None only for an attribute name that is not text, which record_classes refused)
    assert docs is not None
    head, tail = docs.head, docs.tail
    capacities = document_capacities(docs.index_bare, sum(map(len, head)) + len(tail), count)
    graph = None
    if object_graph is not None:
        graph = json.dumps(object_graph).encode()
        capacities[GRAPH_DATASET] = len(graph)
    image: Any = None
    if keep and plan.metadata_size <= generate.KEPT_IMAGE_BYTES:  # (read when used: settable)
        meta = plan.metadata(capacities)
        plan.release()  # (kept for the repeated saves: its offsets and the headers they change)
        (at, image), *rest = meta.pieces
        assert at == 0
        file_size, places = meta.file_size, meta.documents
        pwrite_all(out, memoryview(image), 0)
    else:  # (written into the file a chunk at a time as it is made, and kept for the
        # repeated saves in a file beside the checkpoint; None: not kept)
        chunked = plan.chunks(capacities)
        file_size, places, rest = chunked.file_size, chunked.documents, chunked.data
        folder = os.path.dirname(os.path.abspath(file)) if keep else None
        image = SpilledImage.write(chunked, plan.metadata_size, out, folder)
        plan.release()
    return Prepared(
        key,
        plan,
        image,
        file_size,
        places,
        docs.index_runs(),
        capacities,
        (head, tail),
        graph,
        rest,
    )


def _write_image(fd: int, prep: Prepared) -> None:
    """Write the metadata image of ``prep``'s structure: kept in memory, or (a structure of
    more than ``generate.KEPT_IMAGE_BYTES`` of metadata) copied from the file it was spilled
    to; the disk is asked to start on it at once (it works on the image while the helper
    thread lays out the components' writes, instead of at the ``fsync``). The hint is given
    on the saving thread, unlike the components' (``DataWriter``'s helper): it is the save's
    first write, so only other files' pages can be queued ahead of it, and at most one
    image's pages (``KEPT_IMAGE_BYTES``, or the spilled image's) are asked for."""
    if isinstance(prep.image, SpilledImage):
        prep.image.write_to(fd)
        size = prep.image.size
    else:
        size = memoryview(prep.image).nbytes
        pwrite_all(fd, memoryview(prep.image), 0)
    start_writeback(fd, 0, size)


# The bytes of a document a save writes at once at most (about: a piece is never split).
DOCUMENT_WRITE_BYTES = 4 << 20
# The checksums whose digits one piece of the columns document holds.
_DIGITS_RUN = 65536


def _write_documents(fd: int, prep: Prepared, flat: Sequence[int]) -> dict[str, int]:
    """Write the documents of a save of ``prep``'s structure with its components' checksums
    ``flat`` into ``fd`` at their places, each padded with spaces to its capacity, a few MiB
    at a time (``DOCUMENT_WRITE_BYTES``: made from the template's runs and the columns'
    pieces, never held whole); returns each one's CRC-32C (for its header's attribute)."""
    head, tail = prep.columns
    texts: dict[str, Iterable[str | bytes]] = {
        INDEX_DATASET: index_pieces(prep.template, flat),
        COLUMNS_DATASET: _columns_pieces(head, flat, tail),
    }
    if prep.graph is not None:
        texts[GRAPH_DATASET] = (prep.graph,)
    return {
        name: _write_padded(fd, name, prep.documents[name], prep.capacities[name], pieces)
        for name, pieces in texts.items()
    }


def _columns_pieces(head: Sequence[str], flat: Sequence[int], tail: str) -> Iterator[str]:
    """The columns document's text in pieces: ``head``'s, the checksums' digits a run at a
    time (``", "`` between two), ``tail``."""
    yield from head
    for a in range(0, len(flat), _DIGITS_RUN):
        digits = ", ".join(map(str, flat[a : a + _DIGITS_RUN]))
        yield ", " + digits if a else digits
    yield tail


def _write_padded(fd: int, name: str, offset: int, room: int, pieces: Iterable[str | bytes]) -> int:
    """Write the text of ``pieces`` at ``offset``, padded with spaces to ``room`` bytes (a
    text longer is refused: the structure's key holds what sizes it), a few pieces at a time;
    its CRC-32C."""
    crc = 0
    at = 0
    held: list[bytes] = []
    size = 0
    ended = False
    pieces = iter(pieces)
    while not ended:
        piece = next(pieces, None)
        if piece is None:
            ended = True
        else:
            data = piece if isinstance(piece, bytes) else piece.encode()
            held.append(data)
            size += len(data)
            if size < DOCUMENT_WRITE_BYTES:
                continue
        if at + size > room:
            raise InvalidEntryError(
                "a document does not fit the room its structure gives it",
                variable=name,
                expected=f"{room} bytes",
                found=f"at least {at + size} bytes",
            )
        if ended:
            held.append(b" " * (room - at - size))
        data = b"".join(held)
        pwrite_all(fd, memoryview(data), offset + at)
        crc = _crc32c.crc32c(data, crc)
        at += len(data)
        held.clear()
        size = 0
    return crc


def _fitted(prep: Prepared, docs: dict[str, bytes]) -> dict[str, bytes]:
    """The documents padded with spaces to their capacities (checked: the structure's key
    holds what sizes them)."""
    out = {}
    for name, data in docs.items():
        room = prep.capacities[name]
        if len(data) > room:
            raise InvalidEntryError(
                "a document does not fit the room its structure gives it",
                variable=name,
                expected=f"{room} bytes",
                found=f"{len(data)} bytes",
            )
        out[name] = data.ljust(room, b" ")
    return out


def _save_arrays(
    p: str,
    items: list[Any],
    object_graph: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    cache: Any,
    skey: Any,
    checksums: dict[str, list[int]] | None,
    share_equal: bool,
    compare_first: bool,
) -> None:
    """Write ``items``' file through the cached plan of their structure (or a plan made now).
    Unless ``compare_first``, replicas the records' plan compares by runs are compared while
    the helper thread writes the bytes (a repeated save of a mirrored model: the comparison
    costs no time of its own), taken to be equal as at the last save; one found unlike its
    first raises :class:`Diverged` (the caller saves again, comparing first)."""
    later = not compare_first and compares_later(items, share_equal)
    comps, crcs, shared, pattern = _checksummed(
        items, share_equal, deferred=True, compare=not later
    )
    key = None if skey is None else (skey, pattern)
    root = _root_values(metadata)
    prep = None if cache is None or key is None else cache.get(key)
    if later and not isinstance(prep, Prepared):  # (a plan to make: compared before it)
        if replicas_diverged(items):
            raise Diverged
        later = False
    with atomic_path(p) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        data: _DataWrite | None = None
        laid_batches = None  # (the batches of the last save, reused)
        try:
            if isinstance(prep, Prepared):
                laid = prep.batches
                if laid is not None and not (laid[0] is items and same_arrays(laid[1], comps)):
                    laid = None
                laid_batches = laid and laid[1]
                data = _DataWrite(fd, prep.plan, items, comps, crcs, p, laid_batches)
                _write_image(fd, prep)
            else:  # (a plan made now: its image is written as it is made)
                # (a cached structure's key holds every component's shape and dtype: checked
                # once)
                for e, cs in zip(items, comps, strict=True):
                    _check_components(e, cs, p)

                def laid_out(plan: FilePlan) -> None:
                    nonlocal data  # the bytes go out while the metadata is made
                    data = _DataWrite(fd, plan, items, comps, crcs, p)

                keep = cache is not None and key is not None
                prep = _prepare(key, items, shared, object_graph, root, p, fd, keep, laid_out)
                if prep.image is None:  # (written, not kept: made again by the next save)
                    if keep:
                        cache.clear()  # (the last structure's, not this one's)
                elif keep:
                    cache.put(prep)
            if later and replicas_diverged(items):  # (while the bytes are written)
                raise Diverged
            assert data is not None
            # the checksums are the writer's (each component checksummed as it was written,
            # and checked again after: a buffer another thread wrote to meanwhile fails there)
            batches = data.wait()
            if isinstance(items, RecordList) and not items.copied:
                # (the live records: their component views are the same at the next save;
                # a snapshot's copies are not kept here, their memory is the snapshot's; nor
                # are batches holding a contiguous copy of a strided component, made anew at
                # each save)
                own = batches is laid_batches or same_arrays(batches, [e.components for e in items])
                prep.batches = (items, batches) if own else None
            done = settle(crcs, shared, comps)
            flat = list(itertools.chain.from_iterable(done))
            # after the components: their gathered writes fill gaps of up to 64 bytes with
            # zeros, and a heap collection or a document may lie in one
            for offset, held in prep.data:
                pwrite_all(fd, memoryview(held), offset)
            written = _write_documents(fd, prep, flat)
            with prep.lock:
                refresh = prep.plan.refresh(_changing(root), written)
            for offset, piece in refresh:
                pwrite_all(fd, memoryview(piece), offset)
            os.ftruncate(fd, prep.file_size)  # (only ever extends: everything lies below)
        finally:
            if data is not None:
                data.join()  # (after an error too: no write is left running at the close)
            os.close(fd)
    if checksums is not None:
        checksums.update((e.path, list(cc)) for e, cc in zip(items, done, strict=True))


def _save_streamed(
    p: str,
    items: list[Any],
    object_graph: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    checksums: dict[str, list[int]] | None,
) -> None:
    """Entries read from another file, in runs of at most ``BULK_BYTES``: each run's
    components read (the source's files read ahead in bulk: :class:`ReadAhead`) into one
    buffer, checksummed there, and written in gathered writes on the helper thread while the
    next run is read (:class:`_DataWrite`, two buffers in turn). The metadata is made and
    written first, as a first save's (:func:`_prepare`: the plan let go of what made it before
    the components are read), and the documents last, a few MiB at a time
    (:func:`_write_documents`), their checksums then put into their headers."""
    from parallelvars import _spans
    from parallelvars._fileio import Scratch
    from parallelvars.checkpoint.entry import ReadAhead

    root = _root_values(metadata)
    # Byte strings lay out the global heap, so the plan needs their values: read first
    # (their elements are held until the file is written; the numbers stream as below).
    items = [_Held(e, p) if np.dtype(e.dtype).kind == "O" else e for e in items]
    shapes = [_expected_shapes(e) for e in items]
    dtypes = [np.dtype(e.dtype) for e in items]
    sizes = [
        0 if dt.kind == "O" else sum(map(math.prod, sh)) * dt.itemsize
        for sh, dt in zip(shapes, dtypes, strict=True)
    ]
    crcs: list[list[int]] = []
    with atomic_path(p) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        buffers = (Scratch(), Scratch())
        pending: _DataWrite | None = None  # the previous run's writes (the other buffer's)
        try:
            # (the metadata first, as a first save's: the documents' checksums put in last)
            prep = _prepare(None, items, [None] * len(items), object_graph, root, p, fd, False)
            plan = prep.plan
            with ReadAhead() as ahead:
                for r, run in enumerate(
                    _spans.batches(range(len(items)), sizes, _spans.BULK_BYTES)
                ):
                    run_items = [items[k] for k in run]
                    ahead(run_items)
                    buf = buffers[r % 2].array(np.dtype(np.uint8), (sum(sizes[k] for k in run),))
                    pos = 0
                    run_comps = []
                    for k, e in zip(run, run_items, strict=True):
                        dt, cc, cs = dtypes[k], [], []
                        if isinstance(e, _Held):  # (its data are heap references: the plan's)
                            crcs.append([_crc(c) for c in e.components])
                            run_comps.append(e.components)
                            continue
                        for i, want in enumerate(shapes[k]):
                            got = tuple(e.component_shape(i))
                            if got != want:
                                raise wrong_shape(p, e.path, i, want, got)
                            n = math.prod(want) * dt.itemsize
                            arr = buf[pos : pos + n].view(dt).reshape(want)
                            pos += n
                            e.read_component_into(i, arr)
                            cc.append(_crc(arr))
                            cs.append(arr)
                        crcs.append(cc)
                        run_comps.append(cs)
                    if pending is not None:
                        pending.wait()  # (its buffer is the next run's)
                    run_crcs: Checksums = [list(crcs[k]) for k in run]  # (known: checked)
                    pending = _DataWrite(fd, plan, run_items, run_comps, run_crcs, p)
            if pending is not None:
                pending.wait()
            # (after the components, as a save's: their gathered writes fill small gaps)
            for offset, held in prep.data:
                pwrite_all(fd, memoryview(held), offset)
            written = _write_documents(fd, prep, list(itertools.chain.from_iterable(crcs)))
            for offset, piece in plan.refresh(_changing(root), written):
                pwrite_all(fd, memoryview(piece), offset)
            os.ftruncate(fd, prep.file_size)  # (only ever extends: everything lies below)
        finally:
            if pending is not None:
                pending.join()  # (after an error too: no write is left running at the close)
            os.close(fd)
    if checksums is not None:
        checksums.update((e.path, list(cc)) for e, cc in zip(items, crcs, strict=True))


class _Held:
    """A byte-string entry read from another file, its components read now: the plan lays
    out the global heap from their elements (:func:`_strings_of`)."""

    def __init__(self, entry: Any, file: str) -> None:
        self.path, self.kind, self.dtype = entry.path, entry.kind, np.dtype(entry.dtype)
        self.shape = tuple(int(d) for d in entry.shape)
        self.num_components = int(entry.num_components)
        self.attrs = entry.attrs
        self.components = [np.asarray(entry.component(i)) for i in range(self.num_components)]
        for i, (c, want) in enumerate(zip(self.components, _expected_shapes(entry), strict=True)):
            if c.shape != want:
                raise wrong_shape(file, self.path, i, want, c.shape)

    def component_shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.components[i].shape)
