"""The columns document (docs/FORMAT.md): the index again, column by column, which a reader
takes at open instead of decoding the index; always equal to the index, checked by verify."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pytest
from _columns_support import (
    columns_text,
    documents,
    read_columns,
    read_index,
    strip_columns,
    write_columns,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_mpi_files import save_all

import parallelvars as pv
from parallelvars.checkpoint import H5Reader
from parallelvars.checkpoint.h5io.layout import COLUMNS_DATASET, INDEX_DATASET
from parallelvars.cli import main
from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    ParallelVarsError,
)
from parallelvars.testing import PlanCache
from parallelvars.testing import columns_parts as _columns_parts
from parallelvars.testing import columns_table as _columns_table

GOLDEN = Path(__file__).parent / "data" / "native" / "v1"


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.25)


def every_kind() -> tuple[pv.Module, pv.optimizers.Optimizer]:
    """Every variable kind, on-read aggregations, bytes, bfloat16, an empty variable, slots."""
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.w = pv.Variable(np.arange(12, dtype=np.float32).reshape(3, 4), name="w")
        m.total = pv.Variable(np.int64(3), synchronization="on_read", aggregation="sum")
        m.avg = pv.Variable(np.float32(1.5), synchronization="on_read", aggregation="mean")
        m.half = pv.Variable(np.ones(5, ml_dtypes.bfloat16), name="half")
        m.empty = pv.Variable(np.zeros((0, 3), np.float64), name="empty")
        m.emb = pv.Variable(np.arange(20, dtype=np.float32).reshape(10, 2), name="e", shard_axis=0)
    m.single = pv.Variable(np.float64(2.5), name="single")
    m.text = pv.Variable(np.array([b"a", b"bc"], dtype=object), name="text")
    m.frozen = pv.Variable(np.ones(2, np.float32), name="frozen", trainable=False)
    opt = pv.optimizers.Adam(0.1)
    opt.apply_gradients([(np.ones((3, 4), np.float32), m.w)])  # slots of m.w
    return m, opt


def assert_columns_are_the_index(path: str | Path) -> None:
    """The file lists its columns, they are what our writer makes of its index, and every
    entry the reader makes of them is the index's entry (same JSON, same order)."""
    path = str(path)
    assert COLUMNS_DATASET in documents(path)
    index = read_index(path)
    doc = read_columns(path)
    assert json.dumps(doc) == json.dumps(json.loads(columns_text(index)))
    with H5Reader(path) as r:
        assert r._columns
        assert list(r._metas) == list(index)
        for name, entry in index.items():
            assert json.dumps(r._metas[name]) == json.dumps(entry), name
        assert r.verify_all() == []


def values(path: str | Path) -> dict[str, list[Any]]:
    with H5Reader(str(path)) as r:
        return {k: [r[k].component(i) for i in range(r[k].num_components)] for k in r}


def test_first_save_has_columns_equal_to_the_index(tmp_path: Path) -> None:
    m, opt = every_kind()
    path = pv.Checkpoint(model=m, opt=opt).write(tmp_path / "c.h5")
    assert documents(path) == [INDEX_DATASET, COLUMNS_DATASET, "_parallelvars/object_graph"]
    doc = read_columns(path)
    assert len(doc["layouts"]) < len(doc["paths"])  # shared layouts listed once
    assert any("slot_of" in lay["attrs"] for lay in doc["layouts"])
    assert_columns_are_the_index(path)


def test_repeated_saves_from_the_skeleton_have_the_columns(tmp_path: Path, fixed_clock) -> None:
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.w = pv.Variable(np.zeros((3, 4), np.float32), name="w")
        m.big = pv.Variable(np.zeros(40_000, np.float32), name="big")
        m.emb = pv.Variable(np.zeros((10, 2), np.float32), name="e", shard_axis=0)
    ckpt = pv.Checkpoint(model=m)
    ckpt.save(tmp_path / "run")
    for k in (1, 2):
        m.w.assign(np.full((3, 4), k, np.float32))
        m.big.assign(np.full(40_000, k, np.float32))
        path = ckpt.save(tmp_path / "run")
        assert ckpt._pv_plans.held is not None  # from the cached generated metadata
        assert_columns_are_the_index(path)
        with H5Reader(path) as r:
            np.testing.assert_array_equal(r["model/big"].component(1), np.full(40_000, k))


