"""The native HDF5 adapter (a wrapper over h5io): golden data through it, plain h5py as client."""

from __future__ import annotations

import pathlib
import sys
import weakref
from collections.abc import Mapping
from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pytest
from formats_testlib import KERAS, TORCH, assert_same_view, h5_structure, same_bits, torch_expected

from parallelvars.checkpoint.entry import ForwardingEntry
from parallelvars.checkpoint.graph import graph_from_paths
from parallelvars.errors import (
    CorruptCheckpointError,
    InvalidEntryError,
    NotACheckpointError,
    TruncatedFileError,
)
from parallelvars.formats import (
    ArrayEntry,
    DictView,
    detect_format,
    open_checkpoint,
    write_checkpoint,
)
from parallelvars.formats.hdf5 import open_hdf5, write_hdf5
from parallelvars.formats.safetensors import open_safetensors


def test_golden_safetensors_through_hdf5(tmp_path) -> None:
    with open_safetensors(TORCH / "model.safetensors") as src:
        out = write_hdf5(tmp_path / "t.h5", src)
        with open_hdf5(out) as back:
            assert back.format == "hdf5"
            assert_same_view(back, src)
            assert back.verify_all() == []
            assert back.metadata["seed"] == "0"
    assert detect_format(out) == "hdf5"
    # plain h5py finds every value as an ordinary dataset
    with h5py.File(out, "r") as f:
        for key, want in torch_expected().items():
            ds = f[f"{key.replace('.', '/')}/primary"]
            got = ds[()]
            if want.dtype in (np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)):
                got = got.view(want.dtype)
            assert same_bits(np.asarray(got).reshape(want.shape), want), key


def test_parallel_kinds_and_object_graph(tmp_path) -> None:
    full = np.arange(30, dtype=np.float32).reshape(10, 3)
    view = DictView(
        [
            ArrayEntry(
                "m/w",
                [full[:2], full[:2] + 1],
                kind="mirrored",
                attrs={"devices": ["cpu:0", "cpu:1"]},
            ),
            ArrayEntry(
                "m/e",
                [full[:4], full[4:7], full[7:]],
                kind="sharded",
                shape=(10, 3),
                attrs={"shard_axis": 0, "shard_offsets": [0, 4, 7]},
            ),
            ArrayEntry(
                "m/n",
                [np.array(1, np.int64), np.array(2, np.int64)],
                kind="on_read",
                attrs={"aggregation": "sum"},
            ),
            ArrayEntry("s", [np.array([b"ab", b"", b"\xffc"], dtype=object)]),
        ]
    )
    graph = {"version": 1, "nodes": graph_from_paths(sorted(view))}
    out = write_hdf5(tmp_path / "p.h5", view, object_graph=graph)
    with open_hdf5(out) as back:
        assert_same_view(back, view)
        assert back.object_graph == graph
        again = write_hdf5(tmp_path / "again.h5", back)  # the graph travels with the view
    with open_hdf5(again) as third:
        assert third.object_graph == graph
        # A view that no longer matches its source's graph (one entry dropped) carries none.
        subset = DictView({k: e for k, e in third.items() if k != "s"}, format="hdf5")
        subset.object_graph = graph  # type: ignore[attr-defined]
        with open_hdf5(write_hdf5(tmp_path / "subset.h5", subset)) as fourth:
            assert fourth.object_graph is None
        # A view that no longer matches its source's graph (here: one entry dropped) carries none.
        subset = DictView({k: e for k, e in third.items() if k != "s"}, format="hdf5")
        subset.object_graph = graph  # type: ignore[attr-defined]
        with open_hdf5(write_hdf5(tmp_path / "subset.h5", subset)) as fourth:
            assert fourth.object_graph is None
        assert_same_view(third, view)
    with h5py.File(out, "r") as f:
        assert same_bits(f["m/e/value"][()], full)  # the virtual dataset stitches the shards


def test_keras_layout_survives_a_trip_through_hdf5(tmp_path) -> None:
    from parallelvars.formats.keras import open_keras, write_keras

    with open_keras(KERAS / "model.weights.h5") as src:
        mid = write_hdf5(tmp_path / "mid.h5", src)
    with open_hdf5(mid) as view:
        out = write_keras(tmp_path / "back.weights.h5", view)
    assert h5_structure(out) == h5_structure(KERAS / "model.weights.h5")


def test_non_checkpoint_hdf5_file(tmp_path) -> None:
    path = tmp_path / "data.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(NotACheckpointError) as err:
        open_checkpoint(path)  # detection falls back to the .h5 suffix
    assert str(path) in str(err.value) and "parallelvars_format" in str(err.value)


def test_truncated_hdf5_file(tmp_path) -> None:
    view = DictView([ArrayEntry("w", [np.arange(100000, dtype=np.float64)])])
    out = write_hdf5(tmp_path / "w.h5", view)
    raw = pathlib.Path(out).read_bytes()
    cut = tmp_path / "cut.h5"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises((TruncatedFileError, CorruptCheckpointError)) as err, open_hdf5(cut) as v:
        v["w"].value()
    assert str(cut) in str(err.value)


