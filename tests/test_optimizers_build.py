"""Optimizer state before the first step: ``build(var_list)``, slots made by a restore,
pending values filled at build, mismatches raised at restore/build time (never at step 2)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import parallelvars as pv
from parallelvars import optimizers as opts
from parallelvars.errors import DtypeMismatchError, GradientError, ShapeMismatchError

STEPS = 3


def _model(strategy: pv.MirroredStrategy, dtype: Any = np.float32) -> pv.Module:
    with strategy.scope():
        m = pv.Module()
        m.w = pv.Variable(np.linspace(-1, 1, 6, dtype=dtype).reshape(2, 3), name="w")
        m.b = pv.Variable(np.zeros(3, dtype), name="b")
    return m


def _adam(strategy: pv.MirroredStrategy) -> opts.Adam:
    with strategy.scope():
        return opts.Adam(0.05)


def _step(strategy: pv.MirroredStrategy, m: pv.Module, opt: opts.Optimizer, k: int) -> None:
    rng = np.random.default_rng(k)
    grads = [
        [(rng.normal(size=v.shape).astype(v.dtype), v) for v in (m.w, m.b)]
        for _ in range(strategy.num_replicas_in_sync)
    ]

    def fn(pairs: Any) -> None:
        opt.apply_gradients(pairs)

    strategy.run(fn, args=(pv.PerReplica(grads),))


def _state(m: pv.Module, opt: opts.Adam) -> dict[str, np.ndarray]:
    """Every value of model and optimizer, every component, by name."""
    out: dict[str, np.ndarray] = {}
    for name in ("w", "b"):
        var = getattr(m, name)
        out[name] = var.stacked.copy()
        for slot in ("m", "v"):
            s = opt.get_slot(var, slot)
            assert s is not None, f"no slot {slot} of {name}"
            out[f"{name}/{slot}"] = s.stacked.copy()
    for name in ("iterations", "beta1_power", "beta2_power"):
        out[name] = getattr(opt, name).stacked.copy()
    return out


def _assert_same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].tobytes() == b[k].tobytes(), k


@pytest.fixture
def strategy() -> pv.MirroredStrategy:
    return pv.MirroredStrategy(2)


@pytest.fixture
def trained(strategy, tmp_path) -> tuple[str, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A checkpoint after STEPS Adam steps, its state, and the state one step later."""
    m, opt = _model(strategy), _adam(strategy)
    for k in range(STEPS):
        _step(strategy, m, opt, k)
    path = pv.Checkpoint(model=m, optimizer=opt).save(tmp_path / "run")
    saved = _state(m, opt)
    _step(strategy, m, opt, STEPS)
    return path, saved, _state(m, opt)


def test_build_makes_slots_and_counters_before_the_first_step(strategy) -> None:
    m, opt = _model(strategy), _adam(strategy)
    assert opt.iterations is None and opt.get_slot(m.w, "m") is None
    with strategy.scope():
        opt.build([m.w, m.b])
    assert int(opt.iterations) == 0 and opt.iterations.devices == m.w.devices
    assert float(opt.beta1_power) == pytest.approx(0.9) and opt.beta2_power.dtype == np.float64
    assert opt.get_slot_names() == ["m", "v"]
    slot = opt.get_slot(m.w, "v")
    assert slot.kind == "mirrored" and slot.shape == (2, 3) and not slot.stacked.any()
    again = opt.get_slot(m.w, "m")
    opt.build([m.w, m.b])  # again: nothing new
    assert opt.get_slot(m.w, "m") is again
    # Steps after build equal steps without it.
    ref_m, ref_opt = _model(strategy), _adam(strategy)
    for k in range(2):
        _step(strategy, m, opt, k)
        _step(strategy, ref_m, ref_opt, k)
    _assert_same_bits(_state(m, opt), _state(ref_m, ref_opt))


