"""``verify`` of a file the generator wrote: its metadata regenerated from its own index and
compared byte for byte, then every component's checksum in bulk.

A native file written by the generator (:mod:`parallelvars.checkpoint.h5raw.native`) is a
function of its index: the superblock, every object header, link and attribute, the global
heap, the data offsets and the index and columns documents follow from the index (and the
root attributes) deterministically. :func:`sound_as_generated` makes that file again from the
index the file carries (:class:`~parallelvars.checkpoint.h5raw.generate.FilePlan`, the
writer's own code) and compares:

* the whole metadata image (superblock to the end of the global heap) with the file's bytes,
  made and compared a chunk of at most ``CHUNK_BYTES`` (4 MiB) at a time
  (:meth:`~parallelvars.checkpoint.h5raw.generate.FilePlan.chunks`): any damaged header,
  link, attribute, dataspace, layout or heap byte differs;
* the index and columns documents with the ones the writer makes of that index (their text
  made a thousand rows at a time and compared 1 MiB at a time where HDF5 places each
  document, that place then compared with the plan's: never held whole), and the object
  graph with the checksum its header carries;
* the file's size;
* every component's bytes with its checksum in the index, read in large spans in file order
  (components stored once, hard-linked under several names, are read once).

What h5py or any HDF5 tool reads from such a file is then exactly what the writer wrote for
that index, with data whose checksums hold: the object-by-object check through HDF5
(:meth:`H5Reader.verify_all`'s general path) has nothing left to find. A file that differs
anywhere, or whose index the generator would not write (another writer, an older version,
what the generator cannot express), is not judged here: the caller takes the general path,
which names what is wrong.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import crc32c as _crc32c
import numpy as np

from parallelvars._fileio import value_types
from parallelvars.checkpoint.h5io.attributes import _read_json
from parallelvars.checkpoint.h5io.columns import ColumnEntries
from parallelvars.checkpoint.h5io.layout import (
    _H5_ERRORS,
    COLUMNS_DATASET,
    DOCUMENTS_ATTR,
    GRAPH_DATASET,
    INDEX_DATASET,
    STAGE_GAP,
)
from parallelvars.checkpoint.h5io.stored import _dtype_named
from parallelvars.errors import ParallelVarsError

# The reader (``h5io.read.H5Reader``, which calls this module) is typed ``Any`` here: the
# import graph has no cycles.
H5Reader = Any

__all__ = ["CHECK_SPAN", "sound_as_generated"]

#: The most bytes read in one span when checking components (the memory the check holds).
CHECK_SPAN = 16 << 20

# The root group's object header address in a version-3 superblock (signature, versions and
# sizes, base address, extension address, end of file: 8 + 4 + 3 * 8 bytes).
_ROOT_AT = 36

_ENCODE = json.encoder.encode_basestring_ascii  # (how json.dumps writes a string)


def sound_as_generated(reader: H5Reader) -> bool:
    """Whether ``reader``'s file is exactly what the generator writes for its own index, with
    every component's bytes matching its checksum (see the module docstring). False says
    only that this check does not vouch for the file: the general path decides."""
    from parallelvars.checkpoint._gcfreeze import older_objects_frozen

    try:
        if not _headers_first(reader):
            return False
        # (the index and the plan: a few containers per variable, alive until the end; the
        # collector does not walk the objects that existed before again and again meanwhile)
        with older_objects_frozen():
            regenerate = (
                _regenerate_columns
                if reader.table is not None and isinstance(reader._metas, ColumnEntries)
                else _regenerate
            )
            parts = regenerate(reader, share_empty=True)
            if parts is None and reader._empty_shared_ambiguous:
                parts = regenerate(reader, share_empty=False)
        return parts is not None and _components_sound(reader, parts)
    except (ParallelVarsError, *_H5_ERRORS, ValueError, TypeError, KeyError, OverflowError):
        return False
    except Exception as exc:  # the generator's own refusals (Unsupported, InvalidEntryError)
        from parallelvars.checkpoint.h5raw.messages import Unsupported

        if isinstance(exc, Unsupported):
            return False
        raise


def _headers_first(reader: H5Reader) -> bool:
    """The generator lays every object header before the data; libhdf5 allocates a dataset's
    storage as it creates it, so in its files the index's header (made last) lies after data.
    One lookup that spares a file of another writer the whole regeneration."""
    import h5py

    table = reader.table
    if table is None or not table.located.any():
        return True  # (nothing to compare with: the regeneration decides)
    first = int(table.offsets[table.located].min())
    address = int(h5py.h5o.get_info(reader._h5().id, f"/{INDEX_DATASET}".encode()).addr)
    return address < first


def _root_attributes(reader: H5Reader) -> dict[str, Any] | None:
    """The root attributes as the writer handed them to the plan: the names in the order of
    the root header's attribute messages, each value as h5py reads it (the types the writer
    gave: fixed-length strings, int64, float64, arrays)."""
    from parallelvars.checkpoint.h5raw import header as hdr
    from parallelvars.checkpoint.h5raw.messages import attribute_parts
    from parallelvars.checkpoint.h5raw.source import FileSource, Refused

    fd, size = reader._fd(), reader.file_size
    head = os.pread(fd, _ROOT_AT + 8, 0)
    if len(head) < _ROOT_AT + 8 or head[8] != 3:  # superblock version 3 only
        return None
    root = int.from_bytes(head[_ROOT_AT : _ROOT_AT + 8], "little")
    try:
        header = hdr.read_object_header(FileSource(fd, size), root, checksums=True)
        names = [
            attribute_parts(m.body, "the root group")[0].decode("utf-8")
            for m in header.of_type(hdr.ATTRIBUTE)
        ]
    except (Refused, UnicodeDecodeError):
        return None
    attrs = reader._h5().attrs
    if sorted(names) != sorted(attrs.keys()):
        return None
    return {name: attrs[name] for name in names}


def _regenerate(reader: H5Reader, *, share_empty: bool) -> _Parts | None:
    """Regenerate the file's metadata and documents and compare them with the file; the
    components to check (their offsets, sizes and checksums, each place once in file order),
    or None when anything differs.

    Which components share a dataset follows from the index's offsets, but for empty ones,
    which have none: a writer that stores equal components once shares them too
    (``share_empty``); whether the file has such components is noted on the reader
    (``_empty_shared_ambiguous``), for the caller to try the other way."""
    from parallelvars.checkpoint.h5raw.generate import FilePlan, Variable
    from parallelvars.checkpoint.h5raw.native import index_documents

    f, path = reader._h5(), reader.path
    listed = _documents_listed(reader)
    if listed is None:
        return None
    root, documents = listed
    index = _read_json(f, INDEX_DATASET, path, required=True)
    if not isinstance(index, dict):
        return None
    variables = []
    for name, meta in index.items():
        if meta["dtype"] == "bytes":
            return None  # (values in the global heap, not in the index: the general path)
        n = int(meta["num_components"])
        shared = _sharing(reader, n, meta["offsets"], meta["kind"], meta["shape"], share_empty)
        variables.append(
            Variable(
                name,
                meta["kind"],
                _dtype_named(meta["dtype"]),
                tuple(meta["shape"]),
                n,
                dict(meta["attrs"]),
                shared,
            )
        )
    plan = FilePlan(variables, root_attrs=root, documents=documents)
    if any(plan.offsets[name] != meta["offsets"] for name, meta in index.items()):
        return None
    docs = {
        name: _Document([data.decode("ascii")], _fixed_room(len(data)))
        for name, data in index_documents(index).items()
    }
    if not _compare_generated(reader, plan, documents, docs):
        return None
    return _components(reader, index)


def _sharing(
    reader: H5Reader,
    n: int,
    offsets: list[int | None],
    kind: str,
    shape: Sequence[int],
    share_empty: bool,
) -> list[int] | None:
    """Which component each of a variable's components shares its dataset with, as the
    writer's plan takes it (None: none shared): the first with the same offset. Empty
    components have no bytes to tell them apart: whether they share is ``share_empty``, and
    the reader is told its guess was needed."""
    shared = [offsets.index(o) if o is not None else i for i, o in enumerate(offsets)]
    if kind != "sharded" and n > 1 and 0 in shape:
        reader._empty_shared_ambiguous = True
        if share_empty:
            shared = [0] * n
    return None if shared == list(range(n)) else shared


def _documents_listed(reader: H5Reader) -> tuple[dict[str, Any], list[str]] | None:
    """The root attributes as the writer handed them to the plan and the documents they list
    (None: not a file the generator writes)."""
    root = _root_attributes(reader)
    if root is None or DOCUMENTS_ATTR not in root:
        return None
    listed = np.asarray(root[DOCUMENTS_ATTR]).tolist()
    # (names as the writer lists them, or not a file it wrote: a crafted value, such as a
    # number where a name goes, is never made into bytes)
    if not isinstance(listed, list) or not all(type(d) is bytes and d.isascii() for d in listed):
        return None
    documents = [d.decode("ascii") for d in listed]
    if documents[:2] != [INDEX_DATASET, COLUMNS_DATASET] or documents[2:] not in (
        [],
        [GRAPH_DATASET],
    ):
        return None
    return root, documents


class _Document:
    """A document's expected text: ASCII ``pieces`` (an iterable, taken once: made as they
    are consumed, so the text is never held whole) and ``room``, the room the writer gives a
    text of a given length."""

    __slots__ = ("pieces", "room")

    def __init__(self, pieces: Iterable[str], room: Callable[[int], int]) -> None:
        self.pieces, self.room = pieces, room


def _fixed_room(room: int) -> Callable[[int], int]:
    """The room of a document made whole, padding included: ``room`` whatever its text."""
    return lambda _length: room


#: The most bytes of a document's expected text made and compared at once.
_TEXT_CHUNK = 1 << 20


def _text_found(fd: int, at: int, pieces: Iterable[str]) -> tuple[int, int] | None:
    """Whether the file holds the text of ``pieces`` at ``at``: its length and CRC-32C, or
    None at the first byte that differs (a few MiB made, encoded and compared at a time)."""
    value, pos = 0, at
    batch: list[str] = []
    size = 0

    def flush() -> bool:
        nonlocal value, pos
        data = "".join(batch).encode("ascii")
        batch.clear()
        if os.pread(fd, len(data), pos) != data:
            return False
        value = _crc32c.crc32c(data, value)
        pos += len(data)
        return True

    for piece in pieces:
        batch.append(piece)
        size += len(piece)
        if size >= _TEXT_CHUNK:
            if not flush():
                return None
            size = 0
    if batch and not flush():
        return None
    return pos - at, int(value)


def _padding_found(fd: int, at: int, pad: int, value: int) -> int | None:
    """Whether the file holds ``pad`` spaces at ``at``: the CRC-32C ``value`` carried over
    them, or None."""
    spaces = b" " * min(pad, _TEXT_CHUNK)
    while pad > 0:
        n = min(pad, len(spaces))
        if os.pread(fd, n, at) != spaces[:n]:
            return None
        value = _crc32c.crc32c(spaces[:n], value)
        at, pad = at + n, pad - n
    return int(value)


def _document_at(reader: H5Reader, name: str) -> int | None:
    """Where the file's dataset ``name`` keeps its bytes, as HDF5 reads its layout (None:
    none): where its expected text is compared (the plan's place for it is compared with
    this one after)."""
    import h5py

    try:
        offset = h5py.h5d.open(reader._h5().id, f"/{name}".encode()).get_offset()
    except _H5_ERRORS:
        return None
    return None if offset is None else int(offset)


def _compare_generated(
    reader: H5Reader, plan: Any, documents: list[str], docs: dict[str, _Document]
) -> bool:
    """Whether the file's metadata image, documents and size are what ``plan`` makes with
    the documents ``docs`` (the index and the columns, as the writer writes them). Each
    document's text is compared with the file where the file keeps it as it is made (its
    length then gives its room, and its checksum the value the plan writes in its header),
    and that place with the plan's."""
    f = reader._h5()
    fd, size = reader._fd(), reader.file_size
    capacities: dict[str, int] = {}
    checksums: dict[str, int] = {}
    starts: dict[str, int] = {}
    for name, doc in docs.items():
        at = _document_at(reader, name)
        if at is None:
            return False
        found = _text_found(fd, at, doc.pieces)
        if found is None:
            return False
        length, value = found
        capacity = doc.room(length)
        crc = _padding_found(fd, at + length, capacity - length, value)
        if crc is None or length > capacity:
            return False
        capacities[name], checksums[name], starts[name] = capacity, crc, at
    graph_size = 0
    if GRAPH_DATASET in documents:
        # The graph's size as its header says (compared below with the header made for it),
        # its bytes checked against the checksum the writer puts in that header.
        graph_size = int(f[GRAPH_DATASET].dtype.itemsize)
        capacities[GRAPH_DATASET] = graph_size
        at = size - graph_size  # (the last document: it ends the file)
        graph = os.pread(fd, graph_size, at) if at >= 0 else b""
        checksums[GRAPH_DATASET] = _crc32c.crc32c(graph)
    meta_out = plan.chunks(capacities, document_checksums=checksums)
    if meta_out.file_size != size or (
        GRAPH_DATASET in documents and meta_out.documents[GRAPH_DATASET] != size - graph_size
    ):
        return False
    if any(meta_out.documents.get(name) != at for name, at in starts.items()):
        return False
    # (a chunk of a few MiB made and compared at a time: the image is never held whole)
    for offset, data in itertools.chain(meta_out, meta_out.data):
        if os.pread(fd, len(data), offset) != data:
            return False
    return True


