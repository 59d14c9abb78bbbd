"""reshard: every rule of DESIGN.md's restore table, lazily."""

from __future__ import annotations

import numpy as np
import pytest
from formats_testlib import entries, same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelvars.checkpoint.entry import MAX_COMPONENTS
from parallelvars.errors import DeviceCountError, InvalidArgumentError
from parallelvars.formats import ArrayEntry, DictView, Entry, logical_value, reshard, split_offsets


def _comps(entry: Entry) -> list[np.ndarray]:
    return [entry.component(i) for i in range(entry.num_components)]


def _view(*items: ArrayEntry) -> DictView:
    return DictView(list(items), format="npz", path="/data/ckpt.npz", metadata={"k": "v"})


def test_mirrored_gets_primary_everywhere() -> None:
    w = np.arange(6.0).reshape(2, 3)
    v = _view(ArrayEntry("w", [w, w + 100], kind="mirrored", attrs={"devices": ["gpu:0", "gpu:1"]}))
    r = reshard(v, 3)["w"]
    assert r.kind == "mirrored" and r.num_components == 3
    assert all(same_bits(c, w) for c in _comps(r))
    assert r.attrs["devices"] == ["cpu:0", "cpu:1", "cpu:2"]


@pytest.mark.parametrize("m", [1, 3, 5])
def test_on_read_sum_preserves_the_total_exactly(m: int) -> None:
    parts = [np.array([1.5, -2.0], np.float32), np.array([0.25, 4.0], np.float32)]
    e = ArrayEntry("n", parts, kind="on_read", attrs={"aggregation": "sum"})
    r = reshard(_view(e), m)["n"]
    comps = _comps(r)
    assert same_bits(comps[0], parts[0] + parts[1])
    assert all(not c.any() for c in comps[1:])
    assert same_bits(logical_value(r), logical_value(e))


def test_on_read_sum_integers() -> None:
    e = ArrayEntry(
        "c",
        [np.array(3, np.int64), np.array(4, np.int64), np.array(5, np.int64)],
        kind="on_read",
        attrs={"aggregation": "sum"},
    )
    r = reshard(_view(e), 2)["c"]
    assert [int(c) for c in _comps(r)] == [12, 0]


def test_on_read_mean_and_only_first() -> None:
    a, b = np.array([1.0, 3.0]), np.array([3.0, 5.0])
    mean = reshard(
        _view(ArrayEntry("m", [a, b], kind="on_read", attrs={"aggregation": "mean"})), 3
    )["m"]
    assert all(same_bits(c, np.array([2.0, 4.0])) for c in _comps(mean))
    first = reshard(
        _view(ArrayEntry("f", [a, b], kind="on_read", attrs={"aggregation": "only_first_replica"})),
        4,
    )["f"]
    assert first.num_components == 4 and all(same_bits(c, a) for c in _comps(first))


def test_independent_requires_same_count() -> None:
    e = ArrayEntry("model/buf", [np.zeros(2), np.ones(2)], kind="independent")
    same = reshard(_view(e), 2)["model/buf"]
    assert all(same_bits(x, y) for x, y in zip(_comps(same), _comps(e), strict=True))
    with pytest.raises(DeviceCountError) as err:
        reshard(_view(e), 3)
    msg = str(err.value)
    assert (
        "'model/buf'" in msg
        and "2 devices" in msg
        and "3 devices" in msg
        and "/data/ckpt.npz" in msg
    )


def test_on_read_without_aggregation_cannot_move() -> None:
    e = ArrayEntry("x", [np.zeros(2), np.ones(2)], kind="on_read", attrs={"aggregation": "none"})
    with pytest.raises(DeviceCountError, match="'x'"):
        reshard(_view(e), 1)


@pytest.mark.parametrize("order", ["absent_first", "null_only"])
def test_explicit_null_aggregation_is_refused_after_an_absent_one(order: str) -> None:
    # An absent aggregation means "sum" (totals), an explicit null means "none": the spread
    # decision is made once per aggregation, so the two must not share one decision.
    parts = [np.ones(2, np.float32)] * 2
    a = ArrayEntry("a", parts, kind="on_read", attrs={})
    b = ArrayEntry("b", parts, kind="on_read", attrs={"aggregation": None})
    entries = [a, b] if order == "absent_first" else [b]
    v = DictView(entries, format="npz", path="/data/agg.npz")
    with pytest.raises(DeviceCountError, match="'b'") as err:
        reshard(v, 3)
    assert err.value.file == "/data/agg.npz"
    assert [c.tolist() for c in _comps(reshard(DictView([a]), 3)["a"])] == [[2, 2], [0, 0], [0, 0]]


def test_sharded_resplit_uneven() -> None:
    full = np.arange(40).reshape(10, 4)
    e = ArrayEntry(
        "e",
        [full[:5], full[5:]],
        kind="sharded",
        shape=(10, 4),
        attrs={"shard_axis": 0, "shard_offsets": [0, 5]},
    )
    r = reshard(_view(e), 4)["e"]
    assert r.attrs["shard_offsets"] == [0, 3, 6, 8]
    assert [c.shape[0] for c in _comps(r)] == [3, 3, 2, 2]
    assert [c.shape[0] for c in np.array_split(full, 4)] == [3, 3, 2, 2]
    for got, want in zip(_comps(r), np.array_split(full, 4), strict=True):
        assert same_bits(got, want)
    assert same_bits(r.value(), full)


