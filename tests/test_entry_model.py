"""The core's saved-entry model: one Entry type, one shard geometry, one rule table.

Every saved variable (live save records, the HDF5 reader's variables, format entries) is a
``parallelvars.checkpoint.entry.Entry``; shard sizes and offsets are ``numpy.array_split``'s;
the logical value and what M devices receive come from one table, which restore, reshard,
``Entry.value()``, convert and the CLI consult. An on-read variable with aggregation ``none``
has no single value anywhere (it was summed by restore and ``logical_value`` before, refused by
reshard, an error on a live variable).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parallelvars as pv
from parallelvars import _geometry
from parallelvars._aggregate import (
    RESTORE_RULES,
    has_logical_value,
    logical_value,
    rule_for,
    spread_plan,
)
from parallelvars.checkpoint import H5Reader, SaveRecord, StoredVariable
from parallelvars.checkpoint.entry import (
    KINDS,
    CountingEntry,
    Entry,
    check_entry,
    layout_problem,
)
from parallelvars.cli import main
from parallelvars.errors import CorruptCheckpointError, DeviceCountError, InvalidEntryError
from parallelvars.formats import (
    ArrayEntry,
    DictView,
    convert,
    open_checkpoint,
    reshard,
    write_checkpoint,
)
from parallelvars.formats import Entry as FormatsEntry

# ---------------------------------------------------------------- geometry


@given(st.integers(0, 200), st.integers(1, 17))
def test_shard_sizes_and_offsets_are_numpy_array_split(length: int, n: int) -> None:
    parts = np.array_split(np.arange(length), n)
    assert _geometry.shard_sizes(length, n) == [len(p) for p in parts]
    offsets = _geometry.shard_offsets(length, n)
    assert offsets == [sum(len(q) for q in parts[:i]) for i in range(n)]
    assert _geometry.offsets_problem(offsets, length, n) is None
    value = np.arange(length * 2).reshape(length, 2)
    pieces = [value[s] for s in _geometry.shard_slices(value.shape, 0, offsets)]
    assert [p.shape for p in pieces] == _geometry.shard_shapes(value.shape, 0, offsets)
    np.testing.assert_array_equal(np.concatenate(pieces), value)


@given(
    st.integers(0, 60),
    st.lists(st.integers(0, 60), min_size=1, max_size=6),
    st.integers(0, 60),
    st.integers(0, 60),
)
def test_overlapping_shards_cover_exactly_the_rows_asked(
    length: int, cuts: list[int], lo: int, hi: int
) -> None:
    offsets = sorted({0, *(min(c, length) for c in cuts)})
    lo, hi = sorted((min(lo, length), min(hi, length)))
    rows = [
        r for _, a, b in _geometry.overlapping_shards(offsets, length, lo, hi) for r in range(a, b)
    ]
    assert rows == list(range(lo, hi))


def test_offsets_problem_names_what_is_expected() -> None:
    assert _geometry.offsets_problem([0, 5], 4, 2) is not None  # past the end
    assert _geometry.offsets_problem([1, 2], 4, 2) is not None  # a gap at the start
    assert _geometry.offsets_problem([0, 3, 2], 4, 3) is not None  # overlap
    assert _geometry.offsets_problem([0], 4, 2) == "2 offsets, one per shard"
    assert _geometry.offsets_problem([0, 4], 4, 2) is None  # an empty last shard is allowed


def test_the_sharded_variable_and_batches_use_the_same_split() -> None:
    s = pv.MirroredStrategy(4)
    with s.scope():
        v = pv.Variable(np.zeros((10, 2)), shard_axis=0)
    assert list(v.shard_offsets) == _geometry.shard_offsets(10, 4)
    assert list(v.shard_sizes) == _geometry.shard_sizes(10, 4)
    parts = pv.strategy.split_batch(np.arange(10), 4)
    assert [len(p) for p in parts.values] == _geometry.shard_sizes(10, 4)


# ---------------------------------------------------------------- one Entry type


def test_every_saved_variable_is_one_entry_type(tmp_path: pathlib.Path) -> None:
    assert FormatsEntry is Entry
    assert issubclass(SaveRecord, Entry) and issubclass(StoredVariable, Entry)
    record = SaveRecord(kind="single", components=[np.ones(3)], shape=(3,))
    assert record.num_components == 1 and record.dtype == np.float64
    np.testing.assert_array_equal(record.value(), np.ones(3))
    path = write_checkpoint(tmp_path / "a.h5", {"w": ArrayEntry("w", [np.arange(3.0)])})
    with H5Reader(path) as reader:
        assert isinstance(reader["w"], Entry)
    with open_checkpoint(path) as view:
        assert all(isinstance(e, Entry) for e in view.values())


def test_counting_entry_reports_every_byte_read() -> None:
    seen: list[int] = []
    e = ArrayEntry("m", [np.ones(4, np.float32), np.ones(4, np.float32)], kind="mirrored")
    counted = CountingEntry(e, seen.append)
    assert (counted.kind, counted.num_components, counted.shape) == ("mirrored", 2, (4,))
    counted.component(0)
    counted.read_component_into(1, np.empty(4, np.float32))
    counted.value()
    assert seen == [16, 16, 16]


# ---------------------------------------------------------------- one validation


def test_one_validation_one_wording_for_reader_and_writers(tmp_path: pathlib.Path) -> None:
    bad = ArrayEntry(
        "s",
        [np.zeros(2), np.zeros(2)],
        kind="sharded",
        shape=(4,),
        attrs={"shard_axis": 0, "shard_offsets": [0, 5]},
    )
    what, expected, found = layout_problem(bad.kind, bad.shape, 2, bad.attrs) or ("", "", "")
    assert what == "shard_offsets do not cover the shard axis exactly" and found == [0, 5]
    with pytest.raises(InvalidEntryError) as writer_error:
        write_checkpoint(tmp_path / "w.h5", {"s": bad})
    with pytest.raises(CorruptCheckpointError) as reader_error:
        check_entry(bad, "f.h5", error=CorruptCheckpointError)
    for err in (writer_error.value, reader_error.value):
        assert err.what == what and err.expected == expected and err.found == found
        assert err.variable == "s"
    assert not (tmp_path / "w.h5").exists()
    assert layout_problem("single", (2,), 1, {"aggregation": "total"}) == (
        "unknown aggregation",
        "one of none, sum, mean, only_first_replica",
        "'total'",
    )
    assert layout_problem("mirrored", (2,), 2, {"devices": ["cpu:0"]}) is not None
    assert layout_problem("scattered", (2,), 1, {})[0] == "unknown variable kind"  # type: ignore[index]


# ---------------------------------------------------------------- the rule table


def test_the_rule_table_covers_every_documented_kind() -> None:
    assert {kind for kind, _ in RESTORE_RULES} == set(KINDS)
    assert {agg for kind, agg in RESTORE_RULES if kind == "on_read"} == {
        a.value for a in pv.Aggregation
    }
    assert rule_for("on_read", {}).aggregation == "sum"  # no attribute: saved totals
    assert rule_for("on_read", {"aggregation": "none"}).value is None
    assert rule_for("independent", {}).spread is None


def _none_entry(n: int = 2) -> ArrayEntry:
    comps = [np.full(2, float(i + 1)) for i in range(n)]
    return ArrayEntry("v", comps, kind="on_read", attrs={"aggregation": "none"})


def test_on_read_none_has_no_logical_value() -> None:
    e = _none_entry()
    assert not has_logical_value(e)
    with pytest.raises(InvalidEntryError, match="aggregation 'none' and no single logical value"):
        logical_value(e)
    with pytest.raises(InvalidEntryError, match="'v'"):
        e.value()
    one = _none_entry(1)  # one component: that component is the value
    np.testing.assert_array_equal(one.value(), [1.0, 1.0])


def test_on_read_none_reshard_keeps_it_only_on_as_many_devices() -> None:
    view = DictView([_none_entry()], path="/data/ckpt.npz")
    assert reshard(view, 2)["v"] is view["v"]
    for m in (1, 3):
        with pytest.raises(DeviceCountError, match="'v'"):
            reshard(view, m)


def test_on_read_none_restore_goes_component_by_component_or_not_at_all(
    tmp_path: pathlib.Path,
) -> None:
    path = write_checkpoint(tmp_path / "a.h5", {"v": _none_entry()})
    with pv.MirroredStrategy(2).scope():
        summed = pv.Variable(np.zeros(2), synchronization="on_read", aggregation="sum")
        table = pv.Variable(np.zeros(2), shard_axis=0)
    plain = pv.Variable(np.zeros(2))
    for live in (summed, table, plain):  # was: the sum 3.0 restored
        with pytest.raises(DeviceCountError, match=r"a\.h5.*'v'.*no single logical value"):
            pv.Checkpoint(v=live).restore(path)
        assert all(not c.any() for c in live.components)
    with pv.independent_buffers(2):
        ind = pv.Variable(np.zeros(2))
    pv.Checkpoint(v=ind).restore(path).assert_consumed()  # its missing save counter is not counted
    assert [c.tolist() for c in ind.components] == [[1.0, 1.0], [2.0, 2.0]]
    with H5Reader(path) as reader, pytest.raises(InvalidEntryError, match="'v'"):
        reader["v"].value()


def test_on_read_none_convert_and_cli_refuse_one_value(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_checkpoint(tmp_path / "a.h5", {"v": _none_entry()})
    with pytest.raises(InvalidEntryError, match=r"'v'.*aggregation 'none'"):
        convert(path, tmp_path / "p.safetensors", components="primary")
    assert not (tmp_path / "p.safetensors").exists()
    assert main(["extract", path, "v", "-o", str(tmp_path / "v.npy")]) == 2
    err = capsys.readouterr().err
    assert "2 on-read components with aggregation 'none' and no single value" in err
    assert main(["extract", path, "v", "--component", "1", "-o", str(tmp_path / "v.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "v.npy"), [2.0, 2.0])
    capsys.readouterr()
    other = write_checkpoint(tmp_path / "b.h5", {"v": _none_entry(3)})
    assert main(["diff", path, other, "--json"]) == 1  # not summed and compared: not comparable
    assert "aggregation 'none'" in capsys.readouterr().out
    assert main(["reshard", path, str(tmp_path / "r.h5"), "--devices", "3"]) == 2
    assert "'v'" in capsys.readouterr().err and not (tmp_path / "r.h5").exists()


def test_spread_plan_is_the_one_decision_of_restore_and_reshard() -> None:
    mirrored = ArrayEntry("m", [np.ones(2)] * 2, kind="mirrored")
    total = ArrayEntry("t", [np.ones(2)] * 2, kind="on_read", attrs={"aggregation": "sum"})
    sharded = ArrayEntry(
        "s",
        [np.ones(2)] * 2,
        kind="sharded",
        shape=(4,),
        attrs={"shard_axis": 0, "shard_offsets": [0, 2]},
    )
    assert spread_plan(mirrored, "mirrored", None, 2, file=None).how == "componentwise"
    assert spread_plan(mirrored, "mirrored", None, 3, file=None).how == "all"
    assert spread_plan(mirrored, "on_read", "sum", 3, file=None).how == "first"
    assert spread_plan(total, "on_read", "sum", 2, file=None).how == "componentwise"
    assert spread_plan(total, "on_read", "mean", 2, file=None).how == "all"
    assert spread_plan(sharded, "sharded", None, 3, file=None).how == "resplit"
    with pytest.raises(DeviceCountError):
        spread_plan(
            ArrayEntry("i", [np.ones(2)] * 2, kind="independent"), "mirrored", None, 3, file=None
        )
