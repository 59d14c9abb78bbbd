"""Variable-length attribute values checked in HDF5's global heap before HDF5 reads them.

A variable-length attribute (h5py's default for ``str``) keeps, per element, a 16-byte
reference in its attribute message (sequence length: 4 bytes; collection address; object
index: 4 bytes) and its bytes in a *global heap collection*, which carries no checksum. HDF5
walks a collection by the sizes written in it, so a damaged one makes it read garbage, fail, or
(a free-space object of size 0) never leave the walk. :class:`GlobalHeapCheck` therefore finds
the references itself, in the attribute messages of the object header (chunk 0 and its
continuation chunks, which HDF5 checksums in the files we write), and validates every
collection they name with a bounded parser of its own (docs/FORMAT.md): signature ``GCOL``,
version 1, a size of at least 4096 bytes inside the file, objects laid end to end with their
8-byte padding inside the collection, each index once, the free-space object last and well
formed. Each reference must name an object of the collection with exactly the length the
reference gives. Only then may HDF5 read the value.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any

import h5py

from parallelvars.checkpoint._skeleton import lookup3
from parallelvars.errors import CorruptCheckpointError

__all__ = ["GlobalHeapCheck"]

_MIN_COLLECTION = 4096  # H5HG_MINSIZE: HDF5 reads a collection 4096 bytes at a time at least
_OBJECT_HEADER = 16  # index (2), reference count (2), reserved (4), size (8)
_ATTRIBUTE = 0x000C
_CONTINUATION = 0x0010
_ATTRIBUTE_INFO = 0x0015
_LAYOUT = 0x0008
_VIRTUAL = 3  # the layout class of a virtual dataset, whose mapping is a global heap object
_V2_MESSAGE = struct.Struct("<BH")  # type, size (then flags and the creation order)
_V1_MESSAGE = struct.Struct("<HH")  # type, size (then flags and 3 reserved bytes)
_ATTRIBUTE_HEAD = struct.Struct("<BBHHH")  # version, flags, name, type and space sizes
_HEADER_READ = 1024  # bytes read at an object header's address at first
_MAX_CHUNKS = 256  # object header chunks followed per object (HDF5 writes a handful)


class _Refused(Exception):
    """What our parser refuses, with expected and found; made a CorruptCheckpointError by the
    caller, which knows the variable."""

    def __init__(self, what: str, expected: Any = None, found: Any = None) -> None:
        super().__init__(what)
        self.what, self.expected, self.found = what, expected, found

    def error(self, prefix: str, file: str, variable: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{prefix}: {self.what}",
            file=file,
            variable=variable,
            expected=self.expected,
            found=self.found,
        )


def _align8(n: int) -> int:
    return (n + 7) & ~7


class GlobalHeapCheck:
    """The global heap checks of one open file; each collection is parsed once."""

    def __init__(self, fd: int, file_size: int, file: str, sizeof_addr: int, sizeof_size: int):
        self._fd = fd
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
        self._collections: dict[int, dict[int, bytes] | _Refused] = {}

    # ------------------------------------------------------------------------- file access
    def _read(self, offset: int, n: int, what: str) -> bytes:
        if offset < 0 or n < 0 or offset + n > self._size:
            raise _Refused(
                f"{what} lies outside the file",
                f"bytes {offset}..{offset + n} inside a file of {self._size} bytes",
                f"a file of {self._size} bytes",
            )
        data = os.pread(self._fd, n, offset)
        if len(data) != n:
            raise _Refused(f"{what} lies outside the file", f"{n} bytes", f"{len(data)} bytes")
        return data

    def _structs(self) -> tuple[struct.Struct, struct.Struct]:
        if self._ref is None or self._object is None:
            raise _Refused(
                "the file's address and length sizes are not supported",
                "2, 4 or 8 bytes",
                f"{self._addr} and {self._len} bytes",
            )
        return self._ref, self._object

    def _uint(self, data: bytes, at: int, width: int) -> int:
        return int.from_bytes(data[at : at + width], "little")

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
                    raise _Refused(
                        f"attribute {name!r} is not in the object header",
                        "its attribute message",
                        "none",
                    )
                values[name] = self._check_references(name, raw, _element_size(name, tid), count)
        except _Refused as exc:
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
                raise _Refused("a short virtual layout message")
            collection = int.from_bytes(body[2 : 2 + self._addr], "little")
            index = int.from_bytes(body[2 + self._addr : 6 + self._addr], "little")
            objects = self._collection(collection)
            if not index or index not in objects:
                raise _Refused(
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
                raise _Refused(
                    "the virtual dataset's mapping fails its checksum",
                    "lookup3 " + (f"{stored:#010x}" if stored is not None else "(none)"),
                    "lookup3 " + (f"{found:#010x}" if found is not None else "(none)"),
                )
        except _Refused as exc:
            raise exc.error("the virtual dataset's global heap", self._file, variable) from None

    def _check_references(self, name: str, data: bytes, element: int, count: int) -> list[bytes]:
        ref = 4 + self._addr + 4
        if count * ref > len(data):  # (a version-1 header pads messages to 8 bytes)
            raise _Refused(
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
                    raise _Refused(
                        f"attribute {name!r} element {k} refers to no heap object",
                        f"a heap object of {length * element} bytes",
                        "a null reference",
                    )
                elements.append(b"")
                continue
            objects = self._collection(address)
            found = objects.get(index) if index else None
            if found is None:
                raise _Refused(
                    f"attribute {name!r} element {k} refers to a missing heap object",
                    f"object {index} in the collection at {address}",
                    f"objects {sorted(objects)[:8]}",
                )
            if len(found) != length * element:
                raise _Refused(
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
                known = self._parse_collection(address)
            except _Refused as exc:
                known = exc
            self._collections[address] = known
        if isinstance(known, _Refused):
            raise known
        return known

    def _parse_collection(self, address: int) -> dict[int, bytes]:
        """The objects of the collection at ``address``: index -> data."""
        head_size = 8 + self._len
        head = self._read(address, head_size, f"the global heap collection at {address}")
        if head[:4] != b"GCOL":
            raise _Refused(
                f"no global heap collection at {address}", "signature b'GCOL'", repr(head[:4])
            )
        if head[4] != 1:
            raise _Refused(f"global heap collection at {address}: version", 1, head[4])
        size = self._uint(head, 8, self._len)
        if size < _MIN_COLLECTION or size % 8 or address + size > self._size:
            raise _Refused(
                f"global heap collection at {address}: size",
                f"a multiple of 8, at least {_MIN_COLLECTION} bytes, ending inside the file "
                f"of {self._size} bytes",
                f"{size} bytes",
            )
        body = self._read(address, size, f"the global heap collection at {address}")
        objects: dict[int, bytes] = {}
        unpack = self._structs()[1].unpack_from
        p = head_size
        header = 8 + self._len
        while p < size:
            where = f"global heap collection at {address}, object at {address + p}"
            if size - p < header:  # too small for an object header: free space (HDF5 does so)
                break
            index, length = unpack(body, p)
            if index == 0:  # the free-space object: the rest of the collection, header included
                if length != size - p:
                    raise _Refused(
                        f"{where}: the free-space object",
                        f"{size - p} bytes (the rest of the collection)",
                        f"{length} bytes",
                    )
                break
            need = header + _align8(length)
            if need > size - p:
                raise _Refused(
                    f"{where}: object {index} runs past the end of the collection",
                    f"at most {size - p - header} bytes",
                    f"{length} bytes",
                )
            if index in objects:
                raise _Refused(f"{where}: object index {index} appears twice", "once", "twice")
            objects[index] = body[p + header : p + header + length]
            p += need
        return objects

    # ------------------------------------------------------------------------- object headers
    def _header_messages(self, address: int) -> tuple[dict[bytes, bytes], bool, bytes | None]:
        """What verify needs of the object header at ``address``: its attribute messages
        (name -> the data's bytes), whether it has dense attribute storage, and its layout
        message (None: none)."""
        # One read for the header's prefix and (mostly) its whole first chunk.
        block = self._read(
            address,
            max(0, min(_HEADER_READ, self._size - address)),
            f"the object header at {address}",
        )
        head = block[:32]
        if len(head) < 16:
            raise _Refused(
                f"the object header at {address} lies outside the file",
                f"at least 16 bytes before the end of a file of {self._size} bytes",
                f"{len(head)} bytes",
            )
        chunks: list[tuple[int, int]] = []  # (offset, length) of the message area of each chunk
        if head[:4] == b"OHDR":
            if len(head) < 7 or head[4] != 2:
                raise _Refused(f"object header at {address}: version", 2, head[4:5])
            flags = head[5]
            p = 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
            width = 1 << (flags & 0x03)
            size = self._uint(head, p, width)
            chunks.append((address + p + width, size))
            version = 2
            creation_order = bool(flags & 0x04)
        else:
            if head[0] != 1:
                raise _Refused(f"object header at {address}: version", "1 or 2", head[0])
            chunks.append((address + 16, self._uint(head, 8, 4)))
            version = 1
            creation_order = False
        messages: dict[bytes, bytes] = {}
        dense = False
        layout: bytes | None = None
        seen: set[int] = set()
        k = 0
        while k < len(chunks):
            if k >= _MAX_CHUNKS:
                raise _Refused(f"object header at {address}: chunks", f"at most {_MAX_CHUNKS}")
            start, length = chunks[k]
            k += 1
            if start in seen:
                raise _Refused(f"object header at {address}: a chunk listed twice", found=start)
            seen.add(start)
            if address <= start and start + length <= address + len(block):
                data = block[start - address : start - address + length]
            else:
                data = self._read(start, length, f"an object header chunk of {address}")
            p, end = 0, length  # chunk 0 of version 2: its checksum follows the messages
            if version == 2 and k > 1:  # continuation chunks: signature, messages, checksum
                if data[:4] != b"OCHK":
                    raise _Refused(f"object header chunk at {start}", "b'OCHK'", repr(data[:4]))
                p, end = 4, length - 4
            mhead = (4 + (2 if creation_order else 0)) if version == 2 else 8
            while p + mhead <= end:
                if version == 2:
                    mtype, msize = _V2_MESSAGE.unpack_from(data, p)
                else:
                    mtype, msize = _V1_MESSAGE.unpack_from(data, p)
                body_at = p + mhead
                if body_at + msize > end:
                    raise _Refused(
                        f"object header at {address}: a message runs past its chunk",
                        f"at most {end - body_at} bytes",
                        f"{msize} bytes",
                    )
                body = data[body_at : body_at + msize]
                if mtype == _CONTINUATION:
                    chunks.append(
                        (
                            self._uint(body, 0, self._addr),
                            self._uint(body, self._addr, self._len),
                        )
                    )
                elif mtype == _ATTRIBUTE:
                    name, values = self._attribute(body, address)
                    messages[name] = values
                elif mtype == _LAYOUT:
                    layout = body
                elif mtype == _ATTRIBUTE_INFO:
                    at = 2 + (2 if body[1:2] and body[1] & 1 else 0)
                    heap = self._uint(body, at, self._addr)
                    dense = heap != (1 << (8 * self._addr)) - 1
                p = body_at + (msize if version == 2 else _align8(msize))
        return messages, dense, layout

    def _attribute(self, body: bytes, address: int) -> tuple[bytes, bytes]:
        """An attribute message's name and the bytes of its data."""
        if len(body) < 8:
            raise _Refused(f"object header at {address}: a short attribute message")
        version, flags, name_size, type_size, space_size = _ATTRIBUTE_HEAD.unpack_from(body)
        if version == 1:
            at = 8
            sizes = (_align8(name_size), _align8(type_size), _align8(space_size))
        elif version in (2, 3):
            at = 8 if version == 2 else 9
            sizes = (name_size, type_size, space_size)
        else:
            raise _Refused(f"object header at {address}: attribute message version", "1-3", version)
        if flags & 0x03:  # a shared datatype or dataspace: not what we write; refused
            raise _Refused(
                f"object header at {address}: an attribute with a shared type or space",
                "its own type and space",
                "shared",
            )
        name = body[at : at + name_size].split(b"\x00", 1)[0]
        data_at = at + sum(sizes)
        if data_at > len(body):
            raise _Refused(f"object header at {address}: a short attribute message")
        return name, body[data_at:]


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
    raise _Refused(
        f"attribute {name!r} nests variable-length values, which verify cannot check",
        "a variable-length string or sequence of fixed-size values",
        "a nested variable-length type",
    )