class _Described(DictView):
    """A view that describes each variable (``summary``, as a file's index does) and makes a
    new entry at each ask (as a file's view does), noting the most it had alive at once."""

    def __init__(self, entries: list[ArrayEntry], summaries: dict | None = None) -> None:
        super().__init__(entries)
        self._summaries = summaries or {}
        self.alive: weakref.WeakSet = weakref.WeakSet()
        self.most = 0

    def __getitem__(self, key: str) -> ForwardingEntry:
        entry = ForwardingEntry(self._entries[key])
        self.alive.add(entry)
        self.most = max(self.most, len(self.alive))
        return entry

    def summary(self, key: str) -> tuple:
        if key in self._summaries:
            return self._summaries[key]
        e = self._entries[key]
        return (e.kind, e.dtype, tuple(e.shape), e.num_components, e.nbytes, e.attrs)


def _described_entries() -> list[ArrayEntry]:
    rng = np.random.default_rng(3)
    out = []
    for k in range(40):
        comps = [rng.standard_normal(64).astype(np.float32)] * 2
        out.append(ArrayEntry(f"m/v{k}", comps, kind="mirrored", shape=(64,),
                              attrs={"devices": ["gpu:0", "gpu:1"], "slot_name": "m"}))  # fmt: skip
    out.append(ArrayEntry("m/s", [np.array([b"ab", b"c"], dtype=object)], shape=(2,)))
    return out


def test_a_described_view_is_written_without_holding_its_entries(tmp_path, monkeypatch) -> None:
    # Planned from the summaries, each entry made while its run is read and let go after:
    # the file is the one the entries themselves give, at most a run's entries alive at once.
    import parallelvars.checkpoint.h5raw.native as native

    monkeypatch.setattr("parallelvars._spans.BULK_BYTES", 1024)  # (runs of two variables)
    monkeypatch.setattr(native.time, "time", lambda: 1.0)  # (the same `created` in both)
    view = _Described(_described_entries())
    write_hdf5(tmp_path / "d.h5", view)
    write_hdf5(tmp_path / "e.h5", DictView(_described_entries()))
    assert (tmp_path / "d.h5").read_bytes() == (tmp_path / "e.h5").read_bytes()
    assert view.most <= 4, view.most


@pytest.mark.parametrize(
    ("summary", "what"),
    [
        (("mirrored", np.dtype(np.float32), (64,), 3, 0, {"devices": ["a", "b"]}), "devices"),
        (("nonsense", np.dtype(np.float32), (64,), 2, 0, {}), "unknown variable kind"),
        (("mirrored", np.dtype(np.float32), (64,), 2, 0, {"bad": object()}), "cannot be stored"),
    ],
)
def test_a_described_variable_is_refused_as_its_entry_is(tmp_path, summary, what) -> None:
    # The summary's layout and attributes take the checks the entry's take: the same error.
    bad = ArrayEntry("m/v0", [np.zeros(64, np.float32)] * summary[3], shape=(64,),
                     attrs=summary[5])  # fmt: skip
    bad.kind = summary[0]
    with pytest.raises(InvalidEntryError) as want:
        write_hdf5(tmp_path / "out.h5", DictView([bad]))
    with pytest.raises(InvalidEntryError) as got:
        write_hdf5(tmp_path / "out.h5", _Described(_described_entries(), {"m/v0": summary}))
    assert str(got.value) == str(want.value)
    assert what in str(got.value)
    assert not (tmp_path / "out.h5").exists()


class _Node(Mapping):
    """A mapping that is not a dict (json does not encode it itself)."""

    def __init__(self) -> None:
        self.items_: dict = {}

    def __getitem__(self, key):
        return self.items_[key]

    def __iter__(self):
        return iter(self.items_)

    def __len__(self) -> int:
        return len(self.items_)


def test_the_graph_check_sees_every_cycle_and_passes_every_tree() -> None:
    from parallelvars.formats.testing import check_writable_graph

    node = _Node()
    node.items_["self"] = [1, node]  # (a cycle through a mapping json does not encode)
    with pytest.raises(InvalidEntryError, match="holds itself"):
        check_writable_graph({"nodes": [node]}, "f")
    keyed: dict = {(1, 2): None}  # (a key json cannot write, then a cycle)
    keyed["v"] = [keyed]
    with pytest.raises(InvalidEntryError, match="holds itself"):
        check_writable_graph({"nodes": [keyed]}, "f")
    under: list = []
    under.append(under)
    for key in ((1, 2), b"k", object()):  # (a cycle under a key json cannot write)
        with pytest.raises(InvalidEntryError, match="holds itself"):
            check_writable_graph({"version": 1, key: under}, "f")
    deep: list = []
    for _ in range(sys.getrecursionlimit() * 2):  # (deeper than json's encoder goes)
        deep = [deep]
    check_writable_graph({"nodes": deep, "odd": {1.5: {2}, "x": float("nan")}}, "f")


