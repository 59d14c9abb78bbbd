"""Export for a target library: what ``convert`` selects (``only``/``exclude``/``model_only``)
and what each writer produces for a model trained here (4 devices, Adam)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from safetensors.numpy import load_file

import parallelvars as pv
from parallelvars import formats
from parallelvars.cli import main
from parallelvars.errors import CheckpointWriteError, InvalidArgumentError, NotACheckpointError
from parallelvars.formats.testing import select_entries

MODEL_KEYS = ["model/dense/bias", "model/dense/kernel"]


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARALLELVARS_DEBUG", raising=False)


def trained(devices: int = 4) -> tuple[pv.Checkpoint, pv.Module, pv.optimizers.Adam]:
    """A dense layer trained two Adam steps on ``devices`` devices."""
    with pv.MirroredStrategy(devices).scope() as strategy:
        model = pv.Module()
        model.dense = pv.Module()
        model.dense.kernel = pv.Variable(
            np.arange(6, dtype=np.float32).reshape(3, 2), name="dense/kernel"
        )
        model.dense.bias = pv.Variable(np.zeros(2, np.float32), name="dense/bias")
        opt = pv.optimizers.Adam(0.1)
    grads = [np.full((3, 2), 0.5, np.float32), np.array([1.0, -2.0], np.float32)]
    for _ in range(2):
        opt.distributed_apply(
            strategy, list(zip(grads, (model.dense.kernel, model.dense.bias), strict=True))
        )
    return pv.Checkpoint(model=model, optimizer=opt), model, opt


@pytest.fixture
def run_h5(tmp_path: pathlib.Path) -> str:
    ckpt, _, _ = trained()
    ckpt.save_counter.assign(3)
    return ckpt.write(tmp_path / "run.h5")


def test_model_only_leaves_out_optimizer_state_and_bookkeeping(
    run_h5: str, tmp_path: pathlib.Path
) -> None:
    left: dict[str, str] = {}
    out = formats.convert(
        run_h5,
        tmp_path / "m.safetensors",
        components="logical",
        names="dotted",
        model_only=True,
        on_left_out=left.update,
    )
    tensors = load_file(out)
    assert sorted(tensors) == ["model.dense.bias", "model.dense.kernel"]  # was: + save_counter, ...
    assert left["save_counter"] == "checkpoint bookkeeping"
    assert left["optimizer/iterations"] == "optimizer state"
    assert left["optimizer/slots/model/dense/kernel/m"] == "optimizer state"
    assert len(left) == 8
    _, model, _ = trained()
    np.testing.assert_array_equal(tensors["model.dense.kernel"], model.dense.kernel.components[0])


def test_only_and_exclude_select_by_pattern(run_h5: str, tmp_path: pathlib.Path) -> None:
    out = formats.convert(run_h5, tmp_path / "a.npz", only=["model"], exclude=["*/bias"])
    with formats.open_checkpoint(out) as view:
        assert list(view) == ["model/dense/kernel"]
    out = formats.convert(run_h5, tmp_path / "b.npz", only=["optimizer/slots/*/m"])
    with formats.open_checkpoint(out) as view:
        assert sorted(view) == [
            "optimizer/slots/model/dense/bias/m",
            "optimizer/slots/model/dense/kernel/m",
        ]
    with pytest.raises(InvalidArgumentError, match="leaves no variable"):
        formats.convert(run_h5, tmp_path / "c.npz", only=["nothing/*"])
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        formats.convert(run_h5, tmp_path / "d.npz", exclude=[""])


def test_a_model_only_export_restores_with_every_assertion(
    run_h5: str, tmp_path: pathlib.Path
) -> None:
    """Back into a fresh model: nothing unrestored, nothing unmatched (no save_counter saved)."""
    out = formats.convert(run_h5, tmp_path / "m.npz", components="logical", model_only=True)
    _, model, _ = trained(2)
    for v in (model.dense.kernel, model.dense.bias):
        v.assign(np.zeros(v.shape, np.float32))
    status = pv.Checkpoint(model=model).restore(out)
    status.assert_consumed().assert_existing_objects_matched()
    _, expected, _ = trained()
    np.testing.assert_array_equal(
        model.dense.kernel.components[1], expected.dense.kernel.components[0]
    )


def test_without_a_graph_the_optimizer_subtree_is_still_recognised(tmp_path: pathlib.Path) -> None:
    """A file another library wrote: its ``optimizer/`` subtree and TF1's root beta powers."""
    entries = {
        k: formats.ArrayEntry(k, [np.ones(2, np.float32)])
        for k in ("dense/kernel", "optimizer/vars/0", "beta1_power", "global_step")
    }
    kept, left = select_entries(formats.DictView(entries), model_only=True)
    assert kept == ["dense/kernel"]
    assert set(left) == {"optimizer/vars/0", "beta1_power", "global_step"}


