"""Our own walk of the groups on the way to the components (``h5raw/links.py``) answers what
libhdf5's link walk answers: which names are reached from the root by hard links only; what it
does not read (dense link storage, a damaged header) it refuses, and the reader then asks
libhdf5 (docs/FORMAT.md, "How the commands read")."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from test_h5raw import _SETTINGS, both, structures

from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.checkpoint.h5raw.links import hard_names, reached_members
from parallelvars.checkpoint.h5raw.native import write_native
from parallelvars.checkpoint.h5raw.source import FileSource, Refused, WindowSource
from parallelvars.checkpoint.registry import SaveRecord, component_name


def _libhdf5_hard_names(path: str) -> set[bytes]:
    names: set[bytes] = set()
    with h5py.File(path, "r") as f:

        def visit(link: bytes, info) -> None:
            if info.type == h5py.h5l.TYPE_HARD:
                names.add(link)

        f.id.links.visit(visit, info=True)
    return names


def _wanted(path: str) -> set[bytes]:
    with H5Reader(path) as r:
        return {
            f"{name}/{component_name(i)}".encode()
            for name in r
            for i in range(r[name].num_components)
        } | {b"nothing/here", f"{next(iter(r), 'x')}/missing".encode()}


def _walk(path: str, wanted: set[bytes], window: bool = True) -> set[bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return hard_names(WindowSource(fd, size) if window else FileSource(fd, size), wanted)
    finally:
        os.close(fd)


def _members(path: str, parents: list[bytes], counts: list[int]) -> list[bytes]:
    """The names ``parent/component_name(i)`` that :func:`reached_members` says are reached."""
    members = [component_name(i).encode() for i in range(max(counts, default=0))]
    fd = os.open(path, os.O_RDONLY)
    try:
        got = reached_members(WindowSource(fd, os.fstat(fd).st_size), parents, members, counts)
    finally:
        os.close(fd)
    names = [p + b"/" + members[i] for p, n in zip(parents, counts, strict=True) for i in range(n)]
    assert got.dtype == bool and got.shape == (len(names),)
    return [name for name, ok in zip(names, got.tolist(), strict=True) if ok]


def _members_of(path: str) -> tuple[list[bytes], list[int]]:
    """Every variable of ``path`` with its number of components, one more than it has for the
    first, and a group that is not there."""
    with H5Reader(path) as r:
        parents = [name.encode() for name in r]
        counts = [r[name].num_components for name in r]
    if counts:
        counts[0] += 1
    return [*parents, b"nothing/here"], [*counts, 2]


@settings(max_examples=8, **_SETTINGS)
@given(records=structures())
def test_the_walk_finds_what_libhdf5_finds(tmp_path_factory, records) -> None:
    tmp = tmp_path_factory.mktemp("links")
    for path in both(tmp, records):  # the libhdf5 writer's file and the generator's
        wanted = _wanted(path)
        hard = _libhdf5_hard_names(path)
        expected = wanted & hard
        assert _walk(path, wanted) == expected
        assert _walk(path, wanted, window=False) == expected
        # The same walk, asked per group and member (no name made): the same answers.
        parents, counts = _members_of(path)
        got = _members(path, parents, counts)
        assert (
            len(got) == len(set(got))
            and set(got)
            == {
                p + b"/" + component_name(i).encode()
                for p, n in zip(parents, counts, strict=True)
                for i in range(n)
            }
            & hard
        )


def _records(n: int) -> list[SaveRecord]:
    return [
        SaveRecord(
            "mirrored",
            [np.arange(4, dtype=np.float32) + k] * 2,
            (4,),
            {"devices": ["a", "b"]},
            path=f"m/g{k % 3}/v{k}",
        )
        for k in range(n)
    ]


def test_links_that_are_not_hard_and_groups_met_twice_are_not_reached(tmp_path) -> None:
    path = write_native(str(tmp_path / "g.h5"), _records(9), object_graph={"version": 1})
    with h5py.File(path, "a", libver="latest") as f:
        del f["m/g0/v0/parallel_component_1"]
        f["m/g0/v0/parallel_component_1"] = h5py.SoftLink("/m/g0/v0/primary")
        del f["m/g1/v1/parallel_component_1"]
        f["m/g1/v1/parallel_component_1"] = h5py.ExternalLink("other.h5", "/x")
        f["m/g2/again"] = f["m/g1"]  # (a second name of one group: walked once)
    wanted = {
        f"m/g{k % 3}/v{k}/{component_name(i)}".encode() for k in range(9) for i in range(2)
    } | {b"m/g2/again/v4/primary"}
    got = _walk(path, wanted)
    assert got == wanted & _libhdf5_hard_names(path) - {b"m/g2/again/v4/primary"}
    assert b"m/g0/v0/primary" in got
    assert b"m/g0/v0/parallel_component_1" not in got
    assert b"m/g1/v1/parallel_component_1" not in got
    parents = [f"m/g{k % 3}/v{k}".encode() for k in range(9)] + [b"m/g2/again/v4"]
    assert set(_members(path, parents, [2] * 10)) == got


def test_a_damaged_group_header_and_dense_links_are_refused(tmp_path) -> None:
    path = write_native(str(tmp_path / "g.h5"), _records(6), object_graph={"version": 1})
    wanted = {f"m/g{k % 3}/v{k}/primary".encode() for k in range(6)}
    with h5py.File(path, "r") as f:
        group = h5py.h5o.get_info(f["m/g1/v1"].id).addr
    damaged = str(tmp_path / "d.h5")
    with open(path, "rb") as fh:
        raw = bytearray(fh.read())
    raw[group + 12] ^= 0x40
    with open(damaged, "wb") as fh:
        fh.write(raw)
    with pytest.raises(Refused, match="checksum"):
        _walk(damaged, wanted)
    # A group of libhdf5's dense storage (a fractal heap): not ours to walk.
    dense = str(tmp_path / "dense.h5")
    with h5py.File(dense, "w", libver="latest") as f:
        for k in range(20):
            f[f"m/g/v{k}/primary"] = np.zeros(2)
    with pytest.raises(Refused, match="dense"):
        _walk(dense, {f"m/g/v{k}/primary".encode() for k in range(20)})


def test_the_reader_takes_libhdf5s_walk_where_ours_refuses(tmp_path, monkeypatch) -> None:
    """The reader's bulk reads agree whichever walk answers."""
    from parallelvars.checkpoint.h5io import bulk

    path = write_native(str(tmp_path / "g.h5"), _records(30), object_graph={"version": 1})
    monkeypatch.setattr(bulk, "LINK_CHECKS", 2)
    with H5Reader(path) as r:
        ours = dict(r.bulk_components(list(r)))
        # (ours: whether each of the table's 60 components is reached, no name kept)
        assert r._hard_names is None and r._reached_slots is not None
        assert r._reached_slots.size == 60 and r._reached_slots.all()

    def refuse(*args, **kwargs):
        raise Refused("not walked here")

    monkeypatch.setattr(bulk, "reached_members", refuse)
    with H5Reader(path) as r:
        theirs = dict(r.bulk_components(list(r)))
        assert len(r._hard_names) > 60  # (libhdf5's list: every name, groups too)
    assert ours.keys() == theirs.keys()
    for key, parts in ours.items():
        assert parts is not None and theirs[key] is not None
        assert [p.tobytes() for p in parts] == [p.tobytes() for p in theirs[key]]