def test_build_refuses_what_it_cannot_train(strategy) -> None:
    m, opt = _model(strategy), _adam(strategy)
    with strategy.scope():
        metric = pv.Variable(0.0, name="n", synchronization="on_read", aggregation="sum")
        count = pv.Variable(np.int64(0), name="count")
    for bad in ([metric], [count], [m.w, m.w]):
        with pytest.raises(GradientError):
            opt.build(bad)
    assert opt.iterations is None and opt.get_slot(m.w, "m") is None


def test_restore_makes_slots_and_counters_bit_identical(strategy, trained) -> None:
    path, saved, after = trained
    m, opt = _model(strategy), _adam(strategy)
    with strategy.scope():
        status = pv.Checkpoint(model=m, optimizer=opt).restore(path)
    status.assert_consumed()  # right after the restore: slots and beta powers exist
    assert int(opt.iterations) == STEPS
    _assert_same_bits(_state(m, opt), saved)
    with strategy.scope():
        opt.build([m.w, m.b])  # nothing to make: the restore made it all
    status.assert_consumed()
    _step(strategy, m, opt, STEPS)
    _assert_same_bits(_state(m, opt), after)  # the step of the uninterrupted run


def test_build_fills_counters_a_restore_left_pending(strategy, trained) -> None:
    path, saved, after = trained
    m, opt = pv.Module(), _adam(strategy)
    status = pv.Checkpoint(model=m, optimizer=opt).restore(path)  # no variables yet
    assert opt.iterations is None
    fresh = _model(strategy)
    with strategy.scope():
        opt.build([fresh.w, fresh.b])  # not the saved variables: only the counters are pending
    assert int(opt.iterations) == STEPS
    for name in ("iterations", "beta1_power", "beta2_power"):
        assert getattr(opt, name).stacked.tobytes() == saved[name].tobytes()
    m.w, m.b = fresh.w, fresh.b  # attached: the values and their slots arrive
    status.assert_consumed()
    _assert_same_bits(_state(m, opt), saved)
    _step(strategy, m, opt, STEPS)
    _assert_same_bits(_state(m, opt), after)


class _WideSlots(opts.Adam):
    """Adam whose slots are float64 whatever the variable: a checkpoint that does not fit."""

    def _make_slot(self, var: Any, slot_name: str, init: float) -> pv.ParallelVariable:
        value = np.full(var.shape, 7.0)
        return pv.ReplicatedVariable(f"{var.name}/{slot_name}", [value] * 2, var.device)


class _TallSlots(opts.Adam):
    """Adam whose slots have one row more than the variable."""

    def _make_slot(self, var: Any, slot_name: str, init: float) -> pv.ParallelVariable:
        value = np.zeros((var.shape[0] + 1, *var.shape[1:]), var.dtype)
        return pv.ReplicatedVariable(f"{var.name}/{slot_name}", [value] * 2, var.device)


@pytest.mark.parametrize(
    ("cls", "error", "expected", "found"),
    [
        (_WideSlots, DtypeMismatchError, "expected float32", "found float64"),
        (_TallSlots, ShapeMismatchError, "expected (2, 3)", "found (3, 3)"),
    ],
)
def test_a_slot_that_does_not_fit_raises_at_restore(
    strategy, tmp_path, cls, error, expected, found
) -> None:
    m = _model(strategy)
    with strategy.scope():
        bad = cls(0.05)
        bad.build([m.w, m.b])
    path = pv.Checkpoint(model=m, optimizer=bad).write(tmp_path / "bad.h5")
    m2, opt = _model(strategy), _adam(strategy)
    m2.w.assign(np.full((2, 3), 5.0, np.float32))
    with pytest.raises(error) as info:
        pv.Checkpoint(model=m2, optimizer=opt).restore(path)
    text = str(info.value)
    assert str(path) in text and "optimizer/slots/model/w/" in text
    assert expected in text and found in text
    # All or nothing: the model kept its values, the optimizer made nothing.
    assert m2.w.stacked.tolist() == [[[5.0] * 3] * 2] * 2
    assert opt.iterations is None and opt.get_slot(m2.w, "m") is None