def test_manager_saves_blocking_or_not_have_the_columns(tmp_path: Path) -> None:
    m, opt = every_kind()
    ckpt = pv.Checkpoint(model=m, opt=opt)
    with pv.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=None) as mgr:
        for blocking in (True, False, False, True):
            path = mgr.save(blocking=blocking)
            mgr.wait()
            assert_columns_are_the_index(path)


def test_rank_files_have_the_columns_the_index_file_has_none(tmp_path: Path) -> None:
    caches: list[PlanCache | None] = [PlanCache(), PlanCache()]
    for k in (1, 2):
        (path,) = set(save_all(tmp_path, 2, k, caches))
        parts = sorted(Path(str(path) + ".parts").glob("rank-*.h5"))
        assert len(parts) == 2
        for part in parts:
            assert_columns_are_the_index(part)
        assert COLUMNS_DATASET not in documents(str(path))  # read through its index
        with H5Reader(str(path)) as r:
            assert not r._columns and r.verify_all() == []


def test_the_golden_files_without_columns_still_read() -> None:
    for name in ("single.h5", "mpi.h5"):
        assert COLUMNS_DATASET not in documents(str(GOLDEN / name))
        with H5Reader(str(GOLDEN / name)) as r:
            assert not r._columns and len(r) and r.verify_all() == []


def test_a_restore_is_the_same_with_and_without_columns(tmp_path: Path) -> None:
    m, opt = every_kind()
    m.w.assign(np.full((3, 4), 7, np.float32))
    with_columns = pv.Checkpoint(model=m, opt=opt).write(tmp_path / "c.h5")
    without = str(tmp_path / "i.h5")
    shutil.copy(with_columns, without)
    strip_columns(without)
    with H5Reader(without) as r:
        assert not r._columns and r.table is not None
    restored = []
    for path in (with_columns, without):
        fresh, fresh_opt = every_kind()
        pv.Checkpoint(model=fresh, opt=fresh_opt).restore(path).assert_consumed()
        restored.append(
            [_bytes(c) for name in NAMES for c in getattr(fresh, name).components]
            + [_bytes(s) for s in fresh_opt.variables]
        )
    assert restored[0] == restored[1]
    assert restored[0][1] == _bytes(np.full((3, 4), 7, np.float32))
    a, b = values(with_columns), values(without)
    assert a.keys() == b.keys()
    for k in a:
        for x, y in zip(a[k], b[k], strict=True):
            assert _bytes(x) == _bytes(y), k


def _bytes(a: Any) -> Any:
    a = np.asarray(a)
    return a.tolist() if a.dtype.kind == "O" else (a.dtype.str, a.shape, a.tobytes())


NAMES = ("w", "total", "avg", "half", "empty", "emb", "single", "text", "frozen")


# ----------------------------------------------------------------------------- hypothesis
_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=4,
)
_attr_values = _values.filter(lambda v: v is not None)


@st.composite
def indexes(draw: st.DrawFn) -> dict[str, Any]:
    index: dict[str, Any] = {}
    for path in draw(st.lists(st.text(min_size=1, max_size=6), max_size=8, unique=True)):
        n = draw(st.integers(1, 3))
        keys = draw(
            st.lists(
                st.sampled_from(["name", "slot_of", "devices", "aggregation", "trainable", "x"]),
                unique=True,
            )
        )
        attrs = {}
        for key in keys:
            if key == "devices":
                attrs[key] = [f"cpu:{i}" for i in range(n)]
            elif key == "aggregation":
                attrs[key] = draw(st.sampled_from(["none", "sum", "MEAN"]))
            else:
                attrs[key] = draw(_attr_values)
        index[path] = {
            "kind": draw(st.sampled_from(["single", "mirrored", "on_read", "independent"])),
            "dtype": draw(st.sampled_from(["float32", "int64", "bfloat16", "bool"])),
            "shape": draw(st.lists(st.integers(0, 5), max_size=3)),
            "num_components": n,
            "attrs": attrs,
            "offsets": draw(st.lists(st.none() | st.integers(0, 2**40), min_size=n, max_size=n)),
            "crc32c": draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n)),
        }
    return index


# The default run tries 30 indexes; the sweep (-m slow) 300.
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(indexes())
def test_any_index_makes_columns_that_give_it_back(index: dict[str, Any]) -> None:
    _columns_give_the_index_back(index)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(indexes())