def _texts(values: list[Any]) -> list[str]:
    """Each value's JSON text (as ``json.dumps`` writes it)."""
    if not value_types(values) - {str}:
        return list(map(_ENCODE, values))
    return list(map(json.dumps, values))


#: Rows (or list items) whose text is made at once.
_ROWS = 1024

#: Rows whose components' sharing is found at once (:class:`_Rows`).
_WINDOW = 1 << 14


def _json_pieces(value: Any) -> Iterator[str]:
    """``json.dumps(value)`` in pieces: a long list's items (and a mapping's long lists) a
    few thousand at a time, so that the text of a file's every path is never held whole."""
    if type(value) is dict:
        yield "{"
        for k, (key, item) in enumerate(value.items()):
            yield (", " if k else "") + json.dumps(key) + ": "
            yield from _json_pieces(item)
        yield "}"
    elif type(value) is list and len(value) > _ROWS:
        yield "["
        for a in range(0, len(value), _ROWS):
            yield (", " if a else "") + json.dumps(value[a : a + _ROWS])[1:-1]
        yield "]"
    else:
        yield json.dumps(value)


def _numbers(values: np.ndarray, nulls: bool = False) -> Iterator[str]:
    """The text of a flat JSON list's items (``", "`` between them), a few thousand at a
    time; with ``nulls``, -1 is ``null``."""
    for a in range(0, values.size, _ROWS):
        part = values[a : a + _ROWS].tolist()
        text = ["null" if v < 0 else str(v) for v in part] if nulls else list(map(str, part))
        yield (", " if a else "") + ", ".join(text)


