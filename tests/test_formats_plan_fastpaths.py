"""The flat-key writers' fast paths against the general code they stand for: the header text
of a safetensors file against ``json.dumps``, the planned keys against ``to_key`` and the info
document's attributes against ``jsonable``; and a source entry's attributes left as they were."""

from __future__ import annotations

import copy
import gc
import json
import math
import struct
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from parallelvars.errors import InvalidEntryError
from parallelvars.formats import ArrayEntry, DictView, open_checkpoint, to_key, write_checkpoint
from parallelvars.formats.safetensors import write_safetensors
from parallelvars.formats.testing import jsonable

_SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _header(path) -> bytes:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n]


def _info(path) -> dict:
    meta = json.loads(_header(path))["__metadata__"]
    (doc,) = [json.loads(v) for k, v in meta.items() if v.startswith("{")]
    return doc


# --- item: the header is json.dumps of itself ----------------------------------------------------

_TEXT = st.text(
    alphabet=st.sampled_from(
        list('ab/.\\"\x00\x01\x08\t\n\x0c\r\x1f\x7f é€\u2028😀') + ["\ud800"][:0]
    ),
    min_size=1,
    max_size=12,
).filter(lambda s: s.strip("/") == s and "//" not in s and s != "__metadata__")

_DTYPES = [np.float32, np.float16, np.int8, np.int64, np.bool_, np.uint16]


@_SETTINGS
@given(
    st.dictionaries(_TEXT, st.sampled_from(_DTYPES), min_size=1, max_size=5),
    st.sampled_from(["slash", "dotted"]),
)
def test_header_is_the_json_dumps_of_itself(tmp_path, variables, names) -> None:
    views = DictView(
        {p: ArrayEntry(p, [np.zeros((2, 1), dtype)] * 2) for p, dtype in variables.items()}
    )
    path = tmp_path / "h.safetensors"
    try:
        write_safetensors(path, views, names=names)
    except ValueError:  # a path the key style cannot hold (two paths, one key)
        return
    header = _header(path)
    text = header.rstrip(b" ")
    want = json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
    assert text == want.encode("utf-8")
    assert header == text + b" " * (-(8 + len(text)) % 8)


# --- item: the planned keys are to_key's ---------------------------------------------------------


def _keys(path) -> set[str]:
    return {k for k in json.loads(_header(path)) if k != "__metadata__"}


_PATHS = ["", "a", "a/b", "a//b", "/a", "a/", "/a/b/", "x/y.z/w", "//"]


@pytest.mark.parametrize("names", ["slash", "dotted"])
@pytest.mark.parametrize("count", [1, 2, 63, 64, 65])
@pytest.mark.parametrize("path", _PATHS)
def test_planned_keys_are_to_key_for_each_component(tmp_path, names, count, path) -> None:
    entry = ArrayEntry(path, [np.arange(2, dtype=np.float32) + i for i in range(count)])
    out = tmp_path / "k.safetensors"
    try:
        write_safetensors(out, DictView({path: entry}), names=names)
    except ValueError as e:  # refused by the key style: the general code refuses it too
        with pytest.raises(type(e)):
            [to_key(path, names, component=i) for i in range(count)]
        return
    want = {to_key(path, names, component=i) for i in range(count)}
    assert _keys(out) == want


@pytest.mark.parametrize("names", ["slash", "dotted"])
@pytest.mark.parametrize("path", _PATHS)
def test_planned_key_of_a_sharded_entry_is_to_key(tmp_path, names, path) -> None:
    parts = [np.arange(2, dtype=np.float32), np.arange(2, 5, dtype=np.float32)]
    entry = ArrayEntry(
        path, parts, kind="sharded", shape=(5,), attrs={"shard_axis": 0, "shard_offsets": [0, 2]}
    )
    out = tmp_path / "s.safetensors"
    try:
        write_safetensors(out, DictView({path: entry}), names=names)
    except ValueError as e:
        with pytest.raises(type(e)):
            to_key(path, names, component=0)
        return
    assert _keys(out) == {to_key(path, names, component=0)}


# --- item: the info document's attributes are jsonable's ----------------------------------------

_ATTRS = [
    {"n": np.int64(3), "f": np.float32(0.5)},
    {"t": (1, 2, (3, "x"))},
    {"nan": float("nan"), "inf": float("inf")},
    {"d": {"a": {"b": [1, np.int32(2)]}}},
    {1: "one", "two": 2},
    {"plain": "x", "list": [1, "a", None, True]},
]


