"""The commands on columns: inspect's rows from the index's table, diff's components read in
bulk on both sides (a native file by offset, a safetensors file by its byte ranges), the
comparison of bit-identical arrays, and the one-line-per-variable JSON document; each
against the entry-by-entry path it replaces, over every kind and dtype (docs/FORMAT.md, "How
the commands read").
"""

from __future__ import annotations

import io
import json
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_h5raw import _SETTINGS, both, structures

from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.checkpoint.registry import SaveRecord
from parallelvars.cli import main
from parallelvars.cli.diff import compare_arrays
from parallelvars.cli.inspect import collect
from parallelvars.cli.testing import Output, json_document
from parallelvars.cli.testing import inspect_row as _row
from parallelvars.formats import convert, open_checkpoint
from parallelvars.formats.testing import info_views, jsonable


def _records() -> list[SaveRecord]:
    """Every kind, bfloat16, float8, ints, bool, bytes, 0-d and empty."""
    f32 = np.arange(6, dtype=np.float32)
    return [
        SaveRecord("mirrored", [f32, f32.copy()], (6,), {"devices": ["a", "b"]}, path="m/eq"),
        SaveRecord("mirrored", [f32, f32 + 1], (6,), {"devices": ["a", "b"]}, path="m/ne"),
        SaveRecord(
            "mirrored",
            [np.ones((2, 3), ml_dtypes.bfloat16)] * 2,
            (2, 3),
            {"devices": ["a", "b"], "slot_of": "m/eq", "slot_name": "m"},
            path="o/bf",
        ),
        SaveRecord(
            "on_read",
            [np.arange(3, dtype=np.int64), np.arange(3, dtype=np.int64)],
            (3,),
            {"devices": ["a", "b"], "aggregation": "sum"},
            path="m/r",
        ),
        SaveRecord("single", [np.array(True)], (), {}, path="m/flag"),
        SaveRecord("single", [np.zeros((0, 4), np.float16)], (0, 4), {}, path="m/empty"),
        SaveRecord(
            "independent",
            [np.ones(2, ml_dtypes.float8_e4m3fn), np.zeros(2, ml_dtypes.float8_e4m3fn)],
            (2,),
            {"devices": ["a", "b"]},
            path="m/f8",
        ),
        SaveRecord(
            "sharded",
            [np.arange(4, dtype=np.float32).reshape(2, 2), np.zeros((1, 2), np.float32)],
            (3, 2),
            {"devices": ["a", "b"], "shard_axis": 0, "shard_offsets": [0, 2]},
            path="m/sh",
        ),
        SaveRecord(
            "mirrored",
            [np.array([b"a", b"bc"], dtype=object)] * 2,
            (2,),
            {"devices": ["a", "b"]},
            path="m/txt",
        ),
    ]


def _files(tmp_path, records: list[SaveRecord]) -> tuple[str, str]:
    """The records written by libhdf5 and by the generator."""
    from parallelvars.checkpoint.h5io.write import write_h5
    from parallelvars.checkpoint.h5raw.native import write_native

    lib = write_h5(str(tmp_path / "lib.h5"), records, object_graph={"version": 1})
    gen = write_native(
        str(tmp_path / "gen.h5"),
        records,
        object_graph={"version": 1},
    )
    return lib, gen


def _entry_rows(path: str) -> list[dict]:
    """inspect's rows made the general way: an entry per variable, compared one by one."""
    with open_checkpoint(path) as view:
        view.summaries = lambda: None  # type: ignore[method-assign]
        view.differing_components = lambda paths: {}  # type: ignore[method-assign]
        return collect(view, Output(json_mode=True, stdout=io.StringIO()))


def _table_rows(path: str) -> list[dict]:
    with open_checkpoint(path) as view:
        assert view.summaries() is not None
        return collect(view, Output(json_mode=True, stdout=io.StringIO()))


def test_inspect_rows_from_the_table_are_the_entries_rows(tmp_path):
    records = _records()
    for path in _files(tmp_path, records):  # libhdf5-written and generated
        rows = _table_rows(path)
        assert rows == _entry_rows(path)
        by_path = {r["path"]: r for r in rows}
        assert by_path["m/eq"]["equal"] and not by_path["m/ne"]["equal"]
        assert by_path["m/ne"]["differing"] == [1]
        assert by_path["o/bf"]["dtype"] == "bfloat16"
        assert by_path.get("m/txt", {"dtype": "bytes"})["dtype"] == "bytes"
        with H5Reader(path) as r:
            for key in r:
                assert _row(r[key]).items() <= by_path[key].items(), key


