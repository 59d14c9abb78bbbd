"""HDF5 symbol tables: a group of many links, as every HDF5 since 1.0 stores and reads it.

A group whose links do not fit in its object header (more than
:data:`~.generate.MAX_COMPACT_LINKS`) keeps them in a *symbol table* (the "old-style" group
storage that h5py writes by default): the group's header holds one symbol table message
(type 0x11: the addresses of a version-1 B-tree and of a local heap), and

* the **local heap** (``HEAP``, version 0: data segment size, free-list head, data segment
  address; 32 bytes) holds the link names, NUL-terminated and padded to 8 bytes, after the
  empty string at offset 0; the data segment follows its header directly;
* **symbol table nodes** (``SNOD``, version 1, the number of symbols, then room for
  ``2 * LEAF_K`` entries of 40 bytes: name offset in the heap, object header address, cache
  type 0, 4 reserved bytes, 16 bytes of scratch pad) hold the links sorted by name (byte
  order, as ``strcmp``), full but for the last;
* the **B-tree** (``TREE``, node type 0: level, entries used, left and right siblings, then
  ``key 0, child 0, key 1, ..., key n``; room for ``2 * NODE_K`` children) indexes the nodes:
  each key is the heap offset of a name, and child ``i`` holds the names ``key i < name <=
  key i+1`` (key 0 of the leftmost node: the empty string; every other key: the last name
  under the child to its left). Levels are built bottom up; siblings point at each other.

``LEAF_K`` and ``NODE_K`` are HDF5's defaults (4 and 16), which a version-3 superblock without
an extension implies. None of these structures carries a checksum. The layout is a function
of the names alone: :class:`SymbolTable` sizes it, then :meth:`SymbolTable.encode` writes it
with the children's addresses, deterministically (what ``verify`` regenerates).

:func:`read_symbol_table` is the bounded, hostile-input reader of the same structures
(any valid symbol table, not only ours): every node is read once, inside the file, levels
are bounded, keys and names must lie inside the heap's data segment, and the names must come
out strictly increasing.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence

import numpy as np

from parallelvars.checkpoint.h5raw.source import Refused, Source
from parallelvars.errors import InvalidEntryError

__all__ = [
    "LEAF_K",
    "NODE_K",
    "SNOD_SIZE",
    "SYMBOL_TABLE",
    "TREE_SIZE",
    "SymbolTable",
    "read_symbol_table",
    "symbol_table_message",
]

SYMBOL_TABLE = 0x0011  # the symbol table message's type
LEAF_K = 4  # a symbol table node holds up to 2 * LEAF_K links
NODE_K = 16  # a group B-tree node has up to 2 * NODE_K children
_ENTRY = 40  # a symbol table entry: name offset, address, cache type, reserved, scratch pad
SNOD_SIZE = 8 + 2 * LEAF_K * _ENTRY
_TREE_HEAD = 24  # signature, type, level, entries used, left and right sibling
TREE_SIZE = _TREE_HEAD + (2 * NODE_K + 1) * 8 + 2 * NODE_K * 8
_HEAP_PREFIX = 32
_FREE_NULL = 1  # the local heap's "no free block" (H5HL_FREE_NULL)
_UNDEF = 0xFFFFFFFFFFFFFFFF
_MAX_LEVELS = 16  # 32^16 nodes: far past any file


def _align8(n: int) -> int:
    return (n + 7) & ~7


def symbol_table_message(btree: int, heap: int) -> bytes:
    """A symbol table message body: the B-tree's and the local heap's addresses."""
    return btree.to_bytes(8, "little") + heap.to_bytes(8, "little")


class SymbolTable:
    """The symbol table of a group with links ``names`` (unique, no NUL byte), laid out as
    one block: the local heap's header and data segment, the B-tree nodes (root first), then
    the symbol table nodes in name order. :attr:`size` is the block's size in bytes."""

    def __init__(self, names: Sequence[bytes]) -> None:
        n = len(names)
        if n == 0:
            raise InvalidEntryError("a symbol table needs links", expected="at least 1", found=0)
        self.order = sorted(range(n), key=names.__getitem__)
        sorted_names = [names[i] for i in self.order]
        for a, b in itertools.pairwise(sorted_names):
            if a == b:
                raise InvalidEntryError(
                    "a group has two links of one name", variable=a.decode("utf-8", "replace")
                )
        # the heap: the empty string at 0, then each name NUL-terminated, padded to 8
        lengths = np.fromiter((len(s) for s in sorted_names), np.int64, n)
        slots = (lengths + 1 + 7) & ~7
        self.name_offsets = 8 + np.concatenate(([0], np.cumsum(slots)[:-1]))
        self.heap_data = bytearray(8 + int(slots.sum()))
        for off, s in zip(self.name_offsets.tolist(), sorted_names, strict=True):
            self.heap_data[off : off + len(s)] = s
        # the symbol table nodes, then the B-tree levels above them (level 0 first)
        per = 2 * LEAF_K
        self.nodes = -(-n // per)
        self.levels: list[int] = []  # nodes per B-tree level
        count = self.nodes
        while True:
            count = -(-count // (2 * NODE_K))
            self.levels.append(count)
            if count == 1:
                break
        self.trees = sum(self.levels)
        self.size = _HEAP_PREFIX + len(self.heap_data) + self.trees * TREE_SIZE
        self.size += self.nodes * SNOD_SIZE

    def message(self, base: int) -> bytes:
        """The group's symbol table message body, for the block at file offset ``base``."""
        return symbol_table_message(base + _HEAP_PREFIX + len(self.heap_data), base)

    def encode(self, base: int, addresses: Sequence[int]) -> bytes:
        """The block at file offset ``base`` for links to ``addresses`` (in the order of the
        names given)."""
        n = len(self.order)
        data_at = base + _HEAP_PREFIX
        tree_at = data_at + len(self.heap_data)
        node_at = tree_at + self.trees * TREE_SIZE
        out = bytearray(self.size)
        struct.pack_into("<4sB3xQQQ", out, 0, b"HEAP", 0, len(self.heap_data), _FREE_NULL, data_at)
        out[_HEAP_PREFIX : _HEAP_PREFIX + len(self.heap_data)] = self.heap_data
        # symbol table nodes: one row of 2 * LEAF_K entries each
        per = 2 * LEAF_K
        entries = np.zeros((self.nodes * per, _ENTRY), np.uint8)
        entries[:n, 0:8] = self.name_offsets.astype("<u8").view(np.uint8).reshape(n, 8)
        addr = np.fromiter((addresses[i] for i in self.order), np.uint64, n).astype("<u8")
        entries[:n, 8:16] = addr.view(np.uint8).reshape(n, 8)
        nodes = np.zeros((self.nodes, SNOD_SIZE), np.uint8)
        nodes[:, 0:5] = np.frombuffer(b"SNOD\x01", np.uint8)
        used = np.minimum(per, n - per * np.arange(self.nodes)).astype("<u2")
        nodes[:, 6:8] = used.view(np.uint8).reshape(-1, 2)
        nodes[:, 8:] = entries.reshape(self.nodes, per * _ENTRY)
        start = node_at - base
        out[start : start + nodes.size] = nodes.tobytes()
        # the B-tree, bottom up: each level's children are the level below's nodes (level 0's:
        # the symbol table nodes), each child's last name its right key
        last = self.name_offsets[np.minimum(per * np.arange(1, self.nodes + 1), n) - 1].tolist()
        children = [node_at + k * SNOD_SIZE for k in range(self.nodes)]
        # the trees are laid root first: level L-1 at tree_at, then L-2, ... then level 0
        level_at: list[int] = []
        at = tree_at
        for count in reversed(self.levels):
            level_at.append(at)
            at += count * TREE_SIZE
        level_at.reverse()
        width = 2 * NODE_K
        for level, count in enumerate(self.levels):
            addrs = [level_at[level] + k * TREE_SIZE for k in range(count)]
            up_last = []
            for k in range(count):
                kids = children[k * width : (k + 1) * width]
                keys = last[k * width : (k + 1) * width]
                left_key = 0 if k == 0 else last[k * width - 1]
                o = addrs[k] - base
                struct.pack_into(
                    "<4sBBHQQ",
                    out,
                    o,
                    b"TREE",
                    0,
                    level,
                    len(kids),
                    addrs[k - 1] if k else _UNDEF,
                    addrs[k + 1] if k + 1 < count else _UNDEF,
                )
                body = [left_key]
                for child, key in zip(kids, keys, strict=True):
                    body += [child, key]
                struct.pack_into(f"<{len(body)}Q", out, o + _TREE_HEAD, *body)
                up_last.append(keys[-1])
            children, last = addrs, up_last
        assert level_at[-1] == tree_at  # (the root, where :meth:`message` says)
        return bytes(out)


def read_symbol_table(
    source: Source, body: bytes, where: str, *, max_links: int | None = None
) -> list[tuple[bytes, int]]:
    """The links ``(name, object header address)`` of the symbol table whose message body is
    ``body``, in name order; :class:`Refused` for anything malformed (see the module
    docstring). ``max_links``: the most links accepted (default: what the file's size allows)."""
    if len(body) < 16:
        raise Refused(f"{where}: a short symbol table message", "16 bytes", len(body))
    btree, heap = struct.unpack_from("<QQ", body)
    head = source.read(heap, _HEAP_PREFIX, f"{where}: the local heap")
    sig, version, dsize, free, data_at = struct.unpack_from("<4sB3xQQQ", head)
    if sig != b"HEAP" or version != 0:
        raise Refused(f"{where}: the local heap", "signature HEAP, version 0", (sig, version))
    if dsize > source.size:
        raise Refused(f"{where}: the local heap's size", f"at most {source.size}", dsize)
    if free != _FREE_NULL and free >= dsize:
        raise Refused(f"{where}: the local heap's free list", f"below {dsize}", free)
    data = source.read(data_at, dsize, f"{where}: the local heap's data")
    limit = source.size // _ENTRY if max_links is None else max_links

    def name_at(offset: int) -> bytes:
        if offset >= dsize:
            raise Refused(f"{where}: a name's heap offset", f"below {dsize}", offset)
        end = data.find(b"\x00", offset)
        if end < 0:
            raise Refused(f"{where}: a name without its NUL in the heap", "a NUL", "none")
        return data[offset:end]

    links: list[tuple[bytes, int]] = []
    seen: set[int] = set()
    level: list[int] = [btree]
    expect: int | None = None  # the level the next B-tree layer must have
    for _ in range(_MAX_LEVELS + 1):
        below: list[int] = []
        levels: set[int] = set()
        for address in level:
            if address in seen:
                raise Refused(f"{where}: a B-tree node met twice", "each node once", address)
            seen.add(address)
            node = source.read(address, TREE_SIZE, f"{where}: a B-tree node")
            sig, ntype, lvl, used = struct.unpack_from("<4sBBH", node)
            if sig != b"TREE" or ntype != 0:
                raise Refused(f"{where}: a group B-tree node", "TREE, type 0", (sig, ntype))
            if not 0 < used <= 2 * NODE_K:
                raise Refused(f"{where}: B-tree entries", f"1..{2 * NODE_K}", used)
            if expect is not None and lvl != expect:
                raise Refused(f"{where}: a B-tree node's level", expect, lvl)
            levels.add(lvl)
            values = struct.unpack_from(f"<{2 * used + 1}Q", node, _TREE_HEAD)
            below += values[1::2]
        if len(levels) != 1:
            raise Refused(f"{where}: B-tree levels of one layer", "one level", sorted(levels))
        lvl = levels.pop()
        if lvl == 0:
            level = below
            break
        if len(seen) + len(below) > limit + _MAX_LEVELS * 64:
            raise Refused(f"{where}: B-tree nodes", f"at most {limit}", "more")
        level, expect = below, lvl - 1
    else:
        raise Refused(f"{where}: B-tree depth", f"at most {_MAX_LEVELS}", "more")
    for address in level:  # symbol table nodes, in order
        if address in seen:
            raise Refused(f"{where}: a symbol table node met twice", "each node once", address)
        seen.add(address)
        node = source.read(address, SNOD_SIZE, f"{where}: a symbol table node")
        sig, version, count = struct.unpack_from("<4sBxH", node)
        if sig != b"SNOD" or version != 1 or count > 2 * LEAF_K:
            raise Refused(
                f"{where}: a symbol table node", f"SNOD version 1, at most {2 * LEAF_K}", count
            )
        if len(links) + count > limit:
            raise Refused(f"{where}: links", f"at most {limit}", "more")
        for k in range(count):
            offset, obj = struct.unpack_from("<QQ", node, 8 + k * _ENTRY)
            name = name_at(offset)
            if links and name <= links[-1][0]:
                raise Refused(f"{where}: names out of order", f"after {links[-1][0]!r}", name)
            links.append((name, obj))
    return links
