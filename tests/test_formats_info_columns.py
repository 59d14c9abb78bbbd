"""The column form of the parallel info (version 2) and the ``raw:`` header checksum of our
safetensors files: what the writer writes, that files of the older form (version 1, canonical
header checksum) still read, that the reference library loads what we write, and that a
malformed column is refused naming the file, the column or variable, expected and found."""

from __future__ import annotations

import json
import pathlib
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from formats_testlib import assert_same_view, same_bits
from safetensors import safe_open
from safetensors.numpy import save_file

from parallelvars.cli import main
from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    FormatVersionError,
    LimitExceededError,
    UnsupportedDtypeError,
)
from parallelvars.formats import ArrayEntry, DictView, open_checkpoint
from parallelvars.formats.safetensors import open_safetensors, write_safetensors

DATA = pathlib.Path(__file__).parent / "data"
GOLDEN = DATA / "safetensors_v1"
NATIVE = DATA / "native" / "v1" / "single.h5"


def _header(path) -> tuple[int, dict, bytes]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
    return n, json.loads(raw), raw


def _info(path) -> dict:
    return json.loads(_header(path)[1]["__metadata__"]["parallelvars"])


def _sweep() -> DictView:
    """Every kind, the dtypes safetensors names and those it does not, 0-d and empty."""
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    entries = [
        ArrayEntry("model/w", [w, w + 1], kind="mirrored", attrs={"devices": ["d:0", "d:1"]}),
        ArrayEntry(
            "model/e",
            [w[:1], w[1:3], w[3:]],
            kind="sharded",
            shape=(4, 3),
            attrs={"shard_axis": 0, "shard_offsets": [0, 1, 3]},
        ),
        ArrayEntry(
            "model/s",
            [np.float32([1, 2]), np.float32([3, 4])],
            kind="on_read",
            attrs={"aggregation": "sum"},
        ),
        ArrayEntry(
            "model/i",
            [np.int8([1]), np.int8([2]), np.int8([3])],
            kind="independent",
        ),
        ArrayEntry("bf", [np.arange(6, dtype=ml_dtypes.bfloat16)] * 2, kind="mirrored"),
        ArrayEntry("f8", [np.arange(4, dtype=ml_dtypes.float8_e4m3fn)], attrs={"note": "x"}),
        ArrayEntry("f16", [np.float16([1.5, -0.0])]),
        ArrayEntry("flags", [np.array([True, False])] * 2, kind="mirrored"),
        ArrayEntry("empty", [np.zeros((0, 3), np.float64)] * 2, kind="mirrored"),
        ArrayEntry("step", [np.array(7, np.int64)]),
        ArrayEntry("u64", [np.uint64([2**63 + 1])]),
        # Values equal in Python but not in JSON stay apart in a column's table.
        ArrayEntry("z0", [np.float32([0])], attrs={"scale": 0.0, "flag": 1}),
        ArrayEntry("z1", [np.float32([0])], attrs={"scale": -0.0, "flag": True}),
    ]
    # Many alike variables, the case the columns are for; attributes in one order.
    for k in range(40):
        entries.append(
            ArrayEntry(
                f"opt/slots/v{k}/m",
                [np.full(3, k, np.float32)] * 2,
                kind="mirrored",
                attrs={"name": f"v{k}/m", "trainable": False, "slot_of": f"v{k}", "slot_name": "m"},
            )
        )
    return DictView(entries)


# ------------------------------------------------------------------------------ the writer
def test_the_writer_writes_columns_and_a_raw_header_checksum(tmp_path) -> None:
    view = _sweep()
    path = write_safetensors(tmp_path / "m.safetensors", view)
    info = _info(path)
    assert info["version"] == 2 and "variables" not in info
    columns = info["columns"]
    assert columns["kind"]["values"][0] == "mirrored"  # the indexed form for repeated values
    assert len(columns["path"]) == len(set(columns["path"]))
    record = _header(path)[1]["__metadata__"]["parallelvars_crc32c"]
    assert record.startswith("raw:")
    with open_safetensors(path) as back:
        assert_same_view(back, view)
        for key in view:  # the attributes, in each variable's own order and JSON values
            assert list(back[key].attrs) == list(view[key].attrs), key
            assert json.dumps(back[key].attrs) == json.dumps(view[key].attrs), key