@pytest.mark.parametrize("attrs", _ATTRS, ids=range(len(_ATTRS)))
@pytest.mark.parametrize("shards", [None, 8])
def test_info_attributes_are_jsonable_of_the_entrys(tmp_path, attrs, shards) -> None:
    views = DictView(
        {
            "v": ArrayEntry("v", [np.ones(4, np.float32)] * 2, attrs=attrs),
            "w": ArrayEntry("w", [np.ones(4, np.float32)] * 2),
        }
    )
    out = write_safetensors(tmp_path / "model.safetensors", views, max_shard_size=shards)
    with open_checkpoint(out) as view:
        got = dict(view["v"].attrs)
    want = json.loads(json.dumps(jsonable(attrs)))
    assert _same(got, want)


_GRAPH_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=4)
    | st.sampled_from([np.int64(3), np.float32(0.5), b"x\xff"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=3) | st.integers(0, 3), inner, max_size=3)
    ),
    max_leaves=12,
)


@given(extra=_GRAPH_VALUES)
@example(extra=[1.5, float("nan")])
@example(extra={"k": float("-inf")})
@example(extra=[[1, "a"], (2, "b")])
@example(extra={"k": [np.int64(3)]})
@_SETTINGS
def test_info_object_graph_is_jsonable_of_the_sources(tmp_path, extra) -> None:
    # The carried graph goes into the info as jsonable makes it (shared where it already is
    # plain JSON, so a value jsonable would change must still be changed).
    graph = {"version": 1, "nodes": [{"path": None, "x": extra}, {"path": "v", "children": []}]}
    view = DictView({"v": ArrayEntry("v", [np.ones(2, np.float32)] * 2)})
    view.object_graph = graph  # type: ignore[attr-defined]
    write_safetensors(tmp_path / "g.safetensors", view)
    got = _info(tmp_path / "g.safetensors")["object_graph"]
    assert _same(got, json.loads(json.dumps(jsonable(graph))))


@pytest.mark.parametrize("fmt", ["safetensors", "npz", "hdf5"])
def test_an_object_graph_that_holds_itself_is_refused(tmp_path, fmt) -> None:
    # (the check of whether the graph is plain JSON went round the cycle for ever; the HDF5
    # writer raised json's bare ValueError)
    node: dict = {"path": "v", "children": []}
    node["children"].append(node)
    view = DictView({"v": ArrayEntry("v", [np.ones(2, np.float32)] * 2)})
    view.object_graph = {"version": 1, "nodes": [node]}  # type: ignore[attr-defined]
    out = tmp_path / f"g.{fmt}"
    with pytest.raises(InvalidEntryError, match="object graph cannot be written as JSON") as e:
        write_checkpoint(out, view, format=fmt)
    assert e.value.file == str(out) and e.value.variable == "object_graph"
    assert not out.exists()


def test_an_object_graph_shared_in_two_places_is_written() -> None:
    from parallelvars.formats.testing import check_writable_graph

    shared = {"path": "v", "children": []}
    check_writable_graph({"nodes": [shared, shared, [shared]]}, "f")  # (a DAG: fine)
    loop: list = []
    loop.append({"x": (1, loop)})
    with pytest.raises(InvalidEntryError, match="holds itself"):
        check_writable_graph({"nodes": loop}, "f")


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# --- item: the source's attributes are left as they were ----------------------------------------


@pytest.mark.parametrize(
    ("fmt", "shards"), [("safetensors", None), ("safetensors", 8), ("npz", None)]
)
def test_source_attributes_are_unchanged_by_a_write(tmp_path, fmt, shards) -> None:
    attrs = {"aggregation": "sum", "note": "x", "list": [1, 2], "slot_name": "m"}
    kept = copy.deepcopy(attrs)
    entry = ArrayEntry("v", [np.ones(4, np.float32)] * 2, kind="on_read", attrs=attrs)
    views = DictView({"v": entry, "w": ArrayEntry("w", [np.ones(4, np.float32)] * 2)})
    kwargs = {"max_shard_size": shards} if shards is not None else {}
    write_checkpoint(tmp_path / f"model.{fmt}", views, format=fmt, **kwargs)
    assert entry.attrs == kept
    assert attrs == kept
    assert type(attrs["list"]) is list and attrs["list"] == [1, 2]


# --- item: a plan holds no entry of a source that makes them when asked -----------------------


class _Counted(ArrayEntry):
    """An entry that notes how many of its kind are alive whenever one is read."""

    live: ClassVar[weakref.WeakSet[ArrayEntry]] = weakref.WeakSet()
    most = 0

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        _Counted.most = max(_Counted.most, len(_Counted.live))
        super().read_component_into(i, out)


class _MadeWhenAsked(Mapping[str, ArrayEntry]):
    """A source whose entries are made each time one is asked for (as a conversion's are)."""

    makes_entries = True
    metadata: ClassVar[dict[str, str]] = {}

    def __init__(self, n: int) -> None:
        self._paths = [f"model/w{i}" for i in range(n)]

    def __getitem__(self, key: str) -> ArrayEntry:
        k = self._paths.index(key)
        value = np.arange(4, dtype=np.float32) + k
        entry = _Counted(key, [value, value], kind="mirrored")
        _Counted.live.add(entry)
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