@pytest.mark.parametrize("bound", ["_MAX_CHUNK", "_BATCH_BYTES"])
def test_headers_past_the_walks_bounds_are_refused(tmp_path, monkeypatch, bound) -> None:
    from parallelvars.checkpoint.h5raw import links

    path = write_native(str(tmp_path / "g.h5"), _records(6), object_graph={"version": 1})
    monkeypatch.setattr(links, bound, 16)
    with pytest.raises(Refused, match="first chunk") as caught:
        _walk(path, {f"m/g{k % 3}/v{k}/primary".encode() for k in range(6)})
    assert caught.value.expected == "at most 16 bytes"


def _group_chunk(raw: bytearray, addr: int) -> tuple[int, int]:
    """Where a version-2 object header's first chunk ends (its checksum follows), and where
    its size field is."""
    assert raw[addr : addr + 5] == b"OHDR\x02"
    flags = raw[addr + 5]
    p = addr + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
    width = 1 << (flags & 0x03)
    size0 = int.from_bytes(raw[p : p + width], "little")
    return p + width + size0, p


def _mended(raw: bytearray, addr: int) -> None:
    """The first chunk's checksum made right again after an edit."""
    from parallelvars.testing import lookup3

    end, _ = _group_chunk(raw, addr)
    raw[end : end + 4] = lookup3(bytes(raw[addr:end])).to_bytes(4, "little")