class _Lying(DictView):
    """A view whose ``summary`` says something its entry is not."""

    def __init__(self, entries: Any, lie: dict[int, Any]) -> None:
        super().__init__(entries)
        self.lie = lie

    def summary(self, key: str) -> Any:
        if self.lie is None:
            return f"{key}: a float tensor"  # (a method of the same name, not a summary)
        told = ["on_read", np.dtype(np.float64), (4,), 2, 64, {"aggregation": "sum"}]
        for i, v in self.lie.items():
            told[i] = v
        return tuple(told)


@pytest.mark.parametrize(
    ("lie", "field"),
    [
        ({3: 1}, "number of components"),
        ({3: 3}, "number of components"),
        ({0: "mirrored"}, "kind"),
        ({5: {"aggregation": "mean"}}, "attributes"),
        ({1: np.dtype(np.float32)}, "dtype"),
        ({2: (2, 2)}, "shape"),
    ],
)
def test_a_view_whose_summary_and_entry_differ_is_refused(tmp_path, lie, field) -> None:
    """The writer plans a view's variables from its summary but refuses one whose entry is
    not what the summary said (a component dropped, a kind or an aggregation changed
    silently, otherwise), naming the file and the variable; the last good file stays."""
    from parallelvars.formats import reshard

    entry = ArrayEntry(
        "w",
        [np.arange(4, dtype=np.float64), np.arange(4, dtype=np.float64) + 1],
        kind="on_read",
        attrs={"aggregation": "sum"},
    )
    path = tmp_path / "w.h5"
    write_hdf5(path, _Lying({"w": entry}, {}))
    good = path.read_bytes()
    # (resharded, the lie shows in the rewritten variable's first field that differs)
    for view, said in (
        (_Lying({"w": entry}, lie), field),
        (reshard(_Lying({"w": entry}, lie), 2), ""),
    ):
        with pytest.raises(InvalidEntryError, match=f"differs from its summary in its {said}"):
            write_hdf5(path, view)
        assert path.read_bytes() == good


_NAN = float("nan")


@pytest.mark.parametrize(
    ("mine", "told", "differs"),
    [
        (1, True, True),  # (types apart, though equal as numbers)
        (1, 1.0, True),
        (0.0, -0.0, True),  # (floats by their bits)
        (_NAN, float("nan"), False),
        (["a"], ("a",), True),
        (["a"], ["a", "b"], True),
        ([1, "x"], [True, "x"], True),
        ([["a", 1]], [["a", 1]], False),
        (np.arange(2), np.arange(2).astype(np.int32), True),
        (np.arange(2), np.arange(2), False),
        ({"k": [1]}, {"k": [1]}, False),
        (None, "None", True),
    ],
)
def test_an_attribute_value_that_differs_from_the_summary_is_refused(
    tmp_path, mine, told, differs
) -> None:
    """A planned variable's attributes are compared with its entry's value by value as the
    writer keys them: types apart, floats by their bits, arrays by dtype and bytes (equal
    values held in other objects pass)."""
    entry = ArrayEntry(
        "w",
        [np.arange(4, dtype=np.float64), np.arange(4, dtype=np.float64) + 1],
        kind="on_read",
        attrs={"aggregation": "sum", "x": mine},
    )
    view = _Lying({"w": entry}, {5: {"aggregation": "sum", "x": told}})
    if differs:
        with pytest.raises(InvalidEntryError, match="differs from its summary in its attributes"):
            write_hdf5(tmp_path / "w.h5", view)
    else:
        write_hdf5(tmp_path / "w.h5", view)


def test_a_conversion_from_a_table_keeps_no_entry(tmp_path) -> None:
    """Out of a view whose summaries and entries come from one table (a safetensors file's
    parallel info), the writer plans from the summaries and reads each entry's components
    without reading its attributes: no entry gets attributes of its own, which its table
    would keep until the view is closed."""
    entries = [
        ArrayEntry(f"v{i}", [np.full(3, i, np.float32)] * 2, kind="mirrored") for i in range(5)
    ]
    src = tmp_path / "s.safetensors"
    write_checkpoint(src, DictView(entries))
    with open_checkpoint(src) as view:
        write_hdf5(tmp_path / "o.h5", view)
        assert not view._entries._kept  # type: ignore[attr-defined]
    with open_hdf5(tmp_path / "o.h5") as back:
        assert [back[f"v{i}"].component(1).tolist() for i in range(5)] == [
            [i] * 3 for i in range(5)
        ]


def test_a_summary_that_is_not_a_description_is_refused(tmp_path) -> None:
    from parallelvars.formats import reshard

    view = _Lying({"w": ArrayEntry("w", [np.ones(3, np.float32)] * 2, kind="mirrored")}, None)
    for write in (lambda: write_hdf5(tmp_path / "d.h5", view), lambda: reshard(view, 3)):
        with pytest.raises(InvalidEntryError, match="summary of the variable is not a description"):
            write()
