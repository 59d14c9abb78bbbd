"""HDF5's global heap: collections built for a generated file, and the bounded check of the
collections a file's variable-length values refer to, before HDF5 reads them.

A variable-length value (h5py's default for ``str``, a ``bytes`` dataset's elements, a virtual
dataset's mapping) keeps, per element, a 16-byte reference (sequence length: 4 bytes;
collection address: 8; object index: 4) where the value would be, and its bytes in a *global
heap collection*: ``GCOL``, version 1, 3 reserved bytes, the collection's size (8 bytes,
at least 4096), then objects laid end to end, each a 16-byte head (index: 2 bytes, reference
count: 2, reserved: 4, size: 8) and its bytes padded to 8; the free space, if any, is an object
of index 0 whose size is the rest of the collection. A collection carries no checksum.

The generator's collections (:class:`Collections`) lay out many objects at once (numpy, no
loop per object; their bytes made a range of collections at a time), as
libhdf5 does, one object per reference: HDF5 deletes a value's heap objects when an attribute
is rewritten in place (``attrs.modify``), so an object shared by two references would leave
the other dangling.

:class:`GlobalHeapCheck` is what verify runs before HDF5 reads such a value: HDF5 walks a
collection by the sizes written in it, so a damaged one makes it read garbage, fail, or (a
free-space object of size 0) never leave the walk. The references are taken from the attribute
messages of the object header (read with :func:`~.header.read_object_header`), and every
collection they name is validated by a parser of its own (docs/FORMAT.md): signature ``GCOL``,
version 1, a size of at least 4096 bytes inside the file, objects laid end to end with their
8-byte padding inside the collection, each index once, the free-space object last and well
formed. Each reference must name an object of the collection with exactly the length the
reference gives. Only then may HDF5 read the value.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np

from parallelvars.checkpoint.h5raw import header as _header
from parallelvars.checkpoint.h5raw.lookup3 import lookup3
from parallelvars.checkpoint.h5raw.messages import attribute_parts
from parallelvars.checkpoint.h5raw.source import FileSource, Refused, Source

__all__ = ["MIN_COLLECTION", "Collections", "GlobalHeapCheck", "ObjectBytes", "ragged_copy"]

MIN_COLLECTION = 4096  # H5HG_MINSIZE: HDF5 reads a collection 4096 bytes at a time at least
_OBJECT_HEADER = 16  # index (2), reference count (2), reserved (4), size (8)
_COLLECTION_HEADER = 16  # signature, version, reserved (3), size (8)
_VIRTUAL = 3  # the layout class of a virtual dataset, whose mapping is a global heap object
# Objects per collection we write (an index is 2 bytes: at most 65535).
_OBJECTS_PER_COLLECTION = 4096


def _align8(n: Any) -> Any:
    return (n + 7) & ~7


def ragged_copy(
    out: np.ndarray, dst: np.ndarray, src: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> None:
    """``out[dst[i] : dst[i] + lengths[i]] = src[starts[i] : starts[i] + lengths[i]]`` for
    every ``i`` (uint8 arrays), in one gather and one scatter."""
    total = int(lengths.sum())
    if not total:
        return
    first = np.cumsum(lengths) - lengths
    within = np.arange(total, dtype=np.int64) - np.repeat(first, lengths)
    out[np.repeat(dst, lengths) + within] = src[np.repeat(starts, lengths) + within]


# The most objects whose heads and bytes are scattered at once (:meth:`Collections.image`).
_BATCH_OBJECTS = 1 << 16


class ObjectBytes:
    """The heap objects' bytes gathered in order (added to :attr:`pending`), joined a batch
    of :data:`JOIN_BATCH` at a time (:meth:`spill`): ``bytes.join`` of a list holds a buffer
    view per item (80 bytes each, ten times the bytes of the strings a variable's attributes
    hold), so the objects of a large file are never joined at once."""

    JOIN_BATCH = 1 << 15

    def __init__(self) -> None:
        self.pending: list[bytes] = []  # (appended to by the caller, kept the same list)
        self._lengths: list[np.ndarray] = []
        self._data: list[bytes] = []
        self._spilled = 0

    def __len__(self) -> int:
        """The number of objects gathered."""
        return self._spilled + len(self.pending)

    def spill(self) -> None:
        """Join the pending objects (then none is pending)."""
        pending = self.pending
        if pending:
            self._lengths.append(np.fromiter(map(len, pending), np.int64, len(pending)))
            self._data.append(b"".join(pending))
            self._spilled += len(pending)
            pending.clear()

    def add_joined(self, lengths: np.ndarray, data: bytes) -> None:
        """Objects joined already, after those gathered: each one's length (int64) and their
        bytes (``sum(lengths)`` of them)."""
        assert int(lengths.sum()) == len(data)
        self.spill()
        self._lengths.append(lengths)
        self._data.append(data)
        self._spilled += lengths.size

    def joined(self) -> tuple[np.ndarray, bytes]:
        """Every object's length and their bytes joined (then none is gathered)."""
        self.spill()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        data, self._lengths, self._data, self._spilled = b"".join(self._data), [], [], 0
        return lengths, data