def _twin(tmp_path, edit) -> tuple[str, set[bytes]]:
    """A file of variables ``m/g/qqqqq{0,1,2}`` whose group ``m/g`` header ``edit`` changes
    (its checksum then mended)."""
    raw, addr = _group_bytes(tmp_path, "qqqqq")
    edit(raw, addr)
    _mended(raw, addr)
    out = str(tmp_path / "edited.h5")
    with open(out, "wb") as fh:
        fh.write(raw)
    return out, {f"m/g/qqqqq{k}/primary".encode() for k in range(3)}


def _group_bytes(tmp_path, stem: str) -> tuple[bytearray, int]:
    """The bytes of a file of variables ``m/g/<stem>{0,1,2}``, and where group ``m/g``'s
    object header starts."""
    records = [
        SaveRecord("single", [np.arange(4, dtype=np.float32)], (4,), {}, path=f"m/g/{stem}{k}")
        for k in range(3)
    ]
    path = write_native(str(tmp_path / "g.h5"), records, object_graph={"version": 1})
    with h5py.File(path, "r") as f:
        addr = h5py.h5o.get_info(f["m/g"].id).addr
    with open(path, "rb") as fh:
        return bytearray(fh.read()), addr


def _rename(new: bytes):
    def edit(raw: bytearray, addr: int) -> None:
        end, _ = _group_chunk(raw, addr)
        at = raw.find(b"qqqqq1", addr, end)
        assert at > 0
        raw[at : at + 6] = new

    return edit


@pytest.mark.parametrize(
    "new, match",
    [(b"qq/qq1", "name"), (b"qq\x00qq1", "name"), (b"qqqqq0", "twice")],
    ids=["slash", "nul", "duplicate"],
)
def test_link_names_libhdf5_would_read_otherwise_are_refused(tmp_path, new, match) -> None:
    """A name with a ``/`` or NUL (libhdf5 would split or cut it) or listed twice in one group
    (libhdf5 takes the first) is refused, so the reader asks libhdf5 instead."""
    path, wanted = _twin(tmp_path, _rename(new[:6]))
    with pytest.raises(Refused, match=match):
        _walk(path, wanted)
    with pytest.raises(Refused, match=match):
        _walk(path, wanted, window=False)


def test_link_messages_without_their_link_info_are_refused(tmp_path) -> None:
    """libhdf5 reads a group's link messages only under a link info message: without it, the
    walk refuses the group rather than answer what libhdf5 would not."""
    from parallelvars.checkpoint.h5raw import header as hdr

    def drop_info(raw: bytearray, addr: int) -> None:
        end, p = _group_chunk(raw, addr)
        flags = raw[addr + 5]
        pos = p + (1 << (flags & 0x03))
        mhead = 6 if flags & 0x04 else 4
        while pos + mhead <= end:
            mtype, msize = raw[pos], int.from_bytes(raw[pos + 1 : pos + 3], "little")
            if mtype == hdr.LINK_INFO:
                raw[pos] = 0  # a NIL message in its place
                return
            pos += mhead + msize
        raise AssertionError("no link info message")

    path, wanted = _twin(tmp_path, drop_info)
    with pytest.raises(Refused, match="its links"):
        _walk(path, wanted)


def test_a_first_chunk_size_past_the_file_is_refused(tmp_path) -> None:
    """A group header whose first chunk claims more bytes than the file holds is refused (our
    error, not a read past the end or a numpy error)."""
    raw, addr = _group_bytes(tmp_path, "v")
    flags = raw[addr + 5]
    p = addr + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
    width = 1 << (flags & 0x03)
    raw[p : p + width] = b"\xff" * width  # the largest size the field holds
    out = str(tmp_path / "huge.h5")
    with open(out, "wb") as fh:
        fh.write(raw)
    with pytest.raises(Refused):
        _walk(out, {f"m/g/v{k}/primary".encode() for k in range(3)})


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_groups_walked_a_few_at_a_time_give_the_same_answers(tmp_path, monkeypatch, batch):
    from parallelvars.checkpoint.h5raw import links

    path = write_native(str(tmp_path / "g.h5"), _records(14), object_graph={"version": 1})
    wanted = _wanted(path)
    parents, counts = _members_of(path)
    whole, members = _walk(path, wanted), _members(path, parents, counts)
    assert whole == wanted & _libhdf5_hard_names(path) and len(members) == 28
    monkeypatch.setattr(links, "_BATCH", batch)
    assert _walk(path, wanted) == whole
    assert _members(path, parents, counts) == members