def test_the_reference_library_loads_what_we_write(tmp_path) -> None:
    view = _sweep()
    path = write_safetensors(tmp_path / "m.safetensors", view)
    # (numpy has no float8: the reference library's numpy loader takes every other tensor)
    with safe_open(path, framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "f8"}  # noqa: SIM118
        assert f.metadata()["parallelvars_crc32c"].startswith("raw:")
    assert same_bits(tensors["model.w"], view["model/w"].component(0))
    assert same_bits(tensors["model.w/parallel_component_1"], view["model/w"].component(1))
    assert same_bits(tensors["model.e"], view["model/e"].value())
    assert tensors["opt.slots.v7.m"].tolist() == [7.0, 7.0, 7.0]


def test_the_columns_are_a_fraction_of_the_records(tmp_path) -> None:
    """The reason for the form: alike variables' fields are written once, so a variable adds
    its path, its own attribute values and its key positions (a version-1 record of such a
    slot, every field named and escaped, is over 350 bytes)."""

    def info_bytes(count: int) -> int:
        entries = [
            ArrayEntry(
                f"opt/slots/v{k}/m",
                [np.full(3, k, np.float32)] * 2,
                kind="mirrored",
                attrs={"name": f"v{k}/m", "devices": ["d:0", "d:1"], "slot_of": f"v{k}"},
            )
            for k in range(count)
        ]
        path = write_safetensors(tmp_path / f"m{count}.safetensors", DictView(entries))
        return len(_header(path)[1]["__metadata__"]["parallelvars"])

    per_variable = (info_bytes(400) - info_bytes(200)) / 200
    assert per_variable < 120, per_variable


def test_attributes_in_different_orders_keep_the_record_form(tmp_path) -> None:
    """The columns give attributes back in one order: a file whose variables differ in it is
    written as version 1 records, so no order changes."""
    a = ArrayEntry("a", [np.float32([1])], attrs={"x": 1, "y": 2})
    b = ArrayEntry("b", [np.float32([2])], attrs={"y": 3, "x": 4})
    view = DictView([a, b])
    path = write_safetensors(tmp_path / "m.safetensors", view)
    assert _info(path)["version"] == 1
    with open_safetensors(path) as back:
        assert list(back["a"].attrs) == ["x", "y"] and list(back["b"].attrs) == ["y", "x"]


def test_attributes_past_the_readers_bound_keep_the_record_form(tmp_path, monkeypatch) -> None:
    """A model whose attributes would expand past what the reader takes (the header limit,
    made small here) is written as version 1 records: we never write what we refuse."""
    monkeypatch.setattr("parallelvars.formats._info_columns.ATTRS_LIMIT", 200)
    entries = [
        ArrayEntry(f"v{i}", [np.float32([i])], attrs={"note": "x" * 40, "k": i}) for i in range(8)
    ]
    path = write_safetensors(tmp_path / "m.safetensors", DictView(entries))
    assert _info(path)["version"] == 1
    with open_safetensors(path) as back:
        assert back["v7"].attrs == {"note": "x" * 40, "k": 7}
    few = write_safetensors(tmp_path / "few.safetensors", DictView(entries[:1]))
    assert _info(few)["version"] == 2


def test_a_shard_set_index_holds_the_columns(tmp_path) -> None:
    view = _sweep()
    index = write_safetensors(tmp_path / "set" / "model.safetensors", view, max_shard_size=64)
    doc = json.loads(pathlib.Path(index).read_text())
    assert doc["metadata"]["parallelvars"]["version"] == 2
    with open_safetensors(index) as back:
        assert_same_view(back, view)


