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
* the index and columns documents with the ones the writer makes of that index, and the object
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
from collections.abc import Iterator, Sequence
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


def _regenerate(reader: H5Reader, *, share_empty: bool) -> list[tuple[int, int, int]] | None:
    """Regenerate the file's metadata and documents and compare them with the file; the
    components to check, ``(offset, bytes, crc32c)`` each once in file order, or None when
    anything differs.

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
        name: _Document([data.decode("ascii")], len(data))
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
    """A document's expected bytes: ASCII text pieces, padded with spaces to ``capacity``
    (made into bytes and compared with the file a few MiB at a time: never held whole)."""

    __slots__ = ("capacity", "pieces")

    def __init__(self, pieces: list[str], capacity: int) -> None:
        self.pieces, self.capacity = pieces, capacity

    def _chunks(self) -> Iterator[bytes]:
        batch: list[str] = []
        size = 0
        for piece in self.pieces:
            batch.append(piece)
            size += len(piece)
            if size >= _TEXT_CHUNK:
                yield "".join(batch).encode("ascii")
                batch, size = [], 0
        if batch:
            yield "".join(batch).encode("ascii")

    def crc(self) -> int | None:
        """The CRC-32C of the padded document (None: the text is longer than its room)."""
        value, length = 0, 0
        for chunk in self._chunks():
            value = _crc32c.crc32c(chunk, value)
            length += len(chunk)
        if length > self.capacity:
            return None
        return int(_crc32c.crc32c(b" " * (self.capacity - length), value))

    def matches(self, fd: int, offset: int) -> bool:
        """Whether the file holds the padded document at ``offset``."""
        at = offset
        for chunk in self._chunks():
            if os.pread(fd, len(chunk), at) != chunk:
                return False
            at += len(chunk)
        pad = self.capacity - (at - offset)
        return pad >= 0 and os.pread(fd, pad, at) == b" " * pad


#: The most bytes of a document's expected text made at once.
_TEXT_CHUNK = 4 << 20


def _compare_generated(
    reader: H5Reader, plan: Any, documents: list[str], docs: dict[str, _Document]
) -> bool:
    """Whether the file's metadata image, documents and size are what ``plan`` makes with
    the documents ``docs`` (the index and the columns, as the writer writes them)."""
    f = reader._h5()
    capacities = {name: doc.capacity for name, doc in docs.items()}
    fd, size = reader._fd(), reader.file_size
    checksums: dict[str, int] = {}
    for name, doc in docs.items():
        crc = doc.crc()
        if crc is None:
            return False
        checksums[name] = crc
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
    # (a chunk of a few MiB made and compared at a time: the image is never held whole)
    for offset, data in itertools.chain(meta_out, meta_out.data):
        if os.pread(fd, len(data), offset) != data:
            return False
    return all(doc.matches(fd, meta_out.documents[name]) for name, doc in docs.items())


def _texts(values: list[Any]) -> list[str]:
    """Each value's JSON text (as ``json.dumps`` writes it)."""
    if not value_types(values) - {str}:
        return list(map(_ENCODE, values))
    return list(map(json.dumps, values))