def test_any_index_makes_columns_that_give_it_back_sweep(index: dict[str, Any]) -> None:
    _columns_give_the_index_back(index)


def _columns_give_the_index_back(index: dict[str, Any]) -> None:
    doc = json.loads(columns_text(index))
    table, entries = _columns_table(doc, "f.h5")  # type: ignore[misc]
    assert list(entries) == list(index)
    for name, entry in index.items():
        assert json.dumps(entries[name]) == json.dumps(entry)
    head, tail = _columns_parts(index)
    assert head.endswith('"crc32c": [') and tail == "]}"
    if table is not None:
        assert table.names == list(index)
        assert table.crcs.tolist() == [c for e in index.values() for c in e["crc32c"]]
        assert table.shapes == [tuple(e["shape"]) for e in index.values()]
        assert table.counts == [e["num_components"] for e in index.values()]


# ----------------------------------------------------------------------------- hostile
@pytest.fixture
def small(tmp_path: Path) -> str:
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.w = pv.Variable(np.arange(12, dtype=np.float32).reshape(3, 4), name="w")
        m.e = pv.Variable(np.arange(8, dtype=np.int64).reshape(4, 2), name="e", shard_axis=0)
    m.s = pv.Variable(np.float64(2.5), name="s")
    return pv.Checkpoint(model=m).write(tmp_path / "c.h5")


def _layout(doc: dict[str, Any], path: str) -> dict[str, Any]:
    return doc["layouts"][doc["layout"][doc["paths"].index(path)]]


