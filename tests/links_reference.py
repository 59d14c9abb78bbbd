"""The walk of ``parallelvars.checkpoint.h5raw.links`` as it was before its per-level work was
cut (a link at a time in Python, every chunk's lookup3 by spans): the reference the tests hold
the faster walk's answers and refusals to. Only its reads differ (each header alone, not
coalesced), which changes no answer."""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterable

import numpy as np

from parallelvars.checkpoint.h5raw import header as hdr
from parallelvars.checkpoint.h5raw.lookup3 import lookup3, lookup3_many
from parallelvars.checkpoint.h5raw.source import Refused, Source
from parallelvars.checkpoint.h5raw.symbol_table import SYMBOL_TABLE, read_symbol_table

__all__ = ["hard_names", "root_address"]

_UNDEF = 0xFFFFFFFFFFFFFFFF
_SUPERBLOCK = struct.Struct("<8sBBBBQQQQ")  # versions 2 and 3 (8-byte offsets and lengths)
_HARD = 0
_KEEP = frozenset((hdr.LINK, hdr.LINK_INFO, SYMBOL_TABLE))  # (the messages a walk reads)
_WALKED = np.array([hdr.LINK, hdr.LINK_INFO, SYMBOL_TABLE, hdr.CONTINUATION])
_FIRST = 1024  # bytes of each header read first (its prefix: at most 6 + 16 + 4 + 8; most whole)
_MAX_CHUNK = 1 << 20  # the largest first chunk walked here (ours are at most 4 KiB)
_BATCH = 8192  # groups read together (their headers' bytes held at once)
_BATCH_BYTES = 64 << 20  # the most header bytes read for one batch of groups
# Headers less than this apart are read together, the bytes between them too (a variable's
# group and its datasets' headers lie side by side): at most _BATCH times this in gaps.
_HEADER_GAP = 4096


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
    ``.``), and a name a group lists twice (libhdf5 finds the first one, which may be a link
    that is not hard)."""
    blob = b"".join(names)  # (one scan of every name: the loop only to say which)
    if b"/" in blob or b"\x00" in blob or b"." in names:
        for k, name in zip(groups, names, strict=True):
            if b"/" in name or b"\x00" in name or name == b".":
                raise Refused(f"{_group(where[k])}: a link's name", "one name", repr(name))
    if len(set(zip(groups, names, strict=True))) != len(names):
        seen: set[tuple[int, bytes]] = set()
        for pair in zip(groups, names, strict=True):
            if pair in seen:
                raise Refused(
                    f"{_group(where[pair[0]])}: a link's name listed twice", "once", "twice"
                )
            seen.add(pair)


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
    """The bytes ``[starts[k], starts[k] + sizes[k])`` of ``source`` in one buffer, and where
    each one starts in it."""
    at = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    buf = np.empty(int(np.sum(sizes)), np.uint8)
    for start, size, base in zip(starts.tolist(), sizes.tolist(), at.tolist(), strict=True):
        source.read_into(memoryview(buf)[base : base + size], start, "object headers")  # type: ignore[arg-type]
    return buf, at


def _group_links(
    source: Source, addresses: list[int], where: list[bytes]
) -> tuple[list[int], list[bytes], list[int]]:
    """The hard links of the groups whose object headers are at ``addresses`` (``where``:
    each one's path, for errors), their chunks checked against their checksums: three lists,
    the group (its place in ``addresses``), the link's name and its object's address.
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
        return groups, names, targets
    addr = np.array(addresses, np.int64)
    if int(addr.min()) < 0 or int(addr.max()) + 16 > source.size:
        raise Refused("an object header lies outside the file", f"below {source.size}", "past it")
    head, at = _read_spans(source, addr, np.minimum(_FIRST, source.size - addr))
    ok = (
        (head[at] == 0x4F)
        & (head[at + 1] == 0x48)
        & (head[at + 2] == 0x44)
        & (head[at + 3] == 0x52)
    )
    ok &= head[at + 4] == 2
    flags = head[at + 5].astype(np.int64)
    ok &= (flags & ~0x3F) == 0
    p = 6 + np.where(flags & 0x20, 16, 0) + np.where(flags & 0x10, 4, 0)
    width = np.left_shift(1, flags & 0x03)
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
        spans = np.stack([base, base + length + size0], axis=1)
        failed = np.flatnonzero(
            lookup3_many(buf, spans)  # type: ignore[arg-type]
            != _gather(buf, base + length + size0, 4).astype(np.uint32)
        )
        if failed.size:
            bad = int(addr[fast][failed[0]])
            raise Refused(
                f"the object header at {bad} fails its checksum", "its lookup3", "another"
            )
        mhead = np.where(flags[fast] & 0x04, 6, 4)
        pos, end = base + length, base + length + size0
        rows = np.arange(fast.size)
        found_rows, found_types, found_at, found_size = [], [], [], []
        while rows.size:
            live = pos[rows] + mhead[rows] <= end[rows]
            rows = rows[live]
            if not rows.size:
                break
            q = pos[rows]
            mtype = buf[q].astype(np.int64)
            msize = buf[q + 1].astype(np.int64) | buf[q + 2].astype(np.int64) << 8
            body = q + mhead[rows]
            if np.any(body + msize > end[rows]):
                k = int(rows[np.flatnonzero(body + msize > end[rows])[0]])
                raise Refused(
                    f"the object header at {int(addr[fast][k])}: a message runs past its chunk",
                    "a message inside its chunk",
                    "past its end",
                )
            want = np.isin(mtype, _WALKED)
            found_rows.append(rows[want])
            found_types.append(mtype[want])
            found_at.append(body[want])
            found_size.append(msize[want])
            pos[rows] = body + msize
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
            other = np.unique(f_rows[(f_types == hdr.CONTINUATION) | (f_types == SYMBOL_TABLE)])
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
    return groups, names, targets


def _group(path: bytes) -> str:
    """How an error names the group at ``path``."""
    return f"the group /{path.decode(errors='replace')}"


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
    one per group on the names' paths, and the root)."""
    groups: set[bytes] = set()
    for name in wanted if parents is None else parents:
        if parents is not None:  # (a parent is itself a group on the way)
            if name in groups:
                continue
            groups.add(name)
        cut = name.rfind(b"/")
        while cut > 0 and name[:cut] not in groups:
            groups.add(name[:cut])
            cut = name.rfind(b"/", 0, cut)
    limit = len(groups) + 1 if max_groups is None else max_groups
    found: set[bytes] = set()
    seen: set[int] = set()
    level: list[tuple[bytes, int]] = [(b"", root_address(source))]
    read = 0
    while level:
        read += len(level)
        if read > limit:
            raise Refused("groups on the way to the names", f"at most {limit}", "more")
        below: list[tuple[bytes, int]] = []
        for first in range(0, len(level), _BATCH):
            part = level[first : first + _BATCH]
            seen.update(address for _, address in part)
            prefixes = [path + b"/" if path else b"" for path, _ in part]
            ks, names, targets = _group_links(
                source, [a for _, a in part], [path for path, _ in part]
            )
            fulls = list(map(bytes.__add__, map(prefixes.__getitem__, ks), names))
            found.update(set(fulls).intersection(wanted))
            on_way = groups.intersection(fulls)
            if on_way:
                for full, address in zip(fulls, targets, strict=True):
                    if full in on_way and address not in seen:
                        seen.add(address)
                        below.append((full, address))
        level = below
    return found
