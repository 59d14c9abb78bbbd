"""inspect, diff, verify and extract through ``main([...])`` on real files, human and --json."""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
import pytest
from _cli_support import replaced, sample_entries, write_sample
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from parallelvars.checkpoint.h5io import write_h5
from parallelvars.cli import main
from parallelvars.cli.diff import compare_arrays
from parallelvars.cli.verify import check_structure
from parallelvars.formats import ArrayEntry, write_checkpoint


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARALLELVARS_DEBUG", raising=False)


@pytest.fixture
def sample(tmp_path: pathlib.Path) -> str:
    return write_sample(tmp_path / "run.h5", step=7, note="first run")


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return json.loads(captured.out)


# --- inspect -------------------------------------------------------------------------------------


def test_inspect_human_tree(sample: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", sample]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{sample}: hdf5, 9 variables, 15 components, 214 B"
    assert lines[1] == "metadata:"
    tree = lines[lines.index("variables:") + 1 :]
    assert {"  note: first run", "  step: 7", "  parallelvars_format: 1"} <= set(lines[2:])
    # Groups end in "/", children are indented under them, columns line up.
    assert tree[0] == "metrics/"
    assert tree[1].split() == ["count", "on_read", "int64", "()", "2", "components", "16", "B",
                               "aggregation=sum"]  # fmt: skip
    model = tree.index("model/")
    assert tree[model + 1] == "  dense/"
    kernel = next(line for line in tree if line.strip().startswith("kernel"))
    assert kernel.startswith("    kernel")
    assert kernel.split()[1:] == [
        "mirrored",
        "float32",
        "(3,",
        "2)",
        "2",
        "components",
        "48",
        "B",
        "equal",
    ]
    scale = next(line for line in tree if line.strip().startswith("scale"))
    assert scale.split()[1:4] == ["single", "bfloat16", "(3,)"]
    vocab = next(line for line in tree if line.startswith("vocab"))
    assert vocab.split()[1:3] == ["single", "bytes"]  # the stored name, as docs/FORMAT.md spells it
    emb = next(line for line in tree if line.strip().startswith("embedding"))
    assert emb.split()[1] == "sharded" and emb.endswith("axis=0")
    slot = next(line for line in tree if line.strip().startswith("m "))
    assert slot.endswith("equal, slot=m")
    columns = {line.index(" mirrored ") for line in tree if " mirrored " in line}
    assert len(columns) == 1


def test_inspect_json(sample: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", sample, "--json"]) == 0
    doc = _json(capsys)
    assert doc["format"] == "hdf5"
    assert doc["metadata"]["step"] == 7 and doc["metadata"]["note"] == "first run"
    assert (doc["num_variables"], doc["num_components"], doc["bytes"]) == (9, 15, 214)
    by_path = {v["path"]: v for v in doc["variables"]}
    assert [v["path"] for v in doc["variables"]] == sorted(sample_entries())
    assert by_path["model/dense/kernel"] == {
        "path": "model/dense/kernel", "kind": "mirrored", "dtype": "float32", "shape": [3, 2],
        "components": 2, "bytes": 48, "attrs": {"devices": ["cpu:0", "cpu:1"], "trainable": True},
        "equal": True, "differing": [],
    }  # fmt: skip
    assert by_path["model/embedding"]["attrs"] == {"shard_axis": 0, "shard_offsets": [0, 3]}
    assert "equal" not in by_path["metrics/count"]  # only mirrored variables are compared
    assert by_path["vocab"]["dtype"] == "bytes"


def test_inspect_reports_unequal_mirrored_components(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = np.ones(4, np.float32)
    nudged = w.copy()
    nudged[2] = np.nextafter(np.float32(1), np.float32(2))
    negzero = np.zeros(4, np.float32)
    entries = {
        "w": ArrayEntry("w", [w, w, nudged], kind="mirrored"),
        # -0.0 == 0.0 as numbers, but a restore would not give back the same bits
        "z": ArrayEntry("z", [negzero, -negzero], kind="mirrored"),
        # NaN in the same place with the same bits is equal
        "n": ArrayEntry("n", [np.full(2, np.nan), np.full(2, np.nan)], kind="mirrored"),
    }
    path = write_sample(tmp_path / "m.h5", entries)
    assert main(["inspect", path, "--json"]) == 0
    by_path = {v["path"]: v for v in _json(capsys)["variables"]}
    assert (by_path["w"]["equal"], by_path["w"]["differing"]) == (False, [2])
    assert (by_path["z"]["equal"], by_path["z"]["differing"]) == (False, [1])
    assert (by_path["n"]["equal"], by_path["n"]["differing"]) == (True, [])
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "NOT EQUAL (components [2])" in out
    assert out.splitlines()[-1] == "2 mirrored variable(s) with unequal components"


def test_inspect_with_explicit_format_that_does_not_match(
    sample: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # --from forces the format; a file of another format is refused with one line, exit 2.
    code = main(["inspect", sample, "--from", "safetensors"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"parallelvars: error: {sample}: ")
    assert "Traceback" not in err


# --- diff ----------------------------------------------------------------------------------------


def test_diff_identical(
    sample: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = write_sample(tmp_path / "copy.h5")
    assert main(["diff", sample, other]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"A: {sample} (hdf5, 9 variables)",
        f"B: {other} (hdf5, 9 variables)",
        "no differences (9 variables compared, rtol=0, atol=0)",
    ]
    assert main(["diff", sample, other, "--json"]) == 0
    doc = _json(capsys)
    assert doc["equal"] is True and doc["missing"] == [] and doc["extra"] == []
    kernel = next(v for v in doc["variables"] if v["path"] == "model/dense/kernel")
    assert kernel == {
        "path": "model/dense/kernel", "equal": True, "differences": [], "compared": "components",
        "components": [{"component": i, "size": 6, "mismatched": 0, "max_abs": 0.0, "max_rel": 0.0}
                       for i in range(2)],
    }  # fmt: skip
    vocab = next(v for v in doc["variables"] if v["path"] == "vocab")
    assert vocab["components"] == [
        {"component": 0, "size": 2, "mismatched": 0, "max_abs": None, "max_rel": None}
    ]


def test_diff_finds_a_change_in_a_non_primary_component(
    sample: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kernel = np.arange(6, dtype=np.float32).reshape(3, 2) / 4
    changed = kernel.copy()
    changed[1, 1] += 0.5  # 0.75 -> 1.25 in component 1 only
    entries = replaced(
        sample_entries(), ArrayEntry("model/dense/kernel", [kernel, changed], kind="mirrored")
    )
    other = write_sample(tmp_path / "b.h5", entries)
    assert main(["diff", other, sample]) == 1
    out = capsys.readouterr().out.splitlines()
    assert (
        "model/dense/kernel [component 1]: 1 of 6 values differ; max abs 0.5, max rel 0.666667"
        in out
    )
    assert (
        out[-1] == "different: 0 missing, 0 extra, 1 of 9 common variables differ (rtol=0, atol=0)"
    )
    # Inside the tolerances, the same pair is equal: |1.25 - 0.75| <= 0.1 + 0.6 * 0.75.
    assert main(["diff", other, sample, "--rtol", "0.6", "--atol", "0.1"]) == 0
    assert main(["diff", other, sample, "--atol", "0.49", "--json"]) == 1
    capsys.readouterr()
    assert main(["diff", other, sample, "--atol", "0.5", "--json"]) == 0
    doc = _json(capsys)
    comp = next(v for v in doc["variables"] if v["path"] == "model/dense/kernel")["components"][1]
    assert (comp["mismatched"], comp["max_abs"]) == (0, 0.5)


def test_diff_structure_missing_and_extra(
    sample: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = sample_entries()
    del entries["step"]
    entries["extra/thing"] = ArrayEntry("extra/thing", [np.zeros(1)])
    entries["model/dense/bias"] = ArrayEntry(
        "model/dense/bias", [np.zeros(2, np.float64)] * 2, kind="mirrored"
    )
    kernel = np.arange(6, dtype=np.float32).reshape(3, 2) / 4
    entries["model/dense/kernel"] = ArrayEntry("model/dense/kernel", [kernel])  # single now
    entries["metrics/count"] = ArrayEntry(
        "metrics/count", [np.array(3, np.int64), np.array(4, np.int64)], kind="on_read",
        attrs={"aggregation": "mean"},
    )  # fmt: skip
    entries["rng/state"] = ArrayEntry(
        "rng/state", [np.array([1, 2, 0], np.uint32)] * 2, kind="independent"
    )
    other = write_sample(tmp_path / "b.h5", entries)
    assert main(["diff", sample, other]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "missing from B: step" in out
    assert "extra in B: extra/thing" in out
    assert "model/dense/bias: dtype float32 vs float64" in out
    assert "model/dense/kernel: kind mirrored vs single" in out
    assert "model/dense/kernel: components 2 vs 1" in out
    assert "metrics/count: aggregation sum vs mean" in out
    assert "rng/state: shape (2,) vs (3,)" in out
    assert (
        out[-1] == "different: 1 missing, 1 extra, 4 of 8 common variables differ (rtol=0, atol=0)"
    )
    assert main(["diff", sample, other, "--json"]) == 1
    doc = _json(capsys)
    assert (doc["missing"], doc["extra"], doc["num_differing"]) == (["step"], ["extra/thing"], 4)
    by_path = {v["path"]: v for v in doc["variables"]}
    # Different kinds: the logical values (the primary of the mirrored one) are compared.
    assert by_path["model/dense/kernel"]["compared"] == "logical"
    assert by_path["model/dense/kernel"]["components"][0]["mismatched"] == 0
    # Same layout, values equal after the cast: only the dtype differs.
    assert by_path["model/dense/bias"]["differences"] == ["dtype float32 vs float64"]
    assert by_path["model/dense/bias"]["components"][1]["mismatched"] == 0
    assert by_path["rng/state"]["compared"] is None


def test_diff_sharded_against_single_compares_the_full_value(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = np.arange(10, dtype=np.float32).reshape(5, 2)
    a = write_sample(tmp_path / "a.h5", {"t": ArrayEntry("t", [full[:3], full[3:]], kind="sharded", shape=(5, 2),
                                                           attrs={"shard_axis": 0, "shard_offsets": [0, 3]})})  # fmt: skip
    b = write_sample(tmp_path / "b.h5", {"t": ArrayEntry("t", [full])})
    assert main(["diff", a, b, "--json"]) == 1  # the kinds differ...
    var = _json(capsys)["variables"][0]
    assert var["differences"] == ["kind sharded vs single", "components 2 vs 1"]
    assert var["compared"] == "logical"
    assert var["components"] == [
        {"component": None, "size": 10, "mismatched": 0, "max_abs": 0.0, "max_rel": 0.0}
    ]


def test_diff_bad_input(
    sample: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diff", sample, str(tmp_path / "nope.h5")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"parallelvars: error: {tmp_path / 'nope.h5'}: no such ")
    assert err.count("\n") == 1


def test_compare_arrays_special_values() -> None:
    a = np.array([np.nan, np.inf, -np.inf, 1.0, np.nan, 0.0, 2.0])
    b = np.array([np.nan, np.inf, np.inf, np.inf, 1.0, -0.0, 0.0])
    got = compare_arrays(a, b, rtol=0.5, atol=0.0)
    assert got == {"size": 7, "mismatched": 4, "max_abs": np.inf, "max_rel": np.inf}
    ints = compare_arrays(
        np.array([2**40, 5], np.int64), np.array([2**40 + 3, 5], np.int64), rtol=0, atol=0
    )
    assert ints == {"size": 2, "mismatched": 1, "max_abs": 3.0, "max_rel": 3.0 / (2**40 + 3)}
    bf = compare_arrays(
        np.array([1.0, 2.0], ml_dtypes.bfloat16), np.array([1.0, 2.5], np.float32), rtol=0, atol=0
    )
    assert bf == {"size": 2, "mismatched": 1, "max_abs": 0.5, "max_rel": 0.2}
    c = compare_arrays(np.array([1 + 1j]), np.array([1 - 1j]), rtol=0, atol=0)
    assert (c["mismatched"], c["max_abs"]) == (1, 2.0)
    s = compare_arrays(np.array([b"a", b"b"], object), np.array([1.0, 2.0]), rtol=0, atol=0)
    assert s == {"size": 2, "mismatched": 2, "max_abs": None, "max_rel": None}


_floats = hnp.arrays(
    np.float64, st.integers(0, 40), elements=st.floats(allow_subnormal=False, width=64)
)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    a=_floats,
    rtol=st.sampled_from([0.0, 1e-6, 0.5]),
    atol=st.sampled_from([0.0, 1e-3, 10.0]),
)
def test_compare_arrays_agrees_with_numpy_isclose(
    data: st.DataObject, a: np.ndarray, rtol: float, atol: float
) -> None:
    b = data.draw(
        hnp.arrays(np.float64, a.shape, elements=st.floats(allow_subnormal=False, width=64))
    )
    got = compare_arrays(a, b, rtol=rtol, atol=atol)
    with np.errstate(all="ignore"):
        expected = int(np.count_nonzero(~np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)))
    assert got["mismatched"] == expected
    assert compare_arrays(a, a.copy(), rtol=0, atol=0)["mismatched"] == 0


# --- verify --------------------------------------------------------------------------------------


def test_verify_sound(sample: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", sample]) == 0
    assert (
        capsys.readouterr().out
        == f"OK: {sample} (hdf5, 9 variables, 15 components, 214 B checked)\n"
    )
    assert main(["verify", sample, "--json"]) == 0
    assert _json(capsys) == {
        "path": sample, "format": "hdf5", "ok": True, "problems": [], "num_variables": 9,
        "num_components": 15, "bytes": 214,
    }  # fmt: skip


def test_verify_names_a_damaged_tensor_in_a_tf_checkpoint(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Formats other than ours are verified by reading every component through the adapter,
    # which checks the TensorFlow bundle's CRC32C of each tensor.
    marker = np.frombuffer(b"PARALLELVARS-MARKER-BYTES!", np.uint8).copy()
    entries = {
        "model/good": ArrayEntry("model/good", [np.arange(3, dtype=np.float32)]),
        "model/bad": ArrayEntry("model/bad", [marker]),
    }
    prefix = write_checkpoint(str(tmp_path / "ckpt-1"), entries, format="tf")
    [data] = tmp_path.glob("ckpt-1.data-*")
    raw = bytearray(data.read_bytes())
    raw[raw.index(b"PARALLELVARS-MARKER") + 5] ^= 0x01
    data.write_bytes(bytes(raw))
    assert main(["verify", prefix]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert out[0].startswith("problem: ") and "'model/bad" in out[0] and "component 0" in out[0]
    assert "checksum" in out[0].lower() or "crc" in out[0].lower()
    assert out[-1] == f"FAILED: {prefix} (tf): 1 problem"
    assert main(["verify", prefix, "--json"]) == 1
    doc = _json(capsys)
    assert (doc["ok"], doc["format"], doc["num_variables"]) == (False, "tf", 2)
    assert len(doc["problems"]) == 1 and "'model/bad" in doc["problems"][0]


def _simple() -> dict[str, ArrayEntry]:
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    return {
        "model/w": ArrayEntry("model/w", [w, w.copy()], kind="mirrored"),
        "step": ArrayEntry("step", [np.array(3, np.int64)]),
    }


_FORMATS = [("hdf5", "run.h5"), ("safetensors", "run.safetensors"), ("npz", "run.npz"),
            ("tf", "ckpt-1"), ("keras", "run.weights.h5")]  # fmt: skip


def _truncate_largest(folder: pathlib.Path) -> pathlib.Path:
    biggest = max(
        (p for p in folder.iterdir() if p.name != "checkpoint"), key=lambda p: p.stat().st_size
    )
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size * 2 // 3])
    return biggest


@pytest.mark.parametrize(("fmt", "name"), _FORMATS)
def test_truncated_file_inspect_is_an_input_error_verify_a_finding(
    fmt: str, name: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_checkpoint(str(tmp_path / name), _simple(), format=fmt)
    assert main(["verify", path]) == 0
    capsys.readouterr()
    cut = _truncate_largest(tmp_path)
    assert main(["inspect", path]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith(f"parallelvars: error: {cut}: ")
    assert "truncated" in line or "end" in line
    assert main(["verify", path]) == 1
    captured = capsys.readouterr()
    assert captured.err == ""
    problem, summary = captured.out.splitlines()
    assert problem == "problem: " + line.removeprefix("parallelvars: error: ")
    assert summary == f"FAILED: {path} ({fmt}): 1 problem"


def test_check_structure() -> None:
    def sharded(axis: int, offsets: list[int]) -> ArrayEntry:
        return ArrayEntry("s", [np.zeros(2), np.zeros(2)], kind="sharded", shape=(4,),
                          attrs={"shard_axis": axis, "shard_offsets": offsets})  # fmt: skip

    assert check_structure(sharded(0, [0, 2])) == []
    # The core's one entry validation, in its one wording (the HDF5 reader's and the writers').
    cover = "shard_offsets do not cover the shard axis exactly"
    assert check_structure(sharded(0, [0, 5])) == [
        f"variable 's': {cover} (expected 2 non-decreasing offsets from 0 within the 4 rows of "
        "axis 0, found [0, 5])"
    ]
    assert check_structure(sharded(0, [1, 2])) == [
        f"variable 's': {cover} (expected 2 non-decreasing offsets from 0 within the 4 rows of "
        "axis 0, found [1, 2])"
    ]
    assert check_structure(sharded(-1, [0, 2])) == [
        "variable 's': shard_axis out of range (expected an axis of shape (4,), found -1)"
    ]
    assert check_structure(sharded(0, [0])) == [
        "variable 's': shard_offsets do not match the components (expected 2 offsets, found 1)"
    ]
    bare = ArrayEntry("s", [np.zeros(2), np.zeros(2)], kind="sharded", shape=(4,))
    assert check_structure(bare) == [
        "variable 's': shard_axis out of range (expected an axis of shape (4,), found None)"
    ]
    single = ArrayEntry("one", [np.zeros(2), np.zeros(2)], kind="single")
    assert check_structure(single) == [
        "variable 'one': impossible number of components (expected 1, found 2)"
    ]


@pytest.mark.parametrize("what", ["missing", "junk"])
def test_verify_input_errors_exit_2(
    what: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.bin"
    if what == "junk":
        path.write_bytes(b"\x00" * 64)
    assert main(["verify", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and "Traceback" not in captured.err


# --- extract -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "component", "expected"),
    [
        ("model/dense/kernel", None, np.arange(6, dtype=np.float32).reshape(3, 2) / 4),
        ("model/dense/kernel", 1, np.arange(6, dtype=np.float32).reshape(3, 2) / 4),
        ("model/embedding", None, np.arange(10, dtype=np.float32).reshape(5, 2)),
        ("model/embedding", 1, np.arange(6, 10, dtype=np.float32).reshape(2, 2)),
        ("metrics/count", None, np.array(7, np.int64)),
        ("metrics/count", 0, np.array(3, np.int64)),
        ("rng/state", 1, np.array([3, 4], np.uint32)),
        ("step", None, np.array(7, np.int64)),
    ],
)
def test_extract_values(
    name: str, component: int | None, expected: np.ndarray, sample: str, tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    out = tmp_path / "v.npy"
    argv = ["extract", sample, name, "-o", str(out)] + (
        ["--component", str(component)] if component is not None else []
    )
    assert main(argv) == 0
    got = np.load(out, allow_pickle=False)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    what = "logical value" if component is None else f"component {component}"
    assert capsys.readouterr().out.startswith(f"wrote {out}: {name} ({what}, {expected.dtype} ")


def test_extract_bfloat16_writes_raw_bits_with_a_note(
    sample: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "scale.npy"
    assert main(["extract", sample, "model/scale", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        "note: bfloat16 has no .npy dtype: wrote its raw bits as uint16; read it back with "
        "np.load(path).view(ml_dtypes.bfloat16)\n"
    )
    got = np.load(out, allow_pickle=False)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(
        got.view(ml_dtypes.bfloat16), np.array([1.5, -2.0, 0.25], ml_dtypes.bfloat16)
    )
    assert main(["extract", sample, "model/scale", "-o", str(out), "--json"]) == 0
    doc = _json(capsys)
    assert (doc["dtype"], doc["stored_dtype"], doc["shape"]) == ("bfloat16", "<u2", [3])
    assert doc["note"].startswith("bfloat16 has no .npy dtype")
    assert main(["extract", sample, "model/scale", "-o", str(out), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
def test_extract_float8(
    dtype: type, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    value = np.array([0.5, -1.0, 448.0 if dtype is ml_dtypes.float8_e4m3fn else 2.0], dtype)
    path = write_sample(tmp_path / "f8.h5", {"f": ArrayEntry("f", [value])})
    out = tmp_path / "f.npy"
    assert main(["extract", path, "f", "-o", str(out), "--quiet"]) == 0
    got = np.load(out, allow_pickle=False)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got.view(dtype), value)


def test_extract_strings_without_pickle(
    sample: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "vocab.npy"
    assert main(["extract", sample, "vocab", "-o", str(out), "--json"]) == 0
    assert _json(capsys)["stored_dtype"] == "|S3"
    np.testing.assert_array_equal(np.load(out, allow_pickle=False), np.array([b"ab", b"xyz"]))


def test_extract_keeps_the_output_name(sample: str, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "kernel.bin"  # numpy.save(name) would have written kernel.bin.npy
    assert main(["extract", sample, "step", "-o", str(out), "-q"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernel.bin", "run.h5"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["model/dense/kernl"], "variable 'model/dense/kernl': no such variable; did you mean 'model/dense/kernel', 'model/dense/bias', 'optimizer/slots/model/dense/kernel/m'?"),
        (["nothing/like/it"], "variable 'nothing/like/it': no such variable; list the variables with 'parallelvars inspect'"),
        (["model/dense/kernel", "--component", "2"], "variable 'model/dense/kernel': no component 2 (expected 0..1)"),
        (["rng/state"], "variable 'rng/state' holds 2 independent components and no single value; pick one with --component"),
    ],
)  # fmt: skip
def test_extract_errors(argv: list[str], message: str, sample: str, tmp_path: pathlib.Path,
                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "x.npy"
    assert main(["extract", sample, *argv, "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"parallelvars: error: {sample}: {message}\n"
    assert not out.exists()


# --- verify on the native HDF5 layout (checked by the checkpoint reader itself) -----------------


@pytest.fixture
def native(tmp_path: pathlib.Path) -> str:
    return write_h5(str(tmp_path / "run.h5"), sample_entries(), metadata={"step": 7})


def test_verify_native_sound(native: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", native]) == 0
    assert (
        capsys.readouterr().out
        == f"OK: {native} (hdf5, 9 variables, 15 components, 214 B checked)\n"
    )


def test_verify_native_names_the_damaged_dataset(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = np.frombuffer(b"PARALLELVARS-MARKER-BYTES!", np.uint8).copy()
    entries = {
        "model/ok": ArrayEntry("model/ok", [np.arange(4, dtype=np.float32)]),
        "model/bad": ArrayEntry("model/bad", [marker, marker], kind="mirrored"),
    }
    path = pathlib.Path(write_h5(str(tmp_path / "d.h5"), entries))
    raw = bytearray(path.read_bytes())
    at = raw.rindex(b"PARALLELVARS-MARKER")  # the second copy: parallel_component_1
    raw[at + 3] ^= 0x01
    path.write_bytes(bytes(raw))
    assert main(["verify", str(path), "--json"]) == 1
    doc = _json(capsys)
    assert doc["ok"] is False and doc["format"] == "hdf5"
    [problem] = doc["problems"]
    assert problem.startswith(
        f"{path}: variable 'model/bad/parallel_component_1': checksum mismatch"
    )
    assert main(["verify", str(path)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == f"FAILED: {path} (hdf5): 1 problem"


def test_verify_native_truncated(native: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = pathlib.Path(native)
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 100])
    assert main(["verify", native]) == 1
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.startswith(f"problem: {native}: file is truncated")
    assert captured.out.splitlines()[-1] == f"FAILED: {native} (hdf5): 1 problem"


def test_diff_logical_ignores_the_layout_but_not_the_value(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    k = np.arange(4, dtype=np.float32)
    a = write_sample(tmp_path / "a.h5", {"k": ArrayEntry("k", [k, k + 9], kind="mirrored")})
    same = write_sample(tmp_path / "same.h5", {"k": ArrayEntry("k", [k])})
    other = write_sample(tmp_path / "other.h5", {"k": ArrayEntry("k", [k + 1])})
    assert main(["diff", a, same]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[2:5] == [
        "k: kind mirrored vs single",
        "k: components 2 vs 1",
        "k: logical values agree",
    ]
    # A mirrored variable's logical value is its primary: component 1 is not looked at.
    assert main(["diff", a, same, "--logical"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "no differences (1 variables compared, rtol=0, atol=0, logical values)"
    )
    assert main(["diff", a, other, "--logical", "--json"]) == 1
    doc = _json(capsys)
    assert doc["logical"] is True
    assert doc["variables"] == [
        {"path": "k", "equal": False, "differences": [], "compared": "logical",
         "components": [{"component": None, "size": 4, "mismatched": 4, "max_abs": 1.0, "max_rel": 1.0}]},
    ]  # fmt: skip


def test_extract_into_a_missing_directory(
    sample: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "no" / "such" / "dir" / "k.npy"
    assert main(["extract", sample, "step", "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"parallelvars: error: {out}: no such file or directory\n"


# --- golden files written by the real libraries (tests/data, see the READMEs there) --------------

DATA = pathlib.Path(__file__).parent / "data"
_GOLDEN = [
    ("torch/model.safetensors", "safetensors", 8),
    ("torch/sharded/model.safetensors.index.json", "safetensors", 8),
    ("tf/plain/ckpt-1", "tf", 14),
    ("tf/parallel/ckpt-1", "tf", 3),
    ("tf/many/ckpt-1", "tf", 302),
    ("tf/tf1/model.ckpt-3", "tf", None),
    ("keras/model.weights.h5", "keras", 8),
    ("keras/model_legacy.h5", "keras-legacy", 8),
]


@pytest.mark.parametrize(("rel", "fmt", "count"), _GOLDEN)
def test_golden_files_inspect_and_verify(
    rel: str, fmt: str, count: int | None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(DATA / rel)
    assert main(["inspect", path, "--json"]) == 0
    doc = _json(capsys)
    assert doc["format"] == fmt
    assert doc["num_variables"] == count if count is not None else doc["num_variables"] > 0
    assert main(["verify", path]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {path} ({fmt}, ")


def test_golden_parallel_components_are_reported_unequal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A trackable that saves like a ParallelVariable, one different value per device.
    assert main(["inspect", str(DATA / "tf/parallel/ckpt-1"), "--json"]) == 0
    by_path = {v["path"]: v for v in _json(capsys)["variables"]}
    assert (by_path["model/w"]["kind"], by_path["model/w"]["components"]) == ("mirrored", 3)
    assert by_path["model/w"]["differing"] == [1, 2]


@pytest.mark.parametrize(
    ("name", "key"),
    [("layers/0/attn/q/weight", "layers.0.attn.q.weight"), ("layers/0/fp8", "layers.0.fp8")],
)
def test_golden_extract_bfloat16_and_float8_bits(
    name: str, key: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.npy"
    assert (
        main(["extract", str(DATA / "torch/model.safetensors"), name, "-o", str(out), "--json"])
        == 0
    )
    doc = _json(capsys)
    with np.load(DATA / "torch/torch_expected.npz", allow_pickle=False) as expected:
        bits = expected[key]
        safetensors_dtype = str(expected[f"{key}#dtype"])
    assert doc["dtype"] == {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn"}[safetensors_dtype]
    assert doc["note"].startswith(f"{doc['dtype']} has no .npy dtype")
    got = np.load(out, allow_pickle=False)
    assert got.dtype == bits.dtype
    np.testing.assert_array_equal(got, bits)


# ---------------------------------------------------------------------------- small rules
def test_listings_are_in_natural_order(tmp_path, capsys) -> None:
    from parallelvars.cli.testing import natural_key

    keys = [f"layers/dense/vars/{i}" for i in (10, 2, 0, 1, 11)] + [
        "layers/dense_10/x",
        "layers/dense_2/x",
    ]
    assert sorted(keys, key=natural_key) == [
        "layers/dense/vars/0", "layers/dense/vars/1", "layers/dense/vars/2",
        "layers/dense/vars/10", "layers/dense/vars/11", "layers/dense_2/x", "layers/dense_10/x",
    ]  # fmt: skip
    entries = {f"v/{i}": ArrayEntry(f"v/{i}", [np.full(2, i, np.float32)]) for i in (0, 1, 10, 2)}
    path = write_checkpoint(str(tmp_path / "n.npz"), entries, format="npz")
    assert main(["inspect", path, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["variables"]
    assert [r["path"] for r in rows] == ["v/0", "v/1", "v/2", "v/10"]
    assert main(["verify", path, "--json"]) == 0
    capsys.readouterr()
    other = {k: ArrayEntry(k, [np.zeros(2, np.float32)]) for k in ("w/10", "w/2")}
    path_b = write_checkpoint(str(tmp_path / "m.npz"), other, format="npz")
    assert main(["diff", path, path_b, "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["missing"] == ["v/0", "v/1", "v/2", "v/10"]
    assert result["extra"] == ["w/2", "w/10"]


def test_inspect_shows_created_as_iso_8601(sample: str, capsys) -> None:
    from parallelvars.cli.testing import metadata_text

    assert metadata_text("created", 0) == "1970-01-01T00:00:00+00:00"
    assert metadata_text("created", "not a time") == "not a time"
    assert main(["inspect", sample]) == 0
    text = capsys.readouterr().out
    line = next((ln for ln in text.splitlines() if ln.strip().startswith("created:")), None)
    if line is not None:
        assert "T" in line and line.rstrip().endswith("+00:00"), line


@pytest.mark.parametrize(
    "name", ["e.h5", "e.hdf5", "e.safetensors", "e.npz", "e.weights.h5", "e.index"]
)
def test_verify_exit_code_does_not_depend_on_the_suffix(tmp_path, name, capsys) -> None:
    path = tmp_path / name
    path.write_bytes(b"")
    assert main(["verify", str(path)]) == 1  # a checkpoint file of a known format, damaged
    assert "problem" in capsys.readouterr().out


def test_a_directory_without_a_checkpoint_says_so(tmp_path, capsys) -> None:
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "directory" in err and "b''" not in err


def test_inspect_shows_the_tree_with_a_damaged_component_marked(tmp_path, capsys) -> None:
    marker = np.frombuffer(b"PARALLELVARS-MARKER-BYTES!", np.uint8).copy()
    entries = {
        "model/ok": ArrayEntry("model/ok", [np.arange(4, dtype=np.float32)]),
        "model/bad": ArrayEntry("model/bad", [marker, marker], kind="mirrored"),
        "model/fine": ArrayEntry("model/fine", [np.zeros(3, np.float32)] * 2, kind="mirrored"),
    }
    path = pathlib.Path(write_h5(str(tmp_path / "d.h5"), entries))
    raw = bytearray(path.read_bytes())
    at = raw.rindex(b"PARALLELVARS-MARKER")  # model/bad's parallel_component_1
    raw[at + 3] ^= 0x01
    path.write_bytes(bytes(raw))
    assert main(["inspect", str(path)]) == 1
    text = capsys.readouterr().out
    bad = next(ln for ln in text.splitlines() if ln.strip().startswith("bad "))
    assert "DAMAGED" in bad
    assert any(ln.strip().startswith("ok ") for ln in text.splitlines())
    assert any(ln.strip().startswith("fine ") and "equal" in ln for ln in text.splitlines())
    assert "checksum mismatch" in text
    assert main(["inspect", str(path), "--json"]) == 1
    rows = {r["path"]: r for r in _json(capsys)["variables"]}
    assert "checksum mismatch" in rows["model/bad"]["damaged"] and "damaged" not in rows["model/ok"]


@pytest.mark.parametrize("suffix", [".h5", ".safetensors"])
def test_inspect_json_of_a_checkpoint_without_variables(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    """No variables is an empty list, not the repr of the empty listing."""
    from parallelvars.formats import DictView

    path = write_checkpoint(str(tmp_path / f"empty{suffix}"), DictView([]))
    assert main(["inspect", str(path), "--json"]) == 0
    doc = _json(capsys)
    assert doc["num_variables"] == 0 and doc["variables"] == []


def test_diff_result_rows_are_the_callers_own() -> None:
    """Each result of variables found equal in bulk has rows of its own: changing one
    result changes no other."""
    from parallelvars.cli.testing import diff_settle

    x = np.arange(4, dtype=np.float32)
    first, second = diff_settle([("a", [x], [x.copy()]), ("b", [x], [x.copy()])], None)
    assert first["equal"] and second["equal"]
    first["components"][0]["mismatched"] = 7
    assert second["components"][0]["mismatched"] == 0


_F32 = np.dtype(np.float32)


@pytest.mark.parametrize(
    ("values_a", "values_b", "same"),
    [
        (("sum", None, None), ("sum", None, None), True),
        (("sum", None, None), ("SUM", None, None), True),  # (compared in lower case)
        ((1, None, None), (True, None, None), False),  # "1" vs "true": equal, not alike
        ((None, 1, None), (None, True, None), True),  # both axis 1
        ((None, None, [0, 4]), (None, None, [0, 4]), True),
        ((None, None, [1, 4]), (None, None, [True, 4]), True),
        ((None, None, None), (None, 0, None), False),
    ],
)
def test_diff_describes_two_sides_alike_as_their_compared_values_say(
    values_a, values_b, same
) -> None:
    """Two descriptions are alike when their attributes compare equal as diff compares
    them, whatever shortcut decides it (equal values of different types are not alike
    where their compared forms differ)."""
    from parallelvars.cli.testing import diff_same_signature

    a = ("mirrored", _F32, (3,), 2, *values_a)
    b = ("mirrored", _F32, (3,), 2, *values_b)
    assert diff_same_signature(a, b) is same
    assert diff_same_signature(b, a) is same


@pytest.mark.parametrize("axis", ["x", [0], 1.5e300])
def test_diff_of_a_shard_axis_that_is_no_integer_is_a_difference(axis) -> None:
    """A damaged or foreign shard axis is compared as written, not raised as ValueError."""
    from parallelvars.cli.diff import compare_entries

    x = np.arange(4, dtype=np.float32)
    ea = ArrayEntry("v", [x], attrs={"shard_axis": axis})
    eb = ArrayEntry("v", [x], attrs={"shard_axis": 0})
    assert compare_entries(ea, eb, rtol=0.0, atol=0.0)["equal"] is False
    assert compare_entries(ea, ea, rtol=0.0, atol=0.0)["equal"] is True