def test_sharded_resplit_other_axis_and_more_devices_than_rows() -> None:
    full = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
    e = ArrayEntry(
        "e",
        [full[:, :1], full[:, 1:]],
        kind="sharded",
        shape=(2, 3, 2),
        attrs={"shard_axis": 1, "shard_offsets": [0, 1]},
    )
    r = reshard(_view(e), 5)["e"]
    assert [c.shape[1] for c in _comps(r)] == [1, 1, 1, 0, 0]
    assert same_bits(np.concatenate(_comps(r), axis=1), full)


def test_single_stays_single_or_is_mirrored_on_request() -> None:
    e = ArrayEntry("s", [np.arange(3)])
    assert reshard(_view(e), 4)["s"] is e
    m = reshard(_view(e), 4, mirror_single=True)["s"]
    assert m.kind == "mirrored" and m.num_components == 4
    assert all(same_bits(c, np.arange(3)) for c in _comps(m))


def test_view_properties_are_kept_and_nothing_is_read_early() -> None:
    reads = []

    class Spy(ArrayEntry):
        def component(self, i: int) -> np.ndarray:
            reads.append(i)
            return super().component(i)

        def read_component_into(self, i: int, out: np.ndarray) -> None:
            reads.append(i)
            super().read_component_into(i, out)

    v = _view(Spy("w", [np.zeros(2)] * 2, kind="mirrored"))
    r = reshard(v, 8)
    assert (r.format, r.path, dict(r.metadata)) == ("npz", "/data/ckpt.npz", {"k": "v"})
    assert reads == []
    r["w"].component(7)
    assert reads == [0]


def test_bad_device_count() -> None:
    with pytest.raises(ValueError, match="positive"):
        reshard(_view(), 0)


@pytest.mark.parametrize("mirror_single", [False, True])
def test_more_devices_than_a_variable_can_have_components_is_refused(
    mirror_single: bool,
) -> None:
    # The rewritten entries are not checked again by the writers: M is bounded up front, so
    # no file is written that every reader refuses.
    v = _view(ArrayEntry("w", [np.ones(1, np.float32)] * 2, kind="mirrored"))
    assert reshard(v, MAX_COMPONENTS)["w"].num_components == MAX_COMPONENTS
    with pytest.raises(
        InvalidArgumentError, match=f"at most {MAX_COMPONENTS}.*{MAX_COMPONENTS + 1}"
    ):
        reshard(v, MAX_COMPONENTS + 1, mirror_single=mirror_single)
    with pytest.raises(InvalidArgumentError, match="at most"):
        reshard(_view(), np.int64(MAX_COMPONENTS + 1))


@given(length=st.integers(0, 50), parts=st.integers(1, 12))
def test_split_offsets_match_numpy(length: int, parts: int) -> None:
    sizes = [len(c) for c in np.array_split(np.arange(length), parts)]
    assert split_offsets(length, parts) == [sum(sizes[:i]) for i in range(parts)]


@settings(max_examples=40, deadline=None)
@given(view=entries(kinds=("single", "mirrored", "on_read", "sharded")), m=st.integers(1, 4))
def test_resharded_values_follow_the_table(view: DictView, m: int) -> None:
    for path, e in reshard(view, m).items():
        src = view[path]
        comps = _comps(e)
        if src.kind == "single" or m == src.num_components:
            assert all(same_bits(a, b) for a, b in zip(comps, _comps(src), strict=True)), path
            continue
        assert len(comps) == m
        agg = src.attrs.get("aggregation")
        if src.kind == "on_read" and agg == "sum":
            assert same_bits(comps[0], logical_value(src))
            assert all(not c.any() for c in comps[1:])
        elif src.kind == "on_read" and agg == "mean":
            assert all(same_bits(c, logical_value(src)) for c in comps)
        elif src.kind == "sharded":
            assert same_bits(logical_value(e), logical_value(src))
            axis = e.attrs["shard_axis"]
            want = np.array_split(logical_value(src), m, axis=axis)
            assert all(same_bits(a, b) for a, b in zip(comps, want, strict=True))
        else:  # mirrored, only_first_replica
            assert all(same_bits(c, src.component(0)) for c in comps)


class _Described(DictView):
    """Entries described by ``summary`` (as a file's index describes them)."""

    def summary(self, key: str) -> tuple:
        e = self[key]
        return (e.kind, e.dtype, tuple(e.shape), e.num_components, e.nbytes, e.attrs)


@settings(max_examples=40, deadline=None)
@given(
    view=entries(kinds=("single", "mirrored", "on_read", "sharded")),
    m=st.integers(1, 4),
    mirror_single=st.booleans(),
)
def test_a_resharded_variable_is_described_as_its_entry_is(
    view: DictView, m: int, mirror_single: bool
) -> None:
    # (what the HDF5 writer plans from, without making the rewritten entries)
    source = _Described(dict(view.items()))
    resharded = reshard(source, m, mirror_single=mirror_single)
    counts = set()
    for path in resharded:
        e = resharded[path]
        want = (e.kind, e.dtype, tuple(e.shape), e.num_components, e.nbytes, e.attrs)
        assert resharded.summary(path) == want, path
        counts.add(source[path].num_components)
    assert resharded.source_counts == sorted(counts)
    assert resharded.spread_count == sum(resharded[k].num_components > 1 for k in resharded)


def test_a_resharded_view_holds_no_entry() -> None:
    # Each entry is rewritten when asked for; the view keeps none of them.
    v = _view(ArrayEntry("w", [np.ones(3)] * 2, kind="mirrored"))
    r = reshard(v, 3)
    first = r["w"]
    assert r["w"] is not first
    assert not any(isinstance(x, Entry) for x in vars(r).values())
