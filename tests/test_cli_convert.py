"""convert and reshard through ``main([...])``, checked with each format's own reader."""

from __future__ import annotations

import io
import json
import pathlib
import sys

import numpy as np
import pytest
from _cli_support import sample_entries, write_sample
from safetensors import safe_open
from safetensors.numpy import load_file

from parallelvars.cli import main
from parallelvars.formats import Entry, open_checkpoint


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARALLELVARS_DEBUG", raising=False)


def _numeric_entries() -> dict[str, Entry]:
    """The sample without the string and the independent variable (which not all formats
    or device counts can take)."""
    entries = sample_entries()
    del entries["vocab"], entries["rng/state"]
    return entries


@pytest.fixture
def run_h5(tmp_path: pathlib.Path) -> str:
    return write_sample(tmp_path / "run.h5", _numeric_entries(), step=7)


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return json.loads(captured.out)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert "Traceback" not in captured.err
    return line


# --- convert -------------------------------------------------------------------------------------


def test_convert_to_safetensors_keeps_every_component(
    run_h5: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = str(tmp_path / "model.safetensors")
    assert main(["convert", run_h5, dst]) == 0
    assert capsys.readouterr().out == (
        f"wrote {dst} (safetensors, 7 variables, 182 B) from {run_h5} (hdf5)\n"
    )
    # safetensors' own reader: dotted keys, extra components beside the primary.
    with safe_open(dst, framework="numpy") as f:
        keys = set(f.keys())
        kernel = f.get_tensor("model.dense.kernel")
        kernel_1 = f.get_tensor("model.dense.kernel/parallel_component_1")
    assert "model.dense.kernel" in keys and "metrics.count/parallel_component_1" in keys
    expected = np.arange(6, dtype=np.float32).reshape(3, 2) / 4
    np.testing.assert_array_equal(kernel, expected)
    np.testing.assert_array_equal(kernel_1, expected)
    # Nothing lost: every component of every variable compares equal.
    assert main(["diff", run_h5, dst]) == 0


def test_convert_primary_sharded_by_size(
    run_h5: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "model.safetensors"
    argv = ["convert", run_h5, str(dst), "--components", "primary", "--max-shard-size", "100B"]
    assert main([*argv, "--json"]) == 0
    doc = _json(capsys)
    index = tmp_path / "model.safetensors.index.json"
    assert doc == {
        "source": run_h5, "source_format": "hdf5", "destination": str(index),
        "format": "safetensors", "components": "primary", "max_shard_size": 100,
        "num_variables": 7, "bytes": 118, "notes": [], "left_out": [], "carried": [],
    }  # fmt: skip
    weight_map = json.loads(index.read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 2
    tensors: dict[str, np.ndarray] = {}
    for shard in shards:
        assert (tmp_path / shard).stat().st_size <= 100 + 512  # a header, then at most 100 B
        tensors.update(load_file(str(tmp_path / shard)))
    assert sorted(tensors) == sorted(weight_map)
    assert not any("parallel_component" in k for k in tensors)
    np.testing.assert_array_equal(
        tensors["model.embedding"], np.arange(10, dtype=np.float32).reshape(5, 2)
    )
    np.testing.assert_array_equal(tensors["metrics.count"], np.array(7, np.int64))  # the sum
    # The primary copy differs in layout from the parallel original, but not in value.
    assert main(["diff", run_h5, str(index)]) == 1
    capsys.readouterr()
    assert main(["diff", run_h5, str(index), "--logical"]) == 0


@pytest.mark.parametrize(
    ("names", "key"), [("slash", "model/dense/kernel"), ("dotted", "model.dense.kernel")]
)
def test_convert_names_to_npz(
    names: str, key: str, run_h5: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "weights.npz"
    assert main(["convert", run_h5, str(dst), "--names", names, "-q"]) == 0
    with np.load(dst, allow_pickle=False) as npz:
        assert key in npz.files
        np.testing.assert_array_equal(npz[key], np.arange(6, dtype=np.float32).reshape(3, 2) / 4)
    assert main(["diff", run_h5, str(dst)]) == 0


@pytest.mark.parametrize(
    ("to", "name"),
    [
        ("tf", "ckpt-1"),
        ("keras", "x.weights.h5"),
        ("safetensors", "x.safetensors"),
        ("npz", "x.npz"),
        ("hdf5", "copy.h5"),
    ],
)  # fmt: skip
def test_convert_round_trips(
    to: str, name: str, run_h5: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = str(tmp_path / name)
    assert main(["convert", run_h5, dst, "--to", to, "--json"]) == 0
    doc = _json(capsys)
    assert (doc["format"], doc["num_variables"]) == (to, 7)
    with open_checkpoint(doc["destination"]) as view:
        assert view.format == to
    back = str(tmp_path / "back.h5")
    assert main(["convert", doc["destination"], back, "--from", to, "-q"]) == 0
    capsys.readouterr()
    assert main(["diff", run_h5, back]) == 0


@pytest.mark.parametrize(
    ("extra", "dst", "needle"),
    [
        ([], "out.bin", "out.bin: cannot tell the output format from the name"),
        (["--names", "dotted"], "out.h5", "format 'hdf5' has no key style"),
        (["--max-shard-size", "1MB"], "out.npz", "format 'npz' is not sharded by size"),
        ([], "run.h5", "is the same file as SRC"),
    ],
)
def test_convert_refusals(
    extra: list[str], dst: str, needle: str, run_h5: str, tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    before = pathlib.Path(run_h5).read_bytes()
    assert main(["convert", run_h5, str(tmp_path / dst), *extra]) == 2
    line = _one_line(capsys)
    assert line.startswith("parallelvars: error: ") and needle in line
    assert pathlib.Path(run_h5).read_bytes() == before


def test_convert_refuses_to_overwrite_a_tf_prefix_it_reads(
    run_h5: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = str(tmp_path / "ckpt-1")
    assert main(["convert", run_h5, prefix, "--to", "tf", "-q"]) == 0
    capsys.readouterr()
    assert main(["convert", prefix, prefix, "--to", "tf"]) == 2
    assert (
        _one_line(capsys)
        == f"parallelvars: error: {prefix}: is the same file as SRC; write somewhere else"
    )


def test_convert_string_into_safetensors_is_refused(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_sample(tmp_path / "run.h5")  # the full sample holds a string tensor
    dst = tmp_path / "model.safetensors"
    assert main(["convert", src, str(dst)]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"parallelvars: error: {dst}: variable 'vocab': ")
    assert "string" in line
    assert not dst.exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("command", ["convert", "reshard"])
def test_progress_bar_on_a_terminal(
    command: str, run_h5: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    stderr = _Terminal()
    monkeypatch.setattr(sys, "stderr", stderr)
    extra = ["--devices", "3"] if command == "reshard" else []
    assert main([command, run_h5, str(tmp_path / "out.h5"), *extra]) == 0
    # tqdm draws on stderr (and, with leave=False, wipes the bar when done)
    assert stderr.getvalue().startswith(f"\r{command}: ")
    assert "B" in stderr.getvalue()
    assert capsys.readouterr().out.startswith("wrote ")


@pytest.mark.parametrize("columns", [120, 40])
def test_convert_bar_has_its_total_from_the_start(
    columns: int, run_h5: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The bar knows the bytes to write before the first tensor is read: a percentage and a
    bar, never a bare counter (``0.00B [00:00, ?B/s]``); a narrow terminal still gets both."""
    stderr = _Terminal()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setenv("COLUMNS", str(columns))  # a StringIO has no terminal to ask
    assert main(["convert", run_h5, str(tmp_path / "out.safetensors")]) == 0
    drawn = stderr.getvalue()
    total = sum(int(e.nbytes) for e in _numeric_entries().values())
    assert drawn.startswith("\rconvert:   0%|")  # its first drawing: 0 of the total
    assert f"/{total}" in drawn.replace(".00", "")  # e.g. 0/544 (unit-scaled under 1 KiB)
    assert "B [" not in drawn  # the bare counter's "0.00B [00:00, ?B/s]"
    assert ("B/s" in drawn) == (columns >= 60)  # narrow: no time and rate, room for the bar
    assert capsys.readouterr().out.startswith("wrote ")


def test_convert_draws_nothing_when_stderr_is_not_a_terminal(
    run_h5: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    assert main(["convert", run_h5, str(tmp_path / "out.safetensors")]) == 0
    assert stderr.getvalue() == ""
    assert capsys.readouterr().out.startswith("wrote ")


# --- reshard -------------------------------------------------------------------------------------


def test_reshard_onto_three_devices(
    run_h5: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = str(tmp_path / "run3.h5")
    assert main(["reshard", run_h5, dst, "--devices", "3"]) == 0
    assert (
        capsys.readouterr().out
        == f"wrote {dst} (hdf5, 7 variables, 5 of them on 3 devices, 2 single, as saved) from {run_h5} (hdf5)\n"
    )
    with open_checkpoint(dst) as view:
        assert {k: view[k].num_components for k in view} == {
            "metrics/count": 3, "model/dense/bias": 3, "model/dense/kernel": 3, "model/embedding": 3,
            "model/scale": 1, "optimizer/slots/model/dense/kernel/m": 3, "step": 1,
        }  # fmt: skip
        emb = view["model/embedding"]
        assert [int(o) for o in emb.attrs["shard_offsets"]] == [0, 2, 4]
        np.testing.assert_array_equal(emb.component(2), np.array([[8.0, 9.0]], np.float32))
        count = view["metrics/count"]
        assert [int(count.component(i)) for i in range(3)] == [7, 0, 0]  # the sum is kept
    assert main(["diff", run_h5, dst, "--logical"]) == 0
    assert main(["inspect", dst, "--json"]) == 0
    capsys.readouterr()


def test_reshard_json_and_another_format(
    run_h5: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = str(tmp_path / "run1.safetensors")
    assert main(["reshard", run_h5, dst, "--devices", "1", "--json"]) == 0
    assert _json(capsys) == {
        "source": run_h5, "source_format": "hdf5", "destination": dst, "format": "safetensors",
        "devices": 1, "source_components": [1, 2], "num_variables": 7, "num_on_devices": 0,
    }  # fmt: skip
    assert main(["diff", run_h5, dst, "--logical", "--json"]) == 0
    assert _json(capsys)["equal"] is True


def test_reshard_keeps_the_source_format_for_a_name_without_suffix(
    run_h5: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = str(tmp_path / "resharded")
    assert main(["reshard", run_h5, dst, "--devices", "2", "-q"]) == 0
    assert open_checkpoint(dst).format == "hdf5"
    capsys.readouterr()
    assert main(["diff", run_h5, dst]) == 0  # the same device count: nothing changes


def test_reshard_independent_buffers_need_the_same_devices(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_sample(tmp_path / "run.h5")
    dst = tmp_path / "out.h5"
    assert main(["reshard", src, str(dst), "--devices", "4"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"parallelvars: error: {src}: variable 'rng/state': ")
    assert "(expected 2 devices, found 4 devices)" in line
    assert not dst.exists()


def test_reshard_refuses_its_own_source(run_h5: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reshard", run_h5, run_h5, "--devices", "2"]) == 2
    assert "is the same file as SRC" in _one_line(capsys)


def test_reshard_missing_source(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "nothere.h5"
    assert main(["reshard", str(src), str(tmp_path / "o.h5"), "--devices", "2"]) == 2
    assert _one_line(capsys).startswith(f"parallelvars: error: {src}: no such ")


# ---------------------------------------------------------------------------- folder destinations
def test_convert_into_a_new_folder_with_shards(run_h5, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["convert", run_h5, "shards/", "--to", "safetensors", "--max-shard-size", "40B"]
    assert main(args) == 0  # the folder is made, as a library save makes it
    assert capsys.readouterr().err == f"note: made the folder {tmp_path / 'shards'}\n"
    names = sorted(p.name for p in (tmp_path / "shards").iterdir())
    assert "model.safetensors.index.json" in names
    shards = [n for n in names if n != "model.safetensors.index.json"]
    assert len(shards) > 1 and all(
        n.startswith("model-0000") and n.endswith(f"-of-{len(shards):05d}.safetensors")
        for n in shards
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5", "shards"]
    with open_checkpoint(str(tmp_path / "shards")) as view:
        assert "model/dense/kernel" in view


def test_convert_into_a_new_folder_without_shards(run_h5, tmp_path, capsys) -> None:
    dst = tmp_path / "out" / "deeper"
    assert main(["convert", run_h5, f"{dst}/", "--to", "safetensors"]) == 0
    assert sorted(p.name for p in dst.iterdir()) == ["model.safetensors"]
    assert main(["convert", run_h5, str(dst), "--to", "npz"]) == 0  # an existing folder
    assert sorted(p.name for p in dst.iterdir()) == ["model.npz", "model.safetensors"]


def test_folder_destination_needs_a_format(run_h5, tmp_path, capsys) -> None:
    assert main(["convert", run_h5, f"{tmp_path}/"]) == 2
    assert "--to FORMAT" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["convert", "reshard"])
@pytest.mark.parametrize("parents", [[], ["--parents"]])
def test_missing_folders_are_made_and_said(
    command: str, parents: list[str], run_h5: str, tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The library's rule (a write makes its folders): --parents, once needed, changes nothing."""
    dst = tmp_path / "nope" / "deeper" / "model.safetensors"
    extra = ["--devices", "2"] if command == "reshard" else []
    assert main([command, run_h5, str(dst), *extra, *parents]) == 0  # was: 2, "no such folder"
    assert dst.is_file()
    assert capsys.readouterr().err == f"note: made the folder {tmp_path / 'nope'}\n"
    assert main([command, run_h5, str(dst), *extra, "--json"]) == 0  # made before: no note
    assert capsys.readouterr().err == ""


def test_a_file_in_the_way_of_a_folder_is_an_error(run_h5, tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("")
    assert main(["convert", run_h5, str(tmp_path / "file" / "sub" / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parallelvars: error: ") and str(tmp_path / "file") in err
    assert (tmp_path / "file").is_file()


def test_reshard_into_a_folder(run_h5, tmp_path, capsys) -> None:
    assert main(["reshard", run_h5, f"{tmp_path}/re/", "--devices", "1"]) == 0
    assert sorted(p.name for p in (tmp_path / "re").iterdir()) == ["model.h5"]


def test_unknown_output_suffix_names_the_cli_flag(run_h5, tmp_path, capsys) -> None:
    assert main(["convert", run_h5, str(tmp_path / "model.bin")]) == 2
    err = capsys.readouterr().err
    assert "--to" in err and "to_format=" not in err


# ---------------------------------------------------------------------------- legacy Keras -> Keras 3
KERAS_DATA = pathlib.Path(__file__).parent / "data" / "keras"


def test_legacy_keras_converts_to_keras3_layout(tmp_path, capsys) -> None:
    import h5py

    out = tmp_path / "out.weights.h5"
    assert main(["convert", str(KERAS_DATA / "model_legacy.h5"), str(out)]) == 0

    def datasets(path: pathlib.Path) -> dict[str, tuple[np.ndarray, str]]:
        found: dict[str, tuple[np.ndarray, str]] = {}
        with h5py.File(path, "r") as h5:

            def visit(name: str, obj: object) -> None:
                if isinstance(obj, h5py.Dataset):
                    owner = h5[name.rpartition("/")[0]].attrs.get("name")
                    found[name] = (obj[()], owner.decode() if isinstance(owner, bytes) else owner)

            h5.visititems(visit)
        return found

    ours, keras = datasets(out), datasets(KERAS_DATA / "model.weights.h5")
    assert sorted(ours) == sorted(keras)  # layers/dense/vars/0 ... exactly as Keras 3 writes
    for key, (value, owner) in keras.items():
        np.testing.assert_array_equal(ours[key][0], value, err_msg=key)
        assert ours[key][1] == owner, key


def test_legacy_keras_without_model_config_is_refused(tmp_path, capsys) -> None:
    from parallelvars.formats import ArrayEntry, write_checkpoint

    legacy = tmp_path / "weights.h5"
    entries = {"d1/kernel": ArrayEntry("d1/kernel", [np.ones((2, 3), np.float32)])}
    write_checkpoint(str(legacy), entries, format="keras-legacy")
    out = tmp_path / "out.weights.h5"
    assert main(["convert", str(legacy), str(out), "--from", "keras-legacy"]) == 2
    err = capsys.readouterr().err
    assert "model config" in err and "class" in err
    assert not out.exists()


def test_components_primary_refuses_independent_buffers_like_extract(tmp_path, capsys) -> None:
    src = write_sample(tmp_path / "run.h5")  # the sample has rng/state: independent buffers
    out = tmp_path / "p.npz"
    assert main(["convert", src, str(out), "--components", "primary"]) == 2
    err = capsys.readouterr().err
    assert "rng/state" in err and "independent" in err and "--component" in err
    assert not out.exists()
    assert main(["extract", src, "rng/state", "-o", str(tmp_path / "x.npy")]) == 2
    assert "independent" in capsys.readouterr().err
    assert (
        main(["extract", src, "rng/state", "--component", "1", "-o", str(tmp_path / "x.npy")]) == 0
    )


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".h5"])
def test_convert_reports_the_bytes_of_every_entry(
    run_h5: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    # A whole conversion's entries are made when the writer asks for them, their bytes noted
    # then: the report counts every entry's bytes, as the source holds them.
    assert main(["convert", run_h5, str(tmp_path / f"out{suffix}"), "--json"]) == 0
    doc = _json(capsys)
    with open_checkpoint(run_h5) as view:
        want = (len(view), sum(int(view[k].nbytes) for k in view))
    assert (doc["num_variables"], doc["bytes"]) == want