class Collections:
    """Global heap collections at file offset ``base`` holding one object per entry of
    ``lengths``, in order: each collection holds up to 4096 objects and is at least 4096 bytes
    long (a free-space object fills the rest). Where each object lies (its collection's
    address and its index there: :meth:`refs`) is known from the lengths alone; the
    collections' bytes are made a range of collections at a time (:meth:`image`), from the
    objects' bytes concatenated (which the caller holds), so that the collections themselves
    (heads, alignment, free space) are never held whole."""

    def __init__(self, lengths: np.ndarray, base: int) -> None:
        self.lengths = lengths = np.asarray(lengths, np.int64)
        n = lengths.size
        per = _OBJECTS_PER_COLLECTION
        bounds = np.arange(0, n + per, per)
        bounds[-1] = n
        self._bounds = bounds  # each collection's first object (and the end)
        slot = _OBJECT_HEADER + _align8(lengths)  # each object's bytes in its collection
        self._used = (np.add.reduceat(slot, bounds[:-1]) if n else slot) + _COLLECTION_HEADER
        self.sizes = np.maximum(_align8(self._used), MIN_COLLECTION)
        self.starts = base + np.cumsum(self.sizes) - self.sizes  # each collection's address
        self.size = int(self.sizes.sum())
        # each collection's first byte among the objects' bytes concatenated
        self._data_at = np.concatenate(([0], np.cumsum(lengths)))[bounds]

    @property
    def count(self) -> int:
        """The number of collections."""
        return self.sizes.size

    def refs(self, rows: np.ndarray) -> np.ndarray:
        """The 16-byte references (length, collection address, index) of the objects
        ``rows`` (an int array of any shape): a uint8 array of that shape and 16."""
        rows = np.asarray(rows, np.int64)
        per = _OBJECTS_PER_COLLECTION
        out = np.empty((*rows.shape, 16), np.uint8)
        out[..., 0:4] = self.lengths[rows].astype("<u4")[..., None].view(np.uint8)
        out[..., 4:12] = self.starts[rows // per].astype("<u8")[..., None].view(np.uint8)
        out[..., 12:16] = (rows % per + 1).astype("<u4")[..., None].view(np.uint8)
        return out

    def image(self, data: bytes | np.ndarray, lo: int, hi: int) -> np.ndarray:
        """The bytes of collections ``lo`` to ``hi`` (uint8), laid one after another from
        ``starts[lo]``; ``data``: every object's bytes, concatenated."""
        src = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
        first, last = int(self._bounds[lo]), int(self._bounds[hi])
        lengths = self.lengths[first:last]
        n = lengths.size
        per = _OBJECTS_PER_COLLECTION
        sizes, used = self.sizes[lo:hi], self._used[lo:hi]
        out = np.zeros(int(sizes.sum()), np.uint8)
        if hi <= lo:
            return out
        local = np.cumsum(sizes) - sizes
        count = hi - lo
        # the collection heads
        head = np.zeros((count, _COLLECTION_HEADER), np.uint8)
        head[:, :5] = np.frombuffer(b"GCOL\x01", np.uint8)
        head[:, 8:16] = sizes.astype("<u8").view(np.uint8).reshape(count, 8)
        out[(local[:, None] + np.arange(_COLLECTION_HEADER)).reshape(-1)] = head.reshape(-1)
        # each object's place: after the head and the objects before it in its collection
        which = np.arange(n) // per
        index = np.arange(n) % per + 1
        slot = _OBJECT_HEADER + _align8(lengths)
        before = np.cumsum(slot) - slot
        at = local[which] + _COLLECTION_HEADER + before - before[which * per]
        # each object's bytes in ``src``
        starts = int(self._data_at[lo]) + np.cumsum(lengths) - lengths
        # the objects' heads and bytes, a batch of objects at a time (the index arrays of a
        # scatter take 8 bytes per byte scattered: bounded by the batch, not the heap)
        for b in range(0, n, _BATCH_OBJECTS):
            e = min(n, b + _BATCH_OBJECTS)
            m = e - b
            objhead = np.zeros((m, _OBJECT_HEADER), np.uint8)
            objhead[:, 0:2] = index[b:e].astype("<u2").view(np.uint8).reshape(m, 2)
            objhead[:, 8:16] = lengths[b:e].astype("<u8").view(np.uint8).reshape(m, 8)
            out[(at[b:e, None] + np.arange(_OBJECT_HEADER)).reshape(-1)] = objhead.reshape(-1)
            ragged_copy(out, at[b:e] + _OBJECT_HEADER, src, starts[b:e], lengths[b:e])
        # the free space of each collection: an object of index 0 (when there is room for one)
        free = sizes - used
        for c in np.flatnonzero(free >= _OBJECT_HEADER).tolist():
            p = int(local[c] + used[c])
            out[p + 8 : p + 16] = np.frombuffer(int(free[c]).to_bytes(8, "little"), np.uint8)
        return out


class GlobalHeapCheck:
    """The global heap checks of one open file; each collection is parsed once."""

    def __init__(self, fd: int, file_size: int, file: str, sizeof_addr: int, sizeof_size: int):
        self._source = FileSource(fd, file_size)
        self._size = file_size
        self._file = file
        self._addr = sizeof_addr
        self._len = sizeof_size
        codes = {2: "H", 4: "I", 8: "Q"}
        # a reference (length, collection address, index) and an object header (index, size)
        self._ref: struct.Struct | None = None
        self._object: struct.Struct | None = None
        if sizeof_addr in codes and sizeof_size in codes:
            self._ref = struct.Struct(f"<I{codes[sizeof_addr]}I")
            self._object = struct.Struct(f"<H6x{codes[sizeof_size]}")
        # collection address -> {object index: its data}, or the refusal
        self._collections: dict[int, dict[int, bytes] | Refused] = {}

    def _structs(self) -> tuple[struct.Struct, struct.Struct]:
        if self._ref is None or self._object is None:
            raise Refused(
                "the file's address and length sizes are not supported",
                "2, 4 or 8 bytes",
                f"{self._addr} and {self._len} bytes",
            )
        return self._ref, self._object

    # ------------------------------------------------------------------------- public
    def check_attributes(
        self, oid: Any, attributes: Sequence[tuple[str, Any, int]], variable: str
    ) -> dict[str, list[bytes]]:
        """Validate every global heap object that the variable-length ``attributes`` (name,
        HDF5 type, number of elements) of the object ``oid`` refer to; a
        CorruptCheckpointError naming the file and ``variable``.

        Returns each attribute's elements: the bytes of the heap objects they refer to (empty
        for a null reference), which are the bytes HDF5 hands out for them. An attribute kept
        in the object's dense attribute storage is left out.
        """
        values: dict[str, list[bytes]] = {}
        if not attributes:
            return values
        try:
            messages, dense, _ = self._header_messages(int(h5py.h5o.get_info(oid).addr))
            for name, tid, count in attributes:
                raw = messages.get(name.encode("utf-8"))
                if raw is None and dense:
                    # In the group's dense storage (more than 8 attributes, in files written
                    # before such groups kept them in their header): not reached from here,
                    # left out of the returned values (checked for presence only).
                    continue
                if raw is None:
                    raise Refused(
                        f"attribute {name!r} is not in the object header",
                        "its attribute message",
                        "none",
                    )
                values[name] = self._check_references(name, raw, _element_size(name, tid), count)
        except Refused as exc:
            raise exc.error("variable-length attribute values", self._file, variable) from None
        return values

    def check_virtual_layout(self, address: int, variable: str) -> None:
        """Validate the global heap object holding the mapping of the virtual dataset whose
        object header is at ``address`` (nothing for other layouts), before HDF5 opens it."""
        try:
            body = self._header_messages(address)[2]
            if body is None or len(body) < 2 or body[1] != _VIRTUAL:
                return
            if len(body) < 2 + self._addr + 4:
                raise Refused("a short virtual layout message")
            collection = int.from_bytes(body[2 : 2 + self._addr], "little")
            index = int.from_bytes(body[2 + self._addr : 6 + self._addr], "little")
            objects = self._collection(collection)
            if not index or index not in objects:
                raise Refused(
                    "the virtual dataset's mapping is a missing heap object",
                    f"object {index} in the collection at {collection}",
                    f"objects {sorted(objects)[:8]}",
                )
            # The mapping ends with the lookup3 checksum of what precedes it, which HDF5
            # checks only after decoding it (a damaged selection there can crash it).
            mapping = objects[index]
            stored = int.from_bytes(mapping[-4:], "little") if len(mapping) >= 4 else None
            found = lookup3(mapping[:-4]) if stored is not None else None
            if stored is None or found != stored:
                raise Refused(
                    "the virtual dataset's mapping fails its checksum",
                    "lookup3 " + (f"{stored:#010x}" if stored is not None else "(none)"),
                    "lookup3 " + (f"{found:#010x}" if found is not None else "(none)"),
                )
        except Refused as exc:
            raise exc.error("the virtual dataset's global heap", self._file, variable) from None

    def _check_references(self, name: str, data: bytes, element: int, count: int) -> list[bytes]:
        ref = 4 + self._addr + 4
        if count * ref > len(data):  # (a version-1 header pads messages to 8 bytes)
            raise Refused(
                f"attribute {name!r} holds {len(data)} bytes of references",
                f"{count * ref} bytes ({count} references)",
                f"{len(data)} bytes",
            )
        unpack = self._structs()[0].unpack_from
        elements: list[bytes] = []
        for k in range(count):
            length, address, index = unpack(data, k * ref)
            if address == 0:  # a null reference (no sequence), as HDF5 reads it
                if length:
                    raise Refused(
                        f"attribute {name!r} element {k} refers to no heap object",
                        f"a heap object of {length * element} bytes",
                        "a null reference",
                    )
                elements.append(b"")
                continue
            objects = self._collection(address)
            found = objects.get(index) if index else None
            if found is None:
                raise Refused(
                    f"attribute {name!r} element {k} refers to a missing heap object",
                    f"object {index} in the collection at {address}",
                    f"objects {sorted(objects)[:8]}",
                )
            if len(found) != length * element:
                raise Refused(
                    f"attribute {name!r} element {k}: the heap object has another length",
                    f"{length * element} bytes",
                    f"{len(found)} bytes",
                )
            elements.append(found)
        return elements

    # ------------------------------------------------------------------------- collections
    def _collection(self, address: int) -> dict[int, bytes]:
        known = self._collections.get(address)
        if known is None:
            try:
                known = parse_collection(self._source, address, self._len, self._structs()[1])
            except Refused as exc:
                known = exc
            self._collections[address] = known
        if isinstance(known, Refused):
            raise known
        return known

    # ------------------------------------------------------------------------- object headers
    def _header_messages(self, address: int) -> tuple[dict[bytes, bytes], bool, bytes | None]:
        """What verify needs of the object header at ``address``: its attribute messages
        (name -> the data's bytes), whether it has dense attribute storage, and its layout
        message (None: none)."""
        head = _header.read_object_header(
            self._source, address, sizeof_addr=self._addr, sizeof_size=self._len
        )
        messages: dict[bytes, bytes] = {}
        dense = False
        layout: bytes | None = None
        where = f"object header at {address}"
        for m in head.messages:
            if m.type == _header.ATTRIBUTE:
                name, _at, data = attribute_parts(m.body, where)
                messages[name] = data
            elif m.type == _header.LAYOUT:
                layout = m.body
            elif m.type == _header.ATTRIBUTE_INFO:
                body = m.body
                at = 2 + (2 if body[1:2] and body[1] & 1 else 0)
                heap = int.from_bytes(body[at : at + self._addr], "little")
                dense = heap != (1 << (8 * self._addr)) - 1
        return messages, dense, layout


def parse_collection(
    source: Source, address: int, sizeof_size: int, objstruct: struct.Struct | None = None
) -> dict[int, bytes]:
    """The objects of the collection at ``address`` (index -> data), bounded: every size is
    checked against the collection and the file before it is used."""
    if objstruct is None:
        objstruct = struct.Struct("<H6xQ")
    head_size = 8 + sizeof_size
    head = source.read(address, head_size, f"the global heap collection at {address}")
    if head[:4] != b"GCOL":
        raise Refused(
            f"no global heap collection at {address}", "signature b'GCOL'", repr(head[:4])
        )
    if head[4] != 1:
        raise Refused(f"global heap collection at {address}: version", 1, head[4])
    size = int.from_bytes(head[8 : 8 + sizeof_size], "little")
    if size < MIN_COLLECTION or size % 8 or address + size > source.size:
        raise Refused(
            f"global heap collection at {address}: size",
            f"a multiple of 8, at least {MIN_COLLECTION} bytes, ending inside the file "
            f"of {source.size} bytes",
            f"{size} bytes",
        )
    body = source.read(address, size, f"the global heap collection at {address}")
    objects: dict[int, bytes] = {}
    unpack = objstruct.unpack_from
    p = head_size
    header = 8 + sizeof_size
    while p < size:
        where = f"global heap collection at {address}, object at {address + p}"
        if size - p < header:  # too small for an object header: free space (HDF5 does so)
            break
        index, length = unpack(body, p)
        if index == 0:  # the free-space object: the rest of the collection, header included
            if length != size - p:
                raise Refused(
                    f"{where}: the free-space object",
                    f"{size - p} bytes (the rest of the collection)",
                    f"{length} bytes",
                )
            break
        need = header + _align8(length)
        if need > size - p:
            raise Refused(
                f"{where}: object {index} runs past the end of the collection",
                f"at most {size - p - header} bytes",
                f"{length} bytes",
            )
        if index in objects:
            raise Refused(f"{where}: object index {index} appears twice", "once", "twice")
        objects[index] = body[p + header : p + header + length]
        p += need
    return objects


def _element_size(name: str, tid: Any) -> int:
    """Bytes per sequence element of a variable-length type (1 for a string)."""
    cls = tid.get_class()
    if cls == h5py.h5t.STRING:  # (a variable-length one: the caller asks only for those)
        return 1
    if cls == h5py.h5t.VLEN:
        base = tid.get_super()
        if not base.detect_class(h5py.h5t.VLEN) and not (
            base.get_class() == h5py.h5t.STRING and base.is_variable_str()
        ):
            return int(base.get_size())
    raise Refused(
        f"attribute {name!r} nests variable-length values, which verify cannot check",
        "a variable-length string or sequence of fixed-size values",
        "a nested variable-length type",
    )
