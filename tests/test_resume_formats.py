"""Training resumes from every format we read: slots, non-slot variables and the object graph
survive a trip through safetensors, npz, TensorFlow and Keras, converted back to HDF5 or
restored directly, and a resumed step is bit-identical to the step of the run that saved."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from formats_testlib import same_bits

import parallelvars as pv
from parallelvars import errors, formats
from parallelvars.formats import ArrayEntry, DictView

GRADS = [np.full((3, 2), 0.5, np.float32), np.array([1.0, -2.0], np.float32)]


def _model(devices: int = 4) -> tuple[dict[str, pv.ParallelVariable], pv.optimizers.Adam]:
    with pv.MirroredStrategy(devices).scope():
        w = pv.Variable(np.arange(6, dtype=np.float32).reshape(3, 2), name="w")
        b = pv.Variable(np.zeros(2, np.float32), name="b")
    return {"w": w, "b": b}, pv.optimizers.Adam(0.1)


def _step(model: dict[str, pv.ParallelVariable], opt: pv.optimizers.Adam, scale: float) -> None:
    opt.apply_gradients(
        [(g * np.float32(scale), v) for g, v in zip(GRADS, model.values(), strict=True)]
    )


def _state(model: dict[str, pv.ParallelVariable], opt: pv.optimizers.Adam) -> dict[str, list]:
    """Every component of the variables, the slots and the non-slot variables."""
    out = {name: [np.array(c) for c in v.components] for name, v in model.items()}
    for name, v in model.items():
        for slot in opt.get_slot_names():
            out[f"{name}/{slot}"] = [np.array(c) for c in opt.get_slot(v, slot).components]
    for i, var in enumerate(opt.non_slot_variables):
        out[f"non_slot/{i}"] = [np.array(c) for c in var.components]
    return out


def _assert_same_state(got: dict[str, list], want: dict[str, list]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert len(got[key]) == len(want[key]), key
        for a, b in zip(got[key], want[key], strict=True):
            assert same_bits(a, b), (key, a, b)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[str, dict[str, list]]:
    """A run saved after two steps, and its state after a third step."""
    model, opt = _model()
    _step(model, opt, 1.0)
    _step(model, opt, -0.5)
    path = pv.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "run.h5"))
    _step(model, opt, 2.0)
    return path, _state(model, opt)


def _resume(path: str, **kw: object) -> dict[str, list]:
    """Restore ``path`` into a new model (slots not yet created), step once, the state."""
    model, opt = _model()
    status = pv.Checkpoint(model=model, optimizer=opt).restore(path, **kw)
    _step(model, opt, 2.0)
    status.assert_consumed()
    return _state(model, opt)


def _to(src: str, tmp_path: Path, target: str) -> str:
    out = {
        "safetensors": "x.safetensors",
        "safetensors-sharded": "sharded.safetensors",
        "npz": "x.npz",
        "tf": "tf/ckpt",
        "keras": "x.weights.h5",
        "keras-legacy": "legacy.h5",
    }[target]
    options: dict[str, object] = {}
    if target in ("tf", "keras-legacy"):
        options["to_format"] = target
    if target == "safetensors-sharded":
        options.update(to_format="safetensors", max_shard_size=64)
    return formats.convert(src, str(tmp_path / out), **options)  # type: ignore[arg-type]


TARGETS = ["safetensors", "safetensors-sharded", "npz", "tf", "keras", "keras-legacy"]


@pytest.mark.parametrize("target", TARGETS)
def test_round_trip_through_a_format_resumes_bit_identically(
    saved: tuple[str, dict[str, list]], tmp_path: Path, target: str
) -> None:
    path, want = saved
    back = formats.convert(_to(path, tmp_path, target), str(tmp_path / "back.h5"))
    with formats.open_checkpoint(back) as view:
        graph = view.object_graph
    assert graph is not None
    slots = [s for node in graph["nodes"] for s in node["slots"]]
    assert len(slots) == 4  # m and v of w and b, reached through the optimizer's node
    _assert_same_state(_resume(back), want)


@pytest.mark.parametrize("target", TARGETS)
def test_restore_reads_the_format_directly(
    saved: tuple[str, dict[str, list]], tmp_path: Path, target: str
) -> None:
    path, want = saved
    _assert_same_state(_resume(_to(path, tmp_path, target)), want)


def test_restore_of_a_tensorflow_directory_and_prefix(
    saved: tuple[str, dict[str, list]], tmp_path: Path
) -> None:
    path, want = saved
    prefix = _to(path, tmp_path, "tf")
    _assert_same_state(_resume(str(tmp_path / "tf")), want)  # the folder: its state file
    _assert_same_state(_resume(prefix + ".index"), want)


def test_the_graph_survives_safetensors_and_npz(
    saved: tuple[str, dict[str, list]], tmp_path: Path
) -> None:
    path, _ = saved
    with formats.open_checkpoint(path) as native:
        want = native.object_graph
    for target in ("safetensors", "npz", "keras"):
        with formats.open_checkpoint(_to(path, tmp_path, target)) as view:
            assert view.object_graph is not None, target
            assert view.object_graph["nodes"] == want["nodes"], target


def test_restore_into_existing_slots_checks_everything_first(
    saved: tuple[str, dict[str, list]], tmp_path: Path
) -> None:
    """All or nothing from another format: a mismatch leaves every variable as it was."""
    path, _ = saved
    st = _to(path, tmp_path, "safetensors")
    model, opt = _model()
    _step(model, opt, 3.0)
    before = _state(model, opt)
    with pv.MirroredStrategy(4).scope():
        wrong = pv.Variable(np.zeros(5, np.float32), name="b")
    with pytest.raises(errors.ShapeMismatchError, match="model/b"):
        pv.Checkpoint(model={"w": model["w"], "b": wrong}, optimizer=opt).restore(st)
    _assert_same_state(_state(model, opt), before)


def _plain_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file as another tool writes it: no metadata."""
    header: dict[str, object] = {}
    offset = 0
    for key, value in tensors.items():
        header[key] = {
            "dtype": "F32",
            "shape": list(value.shape),
            "data_offsets": [offset, offset + value.nbytes],
        }
        offset += value.nbytes
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for value in tensors.values():
            f.write(value.astype("<f4").tobytes())