def _counter_file(strategy, tmp_path, name: str, value: Any) -> str:
    """An Adam checkpoint after one step whose counter ``name`` is saved as ``value``."""
    m, opt = _model(strategy), _adam(strategy)
    _step(strategy, m, opt, 0)
    with strategy.scope():
        setattr(opt, name, pv.Variable(value, name=name))
    return pv.Checkpoint(model=m, optimizer=opt).write(tmp_path / f"{name}.h5")


def test_float32_beta_powers_restore_exactly_without_allow_cast(strategy, tmp_path) -> None:
    b1 = np.float32(0.9) ** 3  # TensorFlow keeps beta powers in float32
    path = _counter_file(strategy, tmp_path, "beta1_power", b1)
    m, opt = _model(strategy), _adam(strategy)
    with strategy.scope():
        pv.Checkpoint(model=m, optimizer=opt).restore(path).assert_consumed()
    assert opt.beta1_power.dtype == np.float64
    assert all(float(c) == float(b1) for c in opt.beta1_power.components)  # exactly
    _step(strategy, m, opt, 1)  # trains on
    assert float(opt.beta1_power) == float(b1) * 0.9


@pytest.mark.parametrize(
    ("value", "ok"),
    [(np.float64(1.0), True), (np.int32(1), True), (np.float64(1.5), False), (np.nan, False)],
)
def test_a_step_count_of_another_dtype_converts_only_where_exact(
    strategy, tmp_path, value, ok
) -> None:
    path = _counter_file(strategy, tmp_path, "iterations", value)
    m, opt = _model(strategy), _adam(strategy)
    ckpt = pv.Checkpoint(model=m, optimizer=opt)
    if ok:
        ckpt.restore(path).assert_consumed()
        assert opt.iterations.dtype == np.int64 and int(opt.iterations) == 1
        return
    with pytest.raises(DtypeMismatchError, match="not exactly representable") as info:
        ckpt.restore(path)
    assert "optimizer/iterations" in str(info.value) and "expected int64" in str(info.value)
    assert opt.iterations is None
    if not np.isnan(value):
        ckpt.restore(path, allow_cast=True).assert_consumed()  # an explicit cast still works
        assert int(opt.iterations) == 1


def test_a_mismatch_pending_at_build_raises_there_and_again_never_attribute_error(
    strategy, tmp_path
) -> None:
    path = _counter_file(strategy, tmp_path, "iterations", np.float64(2.5))
    m, opt = pv.Module(), _adam(strategy)
    pv.Checkpoint(model=m, optimizer=opt).restore(path)  # the counters wait for variables
    fresh = _model(strategy)
    for _ in range(2):
        with strategy.scope(), pytest.raises(DtypeMismatchError) as info:
            opt.build([fresh.w, fresh.b])
        assert str(path) in str(info.value) and "optimizer/iterations" in str(info.value)
        assert "expected int64" in str(info.value) and "found float64" in str(info.value)
        assert opt.iterations is None and opt.beta1_power is None
    for _ in range(2):  # the steps raise the same error: nothing half-made
        with pytest.raises(DtypeMismatchError, match="optimizer/iterations"):
            _step(strategy, fresh, opt, 0)
    assert opt.iterations is None


def test_a_shape_mismatch_pending_at_build(strategy, tmp_path) -> None:
    path = _counter_file(strategy, tmp_path, "beta2_power", np.ones(2))
    m, opt = pv.Module(), _adam(strategy)
    pv.Checkpoint(model=m, optimizer=opt).restore(path)
    fresh = _model(strategy)
    with strategy.scope(), pytest.raises(ShapeMismatchError) as info:
        opt.build([fresh.w])
    text = str(info.value)
    assert "optimizer/beta2_power" in text and "expected ()" in text and "found (2,)" in text
    assert opt.iterations is None and opt.get_slot(fresh.w, "m") is None
