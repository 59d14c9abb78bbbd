"""The walk of the groups on the way to the components (``h5raw/links.py``) gives the answer
and the refusal its earlier, link-at-a-time form gave (``links_reference.py``), over generated
structures and over hostile files: a soft link, an external link, a group reached twice, a
cycle, a damaged or truncated header, a name listed twice, in levels of few groups and of many
(whose headers are hashed as rows of one length)."""

from __future__ import annotations

import os

import h5py
import links_reference
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from test_h5raw import both, structures

from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.checkpoint.h5raw.links import hard_names
from parallelvars.checkpoint.h5raw.native import write_native
from parallelvars.checkpoint.h5raw.source import FileSource, Refused, WindowSource
from parallelvars.checkpoint.registry import SaveRecord, component_name
from parallelvars.testing import lookup3

_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}


def _wanted(path: str) -> set[bytes]:
    """Every component's name, and two that are not there."""
    with H5Reader(path) as r:
        return {
            f"{name}/{component_name(i)}".encode()
            for name in r
            for i in range(r[name].num_components)
        } | {b"nothing/here", f"{next(iter(r), 'x')}/missing".encode()}


def _outcome(walk, path: str, wanted: set[bytes], parents: list[bytes] | None, window: bool):
    """The walk's answer, or its refusal's message."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        source = WindowSource(fd, size) if window else FileSource(fd, size)
        try:
            return walk(source, wanted, parents=parents)
        except Refused as exc:
            return f"refused: {exc}"
    finally:
        os.close(fd)


def _same(path: str, wanted: set[bytes], parents: list[bytes] | None = None) -> object:
    """Both walks' outcome (asserted equal), through either source."""
    got = None
    for window in (True, False):
        new = _outcome(hard_names, path, wanted, parents, window)
        old = _outcome(links_reference.hard_names, path, wanted, parents, window)
        assert new == old
        got = new
    return got


def _parents(path: str) -> list[bytes]:
    with H5Reader(path) as r:
        return [name.encode() for name in r]


@settings(max_examples=8, **_SETTINGS)
@given(records=structures())
def test_the_walk_answers_as_before_on_generated_structures(tmp_path_factory, records) -> None:
    tmp = tmp_path_factory.mktemp("reference")
    for path in both(tmp, records):  # the libhdf5 writer's file and the generator's
        wanted = _wanted(path)
        _same(path, wanted)
        _same(path, wanted, _parents(path))


def _records(n: int, groups: int = 3) -> list[SaveRecord]:
    return [
        SaveRecord(
            "mirrored",
            [np.arange(4, dtype=np.float32) + k] * 2,
            (4,),
            {"devices": ["a", "b"]},
            path=f"m/g{k % groups}/v{k}",
        )
        for k in range(n)
    ]


def _all_wanted(n: int, groups: int = 3) -> set[bytes]:
    return {
        f"m/g{k % groups}/v{k}/{component_name(i)}".encode() for k in range(n) for i in range(2)
    }


def _soft(f: h5py.File) -> None:
    del f["m/g0/v0/parallel_component_1"]
    f["m/g0/v0/parallel_component_1"] = h5py.SoftLink("/m/g0/v0/primary")


def _external(f: h5py.File) -> None:
    del f["m/g1/v1/parallel_component_1"]
    f["m/g1/v1/parallel_component_1"] = h5py.ExternalLink("other.h5", "/x")


def _twice(f: h5py.File) -> None:
    f["m/g2/again"] = f["m/g1"]


def _cycle(f: h5py.File) -> None:
    f["m/g0/v3/up"] = f["m"]  # (a group's link back to an ancestor)


def _soft_group(f: h5py.File) -> None:
    f["m/gs"] = h5py.SoftLink("/m/g0")


@pytest.mark.parametrize("n", [9, 200], ids=["few", "many"])
@pytest.mark.parametrize(
    "edit", [_soft, _external, _twice, _cycle, _soft_group], ids=lambda e: e.__name__.strip("_")
)
def test_links_that_are_not_hard_and_groups_met_again_answer_as_before(tmp_path, n, edit) -> None:
    path = write_native(str(tmp_path / "g.h5"), _records(n), object_graph={"version": 1})
    with h5py.File(path, "a", libver="latest") as f:
        edit(f)
    extra = {
        b"m/g2/again/v4/primary",
        b"m/g0/v3/up/g0/v0/primary",
        b"m/gs/v0/primary",
        b"nothing/here",
    }
    wanted = _all_wanted(n) | extra
    got = _same(path, wanted)
    if n < 10:  # (a large group that h5py edits turns to dense storage: refused by both)
        assert isinstance(got, set) and got <= wanted and not got & extra
    _same(path, wanted, sorted({w.rpartition(b"/")[0] for w in wanted}))


def _header(path: str, name: str) -> int:
    with h5py.File(path, "r") as f:
        return h5py.h5o.get_info(f[name].id).addr


@pytest.mark.parametrize("n", [9, 200], ids=["few", "many"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "oversize"])
def test_a_damaged_or_truncated_group_header_is_refused_as_before(tmp_path, n, damage) -> None:
    path = write_native(str(tmp_path / "g.h5"), _records(n), object_graph={"version": 1})
    addr = _header(path, "m/g1/v1")
    with open(path, "rb") as fh:
        raw = bytearray(fh.read())
    if damage == "flip":
        raw[addr + 12] ^= 0x40
    elif damage == "truncate":
        del raw[addr + 40 :]
    else:  # the first chunk's size: past the file
        flags = raw[addr + 5]
        p = addr + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
        raw[p : p + (1 << (flags & 0x03))] = b"\xff" * (1 << (flags & 0x03))
    out = str(tmp_path / "d.h5")
    with open(out, "wb") as fh:
        fh.write(raw)
    got = _same(out, _all_wanted(n))
    assert isinstance(got, str) and got.startswith("refused")


@pytest.mark.parametrize("new", [b"qqqqq0", b"qq/qq1", b"qq\x00qq1"], ids=["twice", "slash", "nul"])
def test_names_libhdf5_would_read_otherwise_are_refused_as_before(tmp_path, new) -> None:
    """A group's header with a link renamed (its checksum mended, so only the name differs)."""
    records = [
        SaveRecord("single", [np.arange(4, dtype=np.float32)], (4,), {}, path=f"m/g/qqqqq{k}")
        for k in range(3)
    ]
    path = write_native(str(tmp_path / "g.h5"), records, object_graph={"version": 1})
    addr = _header(path, "m/g")
    with open(path, "rb") as fh:
        raw = bytearray(fh.read())
    flags = raw[addr + 5]
    p = addr + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
    width = 1 << (flags & 0x03)
    end = p + width + int.from_bytes(raw[p : p + width], "little")
    at = raw.find(b"qqqqq1", p, end)
    assert at > 0
    raw[at : at + 6] = new
    raw[end : end + 4] = lookup3(bytes(raw[addr:end])).to_bytes(4, "little")
    out = str(tmp_path / "edited.h5")
    with open(out, "wb") as fh:
        fh.write(raw)
    got = _same(out, {f"m/g/qqqqq{k}/primary".encode() for k in range(3)})
    assert isinstance(got, str) and got.startswith("refused")


def test_many_groups_of_one_header_length_answer_as_before(tmp_path) -> None:
    """Levels of many groups (one header length: hashed as rows), their whole answer."""
    path = write_native(str(tmp_path / "g.h5"), _records(300, 7), object_graph={"version": 1})
    wanted = _all_wanted(300, 7) | {b"m/g1/v2/primary"}
    got = _same(path, wanted, _parents(path))
    assert got == _all_wanted(300, 7)