def _digits(values: np.ndarray) -> int:
    """The number of decimal digits of all of ``values`` (non-negative integers) together."""
    powers = np.array([10**k for k in range(1, 20)], np.uint64)
    return int((np.searchsorted(powers, values.astype(np.uint64), side="right") + 1).sum())


def _column_documents(reader: H5Reader) -> dict[str, _Document] | None:
    """The index and columns documents as the writer writes them for the columns the reader
    decoded at open, as pieces made when they are compared: the columns document encoded
    again (its long lists a few thousand items at a time: json's C encoder), and the index
    made a few thousand rows at a time from one ``%``-format per layout (its fixed fields'
    text made once), without building the index's objects. The index then says exactly
    what the columns say (``json.dumps`` of the entries :class:`ColumnEntries` gives). None
    for a columns document whose checksums are not its last field."""
    from parallelvars.checkpoint.h5io.records import index_capacity

    metas: ColumnEntries = reader._metas
    doc: dict[str, Any] = metas._doc
    if list(doc)[-2:] != ["offsets", "crc32c"] or metas.offsets is None:
        return None
    table = reader.table
    count = int(table.crcs.size)
    # Both documents get the room of their text without the checksums' digits (as
    # native.document_capacities gives it).
    digits = _digits(table.crcs)

    def room(length: int) -> int:
        return int(index_capacity(length - digits, count))

    return {
        INDEX_DATASET: _Document(_index_pieces(reader), room),
        COLUMNS_DATASET: _Document(_columns_pieces(doc, metas.offsets, table.crcs), room),
    }