def test_a_file_without_metadata_restores_its_values_and_reports_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "other.safetensors"
    w = np.linspace(0, 1, 6, dtype=np.float32).reshape(3, 2)
    _plain_safetensors(path, {"model.w": w, "extra.thing": np.ones(2, np.float32)})
    model, opt = _model()
    status = pv.Checkpoint(model=model, optimizer=opt).restore(str(path))
    for c in model["w"].components:
        np.testing.assert_array_equal(c, w)
    assert status.restored_paths == ["model/w"]
    assert status.unrestored_paths == ["extra/thing"]
    # the optimizer has no variables yet; the file's missing save counter is not counted
    assert status.unmatched_live_paths == ["model/b"]
    with pytest.raises(errors.RestoreMismatchError, match="extra/thing"):
        status.assert_consumed()
    with pytest.raises(errors.RestoreMismatchError, match="model/b"):
        status.assert_existing_objects_matched()


def test_a_malformed_carried_graph_is_corruption(tmp_path: Path) -> None:
    view = DictView([ArrayEntry("w", [np.ones(2, np.float32)])])
    view.object_graph = {  # type: ignore[attr-defined]
        "version": 1,
        "nodes": [{"children": [["w", 7]], "path": None}, {"path": "w"}],
    }
    out = formats.write_checkpoint(str(tmp_path / "g.npz"), view)
    with pytest.raises(errors.CorruptCheckpointError, match="object graph"):
        formats.open_checkpoint(out)


def test_a_slot_whose_variable_is_not_saved_keeps_its_path() -> None:
    from parallelvars.checkpoint.graph import graph_from_paths

    nodes = graph_from_paths(["opt/iter", "opt/slots/gone/m"], {"opt/slots/gone/m": ("gone", "m")})
    assert not any(n["slots"] for n in nodes)
    assert {n["path"] for n in nodes} == {None, "opt/iter", "opt/slots/gone/m"}


def test_graph_from_paths_puts_slots_on_the_optimizer() -> None:
    from parallelvars.checkpoint.graph import graph_from_paths

    nodes = graph_from_paths(
        ["m/w", "opt/iter", "opt/slots/m/w/m"], {"opt/slots/m/w/m": ("m/w", "m")}
    )
    paths = {n["path"]: i for i, n in enumerate(nodes) if n["path"]}
    opt = next(i for i, n in enumerate(nodes) if ["opt", i] in nodes[0]["children"])
    assert nodes[opt]["slots"] == [[paths["m/w"], "m", paths["opt/slots/m/w/m"]]]
    assert all(paths["opt/slots/m/w/m"] != c[1] for n in nodes for c in n["children"])


def test_a_tensorflow_adam_checkpoint_restores_its_slots() -> None:
    """tests/data/tf/sharded: TF 2.21, tf.compat.v1.train.AdamOptimizer after one step of
    ones. Its slots reach our Adam's m and v through TensorFlow's own slot_variables."""
    folder = str(Path(__file__).parent / "data" / "tf" / "sharded")
    with formats.open_checkpoint(folder) as view:
        saved = {k: view[k].value() for k in view}
    with pv.MirroredStrategy(2).scope():
        emb = pv.Variable(np.zeros((5, 2), np.float32), name="emb")
        v = pv.Variable(np.zeros(3, np.float32), name="v")
    opt = pv.optimizers.Adam(0.1)
    # TensorFlow keeps the beta powers in float32, we in float64: exact, so no allow_cast
    status = pv.Checkpoint(model={"emb": emb, "v": v}, optimizer=opt).restore(folder)
    m, vv = saved["optimizer/slots/model/v/m"], saved["optimizer/slots/model/v/v"]
    # the restore itself creates the slots of the variables it matched
    for c in opt.get_slot(v, "m").components:
        np.testing.assert_array_equal(c, m)
    for c in opt.get_slot(v, "v").components:
        np.testing.assert_array_equal(c, vv)
    opt.apply_gradients([(np.zeros(3, np.float32), v)])
    for c in opt.get_slot(v, "m").components:
        np.testing.assert_allclose(c, 0.9 * m, rtol=1e-6)
    for c in opt.get_slot(v, "v").components:
        np.testing.assert_allclose(c, 0.999 * vv, rtol=1e-6)
    # TF1's Adam has no step counter: reported, not silently left at zero
    assert status.unmatched_live_paths == ["optimizer/iterations"]
    assert status.unrestored_paths == []
    with pytest.raises(errors.RestoreMismatchError, match="optimizer/iterations"):
        status.assert_consumed()