@settings(max_examples=8, **_SETTINGS)  # type: ignore[arg-type]
@given(records=structures())
def test_inspect_rows_from_the_table_over_generated_structures(tmp_path_factory, records):
    tmp = tmp_path_factory.mktemp("s")
    for path in both(tmp, records):
        assert _table_rows(path) == _entry_rows(path)


def test_bulk_components_are_the_components_and_a_damaged_one_is_left_out(tmp_path):
    _, path = _files(tmp_path, _records())
    with H5Reader(path, keep_entries=False) as r:
        keys = list(r)
        got = dict(r.bulk_components(keys))
        for key in keys:
            parts = got[key]
            if r.table.direct[r.table.rows[key]]:
                assert parts is not None, key
            if parts is None:
                continue
            for i, part in enumerate(parts):
                assert not part.flags.writeable
                want = r[key].component(i)
                assert part.dtype == want.dtype and part.tobytes() == want.tobytes()
        slot = int(r.table.first[r.table.rows["m/ne"]]) + 1
        offset = int(r.table.offsets[slot])
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff\xff")
    with H5Reader(path) as r:
        got = dict(r.bulk_components(["m/eq", "m/ne"]))
        assert got["m/ne"] is None and got["m/eq"] is not None


def test_safetensors_views_read_in_bulk_and_check_every_checksum(tmp_path, capsys):
    _, h5 = _files(tmp_path, [r for r in _records() if r.path != "m/txt"])
    st_path = str(tmp_path / "a.safetensors")
    convert(h5, st_path)
    with open_checkpoint(st_path) as view:
        keys = list(view)
        got = dict(view.bulk_components(keys))
        # (on-read sums are stored as their aggregate and parts, sharded as one value)
        assert all(got[k] is not None for k in keys if view[k].kind not in ("on_read", "sharded"))
        for key in keys:
            if got[key] is None:
                continue
            for i, part in enumerate(got[key]):
                assert part.tobytes() == view[key].component(i).tobytes()
                assert part.dtype == view[key].dtype
        place = view._store._place(view["m/ne"].keys[1])
    # One byte of a tensor changed: that entry is left to the general path, which names it.
    with open(st_path, "r+b") as f:
        f.seek(place[1])
        f.write(bytes([f.read(1)[0] ^ 0xFF]))
    with open_checkpoint(st_path) as view:
        got = dict(view.bulk_components(["m/eq", "m/ne"]))
        assert got["m/ne"] is None and got["m/eq"] is not None
    assert main(["diff", h5, st_path]) == 2  # the general path's error, naming the tensor
    err = capsys.readouterr().err
    assert "m.ne/parallel_component_1" in err and "checksum" in err


def test_diff_in_bulk_finds_what_the_entry_by_entry_diff_finds(tmp_path, capsys, monkeypatch):
    records = [r for r in _records() if r.path != "m/txt"]
    _, h5 = _files(tmp_path, records)
    st_path = str(tmp_path / "a.safetensors")
    convert(h5, st_path)
    records[1] = SaveRecord(
        "mirrored", [np.arange(6, dtype=np.float32), np.arange(6, dtype=np.float32) * 2], (6,),
        {"devices": ["a", "b"]}, path="m/ne",
    )  # fmt: skip
    (tmp_path / "b").mkdir()
    _, other = _files(tmp_path / "b", records)
    out = {}
    for bulk in (True, False):
        if not bulk:
            import parallelvars.formats.hdf5 as fh
            from parallelvars.formats.testing import info_views as _info

            monkeypatch.delattr(fh.HDF5View, "bulk_components")
            monkeypatch.delattr(_info.StoreView, "bulk_components")
        for b in (st_path, other):
            code = main(["--json", "diff", h5, b])
            out[bulk, b] = (code, json.loads(capsys.readouterr().out))
    assert out[True, st_path] == out[False, st_path]
    assert out[True, other] == out[False, other]
    rows = {r["path"]: r for r in out[True, other][1]["variables"]}
    assert out[True, other][0] == 1 and not rows["m/ne"]["equal"]
    assert [c["mismatched"] for c in rows["m/ne"]["components"]] == [0, 5]