def _columns_pieces(doc: dict[str, Any], offsets: np.ndarray, crcs: np.ndarray) -> Iterator[str]:
    """The columns document's text (``json.dumps`` of it, its offsets and checksums from
    their arrays) in pieces."""
    yield "{"
    for k, (key, value) in enumerate(doc.items()):
        if key in ("offsets", "crc32c"):
            continue
        yield (", " if k else "") + _ENCODE(key) + ": "
        yield from _json_pieces(value)
    yield ', "offsets": ['
    yield from _numbers(offsets, nulls=True)
    yield '], "crc32c": ['
    yield from _numbers(crcs)
    yield "]}"


def _index_pieces(reader: H5Reader) -> Iterator[str]:
    """The index document's text, a few thousand rows at a time, from the columns."""
    table = reader.table
    metas: ColumnEntries = reader._metas
    doc: dict[str, Any] = metas._doc
    dumps = json.dumps
    # Each layout's row format: a "%s" for each per-row field (the path, the shape, the row
    # attributes in the layout's order, the offsets, the checksums), the rest its own text.
    row_attrs = doc["row_attrs"]
    formats: list[str] = []
    keys_of: list[list[str]] = []
    for layout in doc["layouts"]:
        fixed = ["", ""]
        keys = []
        fixed[-1] += (
            f': {{"kind": {_ENCODE(layout["kind"])}, "dtype": {_ENCODE(layout["dtype"])}, '
            '"shape": ['
        )
        fixed.append(f'], "num_components": {layout["num_components"]}, "attrs": {{')
        items = list(layout["attrs"].items())
        for k, (key, value) in enumerate(items):
            sep = ", " if k + 1 < len(items) else ""
            if value is None:
                fixed[-1] += _ENCODE(key) + ": "
                fixed.append(sep)
                keys.append(key)
            else:
                fixed[-1] += f"{_ENCODE(key)}: {dumps(value)}{sep}"
        fixed[-1] += '}, "offsets": ['
        fixed.append('], "crc32c": [')
        fixed.append("]}")
        formats.append("%s".join(part.replace("%", "%%") for part in fixed))
        keys_of.append(keys)
    offsets_all, crcs_all = metas.offsets, table.crcs
    assert offsets_all is not None  # (see _column_documents)
    first_all, shapes, lid = table.first, table.shapes, doc["layout"]
    paths_all: list[str] = doc["paths"]
    join = ", ".join
    yield "{"
    for a in range(0, len(lid), _ROWS):
        b = min(a + _ROWS, len(lid))
        lo, hi = int(first_all[a]), int(first_all[b])
        first = (first_all[a : b + 1] - lo).tolist()
        offsets = ["null" if o < 0 else str(o) for o in offsets_all[lo:hi].tolist()]
        crcs = list(map(str, crcs_all[lo:hi].tolist()))
        paths = _texts(paths_all[a:b])
        texts = {key: _texts(values[a:b]) for key, values in row_attrs.items()}
        rows = []
        for r, layout in enumerate(lid[a:b]):
            s, e = first[r], first[r + 1]
            rows.append(
                formats[layout]
                % (
                    paths[r],
                    join(map(str, shapes[a + r])),
                    *[texts[key][r] for key in keys_of[layout]],
                    join(offsets[s:e]),
                    join(crcs[s:e]),
                )
            )
        yield (", " if a else "") + join(rows)
    yield "}"


