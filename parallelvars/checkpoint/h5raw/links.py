"""Which names of a file are reached from the root by hard links only: a bounded walk of the
groups on the way to the names asked for, without libhdf5.

A command that reads components where the index places them first checks that each component's
name is what any HDF5 reader would open: reached from the root through hard links (no soft or
external link, nothing HDF5 would not find). libhdf5's link walk (``H5Lvisit``) answers it at
about 10 us a link and visits every object; this walk reads only the object headers of the
groups that lie on the way to the names asked for (a component's own header is never read), and
checks them as libhdf5 would when it opens them (each version-2 chunk's lookup3, computed for all
the groups of one depth at once).

What it reads: a superblock of version 2 or 3 (``libver="latest"``, what both of our writers
make), groups whose links are in their object header (link messages) or in a symbol table
(:mod:`.symbol_table`). Anything else (an older superblock, dense link storage in a fractal heap,
a malformed header) is :class:`~.source.Refused`: the caller then takes libhdf5's walk, which
reads every HDF5 file and names any damage. Every read is bounded by the file's size, each group
is read once (a group reached twice is walked under its first name only), and at most
``max_groups`` groups are read.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterable, Iterator, Sequence
from itertools import pairwise, repeat

import numpy as np

from parallelvars._spans import coalesce
from parallelvars.checkpoint.h5raw import header as hdr
from parallelvars.checkpoint.h5raw.lookup3 import lookup3, lookup3_many, lookup3_rows
from parallelvars.checkpoint.h5raw.source import Refused, Source
from parallelvars.checkpoint.h5raw.symbol_table import SYMBOL_TABLE, read_symbol_table

__all__ = ["data_addresses", "hard_names", "reached_members", "root_address"]

_UNDEF = 0xFFFFFFFFFFFFFFFF
_SUPERBLOCK = struct.Struct("<8sBBBBQQQQ")  # versions 2 and 3 (8-byte offsets and lengths)
_HARD = 0
_KEEP = frozenset((hdr.LINK, hdr.LINK_INFO, SYMBOL_TABLE))  # (the messages a walk reads)
_FIRST = 1024  # bytes of each header read first (its prefix: at most 6 + 16 + 4 + 8; most whole)
_MAX_CHUNK = 1 << 20  # the largest first chunk walked here (ours are at most 4 KiB)
# Groups read together: their headers' bytes (and the gaps read with them) are held at once,
# a few tens of MB for 8192 of them; as fast at this size, with a lower peak.
_BATCH = 2048
_BATCH_BYTES = 64 << 20  # the most header bytes read for one batch of groups
# Headers less than this apart are read together, the bytes between them too (a variable's
# group and its datasets' headers lie side by side): at most _BATCH times this in gaps.
_HEADER_GAP = 4096
# Chunks of one length hashed as rows of one array (a generated file's groups of one kind have
# headers of one size) once at least this many share it; the rest as spans.
_SAME_LENGTH_ROWS = 32


def root_address(source: Source) -> int:
    """The root group's object header address, from a version-2 or -3 superblock with 8-byte
    offsets and lengths (its checksum checked); :class:`Refused` for any other superblock."""
    head = source.read_upto(0, _SUPERBLOCK.size + 4, "the superblock")
    if len(head) < _SUPERBLOCK.size + 4:
        raise Refused("the superblock", f"{_SUPERBLOCK.size + 4} bytes", f"{len(head)} bytes")
    sig, version, addr, size, _flags, base, _ext, _eof, root = _SUPERBLOCK.unpack_from(head)
    if sig != b"\x89HDF\r\n\x1a\n" or version not in (2, 3) or (addr, size) != (8, 8):
        raise Refused("the superblock", "version 2 or 3, 8-byte offsets", (version, addr, size))
    stored = int.from_bytes(head[_SUPERBLOCK.size : _SUPERBLOCK.size + 4], "little")
    if lookup3(head[: _SUPERBLOCK.size]) != stored or base != 0:
        raise Refused("the superblock", "its checksum and base address 0", "another")
    return int(root)


def _links(source: Source, header: hdr.ObjectHeader, where: str) -> list[tuple[bytes, int, int]]:
    """The links ``(name, type, address)`` of the group whose header is ``header`` (address
    -1 for a link that is not hard)."""
    out: list[tuple[bytes, int, int]] = []
    types = {m.type for m in header.messages}
    _one_storage(hdr.LINK in types, hdr.LINK_INFO in types, SYMBOL_TABLE in types, where)
    for m in header.messages:
        if m.type == hdr.LINK:
            out.append(_link(m.body, where))
        elif m.type == hdr.LINK_INFO:
            body = m.body
            if body[:1] != b"\x00":
                raise Refused(f"{where}: a link info message", "version 0", body[:1].hex())
            flags = body[1] if len(body) > 1 else 0
            at = 2 + (8 if flags & 1 else 0)
            if len(body) < at + 8:
                raise Refused(f"{where}: a short link info message", at + 8, len(body))
            if int.from_bytes(body[at : at + 8], "little") != _UNDEF:
                raise Refused(f"{where}: dense link storage", "links in the header", "a heap")
        elif m.type == SYMBOL_TABLE:
            out.extend((name, _HARD, obj) for name, obj in read_symbol_table(source, m.body, where))
    return out


def _one_storage(links: bool, info: bool, table: bool, where: str) -> None:
    """A group keeps its links one way, as libhdf5 looks them up: link messages under a link
    info message, or a symbol table alone; any other mix is refused (libhdf5 would find some
    of the names another way, or not at all)."""
    if (links and not info) or (table and (links or info)):
        raise Refused(
            f"{where}: its links",
            "link messages with a link info message, or a symbol table alone",
            "another mix",
        )


def _check_names(groups: list[int], names: list[bytes], where: list[bytes]) -> None:
    """Refuse a link name libhdf5 would not take as one name (a ``/`` or NUL in it, or
    ``.``)."""
    blob = b"".join(names)  # (one scan of every name: the loop only to say which)
    if b"/" in blob or b"\x00" in blob or b"." in names:
        for k, name in zip(groups, names, strict=True):
            if b"/" in name or b"\x00" in name or name == b".":
                raise Refused(f"{_group(where[k])}: a link's name", "one name", repr(name))


def _listed_once(fulls: list[bytes], groups: list[int], where: list[bytes]) -> set[bytes]:
    """The set of ``fulls`` (each link's full name); :class:`Refused` for a name a group lists
    twice (libhdf5 finds the first one, which may be a link that is not hard).

    A full name is its group's path, ``/`` and the link's name (no ``/`` in it: checked
    first), and the groups read together have distinct paths: two links share a full name
    exactly when one group lists one name twice."""
    unique = set(fulls)
    if len(unique) != len(fulls):
        seen: set[bytes] = set()
        for k, full in zip(groups, fulls, strict=True):
            if full in seen:
                raise Refused(f"{_group(where[k])}: a link's name listed twice", "once", "twice")
            seen.add(full)
    return unique


def _link(body: bytes, where: str) -> tuple[bytes, int, int]:
    """One link message's name, type and (hard links) address."""
    if len(body) < 3 or body[0] != 1:
        raise Refused(f"{where}: a link message", "version 1", body[:1].hex())
    flags = body[1]
    if flags & 0xE0:
        raise Refused(f"{where}: a link message's flags", "bits 0-4", hex(flags))
    p = 2
    kind = _HARD
    if flags & 0x08:
        kind = body[p]
        p += 1
    if flags & 0x04:
        p += 8
    if flags & 0x10:
        p += 1
    width = 1 << (flags & 0x03)
    n = int.from_bytes(body[p : p + width], "little")
    p += width
    name = body[p : p + n]
    if len(name) != n or n == 0:
        raise Refused(f"{where}: a link's name", f"{n} bytes", f"{len(name)} bytes")
    p += n
    if kind != _HARD:
        return name, kind, -1
    if len(body) < p + 8:
        raise Refused(f"{where}: a hard link's address", "8 bytes", len(body) - p)
    return name, kind, int.from_bytes(body[p : p + 8], "little")


def _gather(buf: np.ndarray, at: np.ndarray, width: int | np.ndarray) -> np.ndarray:
    """The little-endian unsigned integers of ``width`` bytes (per row, up to 8) at ``at``."""
    widths = np.broadcast_to(np.asarray(width, np.int64), at.shape)
    out = np.zeros(at.shape, np.uint64)
    for k in range(int(widths.max(initial=0))):
        use = k < widths
        out[use] |= buf[at[use] + k].astype(np.uint64) << np.uint64(8 * k)
    return out


def _read_spans(
    source: Source, starts: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The bytes ``[starts[k], starts[k] + sizes[k])`` of ``source`` in one buffer (read in a
    few large reads), and where each one starts in it."""
    spans = coalesce(starts, sizes, gap=_HEADER_GAP, tight=False)
    buf = np.empty(spans.total, np.uint8)
    for start, size, base in zip(
        spans.starts.tolist(), spans.sizes.tolist(), spans.bases.tolist(), strict=True
    ):
        source.read_into(memoryview(buf)[base : base + size], start, "object headers")  # type: ignore[arg-type]
    at = np.empty_like(spans.at)
    at[spans.order] = spans.at
    return buf, at


def _checksums(buf: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """The lookup3 of ``buf[start:end]`` for every span ``(start, end)`` (a uint32 array):
    spans of one length, when many share it, as the rows of one array (:func:`lookup3_rows`,
    a few times cheaper than spans of mixed lengths); the others by :func:`lookup3_many`, or
    one by one when they are few."""
    out = np.empty(len(spans), np.uint32)
    lengths = spans[:, 1] - spans[:, 0]
    order = np.argsort(lengths, kind="stable")
    cuts = [0, *(np.flatnonzero(np.diff(lengths[order])) + 1).tolist(), len(order)]
    rest = np.ones(len(spans), bool)
    for lo, hi in pairwise(cuts):
        if hi - lo < _SAME_LENGTH_ROWS:
            continue
        rows = order[lo:hi]
        size = int(lengths[rows[0]])
        if size:
            windows = np.lib.stride_tricks.sliding_window_view(buf, size)
            out[rows] = lookup3_rows(windows[spans[rows, 0]], size)
        else:
            out[rows] = lookup3(b"")
        rest[rows] = False
    others = np.flatnonzero(rest)
    if others.size > _SAME_LENGTH_ROWS:
        out[others] = lookup3_many(buf, spans[others])  # type: ignore[arg-type]
    else:  # (a few: one by one, each far cheaper than a round of array operations)
        for k, (start, end) in zip(others.tolist(), spans[others].tolist(), strict=True):
            out[k] = lookup3(buf[start:end])
    return out


def _group_links(
    source: Source, addresses: list[int], where: list[bytes], prefixes: list[bytes]
) -> tuple[list[int], list[bytes], list[bytes], list[int], set[bytes]]:
    """The hard links of the groups whose object headers are at ``addresses`` (``where``:
    each one's path, for errors; ``prefixes``: what each one's links' full names start with,
    distinct), their chunks checked against their checksums: each link's group (its index in
    ``addresses``), name, full name (its group's prefix and name) and object's address, and
    the set of those full names.
    Version-2 headers in one chunk are read and walked together, as arrays; any other header
    alone (:func:`~.header.read_object_header`)."""
    n = len(addresses)
    groups: list[int] = []
    names: list[bytes] = []
    targets: list[int] = []
    # the links that are not hard (soft, external): their names checked with the others'
    other_groups: list[int] = []
    other_names: list[bytes] = []

    def take(k: int, name: bytes, kind: int, address: int) -> None:
        if kind == _HARD:
            groups.append(k)
            names.append(name)
            targets.append(address)
        else:
            other_groups.append(k)
            other_names.append(name)

    if n == 0:
        return [], [], [], [], set()
    addr = np.array(addresses, np.int64)
    head, at, ok, flags, p, width = _v2_prefixes(source, addr)
    ok &= addr + p + width + 8 <= source.size
    fast = np.flatnonzero(ok)
    slow = np.flatnonzero(~ok).tolist()
    if fast.size:
        size0 = _gather(head, at[fast] + p[fast], width[fast]).astype(np.int64)
        length = p[fast] + width[fast]
        extent = length + size0 + 4  # (the chunk and its checksum)
        if int(size0.max()) > _MAX_CHUNK or int(size0.min()) < 0:
            raise Refused("an object header's first chunk", f"at most {_MAX_CHUNK} bytes", "more")
        if int(extent.sum()) > _BATCH_BYTES:  # (ours: at most 4 KiB a chunk)
            raise Refused("object headers' first chunks", f"at most {_BATCH_BYTES} bytes", "more")
        if int((addr[fast] + extent).max()) > source.size:
            raise Refused("an object header runs past the end of the file", source.size, "more")
        # Headers whose chunk the first read holds are taken from it; the others read again.
        buf, base = head, at[fast]
        longer = extent > _FIRST
        if np.any(longer):
            more, more_at = _read_spans(source, addr[fast][longer], extent[longer])
            base = base.copy()
            base[longer] = more_at + head.size
            buf = np.concatenate([head, more])
        _check_first_chunks(buf, base, length + size0, addr[fast])
        mhead = np.where(flags[fast] & 0x04, 6, 4)
        pos, end = base + length, base + length + size0
        found_rows, found_types, found_at, found_size = [], [], [], []
        for rows, mtype, msize, body in _message_steps(buf, pos, end, mhead, addr[fast]):
            want = (
                (mtype == hdr.LINK)
                | (mtype == hdr.LINK_INFO)
                | (mtype == SYMBOL_TABLE)
                | (mtype == hdr.CONTINUATION)
            )
            found_rows.append(rows[want])
            found_types.append(mtype[want])
            found_at.append(body[want])
            found_size.append(msize[want])
        if found_rows:
            f_rows = np.concatenate(found_rows)
            f_types = np.concatenate(found_types)
            f_at = np.concatenate(found_at)
            f_size = np.concatenate(found_size)

            # One way of keeping links per group (see _one_storage).
            def rows_with(t: int) -> np.ndarray:
                has = np.zeros(fast.size, bool)
                has[f_rows[f_types == t]] = True
                return has

            has_link, has_info = rows_with(hdr.LINK), rows_with(hdr.LINK_INFO)
            has_table = rows_with(SYMBOL_TABLE)
            # (a header with a continuation is read whole below, and checked there)
            whole = ~rows_with(hdr.CONTINUATION)
            mixed = np.flatnonzero(
                whole & ((has_link & ~has_info) | (has_table & (has_link | has_info)))
            )
            if mixed.size:
                k = int(fast[mixed[0]])
                _one_storage(True, False, False, _group(where[k]))
            # Link info: version 0, the links in the header (no fractal heap address), or the
            # walk stops.
            info = np.flatnonzero(f_types == hdr.LINK_INFO)
            if np.any(buf[f_at[info]] != 0):
                k = int(fast[f_rows[info][np.flatnonzero(buf[f_at[info]] != 0)[0]]])
                raise Refused(f"{_group(where[k])}: a link info message", "version 0", "another")
            if info.size:
                heap_at = f_at[info] + 2 + np.where(buf[f_at[info] + 1] & 1, 8, 0)
                if np.any(heap_at + 8 > f_at[info] + f_size[info]) or np.any(
                    _gather(buf, heap_at, 8) != np.uint64(_UNDEF)
                ):
                    raise Refused("dense link storage", "links in the header", "a heap")
            # Headers with a continuation or a symbol table: read alone (rare).
            # (a set, not np.unique: that imports numpy.ma, tens of ms, on its first call)
            other = f_rows[(f_types == hdr.CONTINUATION) | (f_types == SYMBOL_TABLE)]
            alone = set(fast[other].tolist())
            links = np.flatnonzero(f_types == hdr.LINK)
            l_rows, l_at, l_size = f_rows[links], f_at[links], f_size[links]
            order = np.argsort(l_rows, kind="stable")
            l_rows, l_at, l_size = l_rows[order], l_at[order], l_size[order]
            # The usual link message (version 1, no link type: hard, no creation order) as
            # arrays; any other one through _link.
            lflags = buf[l_at + 1].astype(np.int64)
            plain = (buf[l_at] == 1) & ((lflags & 0xEC) == 0) & (l_size >= 3)
            name_at = l_at + 2 + np.where(lflags & 0x10, 1, 0)
            lwidth = np.left_shift(1, lflags & 0x03)
            plain &= name_at + lwidth <= l_at + l_size
            name_len = np.zeros(l_at.size, np.int64)
            name_len[plain] = _gather(buf, name_at[plain] + 0, lwidth[plain]).astype(np.int64)
            name_at = name_at + lwidth
            plain &= (name_len > 0) & (name_at + name_len + 8 <= l_at + l_size)
            target = np.full(l_at.size, -1, np.int64)
            target[plain] = _gather(buf, name_at[plain] + name_len[plain], 8).astype(np.int64)
            if alone:
                plain &= ~np.isin(fast[l_rows], list(alone))
            data = buf.tobytes()
            groups.extend(fast[l_rows[plain]].tolist())
            names.extend(
                [
                    data[a : a + m]
                    for a, m in zip(name_at[plain].tolist(), name_len[plain].tolist(), strict=True)
                ]
            )
            targets.extend(target[plain].tolist())
            for r, b, m in zip(
                l_rows[~plain].tolist(), l_at[~plain].tolist(), l_size[~plain].tolist(), strict=True
            ):
                k = int(fast[r])
                if k not in alone:
                    name, kind, address = _link(data[b : b + m], _group(where[k]))
                    take(k, name, kind, address)
            slow.extend(sorted(alone))
    for k in slow:
        header = hdr.read_object_header(source, addresses[k], keep=_KEEP, checksums=True)
        for name, kind, address in _links(source, header, _group(where[k])):
            take(k, name, kind, address)
    _check_names(groups + other_groups, names + other_names, where)
    fulls = list(map(bytes.__add__, map(prefixes.__getitem__, groups), names))
    if not other_names:
        return groups, names, fulls, targets, _listed_once(fulls, groups, where)
    others = list(map(bytes.__add__, map(prefixes.__getitem__, other_groups), other_names))
    _listed_once(fulls + others, groups + other_groups, where)
    return groups, names, fulls, targets, set(fulls)


def _group(path: bytes) -> str:
    """How an error names the group at ``path``."""
    return f"the group /{path.decode(errors='replace')}"


def _walk(
    source: Source, groups: set[bytes], max_groups: int | None
) -> Iterator[tuple[list[bytes], list[int], list[bytes], list[int], set[bytes]]]:
    """The groups on the way to ``groups`` (every group above one of them, and those
    themselves) reached from the root by hard links only, a batch at a time: the batch's
    group paths and, of their hard links, each one's group (an index into those paths), its
    name, its object's header address and the set of the links' full names. At most ``max_groups`` groups read (default:
    as many as ``groups`` and the groups above them, and the root)."""
    names = set(groups)
    while names:  # (every group above a name: its path cut at each ``/`` but a leading one)
        names = {name[:cut] for name in names if (cut := name.rfind(b"/")) > 0}
        names -= groups
        groups |= names
    limit = len(groups) + 1 if max_groups is None else max_groups
    seen: set[int] = set()
    # The groups of one depth: their paths and header addresses (lists side by side).
    paths: list[bytes] = [b""]
    level: list[int] = [root_address(source)]
    read = 0
    while level:
        read += len(level)
        if read > limit:
            raise Refused("groups on the way to the names", f"at most {limit}", "more")
        below_paths: list[bytes] = []
        below: list[int] = []
        for first in range(0, len(level), _BATCH):
            part = level[first : first + _BATCH]
            where = paths[first : first + _BATCH]
            seen.update(part)
            prefixes = [path + b"/" if path else b"" for path in where]
            of, names_, fulls, targets, listed = _group_links(source, part, where, prefixes)
            yield where, of, names_, targets, listed
            on_way = groups.intersection(listed)
            if on_way:
                for full, address in zip(fulls, targets, strict=True):
                    if full in on_way and address not in seen:
                        seen.add(address)
                        below_paths.append(full)
                        below.append(address)
        paths, level = below_paths, below


def hard_names(
    source: Source,
    wanted: Collection[bytes],
    *,
    parents: Iterable[bytes] | None = None,
    max_groups: int | None = None,
) -> set[bytes]:
    """Those of ``wanted`` (object paths without the leading ``/``) reached from the root by
    hard links only; only the groups on their way are read.

    :class:`Refused` for what this walk does not read (see the module docstring): the caller
    asks libhdf5 instead. ``parents``: the names' parent groups, when the caller knows them
    (fewer than the names: each is split once). ``max_groups``: the most groups read (default:
    one per group on the names' paths, and the root).

    The readers call :func:`reached_members` (no name made per component); this is kept
    beside it as the same walk asked about any names, which the tests hold to libhdf5's own
    link walk and to the reference walk (``tests/links_reference.py``) name by name, over
    arbitrary files: the answers :func:`reached_members` gives are this one's."""
    if parents is not None:
        groups = set(parents)
    else:
        groups = {name[:cut] for name in wanted if (cut := name.rfind(b"/")) > 0}
    found: set[bytes] = set()
    for _where, _of, _names, _targets, listed in _walk(source, groups, max_groups):
        found |= listed.intersection(wanted)
    return found


def reached_members(
    source: Source,
    parents: Sequence[bytes],
    members: Sequence[bytes],
    counts: np.ndarray,
    *,
    max_groups: int | None = None,
    targets: np.ndarray | None = None,
) -> np.ndarray:
    """For each group ``parents[p]`` and each of its first ``counts[p]`` ``members`` (link
    names), whether that name is a hard link of the group and the group is reached from the
    root by hard links only: a bool array, the members of ``parents[0]`` first, then those of
    ``parents[1]``, and so on (``counts.sum()`` of them).

    :func:`hard_names` for the names ``parents[p] + b"/" + members[i]``, ``i < counts[p]``,
    with none of those names made or kept: what it holds is this array and the walk's batch.
    A group reached under two paths is walked under its first one only (the other's members
    are then False), as in :func:`hard_names`. ``targets`` (an int64 array of as many
    items, when given) receives each reached member's object header address."""
    counts = np.asarray(counts, np.int64)
    starts = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    out = np.zeros(int(starts[-1]), bool)
    row_of = {p: r for r, p in enumerate(parents)}  # (distinct paths: a table's rows)
    index = {name: i for i, name in enumerate(members)}
    for where, of, names, addresses, _listed in _walk(source, set(row_of), max_groups):
        if not names:
            continue
        rows = np.fromiter(map(row_of.get, where, repeat(-1)), np.int64, len(where))
        link_rows = rows[np.asarray(of, np.int64)]
        ids = np.fromiter(map(index.get, names, repeat(-1)), np.int64, len(names))
        keep = (link_rows >= 0) & (ids >= 0)
        keep[keep] &= ids[keep] < counts[link_rows[keep]]
        out[starts[link_rows[keep]] + ids[keep]] = True
        if targets is not None:
            targets[starts[link_rows[keep]] + ids[keep]] = np.asarray(addresses, np.int64)[keep]
    return out


def data_addresses(source: Source, addresses: np.ndarray) -> np.ndarray:
    """The file offset of the data of each dataset whose object header is at ``addresses``
    (an int64 array), as HDF5 would find it on opening the dataset: the address of its
    contiguous data layout message (version 3 or 4); -1 for a dataset laid out otherwise
    (compact, chunked, virtual) or with no data allocated.

    Each header's chunks are checked against their checksums, as when HDF5 loads it.
    Version-2 headers whose layout message lies in their first chunk, without continuation,
    are read and walked together as arrays; any other header alone
    (:func:`~.header.read_object_header`). :class:`Refused` for a header this walk does not
    read: the caller then asks libhdf5."""
    addr = np.asarray(addresses, np.int64)
    out = np.full(addr.size, -1, np.int64)
    if addr.size == 0:
        return out
    head, at, ok, flags, p, width = _v2_prefixes(source, addr)
    ok &= (p + width + 8 <= np.minimum(_FIRST, source.size - addr)) & (width <= 4)
    fast = np.flatnonzero(ok)
    slow = set(np.flatnonzero(~ok).tolist())
    if fast.size:
        base = at[fast]
        size0 = _gather(head, base + p[fast], width[fast]).astype(np.int64)
        length = p[fast] + width[fast]
        # (a first chunk the first read does not hold whole: read alone)
        whole = length + size0 + 4 <= np.minimum(_FIRST, source.size - addr[fast])
        slow.update(fast[~whole].tolist())
        fast, base, size0, length = fast[whole], base[whole], size0[whole], length[whole]
        f_flags = flags[fast]
        _check_first_chunks(head, base, length + size0, addr[fast])
        mhead = np.where(f_flags & 0x04, 6, 4)
        pos, end = base + length, base + length + size0
        layout_at = np.full(fast.size, -1, np.int64)
        layout_size = np.zeros(fast.size, np.int64)
        alone = np.zeros(fast.size, bool)
        for rows, mtype, msize, body in _message_steps(head, pos, end, mhead, addr[fast]):
            layout = mtype == hdr.LAYOUT
            # (a second layout message, or a continuation: the header is read alone)
            alone[rows[(mtype == hdr.CONTINUATION) | (layout & (layout_at[rows] >= 0))]] = True
            layout_at[rows[layout]] = body[layout]
            layout_size[rows[layout]] = msize[layout]
        slow.update(fast[alone].tolist())
        take = ~alone & (layout_at >= 0)
        b, s = layout_at[take], layout_size[take]
        contiguous = (s >= 18) & ((head[b] == 3) | (head[b] == 4)) & (head[b + 1] == 1)
        found = np.full(b.size, -1, np.int64)
        found[contiguous] = _gather(head, b[contiguous] + 2, 8).astype(np.int64)
        out[fast[take]] = found
    for k in sorted(slow):
        header = hdr.read_object_header(
            source, int(addr[k]), keep=frozenset((hdr.LAYOUT,)), checksums=True
        )
        layouts = list(header.of_type(hdr.LAYOUT))
        message = layouts[0].body if len(layouts) == 1 else b""
        if len(message) >= 18 and message[0] in (3, 4) and message[1] == 1:
            out[k] = int.from_bytes(message[2:10], "little")
    return out  # (an undefined address, no data allocated, reads as -1)


def _message_steps(
    buf: np.ndarray, pos: np.ndarray, end: np.ndarray, mhead: np.ndarray, addr: np.ndarray
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Walk the messages of many version-2 object headers at once (row ``k``: the header at
    ``addr[k]``, its next message at ``buf[pos[k]]``, its chunk ending at ``end[k]``, message
    heads of ``mhead[k]`` bytes): each step yields the rows still inside their chunk with their
    message's type, size and body offset, then moves ``pos`` past those messages. A message
    running past its chunk is refused."""
    rows = np.arange(pos.size)
    while rows.size:
        rows = rows[pos[rows] + mhead[rows] <= end[rows]]
        if not rows.size:
            return
        q = pos[rows]
        mtype = buf[q].astype(np.int64)
        msize = buf[q + 1].astype(np.int64) | buf[q + 2].astype(np.int64) << 8
        body = q + mhead[rows]
        past = body + msize > end[rows]
        if np.any(past):
            k = int(rows[np.flatnonzero(past)[0]])
            raise Refused(
                f"the object header at {int(addr[k])}: a message runs past its chunk",
                "a message inside its chunk",
                "past its end",
            )
        yield rows, mtype, msize, body
        pos[rows] = body + msize


def _v2_prefixes(
    source: Source, addr: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The first bytes of the object headers at ``addr`` read in one pass, and for each: its
    place in them, whether it starts as a version-2 header with known flags, its flags, where
    its first chunk's size field starts and that field's width. :class:`Refused` for an
    address outside the file."""
    if int(addr.min()) < 0 or int(addr.max()) + 16 > source.size:
        raise Refused("an object header lies outside the file", f"below {source.size}", "past it")
    head, at = _read_spans(source, addr, np.minimum(_FIRST, source.size - addr))
    ok = (
        (head[at] == 0x4F)
        & (head[at + 1] == 0x48)
        & (head[at + 2] == 0x44)
        & (head[at + 3] == 0x52)
        & (head[at + 4] == 2)
    )
    flags = head[at + 5].astype(np.int64)
    ok &= (flags & ~0x3F) == 0
    p = 6 + np.where(flags & 0x20, 16, 0) + np.where(flags & 0x10, 4, 0)
    width = np.left_shift(1, flags & 0x03)
    return head, at, ok, flags, p, width


def _check_first_chunks(
    buf: np.ndarray, base: np.ndarray, checked: np.ndarray, addr: np.ndarray
) -> None:
    """:class:`Refused` naming the first header (at ``addr``) whose first chunk, the
    ``checked`` bytes from ``base`` in ``buf``, fails the lookup3 checksum stored after it."""
    spans = np.stack([base, base + checked], axis=1)
    failed = np.flatnonzero(
        _checksums(buf, spans) != _gather(buf, base + checked, 4).astype(np.uint32)
    )
    if failed.size:
        bad = int(addr[failed[0]])
        raise Refused(f"the object header at {bad} fails its checksum", "its lookup3", "another")
