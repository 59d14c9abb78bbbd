"""Optimizer API: contexts, slots, non-slot variables, checkpoints, sparse gradients, clipping."""

from __future__ import annotations

from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pytest

import parallelvars as pv
from parallelvars import optimizers as opts
from parallelvars.errors import ContextError, GradientError

ALL = {
    "sgd": lambda: opts.SGD(0.1),
    "momentum": lambda: opts.Momentum(0.1, 0.9, use_nesterov=True),
    "adam": lambda: opts.Adam(0.01, amsgrad=True),
    "adamw": lambda: opts.AdamW(0.01, learning_rate=0.01),
    "adagrad": lambda: opts.Adagrad(0.1),
    "rmsprop": lambda: opts.RMSProp(0.01, momentum=0.9, centered=True),
}


def _bits(a: Any) -> np.ndarray:
    arr = np.ascontiguousarray(a)
    return arr.view(np.dtype(f"u{arr.dtype.itemsize}"))


@pytest.mark.parametrize("name", sorted(ALL))
def test_replicas_stay_bit_identical(name: str) -> None:
    strategy = pv.MirroredStrategy(4)
    rng = np.random.default_rng(0)
    shapes = [(37, 5), (3,), (1000,), (), (8, 8, 3)]
    with strategy.scope():
        vs = [
            pv.Variable(rng.normal(size=s).astype(np.float32), name=f"v{i}")
            for i, s in enumerate(shapes)
        ]
        opt = ALL[name]()
    for _ in range(60):
        grads = [rng.normal(size=s).astype(np.float32) * 10 for s in shapes]
        with strategy.scope():
            opt.distributed_apply(strategy, list(zip(grads, vs, strict=True)))
    tracked = list(vs) + [s for _, _, s in opt._checkpoint_slots()]
    assert len(tracked) > len(vs) or name == "sgd"
    for v in tracked:
        first = _bits(v.components[0])
        assert np.isfinite(v.components[0]).all()
        for comp in v.components[1:]:
            assert np.array_equal(_bits(comp), first), v.name


def test_slots_are_mirrored_like_their_variable() -> None:
    strategy = pv.MirroredStrategy(["cpu:0", "cpu:3"])
    with strategy.scope():
        w = pv.Variable(np.ones((2, 3), np.float32), name="w")
        e = pv.Variable(np.ones((4, 2), np.float32), name="e", shard_axis=0)
        opt = opts.RMSProp(0.1, centered=True)
        assert opt.get_slot(w, "rms") is None
        opt.distributed_apply(strategy, [(np.ones((2, 3)), w), (np.ones((4, 2)), e)])
    assert opt.get_slot_names() == ["mg", "momentum", "rms"]
    rms = opt.get_slot(w, "rms")
    assert rms.kind == "mirrored" and rms.devices == ("cpu:0", "cpu:3") and not rms.trainable
    assert rms.shape == (2, 3) and rms.dtype == np.float32
    # The slot lives at the variable's offset in a shadow of the variable's arena.
    assert rms.placement.offset == w.placement.offset
    assert any(a is rms.placement.arena for a in w.placement.arena._shadows.values())
    np.testing.assert_allclose(rms.components[1], 0.9 + 0.1)
    srms = opt.get_slot(e, "rms")
    assert srms.kind == "sharded" and srms.shard_axis == 0 and srms.devices == e.devices
    assert opt.get_slot(w, "nope") is None
    assert opt.iterations.kind == "mirrored" and opt.iterations.devices == ("cpu:0", "cpu:3")