# --------------------------------------------------------------------- old files still read
@pytest.mark.parametrize("name", ["single.safetensors", "set/model.safetensors.index.json"])
def test_files_of_the_record_form_still_read(tmp_path, name) -> None:
    """Golden files written before the column form (tests/data/safetensors_v1/README.md)."""
    path = GOLDEN / name
    if name.startswith("set/"):
        doc = json.loads(path.read_text())
        assert doc["metadata"]["parallelvars"]["version"] == 1
    else:
        assert _info(path)["version"] == 1
        assert not _header(path)[1]["__metadata__"]["parallelvars_crc32c"].startswith("raw:")
    with open_checkpoint(NATIVE) as native, open_checkpoint(path) as back:
        assert sorted(back) == sorted(native)
        assert {back[k].kind for k in back} >= {"mirrored", "sharded", "on_read", "single"}
        assert_same_view(back, native)
    assert main(["diff", str(path), str(NATIVE)]) == 0


def test_a_file_of_the_record_form_keeps_its_header_checksum(tmp_path) -> None:
    """The canonical checksum of older files still catches a changed header."""
    path = tmp_path / "m.safetensors"
    shutil.copy(GOLDEN / "single.safetensors", path)
    n, header, _ = _header(path)
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [*header[name]["shape"], 1]
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(raw + b" " * (n - len(raw)))
    with pytest.raises(ChecksumMismatchError, match="header does not match its checksum"):
        open_safetensors(path)


def test_the_new_files_convert_back_to_the_same_checkpoint(tmp_path) -> None:
    out = tmp_path / "m.safetensors"
    assert main(["convert", str(NATIVE), str(out)]) == 0
    assert _info(out)["version"] == 2
    with open_checkpoint(NATIVE) as native, open_checkpoint(out) as back:
        assert_same_view(back, native)
    assert main(["diff", str(NATIVE), str(out)]) == 0


# ------------------------------------------------------------------- the raw header checksum
def test_a_changed_header_byte_is_caught(tmp_path) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", _sweep())
    _, _, raw = _header(path)
    at = raw.index(b"mirrored")  # inside the escaped info: no other check would see it
    with open(path, "r+b") as f:
        f.seek(8 + at)
        f.write(b"M")
    with pytest.raises(ChecksumMismatchError) as err:
        open_safetensors(path)
    assert str(path) in str(err.value) and "parallelvars_crc32c" in str(err.value)


def test_a_record_written_another_way_is_refused(tmp_path) -> None:
    """The raw record must be where the writer writes it, in plain text: an escaped copy is
    damage, not a second way to say it."""
    path = write_safetensors(tmp_path / "m.safetensors", _sweep())
    n, _, raw = _header(path)
    raw2 = raw.replace(b'"raw:', b'"\\u0072aw:', 1)
    raw2 = raw2.rstrip(b" ")
    with open(path, "r+b") as f:
        f.seek(0)
        f.write(struct.pack("<Q", len(raw2)))
        f.write(raw2)
    data = pathlib.Path(path).read_bytes()[8 + n :]
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(raw2)) + raw2 + data)
    with pytest.raises(CorruptCheckpointError, match="not where the header's bytes hold it"):
        open_safetensors(path)


# -------------------------------------------------------------------- malformed columns
def _columns_file(tmp_path, columns_edit, *, version: int = 2) -> pathlib.Path:
    """A file of two mirrored variables whose (unchecksummed) info has ``columns_edit``."""
    tensors = {
        "a": np.float32([1, 2]),
        "a/parallel_component_1": np.float32([1, 2]),
        "b": np.float32([3]),
        "b/parallel_component_1": np.float32([3]),
    }
    names = sorted(tensors)
    columns = {
        "path": ["a", "b"],
        "kind": {"values": ["mirrored"], "index": 0},
        "dtype": {"values": ["float32"], "index": [0, 0]},
        "shape": [[2], [1]],
        "num_components": {"values": [2], "index": 0},
        "layout": {"values": ["components"], "index": 0},
        "keys": [names.index(k) for k in ("a", "a/parallel_component_1", "b")]
        + [names.index("b/parallel_component_1")],
        "attrs": {"devices": {"values": [["x", "y"]], "index": [0, -1]}},
    }
    columns_edit(columns)
    info = {"format": "parallelvars", "version": version, "names": "slash", "columns": columns}
    path = tmp_path / "c.safetensors"
    save_file(tensors, str(path), metadata={"parallelvars": json.dumps(info)})
    return path