HOSTILE: dict[str, tuple[Any, str]] = {
    # (the change to the document, what the error names)
    "not-a-mapping": (lambda d: [], "document"),
    "no-version": (lambda d: d.pop("version"), "version"),
    "version-zero": (lambda d: d.update(version=0), "version"),
    "version-as-string": (lambda d: d.update(version="1"), "version"),
    "paths-missing": (lambda d: d.pop("paths"), "paths"),
    "paths-not-strings": (lambda d: d["paths"].__setitem__(0, 7), "paths"),
    "path-twice": (lambda d: d["paths"].__setitem__(1, d["paths"][0]), "paths"),
    "paths-shorter": (lambda d: d["paths"].pop(), "layout"),
    "layout-as-strings": (lambda d: d["layout"].__setitem__(0, "0"), "layout"),
    "layout-as-bool": (lambda d: d["layout"].__setitem__(0, True), "layout"),
    "unknown-layout": (lambda d: d["layout"].__setitem__(0, 99), "layout"),
    "negative-layout": (lambda d: d["layout"].__setitem__(0, -1), "layout"),
    "layouts-not-mappings": (lambda d: d["layouts"].__setitem__(0, 3), "layouts[0]"),
    "kind-not-a-string": (lambda d: d["layouts"][0].update(kind=1), "layouts[0].kind"),
    "ndim-huge": (lambda d: d["layouts"][0].update(ndim=10**9), "layouts[0].ndim"),
    "count-huge": (
        lambda d: d["layouts"][0].update(num_components=2**40),
        "layouts[0].num_components",
    ),
    "count-negative": (
        lambda d: d["layouts"][0].update(num_components=-1),
        "layouts[0].num_components",
    ),
    "count-vs-offsets": (
        lambda d: _layout(d, "model/w").update(num_components=3),
        "offsets",
    ),
    "shapes-shorter": (lambda d: d["shapes"].pop(), "shapes"),
    "shapes-floats": (lambda d: d["shapes"].__setitem__(0, 3.0), "shapes"),
    "dimension-negative": (lambda d: d["shapes"].__setitem__(0, -3), "shapes"),
    "dimension-huge": (lambda d: d["shapes"].__setitem__(0, 2**63), "shapes"),
    "offsets-longer": (lambda d: d["offsets"].append(0), "offsets"),
    "offset-negative": (lambda d: d["offsets"].__setitem__(0, -8), "offsets"),
    "offset-string": (lambda d: d["offsets"].__setitem__(0, "8"), "offsets"),
    "offset-minus-one": (lambda d: d["offsets"].__setitem__(1, -1), "offsets"),
    "crc-too-big": (lambda d: d["crc32c"].__setitem__(0, 2**32), "crc32c"),
    "crc-null": (lambda d: d["crc32c"].__setitem__(0, None), "crc32c"),
    "crcs-shorter": (lambda d: d["crc32c"].pop(), "crc32c"),
    "row-attrs-not-a-mapping": (lambda d: d.update(row_attrs=[]), "row_attrs"),
    "row-attr-shorter": (lambda d: d["row_attrs"]["name"].pop(), "row_attrs.name"),
    "row-attr-missing-value": (
        lambda d: d["row_attrs"]["name"].__setitem__(0, None),
        "row_attrs.name",
    ),
    "row-attr-beside-a-layout-value": (
        lambda d: d["layouts"][0]["attrs"].update(name="fixed"),
        "row_attrs.name",
    ),
    "row-attr-without-place": (
        lambda d: d["row_attrs"]["slot_of"].__setitem__(0, "x"),
        "row_attrs.slot_of",
    ),
    "place-without-row-attr": (
        lambda d: d["layouts"][0]["attrs"].update(other=None),
        "layouts[0].attrs.other",
    ),
    "devices-per-row": (
        lambda d: d["row_attrs"].update(devices=[None] * len(d["paths"])),
        "row_attrs.devices",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_crafted_columns_are_refused(small: str, case: str) -> None:
    change, field = HOSTILE[case]
    doc = read_columns(small)
    out = change(doc)
    write_columns(small, out if case == "not-a-mapping" else doc)
    with pytest.raises(CorruptCheckpointError) as info:
        H5Reader(small)
    message = str(info.value)
    assert small in message and f"{COLUMNS_DATASET}: {field}" in message, message
    assert not isinstance(info.value, ChecksumMismatchError)


@pytest.mark.parametrize(
    ("field", "at", "value"),
    [("crc32c", 2, 2**32), ("offsets", 1, None), ("offsets", 2, -5), ("shapes", 1, 0.5)],
)
def test_a_bad_value_in_a_flat_column_names_its_variable(small: str, field, at, value) -> None:
    doc = read_columns(small)
    doc[field][at] = value if field != "offsets" or value is not None else "x"
    write_columns(small, doc)
    with pytest.raises(CorruptCheckpointError) as info:
        H5Reader(small)
    assert info.value.variable == f"model/w ({COLUMNS_DATASET}: {field})"


def test_damaged_column_bytes_are_a_checksum_error(small: str) -> None:
    with h5py.File(small, "r+") as f:
        ds = f[COLUMNS_DATASET]
        raw = bytearray(bytes(ds[()]))
        raw[raw.index(b'"paths"') + 2] ^= 0x01
        stored = int(ds.attrs["crc32c"])
        del f[COLUMNS_DATASET]
        f.create_dataset(COLUMNS_DATASET, data=np.bytes_(bytes(raw)), track_times=False)
        f[COLUMNS_DATASET].attrs["crc32c"] = np.int64(stored)
    with pytest.raises(ChecksumMismatchError, match="columns"):
        H5Reader(small)
    assert main(["verify", small]) != 0


def test_listed_but_missing_columns_are_the_documents_error(small: str) -> None:
    with h5py.File(small, "r+") as f:
        del f[COLUMNS_DATASET]
    with pytest.raises(CorruptCheckpointError, match="missing") as info:
        H5Reader(small)
    assert info.value.variable == COLUMNS_DATASET


def test_a_later_columns_version_is_read_through_the_index(small: str) -> None:
    doc = read_columns(small)
    doc["version"] = 2
    doc["paths"] = "something else"
    write_columns(small, doc)
    with H5Reader(small) as r:
        assert not r._columns and r.table is not None and r.verify_all() == []


DISAGREE = {
    "name": (lambda d: d["row_attrs"]["name"].__setitem__(1, "other"), "model/w", "attrs.name"),
    "trainable-as-int": (
        lambda d: _layout(d, "model/w")["attrs"].update(trainable=1),
        "model/w",
        "attrs.trainable",
    ),
    "shape": (lambda d: d["shapes"].__setitem__(0, 6), "model/w", "shape"),
}


@pytest.mark.parametrize("case", sorted(DISAGREE))
def test_columns_that_disagree_with_the_index_fail_verify(small: str, case: str, capsys) -> None:
    change, variable, field = DISAGREE[case]
    doc = read_columns(small)
    change(doc)
    write_columns(small, doc)
    with H5Reader(small) as r:
        problems = r.verify_all()
    assert any(variable in p and repr(field) in p and "disagree" in p for p in problems), problems
    assert main(["verify", small]) == 1
    out = capsys.readouterr().out
    assert "disagree" in out and variable in out and field in out


def test_a_checksum_changed_in_the_columns_fails_the_restore(small: str) -> None:
    doc = read_columns(small)
    doc["crc32c"][1] ^= 1  # model/w's first component
    write_columns(small, doc)
    with H5Reader(small) as r:
        problems = r.verify_all()
    assert any("'crc32c'" in p and "model/w" in p for p in problems), problems
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.w = pv.Variable(np.zeros((3, 4), np.float32), name="w")
        m.e = pv.Variable(np.zeros((4, 2), np.int64), name="e", shard_axis=0)
    m.s = pv.Variable(np.float64(0), name="s")
    with pytest.raises(ParallelVarsError, match="checksum"):
        pv.Checkpoint(model=m).restore(small)
    np.testing.assert_array_equal(m.w.components[0], np.zeros((3, 4)))  # all or nothing


# ----------------------------------------------------------------------------- from records
_ATTR_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 63) - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-0.0, 0.0, np.float32(1.5), np.int64(-3), np.bool_(True)]),
    st.text(max_size=8),
    st.sampled_from(["json:{}", "json:[1, 2]", "json:nope", "%d", "%s%%", "\x00", '"', "\ue000"]),
    st.lists(st.text(max_size=4), max_size=3),
    st.lists(st.sampled_from(["a", "json:1", "%"]), max_size=3),
    st.lists(st.integers(-5, 5), max_size=3),
    st.lists(st.one_of(st.booleans(), st.floats(allow_nan=False), st.text(max_size=2)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_ATTR_KEYS = st.one_of(
    st.sampled_from(["name", "slot_of", "slot_name", "devices", "kind", "shape", "aggregation"]),
    st.text(max_size=5),
)


@st.composite
def _records(draw: Any) -> list[Any]:
    from types import SimpleNamespace

    count = draw(st.integers(0, 6))
    paths = draw(
        st.lists(st.text(min_size=1, max_size=6), min_size=count, max_size=count, unique=True)
    )
    out = []
    for path in paths:
        n = draw(st.integers(0, 4))
        out.append(
            SimpleNamespace(
                path=path,
                kind=draw(st.sampled_from(["mirrored", "on_read", "sharded", "single", "k%\x00"])),
                dtype=np.dtype(
                    draw(st.sampled_from(["<f4", "|b1", "<i8", "|u1", ml_dtypes.bfloat16]))
                ),
                shape=tuple(draw(st.lists(st.integers(0, 9), max_size=3))),
                num_components=n,
                attrs=draw(st.dictionaries(_ATTR_KEYS, _ATTR_VALUES, max_size=5)),
                offsets=draw(
                    st.lists(st.one_of(st.none(), st.integers(0, 1 << 40)), min_size=n, max_size=n)
                ),
                crcs=draw(st.lists(st.integers(0, (1 << 32) - 1), min_size=n, max_size=n)),
            )
        )
    return out


def _check_record_documents(records: list[Any], run: int | None = None) -> None:
    """columns.record_documents (in pieces of ``run`` records, when given) gives json.dumps of
    the index the writer records and the columns document made from that index."""
    from types import SimpleNamespace

    from parallelvars.checkpoint.h5io import columns
    from parallelvars.testing import index_of as _index_of

    offsets = {r.path: list(r.offsets) for r in records}
    with pytest.MonkeyPatch.context() as mp:
        if run is not None:
            mp.setattr(columns, "_RUN", run)
        made = columns.record_documents(records, offsets)
        assert made is not None
        runs = made.index_runs()
    crcs = [r.crcs for r in records]
    flat = [c for cc in crcs for c in cc]
    index = _index_of(records, SimpleNamespace(offsets=offsets), crcs)
    text = "".join(columns.index_pieces(runs, flat))
    assert text == json.dumps(index)
    bare = len(text) - sum(len(str(c)) for c in flat)
    # (the index's length is known before its text is made: a first save sizes its room by it)
    assert columns.index_bare_length(runs) == made.index_bare == bare
    assert ("".join(made.head), made.tail) == _columns_parts(index)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_records())
def test_documents_from_records_are_the_index_and_its_columns(records: list[Any]) -> None:
    """A first save writes the index and the columns from each record's fields' texts
    (columns.record_documents), without the index's objects: the same text as json.dumps of
    the index the writer records, and as the columns document made from that index."""
    _check_record_documents(records)


@st.composite
def _runs_of_records(draw: Any) -> list[Any]:
    """Records of a few classes in runs (each record its prototype's with its own path,
    dimensions, name and offsets), as a model's variables and slots are."""
    from types import SimpleNamespace

    protos = draw(_records())
    if not protos:
        return []
    out = []
    for run in range(draw(st.integers(1, 6))):
        proto = protos[draw(st.integers(0, len(protos) - 1))]
        for k in range(draw(st.integers(1, 9))):
            attrs = dict(proto.attrs)
            if type(attrs.get("name")) is str and not attrs["name"].startswith("json:"):
                attrs["name"] = f"{attrs['name']}%{k}"
            n = proto.num_components
            out.append(
                SimpleNamespace(
                    path=f"{proto.path}/{run}/{k}",
                    kind=proto.kind,
                    dtype=proto.dtype,
                    shape=tuple(d + k for d in proto.shape),
                    num_components=n,
                    attrs=attrs,
                    offsets=[None if o is None else o + k for o in proto.offsets],
                    crcs=[(c + k) % (1 << 32) for c in proto.crcs],
                )
            )
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_runs_of_records(), st.sampled_from([1, 2, 3, 4096]))
def test_documents_from_runs_of_records_are_the_index_and_its_columns(
    records: list[Any], run: int
) -> None:
    """The records' texts are made a run of one class at a time (one join of the run's
    columns, in pieces of at most ``_RUN`` records): the index and the columns are still
    json.dumps of the index and the columns document made from it, whatever the runs and
    the pieces."""
    _check_record_documents(records, run)