def test_apply_gradients_contexts_and_global_step() -> None:
    w = pv.Variable(np.ones(3, np.float32), name="w")
    u = pv.Variable(np.ones(3, np.float32), name="u")
    step = pv.Variable(np.int64(0), name="step")
    opt = opts.SGD(0.5)
    opt.apply_gradients([(np.ones(3), w), (None, u)], global_step=step)
    assert w.tolist() == [0.5] * 3 and u.tolist() == [1.0] * 3
    assert int(step) == 1 and int(opt.iterations.read_value()) == 1
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        m = pv.Variable(np.ones(3, np.float32), name="m")
        with pytest.raises(ContextError, match=r"cross-replica.*distributed_apply"):
            opts.SGD(0.1).apply_gradients([(np.ones(3), m)])
    with pytest.raises(GradientError, match="no gradients"):
        opt.apply_gradients([(None, w)])


def test_learning_rate_callable_of_step() -> None:
    w = pv.Variable(np.zeros(1, np.float64))
    opt = opts.SGD(lambda step: 0.1 * (step + 1))
    for _ in range(3):
        opt.apply_gradients([(np.ones(1), w)])
    assert w.tolist() == pytest.approx([-(0.1 + 0.2 + 0.3)])


def test_bad_gradients_raise_clear_errors() -> None:
    w = pv.Variable(np.zeros((3, 2), np.float32), name="kernel")
    opt = opts.Adam()
    with pytest.raises(GradientError, match=r"'kernel'.*expected \(3, 2\), found \(2, 3\)"):
        opt.apply_gradients([(np.zeros((2, 3)), w)])
    with pytest.raises(GradientError, match="out of range"):
        opt.apply_gradients([(pv.IndexedSlices(np.zeros((1, 2)), [3]), w)])
    with pytest.raises(GradientError, match="twice"):
        opt.apply_gradients([(np.zeros((3, 2)), w), (np.zeros((3, 2)), w)])
    n = pv.Variable(np.zeros(2, np.int32), name="count")
    with pytest.raises(GradientError, match=r"'count'.*float"):
        opts.SGD(0.1).apply_gradients([(np.zeros(2), n)])
    with pytest.raises(ValueError, match="indices"):
        pv.IndexedSlices(np.zeros((1, 2)), [[0]])


def test_only_the_given_variables_change_in_a_shared_arena() -> None:
    # a, x, b are neighbours in one arena; training a and b must leave x (and the padding) alone.
    a = pv.Variable(np.ones(5, np.float32), name="a")
    x = pv.Variable(np.full(7, 3.0, np.float32), name="x")
    b = pv.Variable(np.ones(9, np.float32), name="b")
    assert a.placement.arena is x.placement.arena is b.placement.arena
    opt = opts.AdamW(0.5, learning_rate=0.1)
    for _ in range(5):
        opt.apply_gradients([(np.ones(5), a), (np.ones(9), b)])
    assert x.tolist() == [3.0] * 7
    assert a.tolist() != [1.0] * 5
    arena = a.placement.arena
    pad = arena.buffer[:, a.placement.offset + 5 : x.placement.offset]
    assert not pad.any()


def test_padding_between_variables_stays_finite() -> None:
    vs = [
        pv.Variable(np.ones(3, np.float32), name=f"p{i}") for i in range(4)
    ]  # 13 padding columns each
    opt = opts.Adagrad(0.1)
    rms = opts.RMSProp(0.1, centered=True, epsilon=0.0)
    for _ in range(3):
        opt.apply_gradients([(np.ones(3), v) for v in vs])
        rms.apply_gradients([(np.ones(3), v) for v in vs])
    lo, hi = vs[0].placement.offset, vs[-1].placement.offset + 3
    arena = vs[0].placement.arena
    for key, shadow in arena._shadows.items():
        assert np.isfinite(shadow.buffer[:, lo:hi]).all(), key
    assert np.isfinite(arena.buffer[:, lo:hi]).all()


def test_sparse_touches_only_given_rows() -> None:
    w = pv.Variable(np.ones((5, 2), np.float32), name="emb")
    opt = opts.Momentum(0.1, 0.9)
    opt.apply_gradients([(pv.IndexedSlices(np.ones((3, 2)), [1, 3, 1], (5, 2)), w)])
    np.testing.assert_allclose(w.read_value()[:, 0], [1, 0.8, 1, 0.9, 1], rtol=1e-6)
    np.testing.assert_allclose(opt.get_slot(w, "momentum").read_value()[:, 1], [0, 2, 0, 1, 0])