def test_inspect_says_what_a_file_records_of_the_training_run(
    saved: tuple[str, dict[str, list]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from parallelvars.cli import main

    path, _ = saved
    plain = tmp_path / "other.safetensors"
    _plain_safetensors(plain, {"model.w": np.ones(2, np.float32)})
    cases = {
        path: ("parallelvars", 4),
        _to(path, tmp_path, "npz"): ("parallelvars", 4),
        _to(path, tmp_path, "tf"): ("tensorflow", 4),
        str(plain): (None, 0),
    }
    for target, (graph, slots) in cases.items():
        assert main(["inspect", target, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)["training_structure"]
        assert doc == {
            "object_graph": graph,
            "slots": slots,
            "slots_without_variable": [],
            "tf1_slots": 0,
            "tf1_counters": [],
            "not_mappable": {},
        }
    assert main(["inspect", str(plain)]) == 0
    assert "none recorded" in capsys.readouterr().out.splitlines()[-1]
    assert main(["inspect", path]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "training structure: parallelvars object graph, 4 optimizer slots"
    )


def test_a_file_no_format_reads_says_what_it_seems_to_be(tmp_path: Path) -> None:
    import h5py

    path = str(tmp_path / "other.h5")
    with h5py.File(path, "w") as f:
        f["a"] = np.ones(3)
    model, opt = _model()
    with pytest.raises(errors.NotACheckpointError, match="neither our layout nor a Keras") as info:
        pv.Checkpoint(model=model, optimizer=opt).restore(path)
    assert str(info.value).startswith(path)
    damaged = tmp_path / "model.safetensors"
    damaged.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(errors.ParallelVarsError) as info:
        pv.Checkpoint(model=model, optimizer=opt).restore(str(damaged))
    assert isinstance(info.value, ValueError) and str(damaged) in str(info.value)


def test_a_conversion_says_what_the_target_cannot_carry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A variable reached by two paths (tied weights): TensorFlow's graph keeps the first path
    only. The conversion says so (stderr, --json), and the restore still fills both."""
    from parallelvars.cli import main

    def tied() -> tuple[pv.Module, pv.ParallelVariable]:
        with pv.MirroredStrategy(2).scope():
            w = pv.Variable(np.arange(2, dtype=np.float32))
        m = pv.Module()
        m.embed, m.head = pv.Module(), pv.Module()
        m.embed.w = m.head.w = w
        return m, w

    model, _ = tied()
    path = pv.Checkpoint(model=model).write(str(tmp_path / "tied.h5"))
    assert main(["convert", path, str(tmp_path / "tf" / "c"), "--to", "tf", "--parents"]) == 0
    assert "note: 1 link(s) of the object graph" in capsys.readouterr().err
    assert (
        main(["convert", path, str(tmp_path / "tf2" / "c"), "--to", "tf", "--parents", "--json"])
        == 0
    )
    assert len(json.loads(capsys.readouterr().out)["notes"]) == 1
    assert main(["convert", path, str(tmp_path / "t.npz"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == []  # npz carries our graph
    fresh, w = tied()
    pv.Checkpoint(model=fresh).restore(str(tmp_path / "tf" / "c")).assert_consumed()
    assert w.components[1].tolist() == [0.0, 1.0]


def test_the_checkpoints_own_counter_never_counts_against_a_foreign_restore(
    tmp_path: Path,
) -> None:
    """A file another library wrote has no ``save_counter``: as TensorFlow does for a
    name-based restore, the live counter is optionally restored (kept, never reported)."""
    path = tmp_path / "other.safetensors"
    w = np.linspace(0, 1, 6, dtype=np.float32).reshape(3, 2)
    _plain_safetensors(path, {"model.w": w, "model.b": np.ones(2, np.float32)})
    model, _ = _model()
    ckpt = pv.Checkpoint(model=model)
    ckpt.save_counter.assign(7)
    status = ckpt.restore(str(path))
    assert status.unmatched_live_paths == []  # was: ["save_counter"]
    status.assert_consumed().assert_existing_objects_matched()
    assert int(ckpt.save_counter) == 7
    # a file of ours that has the counter still counts it: restored, so matched
    native = ckpt.write(tmp_path / "native.h5")
    ckpt.save_counter.assign(0)
    assert "save_counter" in ckpt.restore(native).assert_consumed().restored_paths
    assert int(ckpt.save_counter) == 7