def test_documents_from_records_refuse_attribute_names_that_are_not_text() -> None:
    from types import SimpleNamespace

    from parallelvars.checkpoint.h5io.columns import record_documents
    from parallelvars.errors import InvalidEntryError

    rec = SimpleNamespace(
        path="a", kind="single", dtype=np.dtype("<f4"), shape=(), num_components=1, attrs={1: "x"}
    )
    with pytest.raises(InvalidEntryError, match="attribute name 1 is not text"):
        record_documents([rec], {"a": [None]})


def test_a_sharded_layout_without_components_names_its_variable(small: str) -> None:
    """A sharded variable with no shard (the last row: its offsets and checksums consistent
    with that) is refused naming the variable and the field, not by the table's arithmetic
    failing on the empty row."""
    doc = read_columns(small)
    doc["layouts"].append(
        {"kind": "sharded", "dtype": "float32", "ndim": 1, "num_components": 0}
        | {"attrs": {"shard_axis": 0, "shard_offsets": []}}
    )
    doc["paths"].append("zz")
    doc["layout"].append(len(doc["layouts"]) - 1)
    doc["shapes"].append(4)
    for values in doc["row_attrs"].values():
        values.append(None)
    write_columns(small, doc)
    with pytest.raises(CorruptCheckpointError) as info:
        H5Reader(small)
    field = f"layouts[{len(doc['layouts']) - 1}].num_components"
    assert info.value.variable == f"zz ({COLUMNS_DATASET}: {field})"
    assert "found 0" in str(info.value)


def test_a_sharded_index_entry_without_components_names_its_variable(tmp_path: Path) -> None:
    """The same through the index (a file without columns): the general path names it."""
    from parallelvars.checkpoint.h5io.layout import INDEX_DATASET
    from parallelvars.testing import write_json

    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.e = pv.Variable(np.arange(8, dtype=np.int64).reshape(4, 2), name="e", shard_axis=0)
    path = pv.Checkpoint(model=m).write(tmp_path / "c.h5")
    strip_columns(path)
    index = read_index(path)
    index["zz"] = {"kind": "sharded", "dtype": "float32", "shape": [4], "num_components": 0}
    index["zz"] |= {"offsets": [], "crc32c": [], "attrs": {"shard_axis": 0, "shard_offsets": []}}
    with h5py.File(path, "r+") as f:
        del f[INDEX_DATASET]
        write_json(f, INDEX_DATASET, index)
    with pytest.raises(CorruptCheckpointError) as info:
        H5Reader(path)
    assert info.value.variable == "zz" and "found 0" in str(info.value)