def test_indexed_slices_deduplicate_and_dense() -> None:
    g = pv.IndexedSlices(np.arange(8.0).reshape(4, 2), [3, 1, 3, 0], (5, 2))
    d = g.deduplicate()
    assert d.indices.tolist() == [0, 1, 3]
    assert d.values.tolist() == [[6, 7], [2, 3], [4, 6]]
    np.testing.assert_array_equal(g.to_dense(), d.to_dense())
    with pytest.raises(GradientError, match="dense_shape"):
        pv.IndexedSlices(np.zeros((1, 2)), [0], (4, 3))


def test_bfloat16_variables_use_the_float32_path() -> None:
    w = pv.Variable(np.ones(4, np.float32), name="bf", dtype="bfloat16")
    opt = opts.Adam(0.25)
    opt.apply_gradients([(np.ones(4, np.float32), w)])
    assert w.dtype == ml_dtypes.bfloat16
    assert opt.get_slot(w, "m").dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(w.read_value().astype(np.float32), 0.75, rtol=1e-2)


def test_clip_by_global_norm() -> None:
    a, b = np.array([3.0, 0.0]), pv.IndexedSlices(np.array([[4.0]]), [0], (2, 1))
    (ca, cb, cn), norm = pv.clip_by_global_norm([a, b, None], 1.0)
    assert norm == pytest.approx(5.0) and cn is None
    np.testing.assert_allclose(ca, [0.6, 0.0])
    np.testing.assert_allclose(cb.values, [[0.8]])
    (same,), norm = pv.clip_by_global_norm([a], 10.0)
    assert norm == pytest.approx(3.0) and np.array_equal(same, a)
    (nan,), norm = pv.clip_by_global_norm([np.array([np.inf])], 1.0)
    assert np.isnan(nan).all()
    with pytest.raises(GradientError):
        pv.clip_by_global_norm([a], 0.0)


def _model(strategy: Any) -> tuple[Any, Any]:
    with strategy.scope():
        m = pv.Module()
        m.w = pv.Variable(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), name="w")
        m.e = pv.Variable(np.ones((4, 2), np.float32), name="e", shard_axis=0)
        opt = opts.Adam(0.1)
    return m, opt


def _step(strategy: Any, m: Any, opt: Any, k: int) -> None:
    with strategy.scope():
        opt.distributed_apply(
            strategy, [(np.full((2, 3), k + 1.0), m.w), (np.full((4, 2), -k - 0.5), m.e)]
        )


def test_checkpoint_saves_slots_and_defers_their_restore(tmp_path: Any) -> None:
    strategy = pv.MirroredStrategy(2)
    m, opt = _model(strategy)
    for k in range(3):
        _step(strategy, m, opt, k)
    path = pv.Checkpoint(model=m, optimizer=opt).save(tmp_path / "run")
    with h5py.File(path) as f:
        slot_groups = []
        f.visit(lambda name: slot_groups.append(name) if name.endswith("/m") else None)
        assert any("slots" in g for g in slot_groups)
    _step(strategy, m, opt, 3)  # the step the restored copy must reproduce

    m2, opt2 = _model(strategy)
    status = pv.Checkpoint(model=m2, optimizer=opt2).restore(path)
    # The variables are there, so the restore makes their slots and the counters at once.
    assert int(opt2.iterations) == 3 and opt2.get_slot(m2.w, "m") is not None
    status.assert_consumed()
    _step(strategy, m2, opt2, 3)
    assert int(opt2.iterations.read_value()) == 4
    assert float(opt2.beta1_power.read_value()) == pytest.approx(0.9**5)
    for a, b in [(m.w, m2.w), (m.e, m2.e), (opt.get_slot(m.w, "v"), opt2.get_slot(m2.w, "v"))]:
        for ca, cb in zip(a.components, b.components, strict=True):
            np.testing.assert_array_equal(ca, cb)

    # A model built after the restore: its slots wait for the first step (or build()).
    m3 = pv.Module()
    with strategy.scope():
        opt3 = opts.Adam(0.1)
    status = pv.Checkpoint(model=m3, optimizer=opt3).restore(path)
    assert opt3.iterations is None
    fresh, _ = _model(strategy)
    m3.w = fresh.w  # restored as it is attached, with its slots and the counters
    assert int(opt3.iterations) == 3 and opt3.get_slot(m3.w, "v") is not None
    assert opt3.get_slot(fresh.e, "m") is None
    m3.e = fresh.e
    status.assert_consumed()
    _step(strategy, m3, opt3, 3)
    for a, b in [(m.w, m3.w), (m.e, m3.e), (opt.get_slot(m.e, "m"), opt3.get_slot(m3.e, "m"))]:
        for ca, cb in zip(a.components, b.components, strict=True):
            np.testing.assert_array_equal(ca, cb)