def _column_documents(reader: H5Reader) -> dict[str, _Document] | None:
    """The index and columns documents as the writer writes them for the columns the reader
    decoded at open: the columns document encoded again (a few long lists: json's C
    encoder), and the index made row by row from one ``%``-format per layout (its fixed
    fields' text made once), without building the index's objects. The index then says
    exactly what the columns say (``json.dumps`` of the entries :class:`ColumnEntries`
    gives). None for a columns document whose checksums are not its last field."""
    from parallelvars.checkpoint.h5raw.native import document_capacities

    table = reader.table
    metas: ColumnEntries = reader._metas
    doc: dict[str, Any] = metas._doc
    if list(doc)[-2:] != ["offsets", "crc32c"] or metas.offsets is None:
        return None
    dumps = json.dumps
    flat = table.crcs.tolist()
    digits = ", ".join(map(str, flat))
    offsets = ["null" if o < 0 else str(o) for o in metas.offsets.tolist()]
    head = (
        dumps({k: v for k, v in doc.items() if k not in ("offsets", "crc32c")})[:-1]
        + ', "offsets": ['
        + ", ".join(offsets)
        + '], "crc32c": ['
    )
    tail = "]}"
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
    texts = {key: _texts(values) for key, values in row_attrs.items()}
    paths = _texts(doc["paths"])
    first = table.first.tolist()
    shapes = table.shapes
    crcs = list(map(str, flat))
    lid: list[int] = doc["layout"]
    pieces = ["{"]
    join = ", ".join
    for row, layout in enumerate(lid):
        a, b = first[row], first[row + 1]
        values = [texts[key][row] for key in keys_of[layout]]
        pieces.append(
            formats[layout]
            % (
                paths[row],
                join(map(str, shapes[row])),
                *values,
                join(offsets[a:b]),
                join(crcs[a:b]),
            )
        )
        pieces.append(", ")
    if len(pieces) > 1:
        pieces.pop()
    pieces.append("}")
    index_length = sum(map(len, pieces))
    room = document_capacities(
        index_length - len(digits) + 2 * max(len(flat) - 1, 0), (head, tail), len(flat)
    )
    return {
        INDEX_DATASET: _Document(pieces, room[INDEX_DATASET]),
        COLUMNS_DATASET: _Document([head, digits, tail], room[COLUMNS_DATASET]),
    }


def _regenerate_columns(
    reader: H5Reader, *, share_empty: bool
) -> list[tuple[int, int, int]] | None:
    """:func:`_regenerate` from the columns the reader took at open (its
    :class:`~parallelvars.checkpoint.h5io.index_table.IndexTable` and the columns' entries):
    the index document is not decoded. The plan's variables are the table's rows, and the
    index and columns documents the writer makes of them (from each field's text:
    ``native._record_index_documents``) are compared with the file's bytes, so the index a
    plain HDF5 reader sees is the one the columns describe."""
    from parallelvars.checkpoint.h5raw.generate import FilePlan, Variable

    table = reader.table
    metas: ColumnEntries = reader._metas
    listed = _documents_listed(reader)
    if listed is None or any(dt.kind == "O" for dt in set(table.dtypes)):
        return None  # (byte strings: values in the global heap, not in the index)
    root, documents = listed
    raw = table.offsets.tolist()  # (-1: no offset)
    first = table.first.tolist()
    variables = []
    for row, (name, kind, dtype, shape, n) in enumerate(
        zip(table.names, table.kinds, table.dtypes, table.shapes, table.counts, strict=True)
    ):
        offsets = [None if o < 0 else o for o in raw[first[row] : first[row] + n]]
        shared = _sharing(reader, n, offsets, kind, shape, share_empty)
        variables.append(Variable(name, kind, dtype, shape, n, metas.attrs_of(row), shared))
    plan = FilePlan(variables, root_attrs=root, documents=documents)
    placed = plan.offsets
    for row, name in enumerate(table.names):
        want = [None if o < 0 else o for o in raw[first[row] : first[row + 1]]]
        if placed[name] != want:
            return None
    del variables
    docs = _column_documents(reader)
    if docs is None or not _compare_generated(reader, plan, documents, docs):
        return None
    return _table_components(reader)


def _table_components(reader: H5Reader) -> list[tuple[int, int, int]] | None:
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
    return list(zip(o[heads].tolist(), n[heads].tolist(), c[heads].tolist(), strict=True))


def _components(reader: H5Reader, index: dict[str, Any]) -> list[tuple[int, int, int]] | None:
    """Every component with bytes as ``(offset, bytes, crc32c)``, each place once (a shared
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
    return sorted((o, n, c) for o, (n, c) in seen.items())


def _components_sound(reader: H5Reader, found: list[tuple[int, int, int]]) -> bool:
    """Every component's bytes against its checksum: neighbours read together in spans of at
    most :data:`CHECK_SPAN` bytes into one reused buffer, a larger component in chunks."""
    parts = found
    fd = reader._fd()
    extent = max((o + n for o, n, _ in parts), default=0) - (parts[0][0] if parts else 0)
    buf = np.empty(max(1, min(CHECK_SPAN, extent)), np.uint8)
    view = memoryview(buf)  # type: ignore[arg-type]
    crc32c = _crc32c.crc32c
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