def test_cli_model_only_notes_what_it_left_out(
    run_h5: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "m.safetensors"
    rc = main(
        [
            "convert",
            run_h5,
            str(dst),
            "--components",
            "logical",
            "--model-only",
            "--names",
            "dotted",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "note: left out 7 entries (optimizer state)" in err
    assert "note: left out 1 entry (checkpoint bookkeeping): save_counter" in err
    assert sorted(load_file(dst)) == ["model.dense.bias", "model.dense.kernel"]
    rc = main(["--json", "convert", run_h5, str(tmp_path / "x.npz"), "--exclude", "optimizer"])
    assert rc == 0

    doc = json.loads(capsys.readouterr().out)
    assert doc["num_variables"] == 3  # the model and save_counter
    assert len(doc["left_out"]) == 7


def test_tf_export_keeps_adam_beta_powers_in_float32_as_tensorflow_does(
    run_h5: str, tmp_path: pathlib.Path
) -> None:
    """TF 1.x ``AdamOptimizer`` refuses a float64 beta power ("expected dtype float does not
    equal original dtype double"); ours are float64 and were written so."""
    from parallelvars.formats.tf import BundleReader

    prefix = formats.convert(run_h5, tmp_path / "tf" / "ckpt-1", to_format="tf")
    _, _, opt = trained()
    bundle = BundleReader(prefix)  # the tensors as TensorFlow reads them
    try:
        for name in ("beta1_power", "beta2_power"):
            keys = [k for k in bundle.entries if name.encode() in k]
            assert len(keys) == 4  # VARIABLE_VALUE and parallel_component_1..3
            expected = np.float32(getattr(opt, name).read_value())
            for key in keys:
                assert bundle.entries[key].dtype == 1  # DT_FLOAT; was: DT_DOUBLE
                assert bundle.read(key)[()] == expected
    finally:
        bundle.close()
    with formats.open_checkpoint(prefix) as view:
        for name in ("beta1_power", "beta2_power"):  # ours: the exact float64 recorded beside
            entry = view[f"optimizer/{name}"]
            assert (
                entry.dtype == np.float64 and entry.component(0) == getattr(opt, name).read_value()
            )
        assert view["optimizer/iterations"].dtype == np.int64
        assert view["model/dense/kernel"].dtype == np.float32
    # a model-only export for TensorFlow keeps save_counter: tf.train.Checkpoint counts it
    left: dict[str, str] = {}
    model_only = formats.convert(
        run_h5, tmp_path / "m" / "ckpt-1", to_format="tf", model_only=True, on_left_out=left.update
    )
    with formats.open_checkpoint(model_only) as view:
        assert sorted(view) == [*MODEL_KEYS, "save_counter"]
    assert "save_counter" not in left and len(left) == 7
    # back into our float64 counters: the exact value (a resume through TF is bit-identical)
    ckpt2, _, opt2 = trained()
    ckpt2.restore(prefix).assert_consumed()
    assert opt2.beta1_power.read_value() == opt.beta1_power.read_value()
    assert opt.beta1_power.read_value() != np.float64(np.float32(opt.beta1_power.read_value()))


def test_write_checkpoint_takes_the_export_options_for_every_format(
    run_h5: str, tmp_path: pathlib.Path
) -> None:
    """Was: ``components=`` a raw TypeError from the Keras writer."""
    with formats.open_checkpoint(run_h5) as view:
        for name in ("m.weights.h5", "m.safetensors", "m.npz", "m.h5"):
            out = formats.write_checkpoint(
                tmp_path / name, view, components="logical", model_only=True
            )
            with formats.open_checkpoint(out) as written:
                assert len(written) == 2, name
                assert all(written[k].num_components == 1 for k in written)
        with pytest.raises(InvalidArgumentError, match=r"m\.weights\.h5.*'keras'.*'bogus'"):
            formats.write_checkpoint(tmp_path / "m.weights.h5", view, bogus=1)
        with pytest.raises(InvalidArgumentError, match="components must be"):
            formats.write_checkpoint(tmp_path / "m.npz", view, components="some")


# --- symmetry of Checkpoint.write / restore ----------------------------------------------------


@pytest.mark.parametrize(
    "name", ["x.safetensors", "x.npz", "x.keras", "x.weights.h5", "ckpt-1.index", "x.pt"]
)
def test_write_refuses_another_formats_suffix(tmp_path: pathlib.Path, name: str) -> None:
    """Was: an HDF5 file under that name (safetensors then failed "header too large")."""
    ckpt, _, _ = trained(2)
    with pytest.raises(InvalidArgumentError, match=rf"{name.replace('.', '[.]')}: .*convert"):
        ckpt.write(tmp_path / name)
    assert not list(tmp_path.iterdir())
    assert ckpt.write(tmp_path / "x.h5").endswith("x.h5")


def test_a_folder_that_cannot_be_made_is_our_error_naming_the_path(tmp_path: pathlib.Path) -> None:
    """Was: a builtin FileNotFoundError naming the folder."""
    (tmp_path / "file").write_bytes(b"x")
    ckpt, _, _ = trained(2)
    target = tmp_path / "file" / "sub" / "x.h5"
    with pytest.raises(CheckpointWriteError, match=r"file/sub/x\.h5: cannot make the folder"):
        ckpt.write(target)
    with pytest.raises(CheckpointWriteError, match=r"file/sub/x-1\.h5"):
        ckpt.save(tmp_path / "file" / "sub" / "x")
    assert int(ckpt.save_counter) == 0  # the failed save took its count back


class _Stops(formats.ArrayEntry):
    """An entry whose data cannot be read: the write stops after it made its folders."""

    def component(self, i: int) -> np.ndarray:
        raise KeyboardInterrupt

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        raise KeyboardInterrupt

    def value(self) -> np.ndarray:
        raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("name", "fmt"),
    [("x.h5", None), ("x.safetensors", None), ("x.npz", None), ("x.weights.h5", None),
     ("ckpt", "tf")],
)  # fmt: skip
def test_every_writer_makes_its_folders_and_takes_them_back_when_stopped(
    tmp_path: pathlib.Path, name: str, fmt: str | None
) -> None:
    """One folder rule for the library (and the command line, tests/test_cli_convert.py): a
    write makes the folders it goes into; one that fails or is interrupted takes them back."""
    ok = formats.DictView([formats.ArrayEntry("layers/dense/vars/0", [np.ones(2, np.float32)])])
    made = tmp_path / "a" / "b" / name
    formats.write_checkpoint(made, ok, format=fmt)
    assert (tmp_path / "a" / "b").is_dir()
    stops = formats.DictView([_Stops("layers/dense/vars/0", [np.ones(2, np.float32)])])
    (tmp_path / "kept").mkdir()
    with pytest.raises(KeyboardInterrupt):
        formats.write_checkpoint(tmp_path / "kept" / "c" / "d" / name, stops, format=fmt)
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == []  # was: c/d left behind
    with pytest.raises(KeyboardInterrupt):  # a folder holding something stays as it is
        formats.write_checkpoint(made, stops, format=fmt)
    assert (tmp_path / "a" / "b").is_dir()


def test_checkpoint_write_makes_its_folders(tmp_path: pathlib.Path) -> None:
    ckpt, _, _ = trained(2)
    assert pathlib.Path(ckpt.write(tmp_path / "new" / "deeper" / "x.h5")).is_file()
    assert pathlib.Path(ckpt.save(tmp_path / "other" / "x")).name == "x-1.h5"


@pytest.mark.parametrize("shard", [None, "20B"])
def test_restore_reads_a_hugging_face_folder(
    run_h5: str, tmp_path: pathlib.Path, shard: str | None
) -> None:
    """A folder of model.safetensors or of a shard set (config.json beside it), as the docs
    say; was: NotACheckpointError "is a directory"."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    formats.convert(
        run_h5,
        folder,
        to_format="safetensors",
        components="logical",
        model_only=True,
        max_shard_size=shard,
    )
    _, model, _ = trained(2)
    for v in (model.dense.kernel, model.dense.bias):
        v.assign(np.zeros(v.shape, np.float32))
    pv.Checkpoint(model=model).restore(folder).assert_consumed()
    _, expected, _ = trained()
    np.testing.assert_array_equal(model.dense.bias.components[1], expected.dense.bias.components[0])


def test_the_package_exports_only_its_public_names() -> None:
    """Was: ``pv.Any``, ``pv.TYPE_CHECKING`` and ``pv.importlib`` beside the API."""
    public = {n for n in dir(pv) if not n.startswith("_")}
    assert not {"Any", "TYPE_CHECKING", "importlib"} & public
    assert public - set(pv.__all__) <= {"checkpoint", "errors", "optimizers", "formats"} | {
        n for n in public if isinstance(getattr(pv, n), type(pv))
    }


def test_a_torch_pickle_is_named_and_never_loaded(capsys: pytest.CaptureFixture[str]) -> None:
    """tests/data/torch/state_dict.pt (torch.save 2.13); was: "not a checkpoint of any known
    format" with no hint."""
    path = str(pathlib.Path(__file__).parent / "data" / "torch" / "state_dict.pt")
    with pytest.raises(
        NotACheckpointError, match=r"state_dict\.pt: .*PyTorch pickle.*never loaded"
    ):
        pv.Checkpoint(w=pv.Variable(np.ones(2))).restore(path)
    with pytest.raises(NotACheckpointError, match=r"PyTorch pickle.*safetensors\.torch\.save_file"):
        formats.open_checkpoint(path)
    assert main(["inspect", path]) != 0
    assert "PyTorch pickle" in capsys.readouterr().err


def test_root_exports_a_subtree_under_a_torch_modules_own_keys(
    run_h5: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "net.safetensors"
    argv = ["convert", run_h5, str(dst), "--components", "logical", "--model-only"]
    assert main([*argv, "--root", "model", "--names", "dotted"]) == 0
    assert sorted(load_file(dst)) == ["dense.bias", "dense.kernel"]
    assert "note:" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match="nothing lies under the root 'nope'"):
        formats.convert(run_h5, tmp_path / "x.npz", root="nope")
    left: dict[str, str] = {}
    formats.convert(run_h5, tmp_path / "y.npz", root="model", on_left_out=left.update)
    assert left["save_counter"] == left["optimizer/iterations"] == "outside --root"


def test_reshard_says_which_variables_stay_single(
    run_h5: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was: "4 devices" while every single variable stays single."""
    assert main(["reshard", run_h5, str(tmp_path / "r.h5"), "--devices", "2"]) == 0
    assert "10 variables, 9 of them on 2 devices, 1 single, as saved" in capsys.readouterr().out


def test_verify_says_one_cause_once_and_keeps_distinct_causes_apart() -> None:
    from parallelvars.cli.verify import collapse_repeats

    link = "f.h5: variable '{}': an external link is outside (found link to '{}'); copy both"
    problems = [link.format(f"v{i}", f"p{i}.h5") for i in range(5)]
    problems.insert(2, "f.h5: variable 'w': checksum does not match")
    got = collapse_repeats(problems)
    assert got == [
        link.format("v0", "p0.h5") + " (the same for 4 more: v1, v2, v3, ...)",
        "f.h5: variable 'w': checksum does not match",
    ]
    assert collapse_repeats(["a", "a", "b"]) == ["a (found 2 times)", "b"]


@pytest.mark.parametrize("command", ["convert", "reshard"])
@pytest.mark.parametrize("stop", [KeyboardInterrupt, InvalidArgumentError])
def test_a_failed_or_interrupted_write_takes_back_the_folders_it_made(
    run_h5: str,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    stop: type[BaseException],
) -> None:
    calls = []

    def interrupted(*args: object, **kwargs: object) -> str:
        calls.append(args)
        raise stop("stopped")

    monkeypatch.setattr(
        formats, "convert" if command == "convert" else "write_checkpoint", interrupted
    )
    (tmp_path / "kept").mkdir()
    dst = tmp_path / "kept" / "new" / "deeper" / "out.safetensors"
    extra = ["--devices", "2"] if command == "reshard" else []
    assert main([command, run_h5, str(dst), *extra]) != 0
    assert (tmp_path / "kept").is_dir()  # there before: stays
    assert calls  # the write was reached (the folders made) and stopped
    assert not (tmp_path / "kept" / "new").exists()  # was: kept/new/deeper left behind