def test_a_sound_columns_file_reads(tmp_path) -> None:
    path = _columns_file(tmp_path, lambda c: None)
    with open_safetensors(path) as v:
        assert sorted(v) == ["a", "b"]
        assert v["a"].kind == "mirrored" and v["a"].num_components == 2
        assert v["a"].attrs == {"devices": ["x", "y"]} and v["b"].attrs == {}
        assert v["b"].component(1).tolist() == [3.0]


def _set(key, value):
    return lambda c: c.__setitem__(key, value)


@pytest.mark.parametrize(
    ("edit", "match", "variable"),
    [
        (_set("path", "a"), "no list of variable paths", "columns/path"),
        (_set("path", ["a", "a"]), "listed twice", "'a'"),
        (_set("kind", ["mirrored"]), "wrong length", "columns/kind"),
        (_set("kind", {"values": ["mirrored"], "index": [0, 1]}), "outside its values", "'b'"),
        (_set("kind", {"values": ["mirrored"], "index": [0, True]}), "outside its values", "'b'"),
        (_set("kind", {"values": ["mirrored"]}), "is not a column", "columns/kind"),
        (_set("kind", {"values": 5, "index": 0}), "malformed", "columns/kind"),
        (_set("dtype", {"values": None, "index": 0}), "malformed", "columns/dtype"),
        (
            _set("attrs", {"devices": {"values": 7, "index": 0}}),
            "malformed",
            "columns/attrs/devices",
        ),
        (_set("kind", {"values": ["sideways"], "index": 0}), "unknown variable kind", "'a'"),
        (_set("dtype", {"values": ["float99"], "index": 0}), "unknown dtype", "'a'"),
        (_set("shape", [[2], "1"]), "incomplete", "'b'"),
        (_set("num_components", {"values": ["2"], "index": 0}), "incomplete", "'a'"),
        (_set("layout", {"values": ["spread"], "index": 0}), "bad layout", "'a'"),
        (_set("keys", [0, 1, 2]), "wrong number of stored tensors", "'b'"),
        (_set("keys", [0, 1, 2, 3, 3]), "claimed twice", "columns/keys"),
        (_set("keys", [0, 1, 2, 9]), "does not hold", "columns/keys"),
        (_set("keys", "0123"), "does not hold", "columns/keys"),
        (_set("attrs", []), "attributes are not an object", "columns/attrs"),
        (
            _set("attrs", {"devices": {"values": [["x"]], "index": 0}}),
            "devices do not match",
            "'a'",
        ),
        (_set("shape", [[3], [1]]), "does not match the variable", "'a'"),
    ],
)
def test_malformed_columns_are_refused_by_name(tmp_path, edit, match, variable) -> None:
    path = _columns_file(tmp_path, edit)
    with pytest.raises((CorruptCheckpointError, UnsupportedDtypeError), match=match) as err:
        open_safetensors(path)
    text = str(err.value)
    assert str(path) in text and variable in text


def test_missing_columns_and_later_versions_are_refused(tmp_path) -> None:
    path = _columns_file(tmp_path, lambda c: c.clear())
    with pytest.raises(CorruptCheckpointError, match="no list of variable paths"):
        open_safetensors(path)
    path.unlink()
    path = _columns_file(tmp_path, lambda c: None, version=3)
    with pytest.raises(FormatVersionError, match="unknown version"):
        open_safetensors(path)


def test_diff_finds_one_differing_variable_in_a_batch(tmp_path, capsys) -> None:
    """Variables compared a batch at a time: one difference among many is still reported
    for that variable only, and -0.0 still equals 0.0."""
    view = _sweep()
    a = write_safetensors(tmp_path / "a.safetensors", view)
    entries = dict(view.items())
    changed = np.full(3, 17, np.float32)
    changed[1] = 17.5
    entries["opt/slots/v17/m"] = ArrayEntry(
        "opt/slots/v17/m",
        [changed, np.full(3, 17, np.float32)],
        kind="mirrored",
        attrs=dict(view["opt/slots/v17/m"].attrs),
    )
    entries["f16"] = ArrayEntry("f16", [np.float16([1.5, 0.0])])
    b = write_safetensors(tmp_path / "b.safetensors", DictView(entries))
    assert main(["--json", "diff", a, b]) == 1
    doc = json.loads(capsys.readouterr().out)
    differing = [r["path"] for r in doc["variables"] if not r["equal"]]
    assert differing == ["opt/slots/v17/m"]
    row = next(r for r in doc["variables"] if r["path"] == "opt/slots/v17/m")
    assert [c["mismatched"] for c in row["components"]] == [1, 0]