@pytest.mark.parametrize("changed", [None, 5])
def test_diff_batches_stay_within_their_byte_bound(tmp_path, capsys, monkeypatch, changed):
    """Variables read in bulk wait to be settled in batches bounded in bytes (both sides'
    components), not only in count: 12 variables of 2 x 64 KiB a side under a 600 KiB bound
    settle two at a time, with the results of an unbounded batch."""
    from parallelvars.cli import diff
    from parallelvars.formats import ArrayEntry, DictView
    from parallelvars.formats.safetensors import write_safetensors

    def entries(bump):
        return [
            ArrayEntry(
                f"v{i}", [np.full(1 << 14, i + (i == bump), np.float32)] * 2, kind="mirrored"
            )
            for i in range(12)
        ]

    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    write_safetensors(a, DictView(entries(None)))
    write_safetensors(b, DictView(entries(changed)))
    main(["--json", "diff", a, b])
    unbounded = json.loads(capsys.readouterr().out)
    batches = []
    settle = diff._settle
    monkeypatch.setattr(diff, "_BATCH_BYTES", 600 << 10)
    monkeypatch.setattr(
        diff, "_settle", lambda p, g, *more: batches.append(list(p)) or settle(p, g, *more)
    )
    code = main(["--json", "diff", a, b])
    assert json.loads(capsys.readouterr().out) == unbounded
    assert code == (0 if changed is None else 1)
    held = [sum(int(c.nbytes) for _, ca, cb in batch for c in (*ca, *cb)) for batch in batches]
    assert sum(map(len, batches)) == 12 and max(held) <= 600 << 10 and len(batches) == 6


@pytest.mark.parametrize(
    "values",
    [
        np.array([1.5, np.nan, -0.0, np.inf], np.float32),
        np.array([1, 2], ml_dtypes.bfloat16),
        np.array([1, 2], ml_dtypes.float8_e4m3fn),
        np.array([[1, -3]], np.int64),
        np.array([True, False]),
        np.array([1 + 2j], np.complex64),
        np.zeros((0, 3), np.float16),
        np.array(7.0, np.float64),
    ],
)
def test_identical_arrays_compare_as_the_full_comparison_says(values):
    from parallelvars.cli import diff

    fast = compare_arrays(values, values.copy(), rtol=0.0, atol=0.0)
    real = diff._same_bytes
    try:
        diff._same_bytes = lambda a, b: False  # the element-wise comparison
        slow = compare_arrays(values, values.copy(), rtol=0.0, atol=0.0)
    finally:
        diff._same_bytes = real
    assert fast == slow
    assert fast["size"] == math.prod(values.shape)


def _plain(doc):
    return json.loads(json.dumps(jsonable(doc), allow_nan=False))


@given(
    st.dictionaries(
        st.text(max_size=5),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.text(max_size=3), inner, max_size=3)
            ),
            max_leaves=8,
        ),
        max_size=5,
    )
)
def test_the_json_document_is_the_jsonable_document(doc):
    doc["variables"] = [{"path": "a", "x": float("nan")}, {"path": "b", "y": np.float32(1.5)}]
    assert json.loads(json_document(doc)) == _plain(doc)
    assert json_document({"a": 1, "v": [{"p": 1}, {"p": 2}]}).splitlines() == [
        "{",
        '  "a": 1,',
        '  "v": [',
        '    {"p": 1},',
        '    {"p": 2}',
        "  ]",
        "}",
    ]


