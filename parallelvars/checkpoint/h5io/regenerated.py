"""``verify`` of a file the generator wrote: its metadata regenerated from its own index and
compared byte for byte, then every component's checksum in bulk.

A native file written by the generator (:mod:`parallelvars.checkpoint.h5raw.native`) is a
function of its index: the superblock, every object header, link and attribute, the global
heap, the data offsets and the index and columns documents follow from the index (and the
root attributes) deterministically. :func:`sound_as_generated` makes that file again from the
index the file carries (:class:`~parallelvars.checkpoint.h5raw.generate.FilePlan`, the
writer's own code) and compares:

* the whole metadata image (superblock to the end of the global heap) with the file's bytes:
  any damaged header, link, attribute, dataspace, layout or heap byte differs;
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

import math
import os
from typing import Any

import crc32c as _crc32c
import numpy as np

from parallelvars.checkpoint.h5io.attributes import _read_json
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
            parts = _regenerate(reader, share_empty=True)
            if parts is None and reader._empty_shared_ambiguous:
                parts = _regenerate(reader, share_empty=False)
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
    root = _root_attributes(reader)
    if root is None or DOCUMENTS_ATTR not in root:
        return None
    documents = [bytes(d).decode("utf-8") for d in np.asarray(root[DOCUMENTS_ATTR]).tolist()]
    if documents[:2] != [INDEX_DATASET, COLUMNS_DATASET] or documents[2:] not in (
        [],
        [GRAPH_DATASET],
    ):
        return None
    index = _read_json(f, INDEX_DATASET, path, required=True)
    if not isinstance(index, dict):
        return None
    variables = []
    for name, meta in index.items():
        if meta["dtype"] == "bytes":
            return None  # (values in the global heap, not in the index: the general path)
        offsets = meta["offsets"]
        n = int(meta["num_components"])
        shared = [offsets.index(o) if o is not None else i for i, o in enumerate(offsets)]
        if meta["kind"] != "sharded" and n > 1 and 0 in meta["shape"]:
            reader._empty_shared_ambiguous = True
            if share_empty:
                shared = [0] * n
        variables.append(
            Variable(
                name,
                meta["kind"],
                _dtype_named(meta["dtype"]),
                tuple(meta["shape"]),
                n,
                dict(meta["attrs"]),
                None if shared == list(range(n)) else shared,
            )
        )
    plan = FilePlan(variables, root_attrs=root, documents=documents)
    if any(plan.offsets[name] != meta["offsets"] for name, meta in index.items()):
        return None
    docs = index_documents(index)
    capacities = {name: len(data) for name, data in docs.items()}
    fd, size = reader._fd(), reader.file_size
    checksums = {name: _crc32c.crc32c(data) for name, data in docs.items()}
    if GRAPH_DATASET in documents:
        # The graph's size as its header says (compared below with the header made for it),
        # its bytes checked against the checksum the writer puts in that header.
        graph_size = int(f[GRAPH_DATASET].dtype.itemsize)
        capacities[GRAPH_DATASET] = graph_size
        at = size - graph_size  # (the last document: it ends the file)
        graph = os.pread(fd, graph_size, at) if at >= 0 else b""
        checksums[GRAPH_DATASET] = _crc32c.crc32c(graph)
    meta_out = plan.metadata(capacities, document_checksums=checksums)
    if meta_out.file_size != size or (
        GRAPH_DATASET in documents and meta_out.documents[GRAPH_DATASET] != size - graph_size
    ):
        return None
    for offset, data in meta_out.pieces:
        if os.pread(fd, len(data), offset) != bytes(data):
            return None
    for name, data in docs.items():
        if os.pread(fd, len(data), meta_out.documents[name]) != data:
            return None
    return _components(reader, index)


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