class _Rows(Sequence[Any]):
    """The plan's variables, one made from the reader's table (and its columns' attributes)
    when the plan takes it: never a list of them all. Which component each component shares
    its dataset with (:func:`_sharing`, a window of rows at a time): the first of its row at the
    same offset; empty components of a variable that is not sharded (no offset tells them
    apart) all the first one's with ``share_empty``, and the reader is told its guess was
    needed. Rows of one pattern share one list of it (the plan copies what it keeps)."""

    def __init__(self, reader: H5Reader, share_empty: bool) -> None:
        self._reader = reader
        table = reader.table
        rows = len(table.names)
        empty = np.fromiter(
            (
                k != "sharded" and 0 in shape
                for k, shape in zip(table.kinds, table.shapes, strict=True)
            ),
            bool,
            rows,
        ) & (np.diff(table.first) > 1)
        if empty.any():
            reader._empty_shared_ambiguous = True
        self._pattern = np.full(rows, -1, np.int64)
        self._patterns: list[list[int]] = []
        number: dict[tuple[int, ...], int] = {}  # a pattern -> its place in _patterns
        # (a window of rows at a time: the sorts' arrays are a window's, not every slot's)
        for a in range(0, rows, _WINDOW):
            b = min(a + _WINDOW, rows)
            self._window(a, b, empty[a:b] if share_empty else None, number)

    def _window(
        self, a: int, b: int, empty: np.ndarray | None, number: dict[tuple[int, ...], int]
    ) -> None:
        """The sharing patterns of rows ``a:b`` (``empty``: those whose empty components
        all share the first's dataset)."""
        table = self._reader.table
        first = table.first[a : b + 1] - table.first[a]
        offsets = table.offsets[table.first[a] : table.first[b]]
        counts = np.diff(first)
        slots = np.arange(offsets.size, dtype=np.int64)
        row_of = np.repeat(np.arange(b - a, dtype=np.int64), counts)
        # Each slot's first slot of its row at its offset (a slot without one: itself).
        order = np.lexsort((slots, offsets, row_of))
        o, r = offsets[order], row_of[order]
        head = np.ones(o.size, bool)
        head[1:] = ~((o[1:] == o[:-1]) & (r[1:] == r[:-1]) & (o[1:] >= 0))
        at = np.maximum.accumulate(np.where(head, np.arange(o.size, dtype=np.int64), 0))
        local = np.empty(o.size, np.int64)
        local[order] = order[at] - first[r]
        del order, o, r, head, at
        if empty is not None and empty.any():
            local[np.repeat(empty, counts)] = 0
        special = np.bincount(row_of[local != slots - first[row_of]], minlength=b - a) > 0
        for n in np.unique(counts[special]).tolist():
            these = np.flatnonzero(special & (counts == n))
            grid = local[first[these][:, None] + np.arange(n, dtype=np.int64)]
            distinct, which = np.unique(grid, axis=0, return_inverse=True)
            ids = []
            for pattern in map(tuple, distinct.tolist()):
                k = number.get(pattern)
                if k is None:
                    k = number[pattern] = len(self._patterns)
                    self._patterns.append(list(pattern))
                ids.append(k)
            self._pattern[a + these] = np.array(ids, np.int64)[which.reshape(-1)]

    def __len__(self) -> int:
        return len(self._reader.table.names)

    def __getitem__(self, row: int) -> Any:  # type: ignore[override]
        from parallelvars.checkpoint.h5raw.generate import Variable

        table = self._reader.table
        p = int(self._pattern[row])
        return Variable(
            table.names[row],
            table.kinds[row],
            table.dtypes[row],
            table.shapes[row],
            table.counts[row],
            self._reader._metas.attrs_of(row, shared=True),  # (read, not kept: the plan copies)
            None if p < 0 else self._patterns[p],
        )

    def __iter__(self) -> Iterator[Any]:
        from parallelvars.checkpoint.h5raw.generate import Variable

        table = self._reader.table
        attrs_of = self._reader._metas.attrs_of
        patterns = self._patterns
        columns = (table.names, table.kinds, table.dtypes, table.shapes, table.counts)
        for a in range(0, len(table.names), _ROWS):
            b = a + _ROWS
            rows = zip(*(c[a:b] for c in columns), self._pattern[a:b].tolist(), strict=True)
            for row, (name, kind, dtype, shape, n, p) in enumerate(rows, a):
                shared = None if p < 0 else patterns[p]
                yield Variable(name, kind, dtype, shape, n, attrs_of(row, shared=True), shared)