@pytest.mark.parametrize("fmt", ["hdf5", "safetensors", "npz", "tf"])
@pytest.mark.parametrize("components", ["all", "logical"])
def test_a_converted_file_reads_back_as_the_entries_written(tmp_path, fmt, components):
    """What convert reports of its output is counted from the entries it wrote
    (``on_written``): each of these formats reads back as exactly those."""
    records = _records()
    if fmt == "safetensors":
        records = [r for r in records if r.path != "m/txt"]  # (no strings in safetensors)
    if components == "logical":
        records = [r for r in records if r.kind != "independent"]  # (has no single value)
    lib, gen = _files(tmp_path, records)
    for k, src in enumerate((lib, gen)):
        dst = tmp_path / f"out{k}" / ("ckpt" if fmt == "tf" else f"o.{fmt}")
        dst.parent.mkdir()
        got: dict = {}
        convert(src, dst, to_format=fmt, components=components, on_written=got.update)
        with open_checkpoint(str(dst), format=fmt) as view:
            assert sorted(view) == sorted(got)
            assert sum(int(view[p].nbytes) for p in view) == sum(
                int(e.nbytes) for e in got.values()
            )


def test_the_commands_on_a_multi_process_index_file(tmp_path, capsys):
    """A checkpoint saved by several processes (an index file whose components are external
    links into its parts): the table's rows are the entries' rows, the bulk paths leave the
    linked components to the general path, and every command reads it as before."""
    from test_mpi_files import save_all

    (path,) = set(save_all(tmp_path, 2, 3, [None, None]))
    assert _table_rows(path) == _entry_rows(path)
    with H5Reader(path, keep_entries=False) as r:
        assert all(parts is None for _, parts in r.bulk_components(list(r)))
    assert main(["verify", path]) == 0
    capsys.readouterr()
    assert main(["--json", "diff", path, path]) == 0
    assert json.loads(capsys.readouterr().out)["equal"]
    for out in ("o.safetensors", "o.h5", "o.npz"):
        assert main(["convert", path, str(tmp_path / out)]) == 0
        assert main(["diff", path, str(tmp_path / out)]) in (0, 1)
    assert main(["diff", path, str(tmp_path / "o.h5")]) == 0
    capsys.readouterr()


def test_one_rule_for_a_bulk_readable_row_whatever_the_component_size(tmp_path, monkeypatch):
    """A row is read in bulk by the commands (``bulk_components``, ``differing_components``)
    and by a restore under one definition (``IndexTable.direct``: every component placed,
    with bytes, any size); the commands also keep each batch within BULK_BYTES, so a variable
    larger than that is read the general way."""
    import parallelvars as pv
    from parallelvars.checkpoint.h5io import bulk as bulk_module

    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.small = pv.Variable(np.arange(8, dtype=np.float32))
        m.large = pv.Variable(np.arange(1 << 16, dtype=np.float32))  # 256 KiB components
    path = pv.Checkpoint(model=m).write(tmp_path / "c.h5")
    with H5Reader(path) as r:
        table = r.table
        assert table is not None
        assert [table.direct[table.rows[k]] for k in ("model/small", "model/large")] == [
            True,
            True,
        ]
        got = dict(r.bulk_components(["model/small", "model/large"]))
        assert got["model/large"] is not None
        assert [p.tobytes() for p in got["model/large"]] == [
            c.tobytes() for c in m.large.components
        ]
        assert r.differing_components(["model/small", "model/large"]) == {
            "model/small": [],
            "model/large": [],
        }
        monkeypatch.setattr(bulk_module, "BULK_BYTES", 1 << 18)  # the large row: 512 KiB
        assert dict(r.bulk_components(["model/large"]))["model/large"] is None


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_safetensors_bulk_components_the_same_whatever_the_rows_looked_up_at_a_time(
    tmp_path, monkeypatch, rows
):
    """A safetensors view looks its table's rows up a chunk of paths at a time (a batch ends
    at each chunk's end): every path comes back once, in order, with the same components as
    when every row is looked up at once, a path the table does not list included."""
    _, h5 = _files(tmp_path, [r for r in _records() if r.path != "m/txt"])
    st_path = str(tmp_path / "a.safetensors")
    convert(h5, st_path)
    with open_checkpoint(st_path) as view:
        keys = [*list(view), "no/such", *list(view)[:2]]
        whole = [
            (k, None if c is None else [x.tobytes() for x in c])
            for k, c in view.bulk_components(keys)
        ]
        monkeypatch.setattr(info_views, "_ROWS", rows)
        chunked = [
            (k, None if c is None else [x.tobytes() for x in c])
            for k, c in view.bulk_components(keys)
        ]
    assert [k for k, _ in whole] == keys
    assert chunked == whole
    assert sum(c is not None for _, c in whole) > 3