@pytest.mark.parametrize("name", ["sgd", "adam", "momentum"])
def test_apply_gradients_in_strategy_run_sums_replica_gradients(name: str) -> None:
    strategy = pv.MirroredStrategy(4)
    rng = np.random.default_rng(3)
    init = rng.normal(size=(4, 3)).astype(np.float64)
    with strategy.scope():
        w = pv.Variable(init, name="w")
        emb = pv.Variable(np.zeros((6, 2)), name="emb")
        step = pv.Variable(np.int64(0), name="step")
        opt = ALL[name]()
    ref_w = pv.Variable(init.copy(), name="ref_w")
    ref_emb = pv.Variable(np.zeros((6, 2)), name="ref_emb")
    ref_opt = ALL[name]()
    per_replica = [rng.normal(size=(4, 3)) for _ in range(4)]
    rows = [np.array([r, 5]) for r in range(4)]

    def replica_fn(grads: Any, idx: Any) -> None:
        ctx = pv.get_replica_context()
        sparse = pv.IndexedSlices(np.ones((2, 2)), idx, (6, 2))
        opt.apply_gradients([(grads, w), (sparse, emb), (None, step)], global_step=step)
        assert ctx is not None

    for _ in range(2):
        strategy.run(replica_fn, args=(pv.PerReplica(per_replica), pv.PerReplica(rows)))
        dense_sum = sum(per_replica)
        sparse_sum = pv.IndexedSlices(np.ones((8, 2)), np.concatenate(rows), (6, 2))
        ref_opt.apply_gradients([(dense_sum, ref_w), (sparse_sum, ref_emb)])
    assert int(step.read_value()) == 2 and int(opt.iterations.read_value()) == 2
    for comp in w.components:
        np.testing.assert_allclose(comp, ref_w.read_value(), rtol=1e-12, atol=1e-14)
    for comp in emb.components:
        np.testing.assert_allclose(comp, ref_emb.read_value(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_gradient_object_shared_by_every_replica_counts_once_per_replica(replicas: int) -> None:
    """Every replica handing ``apply_gradients`` the same array (a closure's gradient) is summed
    once per replica, bit for bit as equal separate arrays are; it used to count once."""
    values = np.array([0.1, 1.7, -3.3], np.float32)
    results = []
    for shared in (True, False):
        strategy = pv.MirroredStrategy(replicas)
        with strategy.scope():
            w = pv.Variable(np.zeros(3, np.float32), name="w")
            opt = pv.optimizers.SGD(1.0)
        grads = [values] * replicas if shared else [values.copy() for _ in range(replicas)]
        strategy.run(
            lambda g, w=w, opt=opt: opt.apply_gradients([(g, w)]), args=(pv.PerReplica(grads),)
        )
        results.append(np.asarray(w).copy())
    expected = -sum([values] * (replicas - 1), values.copy())
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], expected)