def test_detecting_a_safetensors_file_does_not_load_the_keras_adapter(tmp_path) -> None:
    """Keras files are HDF5 files or zip archives: another file never imports that adapter
    to be sniffed (tens of milliseconds of every command on a safetensors file)."""
    import subprocess
    import sys

    path = write_safetensors(tmp_path / "m.safetensors", _sweep())
    code = (
        "import sys\n"
        "from parallelvars.formats import detect_format\n"
        f"print(detect_format({str(path)!r}))\n"
        "print(sorted(m for m in sys.modules if m.startswith('parallelvars.formats.keras')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["safetensors", "[]"]
    # (a Keras file is still found: its adapter is imported for an HDF5 file)
    from parallelvars.formats import detect_format

    assert detect_format(DATA / "keras" / "model.weights.h5") == "keras"
    assert detect_format(DATA / "keras" / "model_legacy.h5") == "keras-legacy"


def test_attribute_columns_that_expand_beyond_the_document_are_refused(tmp_path) -> None:
    """``"index": 0`` stands for one value per variable: 2,000 variables x 8,000 such columns
    would be 16 million attributes (over 100 MB as version 1's records) from a 240 KB document;
    the reader refuses it, by name, before expanding any."""
    n, k = 2000, 8000
    tensors = {f"t{i:05d}": np.float32([i]) for i in range(n)}
    one = {"values": [0], "index": 0}
    columns = {
        "path": [f"v{i}" for i in range(n)],
        "kind": {"values": ["single"], "index": 0},
        "dtype": {"values": ["float32"], "index": 0},
        "shape": {"values": [[1]], "index": 0},
        "num_components": {"values": [1], "index": 0},
        "layout": {"values": ["components"], "index": 0},
        "keys": list(range(n)),
        "attrs": {f"x{j}": one for j in range(k)},
    }
    info = {"format": "parallelvars", "version": 2, "names": "slash", "columns": columns}
    path = tmp_path / "amp.safetensors"
    save_file(tensors, str(path), metadata={"parallelvars": json.dumps(info)})
    with pytest.raises(LimitExceededError, match="expand beyond what a header may hold") as err:
        open_checkpoint(path)
    text = str(err.value)
    assert str(path) in text and "columns/attrs" in text and "2000 variables x 8000" in text
    # the same columns for 20 variables read, every attribute there
    columns["path"], columns["keys"] = columns["path"][:20], list(range(20))
    info["columns"] = columns
    path.unlink()
    save_file(
        {k: tensors[k] for k in sorted(tensors)[:20]},
        str(path),
        metadata={"parallelvars": json.dumps(info)},
    )
    with open_checkpoint(path) as v:
        assert len(v) == 20 and len(v["v19"].attrs) == k and v["v19"].attrs["x7999"] == 0


def test_variables_sharing_an_attribute_value_do_not_share_its_object(tmp_path) -> None:
    """Version 2 stores a repeated value once; each variable still gets attributes of its own,
    as version 1's records give: changing one variable's changes no other's."""
    nested = {"values": [{"k": [1, [2]]}], "index": 0}
    path = _columns_file(
        tmp_path,
        lambda c: c["attrs"].update(
            {"devices": {"values": [["x", "y"]], "index": 0}, "extra": nested}
        ),
    )
    with open_checkpoint(path) as v:
        a, b = v["a"].attrs, v["b"].attrs
        assert a == b == {"devices": ["x", "y"], "extra": {"k": [1, [2]]}}
        a["devices"].append("z")
        a["extra"]["k"][1].append(3)
        a["new"] = 1
        assert v["b"].attrs == {"devices": ["x", "y"], "extra": {"k": [1, [2]]}}
        assert v["a"].attrs["devices"] == ["x", "y", "z"]  # (the entry's own, kept)
        assert v["b"].component(1).tolist() == [3.0]


def test_a_damaged_tensor_crc_digit_is_reported_as_that_tensors_mismatch(tmp_path) -> None:
    """The header CRC reads every digit of the record as 0, the tensors' CRCs too: a changed
    digit of one shows when that tensor is read, named, and the message does not blame the
    bytes alone."""
    path = write_safetensors(
        tmp_path / "m.safetensors",
        DictView([ArrayEntry("w", [np.float32([1, 2])]), ArrayEntry("z", [np.float32([3])])]),
    )
    _, _, raw = _header(path)
    record = json.loads(raw)["__metadata__"]["parallelvars_crc32c"]
    at = 8 + raw.index(record.encode()) + len("raw:") + 8  # the first tensor's first digit
    data = bytearray(pathlib.Path(path).read_bytes())
    data[at] = ord("0") if data[at] != ord("0") else ord("1")
    pathlib.Path(path).write_bytes(bytes(data))
    with open_safetensors(path) as v:
        assert v["z"].component(0).tolist() == [3.0]
        with pytest.raises(ChecksumMismatchError, match="or the checksum stored") as err:
            v["w"].component(0)
    assert str(path) in str(err.value) and "'w'" in str(err.value)


def test_the_first_use_of_shared_attributes_is_one_dict_for_every_thread(tmp_path) -> None:
    """A version-2 entry copies its shared attributes at the first use; a restore reads
    entries from several threads. A thread that found no copy yet and is then overtaken (a
    thread switch between reading ``_own`` and building) must get the copy the other thread
    made, not a second one, nor an empty one made after the shared table was let go.

    The switch is placed where it hurts by a subclass that holds the second thread right
    after its first read of ``_own`` until the first thread has finished."""
    import threading

    overtaken, finished = threading.Event(), threading.Event()
    held: list[threading.Thread] = []
    with open_checkpoint(_columns_file(tmp_path, lambda c: None)) as view:
        entry = view["a"]
        assert entry._own is None  # (not copied yet: nothing read the attributes)

        class Held(type(entry)):  # type: ignore[misc]
            def __getattribute__(self, name: str) -> object:
                value = super().__getattribute__(name)
                if name == "_own" and held and threading.current_thread() is held[0]:
                    held.clear()  # only the first read
                    overtaken.set()
                    finished.wait(10)
                return value

        entry.__class__ = Held
        got: list[object] = []
        second = threading.Thread(target=lambda: got.append(entry.attrs))
        held.append(second)
        second.start()
        assert overtaken.wait(10)
        first = entry.attrs  # the first thread, while the second is held
        finished.set()
        second.join(10)
        want = {"devices": ["x", "y"]}
        assert first == want
        assert got == [want] and got[0] is first  # the second thread: the same copy
        assert entry.attrs is first and entry.attrs == want  # and the entry keeps it


def _record_file(tmp_path: pathlib.Path, **fields: object) -> pathlib.Path:
    """A safetensors file another tool wrote (no checksum) with a version-1 parallel info of
    one mirrored variable ``v``, ``fields`` changed in its record."""
    record: dict[str, object] = {
        "kind": "mirrored",
        "dtype": "float32",
        "shape": [2],
        "num_components": 2,
        "layout": "components",
        "keys": ["v", "v/parallel_component_1"],
        **fields,
    }
    info = {"format": "parallelvars", "version": 1, "names": "slash", "variables": {"v": record}}
    path = tmp_path / "records.safetensors"
    tensors = {"v": np.ones(2, np.float32), "v/parallel_component_1": np.ones(2, np.float32)}
    save_file(tensors, str(path), metadata={"parallelvars": json.dumps(info)})
    return path


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (
            {"shape": [2.7]},
            r"shape is not of integers\) \(expected a list of integers, found \[2.7\]",
        ),
        ({"shape": ["2"]}, r"shape is not of integers"),
        ({"shape": [True, 1]}, r"shape is not of integers"),
        ({"num_components": 2.0}, r"num_components is not of integers"),
        ({"num_components": "2"}, r"num_components is not of integers"),
        ({"keys": "v"}, r"keys is not of strings"),
        ({"keys": [0, 1]}, r"keys is not of strings"),
    ],
)
def test_both_forms_of_the_info_check_a_records_fields_alike(tmp_path, fields, match) -> None:
    """A version-1 record's shape, number of components and keys are checked as version 2's
    columns are (one check for both): a value of another type is refused naming the file and
    the variable, not converted (``int(2.7)`` read a shape of 2.7 as 2)."""
    path = _record_file(tmp_path, **fields)
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        open_checkpoint(path).close()
    assert str(path) in str(info.value) and "'v'" in str(info.value)
    with open_checkpoint(_record_file(tmp_path)) as view:  # the sound record reads
        assert view["v"].kind == "mirrored" and view["v"].component(1).tolist() == [1.0, 1.0]