def _placed_as_indexed(plan: Any, table: Any) -> bool:
    """Whether the plan places every component where the index says (a few thousand rows
    compared at a time)."""
    placed = plan.offsets
    names, first, offsets = table.names, table.first, table.offsets
    counts = np.diff(first)
    for a in range(0, len(names), _ROWS):
        b = min(a + _ROWS, len(names))
        lists = list(map(placed.__getitem__, names[a:b]))
        if not np.array_equal(np.fromiter(map(len, lists), np.int64, b - a), counts[a:b]):
            return False
        flat = [-1 if o is None else o for o in itertools.chain.from_iterable(lists)]
        if not np.array_equal(np.array(flat, np.int64), offsets[first[a] : first[b]]):
            return False
    return True


def _regenerate_columns(reader: H5Reader, *, share_empty: bool) -> _Parts | None:
    """:func:`_regenerate` from the columns the reader took at open (its
    :class:`~parallelvars.checkpoint.h5io.index_table.IndexTable` and the columns' entries):
    the index document is not decoded. The plan's variables are the table's rows, each made
    as the plan takes it, and the index and columns documents the writer makes of them are
    compared with the file's bytes as they are made, so the index a plain HDF5 reader sees
    is the one the columns describe."""
    from parallelvars.checkpoint.h5raw.generate import FilePlan

    table = reader.table
    listed = _documents_listed(reader)
    if listed is None or any(dt.kind == "O" for dt in set(table.dtypes)):
        return None  # (byte strings: values in the global heap, not in the index)
    root, documents = listed
    plan = FilePlan(_Rows(reader, share_empty), root_attrs=root, documents=documents)
    if not _placed_as_indexed(plan, table):
        return None
    docs = _column_documents(reader)
    if docs is None or not _compare_generated(reader, plan, documents, docs):
        return None
    return _table_components(reader)