def _assert_same_files(tmp_path: Any, suffix: str, name: str, kind: str | None = None) -> None:
    """The file ``name`` + ``suffix`` holds what ``held`` + ``suffix`` holds (a safetensors
    file byte for byte), each variable of ``kind`` when given."""
    a, b = (
        open_checkpoint(str(tmp_path / f"held{suffix}")),
        open_checkpoint(str(tmp_path / f"{name}{suffix}")),
    )
    with a, b:
        assert list(a) == list(b)
        for k in a:
            if kind is not None:
                assert a[k].kind == b[k].kind == kind
            np.testing.assert_array_equal(a[k].component(1), b[k].component(1))
    if suffix == ".safetensors":
        held = (tmp_path / "held.safetensors").read_bytes()
        assert held == (tmp_path / f"{name}.safetensors").read_bytes()


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_plan_lets_go_of_entries_made_when_asked(tmp_path, monkeypatch, suffix):
    # Runs of at most 64 bytes: 4 tensors of 16 bytes, so at most 4 variables' entries are
    # alive while one is read (the plan holds none between runs); the file is the one the
    # same entries held in a dict give.
    monkeypatch.setattr("parallelvars._spans.BULK_BYTES", 64)
    source = _MadeWhenAsked(30)
    held = {k: source[k] for k in source}
    write_checkpoint(str(tmp_path / f"held{suffix}"), held)
    del held
    gc.collect()
    _Counted.most = 0
    write_checkpoint(str(tmp_path / f"asked{suffix}"), source)
    assert 0 < _Counted.most <= 4
    _assert_same_files(tmp_path, suffix, "asked", kind="mirrored")


def test_a_record_dtype_is_refused_naming_the_file_and_the_variable(tmp_path) -> None:
    # (tensor_dtype_name names them itself: the plan no longer re-raises its error)
    from parallelvars.errors import UnsupportedDtypeError

    view = DictView({"w": ArrayEntry("w", [np.zeros(2, dtype=[("a", "<f4")])])})
    out = tmp_path / "r.safetensors"
    with pytest.raises(UnsupportedDtypeError) as info:
        write_safetensors(out, view)
    assert info.value.file == str(out) and info.value.variable == "w"
    assert "not a tensor dtype" in str(info.value) and "found [('a', '<f4')]" in str(info.value)
    assert not out.exists()


# --- item: a run's variables read in bulk by a source that offers it, not made again ----------


class _Bulk(_MadeWhenAsked):
    """A source made when asked that also reads a list of variables' components in bulk (as
    a conversion of a native file does): None for ``refused`` (read the general way)."""

    def __init__(self, n: int, refused: str) -> None:
        super().__init__(n)
        self.refused = refused
        self.asked: list[str] = []
        self.bulk_asked: list[str] = []

    def __getitem__(self, key: str) -> ArrayEntry:
        self.asked.append(key)
        return super().__getitem__(key)

    def bulk_components(self, paths: list[str]) -> Iterator[tuple[str, list | None]]:
        for path in paths:
            self.bulk_asked.append(path)
            if path == self.refused:
                yield path, None
            else:
                value = np.arange(4, dtype=np.float32) + self._paths.index(path)
                value.flags.writeable = False
                yield path, [value, value]


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_a_runs_whole_variables_are_read_in_bulk_not_made_again(tmp_path, monkeypatch, suffix):
    # Runs of 48 bytes: 3 tensors of 16, so every other variable's two components fall in two
    # runs (its entry is asked for again in each: bulk reads whole variables only, so a run
    # never holds more than its own bytes); the others are read in bulk, their entries made once
    # (by the plan). The refused one is read through its entry. The file is the held one's.
    monkeypatch.setattr("parallelvars._spans.BULK_BYTES", 48)
    n = 12
    source = _Bulk(n, refused="model/w3")
    write_checkpoint(str(tmp_path / f"held{suffix}"), {k: source[k] for k in source})
    source.asked.clear()
    write_checkpoint(str(tmp_path / f"bulk{suffix}"), source)
    once = {k for k in source if source.asked.count(k) == 1}
    again = {k for k in source if source.asked.count(k) > 1}
    assert once | again == set(source) and "model/w3" in again
    assert len(again) >= 4  # (24 tensors in runs of 3: 4 variables split; and the refused)
    assert set(source.bulk_asked) & again == {"model/w3"}
    assert set(source.bulk_asked) >= once
    _assert_same_files(tmp_path, suffix, "bulk")