def test_summary_and_described_give_the_attributes_an_entry_changed(tmp_path) -> None:
    """A change to an entry's attributes stays (the view keeps that entry), and the view's
    answers without an entry made (``summary``, ``described``) give the changed values too,
    not the stored ones; the other variables' stay as stored."""
    import gc

    def edit(columns):
        columns["attrs"]["note"] = {"values": [[1, 2]], "index": 0}

    with open_checkpoint(_columns_file(tmp_path, edit)) as view:
        entry = view["a"]
        entry.attrs["note"].append(3)
        del entry
        gc.collect()
        assert view["a"].attrs["note"] == [1, 2, 3]
        assert view.summary("a")[5]["note"] == [1, 2, 3]
        assert view.summary("b")[5]["note"] == [1, 2]
        got = view.described(["a", "b"], ["note", "devices"])
        assert [row[4:] for row in got] == [([1, 2, 3], ["x", "y"]), ([1, 2], None)]
        view["b"].attrs = {"note": [7]}  # (replaced whole: the same)
        assert view.summary("b")[5] == {"note": [7]}
        assert view.described(["b"], ["note", "devices"])[0][4:] == ([7], None)


def test_two_threads_looking_up_one_variable_get_one_entry(tmp_path, monkeypatch) -> None:
    """The view makes an entry when a variable is first looked up; two threads looking up
    the same one at once must get the same entry (a change through one is the other's), not
    one each with the later overwriting the earlier.

    The switch is placed where it hurts: the first thread is held while it makes the entry
    until the second has either begun making one too or waits for the first to finish."""
    import threading

    with open_checkpoint(_columns_file(tmp_path, lambda c: None)) as view:
        table = view._entries
        real = type(view["b"])._checked  # (bound before it is replaced)
        first: list[threading.Thread] = []
        making, second_came = threading.Event(), threading.Event()

        def held(cls, *args):
            if threading.current_thread() is first[0]:
                making.set()
                assert second_came.wait(10)
            else:
                second_came.set()
            return real(*args)

        class Waiting:  # the table's lock, telling when a second thread waits on it
            def __init__(self, lock) -> None:
                self.lock = lock

            def __enter__(self):
                if threading.current_thread() is not first[0]:
                    second_came.set()
                return self.lock.__enter__()

            def __exit__(self, *exc):
                return self.lock.__exit__(*exc)

        monkeypatch.setattr("parallelvars.formats._info.StoredEntry._checked", classmethod(held))
        lock = getattr(table, "_making", threading.Lock())
        monkeypatch.setattr(table, "_making", Waiting(lock), raising=False)
        got: dict[str, object] = {}
        one = threading.Thread(target=lambda: got.__setitem__("first", view["a"]))
        first.append(one)
        one.start()
        assert making.wait(10)  # the first thread is making the entry
        got["second"] = view["a"]
        one.join(10)
        assert not one.is_alive()
        assert got["first"] is got["second"] is view["a"]
        got["first"].attrs["devices"].append("z")
        assert view["a"].attrs["devices"] == ["x", "y", "z"]
