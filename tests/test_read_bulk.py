"""The readers in bulk: components read where the index places them (no dataset opened one by
one), inspect's comparison of mirrored components in bulk, and verify of a file the generator
wrote by regenerating its metadata (docs/FORMAT.md, "How the commands read").
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_corruption import _h5py_everything
from test_h5raw import _SETTINGS, both, structures

from parallelvars.checkpoint.h5io import H5Reader, StoredVariable
from parallelvars.checkpoint.h5io import bulk as h5bulk
from parallelvars.checkpoint.h5io import read as h5read
from parallelvars.checkpoint.h5io.layout import COLUMNS_DATASET, INDEX_DATASET
from parallelvars.checkpoint.h5io.regenerated import sound_as_generated
from parallelvars.checkpoint.h5raw.native import write_native
from parallelvars.checkpoint.registry import SaveRecord
from parallelvars.cli import main


def generated(tmp_path, *, share: bool = True, differ: bool = False, n: int = 6) -> str:
    """A generated file: ``n`` mirrored variables of 2 components (the last one's components
    differ when ``differ``), an on-read, an int8 single and a sharded one."""
    records = []
    for k in range(n):
        w = np.arange(40, dtype=np.float32) + k
        other = w + 1 if differ and k == n - 1 else w.copy()
        records.append(
            SaveRecord("mirrored", [w, other], (40,), {"devices": ["a", "b"]}, path=f"m/v{k}")
        )
    records.append(
        SaveRecord(
            "on_read",
            [np.ones(3, np.float16), np.zeros(3, np.float16)],
            (3,),
            {"devices": ["a", "b"], "aggregation": "sum"},
            path="m/r",
        )
    )
    records.append(SaveRecord("single", [np.arange(5, dtype=np.int8)], (5,), {}, path="m/s"))
    full = np.arange(12, dtype=np.float32).reshape(6, 2)
    records.append(
        SaveRecord(
            "sharded",
            [full[:4], full[4:]],
            (6, 2),
            {"devices": ["a", "b"], "shard_axis": 0, "shard_offsets": [0, 4]},
            path="m/e",
        )
    )
    path = str(tmp_path / "gen.h5")
    return write_native(path, records, object_graph={"version": 1}, share_equal=share)


def no_dataset_walk(monkeypatch) -> None:
    """Make the object-by-object verify fail loudly: the fast path must not need it."""

    def refuse(*_a, **_k):
        raise AssertionError("the object-by-object path ran")

    monkeypatch.setattr(StoredVariable, "verify_through_h5", refuse)
    monkeypatch.setattr(StoredVariable, "verify_group", refuse)


@pytest.mark.parametrize("share", [False, True])
def test_verify_of_a_generated_file_regenerates_it_and_walks_no_object(
    tmp_path, monkeypatch, share
):
    path = generated(tmp_path, share=share)
    no_dataset_walk(monkeypatch)
    with H5Reader(path) as r:
        assert sound_as_generated(r)
        assert r.verify_all() == []


def test_a_file_written_through_libhdf5_takes_the_object_by_object_path(tmp_path):
    from parallelvars.checkpoint.h5io.write import write_h5

    record = SaveRecord("single", [np.arange(4, dtype=np.float32)], (4,), {}, path="w")
    path = write_h5(tmp_path / "lib.h5", [record])
    with H5Reader(path) as r:
        assert not sound_as_generated(r)
        assert r.verify_all() == []


def test_a_checkpoint_write_is_verified_by_regeneration(tmp_path, monkeypatch):
    import parallelvars as pv

    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        w = pv.Variable(np.arange(4, dtype=np.float32), name="w")
    path = pv.Checkpoint(w=w).write(tmp_path / "ckpt.h5")
    no_dataset_walk(monkeypatch)
    with H5Reader(path) as r:
        assert sound_as_generated(r)
        assert r.verify_all() == []


@settings(max_examples=6, **_SETTINGS)  # type: ignore[arg-type]
@given(records=structures(), share=st.booleans())
def test_every_generated_structure_verifies_by_regeneration(tmp_path, records, share):
    """Every kind, dtype (bfloat16, float8, bool, ints), shape (0-d, empty), 1-6 components,
    slots, shared components: the file regenerates byte for byte; its libhdf5 twin does not
    (and still verifies, object by object)."""
    a, b = both(tmp_path, records, share_equal=share)
    with H5Reader(b) as rb, H5Reader(a) as ra:
        assert sound_as_generated(rb)
        assert not sound_as_generated(ra)
        assert ra.verify_all() == []


@pytest.mark.parametrize("share", [False, True])
def test_verify_makes_and_compares_its_texts_a_few_rows_at_a_time(tmp_path, monkeypatch, share):
    """The documents' expected texts are made a few rows (and list items) at a time and
    compared a few bytes at a time, the components checked a few at a time and their sharing
    found a few rows at a time: batches of 1 to 3
    still regenerate the file exactly, and one changed byte anywhere in the index or columns
    document (its padding too) is found by that comparison.

    The open reads the columns document and checks its checksum, which refuses such a byte
    before verify runs; so that the comparison itself is what finds it, the open is handed
    the document as written (the damage one the open did not see)."""
    rg = "parallelvars.checkpoint.h5io.regenerated"
    path = generated(tmp_path, share=share, n=7)
    with H5Reader(path) as r:
        assert sound_as_generated(r)
    with h5py.File(path, "r") as f:
        places = {
            name: (f[name].id.get_offset(), f[name].dtype.itemsize)
            for name in (INDEX_DATASET, COLUMNS_DATASET)
        }
        written = json.loads(bytes(f[COLUMNS_DATASET][()]))
    raw = Path(path).read_bytes()
    real_read = h5read._read_json

    def as_written(f, name, file, **kw):
        return copy.deepcopy(written) if name == COLUMNS_DATASET else real_read(f, name, file, **kw)

    for rows, chunk, batch in ((1, 8, 1), (2, 64, 2), (3, 1, 3)):
        monkeypatch.setattr(f"{rg}._ROWS", rows)
        monkeypatch.setattr(f"{rg}._TEXT_CHUNK", chunk)
        monkeypatch.setattr(f"{rg}._BATCH", batch)
        monkeypatch.setattr(f"{rg}._WINDOW", rows)  # (the sharing found a few rows at a time)
        no_dataset_walk(monkeypatch)
        with H5Reader(path) as r:
            assert sound_as_generated(r)
        monkeypatch.undo()
        monkeypatch.setattr("parallelvars.checkpoint.h5io.read._read_json", as_written)
        monkeypatch.setattr(f"{rg}._ROWS", rows)
        monkeypatch.setattr(f"{rg}._TEXT_CHUNK", 8)
        with H5Reader(path) as r:  # (the open handed the document: the clean file is sound)
            assert sound_as_generated(r)
        missed = []  # (every damaged place tried, both documents, before any is reported)
        for name, (at, size) in places.items():
            doc = raw[at : at + size]
            assert doc.endswith(b" ")  # (its room's padding)
            for where in (at, at + size // 3, at + len(doc.rstrip()) - 1, at + size - 1):
                bad = bytearray(raw)
                bad[where] ^= 0x01
                damaged = tmp_path / f"bad{rows}.h5"
                damaged.write_bytes(bytes(bad))
                with H5Reader(str(damaged)) as r:
                    assert r._columns  # (opened from the columns, as the clean file is)
                    if sound_as_generated(r):
                        missed.append((name, where - at))
        assert missed == [], rows
        monkeypatch.undo()


def test_a_reader_that_walks_every_row_makes_no_mapping_of_its_paths(tmp_path):
    """verify walks the rows in order: the path -> row mapping (8 MB at 150,000 rows) is
    made only when a path is first looked up, and then answers as a dict would."""
    path = generated(tmp_path, n=7)
    with H5Reader(path, keep_entries=False) as r:
        assert r.verify_all() == []
        assert r.table.rows._rows is None
        assert r.table.rows.get("m/v3") == r.table.names.index("m/v3")
        assert r["m/v3"].component(0).tolist() == list(range(3, 43))
        assert "m/nope" not in r and r.table.rows.get("m/nope", -1) == -1
        assert list(r.table.rows) == r.table.names and len(r.table.rows) == len(r)


@pytest.mark.parametrize(
    "graph, kind",
    [
        ({"a": [{"b": 1}, "c"], "d": {}}, "parallelvars"),
        ({}, "parallelvars"),
        ([{"x": 1}, 2], "other"),
        ("text", "other"),
        (None, None),
    ],
)
def test_what_the_graph_is_is_known_whether_the_reader_keeps_it_or_not(tmp_path, graph, kind):
    """A reader that does not keep the object graph drops each of its objects as it is
    decoded at open: what the graph is, and the graph itself when asked for, are the same."""
    record = SaveRecord("single", [np.arange(3, dtype=np.float32)], (3,), {}, path="w")
    path = write_native(str(tmp_path / "g.h5"), [record], object_graph=graph)
    for keep in (True, False):
        with H5Reader(path, keep_entries=keep) as r:
            assert (r.graph_kind, r.object_graph) == (kind, graph)


def test_a_damaged_data_byte_falls_back_and_is_named(tmp_path, monkeypatch):
    path = generated(tmp_path)
    with H5Reader(path) as r:
        offset = int(r.table.offsets[0])
    with open(path, "r+b") as f:
        f.seek(offset + 3)
        byte = f.read(1)[0]
        f.seek(offset + 3)
        f.write(bytes([byte ^ 1]))
    with H5Reader(path) as r:
        assert not sound_as_generated(r)
        problems = r.verify_all()
    assert problems and "crc32c" in problems[0] and "m/v0" in problems[0]


def _flips(tmp_path, positions) -> tuple[int, int]:
    """Each flip: the fast verify refuses it, or h5py reads exactly the clean file."""
    path = generated(tmp_path, n=3)
    clean = _h5py_everything(path)
    with open(path, "rb") as f:
        raw = f.read()
    damaged = str(tmp_path / "damaged.h5")
    vouched = refused = 0
    failures = []
    for pos, bit in positions(len(raw)):
        data = bytearray(raw)
        data[pos] ^= 1 << bit
        with open(damaged, "wb") as f:
            f.write(bytes(data))
        try:
            with H5Reader(damaged) as r:
                ok = sound_as_generated(r)
        except Exception:
            ok = False
        if not ok:
            refused += 1
            continue
        vouched += 1
        try:
            seen = _h5py_everything(damaged)
        except Exception as exc:
            failures.append(f"bit {bit} of byte {pos}: vouched for, h5py fails: {exc!r}")
            continue
        if seen != clean:
            failures.append(f"bit {bit} of byte {pos}: vouched for, h5py reads other values")
    assert not failures, "\n".join(failures)
    return vouched, refused


def test_the_fast_verify_vouches_only_for_what_h5py_reads_identically(tmp_path):
    """A seeded sample of single-bit flips over the whole generated file."""
    rng = np.random.default_rng(26)

    def positions(size: int):
        for pos in rng.choice(size, size=min(size, 120), replace=False):
            yield int(pos), int(rng.integers(8))

    _vouched, refused = _flips(tmp_path, positions)
    assert refused > 0


@pytest.mark.slow  # every byte of a generated file through the fast verify and h5py
def test_the_fast_verify_vouches_only_for_what_h5py_reads_identically_every_byte(tmp_path):
    rng = np.random.default_rng(27)

    def positions(size: int):
        for pos in range(size):
            yield pos, int(rng.integers(8))

    _flips(tmp_path, positions)


def test_inspect_compares_mirrored_components_in_bulk(tmp_path, monkeypatch, capsys):
    """Equal and differing components, shared ones (hard links) included, without reading
    any component one by one; a damaged one is marked, by the general path."""
    path = generated(tmp_path, differ=True)
    with H5Reader(path) as r:
        found = r.differing_components([f"m/v{k}" for k in range(6)])
    assert found == {**{f"m/v{k}": [] for k in range(5)}, "m/v5": [1]}

    calls = []
    real = StoredVariable.component
    monkeypatch.setattr(
        StoredVariable, "component", lambda self, i: calls.append(self.path) or real(self, i)
    )
    assert main(["--json", "inspect", path]) == 0
    rows = {r["path"]: r for r in json.loads(capsys.readouterr().out)["variables"]}
    assert [rows[f"m/v{k}"]["equal"] for k in range(6)] == [True] * 5 + [False]
    assert rows["m/v5"]["differing"] == [1]
    assert calls == []  # every mirrored variable compared in bulk

    with H5Reader(path) as r:
        slot = int(r.table.first[r.table.rows["m/v5"]]) + 1
        offset = int(r.table.offsets[slot])
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff\xff")
    assert main(["--json", "inspect", path]) == 1
    rows = {r["path"]: r for r in json.loads(capsys.readouterr().out)["variables"]}
    assert "crc32c" in rows["m/v5"]["damaged"]
    assert calls == ["m/v5", "m/v5"]  # the damaged one alone, the general way


def test_components_are_read_without_opening_datasets(tmp_path, monkeypatch):
    """value(), component() and extract read by offset; hard-linked names read the shared
    bytes."""
    path = generated(tmp_path)
    opened = []
    real = h5read.H5Reader._open_dataset
    monkeypatch.setattr(
        h5read.H5Reader,
        "_open_dataset",
        lambda self, p, dt: opened.append(p) or real(self, p, dt),
    )
    with H5Reader(path) as r:
        np.testing.assert_array_equal(r["m/v2"].component(1), np.arange(40, dtype=np.float32) + 2)
        np.testing.assert_array_equal(r["m/v2"].value(), np.arange(40, dtype=np.float32) + 2)
        np.testing.assert_array_equal(
            r["m/e"].value(), np.arange(12, dtype=np.float32).reshape(6, 2)
        )
    out = tmp_path / "x.npy"
    assert main(["extract", path, "m/v3", "-o", str(out), "--component", "1"]) == 0
    np.testing.assert_array_equal(np.load(out), np.arange(40, dtype=np.float32) + 3)
    assert opened == []
    with h5py.File(path, "r") as f:  # (the names are hard links to one dataset)
        g = f["m/v3"]
        assert g["primary"].id.get_offset() == g["parallel_component_1"].id.get_offset()


def test_a_component_name_turned_external_link_is_refused_by_the_bulk_paths(tmp_path, capsys):
    """The index still places the component, but its name now leads out of the file."""
    path = generated(tmp_path)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.zeros(40, np.float32)
    with h5py.File(path, "r+") as f:
        del f["m/v1/parallel_component_1"]
        f["m/v1/parallel_component_1"] = h5py.ExternalLink(str(other), "/x")
    with H5Reader(path) as r:
        assert "m/v1" not in r.differing_components(["m/v1"])
        with pytest.raises(Exception, match="external link"):
            r["m/v1"].component(1)
    assert main(["--json", "inspect", path]) == 1
    assert "external link" in capsys.readouterr().out


def test_many_names_are_checked_by_one_walk_of_the_links(tmp_path, monkeypatch):
    """Past LINK_CHECKS names, the reader lists the file's links once (same answers)."""
    monkeypatch.setattr(h5bulk, "LINK_CHECKS", 2)
    path = generated(tmp_path)
    with H5Reader(path) as r:
        values = [r[f"m/v{k}"].component(1).tobytes() for k in range(6)]
        assert r._reached_slots is not None
        assert not r._reached("m/v0/nothing") and not r._reached("m/v0/parallel_component_9")
        assert r._reached("m/v0/parallel_component_1") and not r._reached("m/v99/primary")
    assert values == [(np.arange(40, dtype=np.float32) + k).tobytes() for k in range(6)]
    assert os.path.exists(path)


@pytest.mark.parametrize("batch", [1, 3, 1 << 15])
def test_dataset_headers_are_walked_in_batches_with_the_same_answers(tmp_path, monkeypatch, batch):
    """The walk of the datasets' headers (where each link's data lies) goes a batch at a
    time (its memory bounded): every component is still found where the index places it, in
    its own slot, whatever the batch."""
    monkeypatch.setattr(h5bulk, "LINK_CHECKS", 2)
    monkeypatch.setattr(h5bulk, "_HEADER_BATCH", batch)
    path = generated(tmp_path, share=False, differ=True, n=7)
    with H5Reader(path, keep_entries=False) as r:
        differing = r.differing_components([f"m/v{k}" for k in range(7)])
        assert r._reached_slots is not None and bool(r._reached_slots.all())
    assert differing == {**{f"m/v{k}": [] for k in range(6)}, "m/v6": [1]}