#: The components to check: their offsets, sizes and checksums, each place once, in file
#: order.
_Parts = tuple[np.ndarray, np.ndarray, np.ndarray]


def _table_components(reader: H5Reader) -> _Parts | None:
    """:func:`_components` from the reader's table (a sharded variable's shard sizes from its
    variable, made at open)."""
    table = reader.table
    counts = np.asarray(table.counts, np.int64)
    per = np.asarray(table.row_nbytes, np.int64) // np.maximum(counts, 1)
    sizes = np.repeat(per, counts)
    for row, kind in enumerate(table.kinds):
        if kind == "sharded":
            stored = reader[table.names[row]]
            start = int(table.first[row])
            sizes[start : start + stored.num_components] = [
                stored.component_nbytes(i) for i in range(stored.num_components)
            ]
    offsets, crcs = table.offsets, table.crcs
    skip = (offsets < 0) | (sizes == 0)
    if bool((skip & ((sizes != 0) | (crcs != 0))).any()):
        return None
    keep = np.flatnonzero(~skip)
    order = keep[np.argsort(offsets[keep], kind="stable")]
    o, n, c = offsets[order], sizes[order], crcs[order]
    again = np.flatnonzero(o[1:] == o[:-1]) + 1  # (names of one dataset agree on it)
    if again.size and bool(((n[again] != n[again - 1]) | (c[again] != c[again - 1])).any()):
        return None
    heads = np.ones(o.size, bool)
    heads[again] = False
    return o[heads], n[heads], c[heads]


