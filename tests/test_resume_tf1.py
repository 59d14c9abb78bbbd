"""TF1 name-based checkpoints (``tf.compat.v1.train.Saver``) restore by variable name, with the
optimizer state where its owner is unambiguous; what cannot be mapped is reported with a reason.

The files with optimizer state here are written by our own TensorFlow writer with the key names
a TF1 Saver gives (``dense/kernel/Adam``, ``dense/kernel/Adam_1``, ``beta1_power``, ...: see
formats/tf/_tf1.py for where TensorFlow makes these names); they imitate a Saver's keys and were
not written by TensorFlow. tests/data/tf/tf1 is a real Saver checkpoint (no optimizer).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import parallelvars as pv
from parallelvars import errors, formats
from parallelvars.formats import ArrayEntry, DictView

DATA = Path(__file__).parent / "data" / "tf"
RNG = np.random.default_rng(7)
KERNEL = RNG.standard_normal((3, 4)).astype(np.float32)
BIAS = RNG.standard_normal(4).astype(np.float32)


def _saver_file(tmp_path: Path, tensors: dict[str, np.ndarray], name: str = "model.ckpt-2") -> str:
    """A name-based checkpoint holding ``tensors`` under their keys, as a Saver names them."""
    view = DictView([ArrayEntry(k, [np.asarray(v)]) for k, v in tensors.items()])
    return formats.write_checkpoint(str(tmp_path / name), view, format="tf", naming="name")


def _adam_state() -> dict[str, np.ndarray]:
    return {
        "dense/kernel": KERNEL,
        "dense/bias": BIAS,
        "dense/kernel/Adam": (KERNEL * 0.1).astype(np.float32),
        "dense/kernel/Adam_1": (KERNEL * KERNEL * 0.01).astype(np.float32),
        "dense/bias/Adam": (BIAS * 0.1).astype(np.float32),
        "dense/bias/Adam_1": (BIAS * BIAS * 0.01).astype(np.float32),
        # after two steps: beta^3 for the third, in float32 as TF1 keeps them
        "beta1_power": np.float32(0.9) ** 3,
        "beta2_power": np.float32(0.999) ** 3,
        "global_step": np.int64(2),
    }


def _model(devices: int = 2) -> tuple[pv.Module, pv.ParallelVariable, pv.ParallelVariable]:
    """Our variables named as the TF1 graph named them, at paths of our own."""
    with pv.MirroredStrategy(devices).scope():
        kernel = pv.Variable(np.zeros((3, 4), np.float32), name="dense/kernel")
        bias = pv.Variable(np.zeros(4, np.float32), name="dense/bias")
    model = pv.Module()
    model.w, model.b = kernel, bias
    return model, kernel, bias


def _components(var: pv.ParallelVariable) -> list[np.ndarray]:
    return [np.asarray(c) for c in var.components]


def test_the_real_saver_fixture_restores_by_path_and_by_name() -> None:
    expected = np.load(DATA / "expected.npz")
    want = {k: expected[f"tf1|dense/{k}"] for k in ("kernel", "bias")}
    dense = pv.Module()
    dense.kernel = pv.Variable(np.zeros((3, 4), np.float32))
    dense.bias = pv.Variable(np.zeros(4, np.float32))
    root = pv.Module()
    root.dense = dense
    status = pv.Checkpoint(**{"dense": dense}).restore(str(DATA / "tf1"))
    assert status.restored_paths == ["dense/bias", "dense/kernel"]
    np.testing.assert_array_equal(np.asarray(dense.kernel), want["kernel"])
    model, kernel, bias = _model()
    status = pv.Checkpoint(model=model).restore(str(DATA / "tf1"))  # by the variables' names
    assert status.restored_paths == ["model/b", "model/w"]
    assert status.unrestored_paths == []
    for c in _components(kernel):
        np.testing.assert_array_equal(c, want["kernel"])
    for c in _components(bias):
        np.testing.assert_array_equal(c, want["bias"])


def test_a_real_tf1_adam_checkpoint_resumes_as_tensorflow_continues() -> None:
    """tests/data/tf/tf1_adam: a Saver checkpoint of TF 2.21's AdamOptimizer after two steps;
    the third step TensorFlow took from it is in tf1_adam_after_step_3.npz."""
    after = np.load(DATA / "tf1_adam_after_step_3.npz")
    with pv.MirroredStrategy(2).scope():
        kernel = pv.Variable(np.zeros((3, 4), np.float32), name="dense/kernel")
        bias = pv.Variable(np.zeros(4, np.float32), name="dense/bias")
        opt = pv.optimizers.Adam(0.01)
    model = pv.Module()
    model.layer = pv.Module()
    model.layer.kernel, model.layer.bias = kernel, bias
    status = pv.Checkpoint(model=model, optimizer=opt).restore(str(DATA / "tf1_adam"))
    assert status.unrestored_paths == []
    assert status.unmatched_live_paths == ["optimizer/iterations"]
    grads = [np.full((3, 4), 0.25, np.float32), np.linspace(-1, 1, 4, dtype=np.float32)]
    opt.apply_gradients(list(zip(grads, (kernel, bias), strict=True)))
    for var, key in ((kernel, "dense/kernel"), (bias, "dense/bias")):
        for c in _components(var):
            np.testing.assert_allclose(c, after[key], rtol=1e-6, atol=1e-7)
        # TensorFlow rounds beta1, beta2 to float32 first (1 - float32(0.999) is 1.0000467e-3):
        # the moments agree to float32 rounding of those constants, a few parts in 1e6
        for slot, suffix in (("m", "Adam"), ("v", "Adam_1")):
            for c in _components(opt.get_slot(var, slot)):
                np.testing.assert_allclose(c, after[f"{key}/{suffix}"], rtol=5e-6, atol=1e-9)
    for name in ("beta1_power", "beta2_power"):
        np.testing.assert_allclose(float(getattr(opt, name).read_value()), after[name], rtol=1e-7)


def test_adam_slots_and_beta_powers_map_and_the_next_step_is_tf1_adam(tmp_path: Path) -> None:
    saved = _adam_state()
    prefix = _saver_file(tmp_path, saved)
    model, kernel, bias = _model()
    with pv.MirroredStrategy(2).scope():
        opt = pv.optimizers.Adam(0.01)
    status = pv.Checkpoint(model=model, optimizer=opt).restore(prefix)
    for var, key in ((kernel, "dense/kernel"), (bias, "dense/bias")):
        for c in _components(opt.get_slot(var, "m")):
            np.testing.assert_array_equal(c, saved[f"{key}/Adam"])
        for c in _components(opt.get_slot(var, "v")):
            np.testing.assert_array_equal(c, saved[f"{key}/Adam_1"])
    assert float(opt.beta1_power.read_value()) == float(saved["beta1_power"])
    assert float(opt.beta2_power.read_value()) == float(saved["beta2_power"])
    # TF1's Adam keeps no step count; global_step is not the optimizer's: both reported
    assert status.unmatched_live_paths == ["optimizer/iterations"]
    assert status.unrestored_paths == ["global_step"]
    assert set(status.unrestored_reasons) == {"global_step"}

    grads = [np.full((3, 4), 0.25, np.float32), np.linspace(-1, 1, 4, dtype=np.float32)]
    opt.apply_gradients(list(zip(grads, (kernel, bias), strict=True)))
    # TF1's Adam (training_ops.apply_adam) on the same values, in float64
    b1p, b2p = float(saved["beta1_power"]), float(saved["beta2_power"])
    lr_t = 0.01 * math.sqrt(1 - b2p) / (1 - b1p)
    for var, key, g in ((kernel, "dense/kernel", grads[0]), (bias, "dense/bias", grads[1])):
        g64 = g.astype(np.float64)
        m = 0.9 * saved[f"{key}/Adam"] + 0.1 * g64
        v = 0.999 * saved[f"{key}/Adam_1"] + 0.001 * g64 * g64
        want = saved[key] - lr_t * m / (np.sqrt(v) + 1e-8)
        for c in _components(var):
            np.testing.assert_allclose(c, want, rtol=2e-6, atol=1e-7)
        for c in _components(opt.get_slot(var, "m")):
            np.testing.assert_allclose(c, m, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(float(opt.beta1_power.read_value()), b1p * 0.9, rtol=1e-12)


@pytest.mark.parametrize(
    ("make", "keys"),
    [
        (lambda: pv.optimizers.Momentum(0.1, 0.9), {"Momentum": "momentum"}),
        (lambda: pv.optimizers.Adagrad(0.1), {"Adagrad": "accumulator"}),
        (lambda: pv.optimizers.RMSProp(0.1), {"RMSProp": "rms", "RMSProp_1": "momentum"}),
        (
            lambda: pv.optimizers.RMSProp(0.1, centered=True),
            {"RMSProp": "rms", "RMSProp_1": "mg", "RMSProp_2": "momentum"},
        ),
    ],
)
def test_the_other_tf1_optimizers_map_their_slots(
    tmp_path: Path, make: object, keys: dict[str, str]
) -> None:
    tensors: dict[str, np.ndarray] = {"dense/kernel": KERNEL, "dense/bias": BIAS}
    for i, suffix in enumerate(keys):
        tensors[f"dense/kernel/{suffix}"] = KERNEL * 0 + np.float32(i + 1.5)
        tensors[f"dense/bias/{suffix}"] = BIAS * 0 + np.float32(i + 2.5)
    prefix = _saver_file(tmp_path, tensors)
    model, kernel, bias = _model()
    with pv.MirroredStrategy(2).scope():
        opt = make()  # type: ignore[operator]
    status = pv.Checkpoint(model=model, optimizer=opt).restore(prefix)
    for suffix, slot in keys.items():
        for c in _components(opt.get_slot(kernel, slot)):
            np.testing.assert_array_equal(c, tensors[f"dense/kernel/{suffix}"])
        for c in _components(opt.get_slot(bias, slot)):
            np.testing.assert_array_equal(c, tensors[f"dense/bias/{suffix}"])
    assert status.unrestored_paths == []


def _unmapped(status: pv.CheckpointLoadStatus) -> dict[str, str]:
    return {p: r for p, r in status.unrestored_reasons.items() if p != "global_step"}


def test_several_optimizers_are_not_guessed(tmp_path: Path) -> None:
    prefix = _saver_file(tmp_path, _adam_state())
    model, kernel, _ = _model()
    first, second = pv.optimizers.Adam(0.1), pv.optimizers.Adam(0.1)
    status = pv.Checkpoint(model=model, opt_a=first, opt_b=second).restore(prefix)
    reasons = _unmapped(status)
    assert set(reasons) == {
        "beta1_power",
        "beta2_power",
        "dense/bias/Adam",
        "dense/bias/Adam_1",
        "dense/kernel/Adam",
        "dense/kernel/Adam_1",
    }
    assert all("2 optimizers (opt_a, opt_b)" in r for r in reasons.values())
    assert first.get_slot(kernel, "m") is None and second.get_slot(kernel, "m") is None
    np.testing.assert_array_equal(np.asarray(kernel), KERNEL)  # the values still restore
    with pytest.raises(errors.RestoreMismatchError, match="whose state it is cannot be told"):
        status.assert_consumed()


def test_state_of_another_optimizer_kind_is_reported(tmp_path: Path) -> None:
    prefix = _saver_file(tmp_path, _adam_state())
    model, kernel, _ = _model()
    opt = pv.optimizers.Momentum(0.1, 0.9)
    reasons = _unmapped(pv.Checkpoint(model=model, optimizer=opt).restore(prefix))
    assert reasons["dense/kernel/Adam"].endswith("the live optimizer 'optimizer' is Momentum")
    assert reasons["beta1_power"].endswith("is Momentum")
    assert opt.get_slot(kernel, "momentum") is None
    adamw = pv.optimizers.AdamW(0.01)  # not TF1's Adam: its update differs
    model, _, _ = _model()
    reasons = _unmapped(pv.Checkpoint(model=model, optimizer=adamw).restore(prefix))
    assert reasons["dense/bias/Adam_1"].endswith("is AdamW")


def test_without_an_optimizer_or_a_matching_variable_slots_are_reported(tmp_path: Path) -> None:
    prefix = _saver_file(tmp_path, _adam_state())
    model, _, _ = _model()
    reasons = _unmapped(pv.Checkpoint(model=model).restore(prefix))
    assert reasons["dense/kernel/Adam"].endswith("no optimizer among the checkpoint's objects")
    with pv.MirroredStrategy(2).scope():
        only = pv.Variable(np.zeros(4, np.float32), name="dense/bias")
    opt = pv.optimizers.Adam(0.1)
    status = pv.Checkpoint(b=only, optimizer=opt).restore(prefix)
    reasons = _unmapped(status)
    assert reasons["dense/kernel/Adam"].endswith("matched no live variable by path or name")
    assert "dense/bias/Adam" not in reasons
    for c in _components(opt.get_slot(only, "m")):
        np.testing.assert_array_equal(c, BIAS * np.float32(0.1))


def test_two_live_variables_of_one_name_are_not_guessed(tmp_path: Path) -> None:
    prefix = _saver_file(tmp_path, {"dense/kernel": KERNEL})
    a = pv.Variable(np.zeros((3, 4), np.float32), name="dense/kernel")
    b = pv.Variable(np.zeros((3, 4), np.float32), name="dense/kernel")
    status = pv.Checkpoint(a=a, b=b).restore(prefix)
    assert status.unrestored_reasons == {
        "dense/kernel": "2 live variables are named 'dense/kernel' (a, b): which one it is "
        "cannot be told"
    }
    assert not np.asarray(a).any() and not np.asarray(b).any()


def test_rmsprop_centered_or_not_must_agree(tmp_path: Path) -> None:
    tensors = {"w": KERNEL, "w/RMSProp": np.ones_like(KERNEL), "w/RMSProp_1": KERNEL * 0}
    prefix = _saver_file(tmp_path, tensors)
    w = pv.Variable(np.zeros((3, 4), np.float32), name="w")
    opt = pv.optimizers.RMSProp(0.1, centered=True)
    reasons = pv.Checkpoint(w=w, optimizer=opt).restore(prefix).unrestored_reasons
    assert reasons["w/RMSProp"].endswith("saved not centered, the live RMSProp is centered")


def test_slot_keys_in_no_tf1_layout_are_reported(tmp_path: Path) -> None:
    tensors = {"w": KERNEL, "w/Adam": KERNEL, "w/Adam_2": KERNEL}  # Adam_1 missing
    prefix = _saver_file(tmp_path, tensors)
    w = pv.Variable(np.zeros((3, 4), np.float32), name="w")
    reasons = pv.Checkpoint(w=w, optimizer=pv.optimizers.Adam()).restore(prefix).unrestored_reasons
    assert set(reasons) == {"w/Adam", "w/Adam_2"}
    assert "in no layout TF1's Adam writes" in reasons["w/Adam"]


def test_a_mapped_slot_that_does_not_fit_fails_the_whole_restore(tmp_path: Path) -> None:
    tensors = _adam_state()
    tensors["dense/bias/Adam"] = tensors["dense/bias/Adam"].astype(np.float64)
    prefix = _saver_file(tmp_path, tensors)
    model, kernel, bias = _model()
    opt = pv.optimizers.Adam(0.1)
    with pytest.raises(errors.DtypeMismatchError, match="optimizer/slots/model/b/m"):
        pv.Checkpoint(model=model, optimizer=opt).restore(prefix)
    assert not np.asarray(kernel).any() and opt.get_slot(bias, "m") is None


def test_keras3_optimizer_variables_saved_by_position_are_reported(tmp_path: Path) -> None:
    """Keras 3 (TF backend) saves its optimizer's step count as ``optimizer/_iterations`` and
    the moments by position (``optimizer/_variables/<i>``); this file imitates those keys
    (written by our writer, object-based)."""
    view = DictView(
        [
            ArrayEntry("model/w", [KERNEL]),
            ArrayEntry("optimizer/_iterations", [np.array(3, np.int64)]),
            ArrayEntry("optimizer/_variables/2", [KERNEL]),
            ArrayEntry("optimizer/_variables/3", [KERNEL]),
        ]
    )
    prefix = formats.write_checkpoint(str(tmp_path / "k" / "ckpt-1"), view, format="tf")
    w = pv.Variable(np.zeros((3, 4), np.float32))
    model = pv.Module()
    model.w = w
    status = pv.Checkpoint(model=model, optimizer=pv.optimizers.Adam()).restore(prefix)
    reasons = status.unrestored_reasons
    assert set(reasons) == {
        "optimizer/_iterations",
        "optimizer/_variables/2",
        "optimizer/_variables/3",
    }
    assert all("a Keras 3 optimizer's state" in r for r in reasons.values())
    np.testing.assert_array_equal(np.asarray(w), KERNEL)


def test_inspect_names_the_tf1_state_and_what_cannot_map(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from parallelvars.cli import main

    tensors = {**_adam_state(), "x": KERNEL, "x/Adam_3": KERNEL}
    prefix = _saver_file(tmp_path, tensors)
    assert main(["inspect", prefix, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["training_structure"]
    assert (doc["tf1_slots"], doc["tf1_counters"]) == (4, ["beta1_power", "beta2_power"])
    assert list(doc["not_mappable"]) == ["x/Adam_3"]
    assert main(["inspect", prefix]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert "TF1 name-based optimizer state: 4 slots and beta1_power, beta2_power" in line
    assert "1 not mappable, e.g. x/Adam_3: TF1 Adam slot keys of 'x' in no layout" in line