def _components(reader: H5Reader, index: dict[str, Any]) -> _Parts | None:
    """Every component with bytes: their offsets, sizes and checksums, each place once (a shared
    dataset's names agree on their checksum), in file order; None when the index's sizes or
    checksums do not agree with one another."""
    seen: dict[int, tuple[int, int]] = {}
    for name, meta in index.items():
        dtype = _dtype_named(meta["dtype"])
        if meta["kind"] == "sharded":
            stored = reader[name]  # (its shards' shapes, validated at open)
            sizes = [stored.component_nbytes(i) for i in range(stored.num_components)]
        else:
            sizes = [math.prod(meta["shape"]) * dtype.itemsize] * int(meta["num_components"])
        for offset, nbytes, crc in zip(meta["offsets"], sizes, meta["crc32c"], strict=True):
            if offset is None or nbytes == 0:
                if nbytes or crc != 0:
                    return None
                continue
            if seen.setdefault(offset, (nbytes, crc)) != (nbytes, crc):
                return None
    places = sorted(seen.items())
    return (
        np.array([o for o, _ in places], np.int64),
        np.array([n for _, (n, _) in places], np.int64),
        np.array([c for _, (_, c) in places], np.int64),
    )


def _components_sound(reader: H5Reader, found: _Parts) -> bool:
    """Every component's bytes against its checksum: neighbours (in file order) read together
    in spans of at most :data:`CHECK_SPAN` bytes into one reused buffer, a larger component
    in chunks; a few thousand components' places taken out of the arrays at a time."""
    offsets, sizes, crcs = found
    if not offsets.size:
        return True
    fd = reader._fd()
    extent = int((offsets + sizes).max()) - int(offsets[0])
    buf = np.empty(max(1, min(CHECK_SPAN, extent)), np.uint8)
    view = memoryview(buf)  # type: ignore[arg-type]
    crc32c = _crc32c.crc32c
    for a in range(0, offsets.size, _BATCH):
        parts = list(
            zip(
                offsets[a : a + _BATCH].tolist(),
                sizes[a : a + _BATCH].tolist(),
                crcs[a : a + _BATCH].tolist(),
                strict=True,
            )
        )
        k = 0
        while k < len(parts):
            start, nbytes, crc = parts[k]
            if nbytes > CHECK_SPAN:  # alone, in chunks
                if reader._crc_of(view, start, nbytes) != crc:
                    return False
                k += 1
                continue
            end, j = start + nbytes, k + 1
            while j < len(parts):
                o, n, _ = parts[j]
                if n > CHECK_SPAN or o - end > STAGE_GAP or o + n - start > CHECK_SPAN:
                    break
                end, j = max(end, o + n), j + 1
            if j - k > 1 and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
            reader._read_fully(view[: end - start], start)
            for o, n, c in parts[k:j]:
                if crc32c(view[o - start : o - start + n]) != c:
                    return False
            k = j
    return True


#: Components whose places are taken out of the arrays at once by the checksum pass.
_BATCH = 1 << 13
