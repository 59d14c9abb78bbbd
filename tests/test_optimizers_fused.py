"""The fused path of apply_gradients: flat per-replica buffers, same bits as per-variable sums."""

from __future__ import annotations

import array
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _sample import Args, pairwise

import parallelvars as pv
from parallelvars import optimizers as opts
from parallelvars import update_core
from parallelvars.errors import ContextError, GradientError
from parallelvars.strategy import add_n_by_device
from parallelvars.variables import ShardedVariable

SHAPES = [(37, 5), (3,), (1,), (), (129,), (8, 8, 3), (1001,)]
# Large enough on average that the replicas' arrays are added without packing.
LARGE = [(40009,), (150, 131), (17,)]


def _bits(a: Any) -> np.ndarray:
    arr = np.ascontiguousarray(a)
    return arr.view(np.dtype(f"u{arr.dtype.itemsize}"))


def _model(
    strategy: pv.Strategy,
    dtype: Any,
    make_opt: Callable[[], opts.Optimizer],
    seed: int = 0,
    shapes: Any = SHAPES,
) -> tuple[list[Any], opts.Optimizer]:
    rng = np.random.default_rng(seed)
    with strategy.scope():
        vs = [
            pv.Variable(rng.normal(size=s).astype(dtype), name=f"v{i}")
            for i, s in enumerate(shapes)
        ]
        opt = make_opt()
    return vs, opt


def _grads(
    rng: np.random.Generator, n: int, dtype: Any, shapes: Any = SHAPES
) -> list[list[np.ndarray]]:
    # Magnitudes far apart, so that another summation order gives other bits.
    scales = [1e-3, 1.0, 1e3, 7.0]
    return [
        [(rng.normal(size=s) * scales[r % len(scales)]).astype(dtype) for s in shapes]
        for r in range(n)
    ]


def _assert_same(a: list[Any], b: list[Any]) -> None:
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.components, y.components, strict=True):
            assert np.array_equal(_bits(cx), _bits(cy)), x.name


def _lines(opt: opts.Optimizer) -> Any:
    """The fused path's cache of the one variable list ``opt`` has stepped."""
    ((_, lines),) = opt._pv_transport.lines.values()
    return lines


def _state(vs: list[Any], opt: opts.Optimizer) -> list[Any]:
    return [*vs, *sorted((s for _, _, s in opt._checkpoint_slots()), key=lambda s: s.name)]


@pytest.mark.parametrize(
    "devices, dtype, shapes",
    pairwise(
        {"1": 1, "2": 2, "3": 3, "4": 4, "unordered": ["cpu:2", "cpu:0", "cpu:10", "cpu:1"]},
        {"float32": np.float32, "float64": np.float64},
        {"packed": SHAPES, "direct": LARGE},
    ),
)
def test_fused_sum_is_bit_identical_to_the_per_variable_sum(
    dtype: Any, devices: Any, shapes: Any
) -> None:
    strategy = pv.MirroredStrategy(devices)
    n = strategy.num_replicas_in_sync
    vs, opt = _model(strategy, dtype, lambda: opts.Adam(0.01), shapes=shapes)
    ref_vs, ref_opt = _model(strategy, dtype, lambda: opts.Adam(0.01), shapes=shapes)
    rng = np.random.default_rng(1)
    for _ in range(3):
        per_replica = _grads(rng, n, dtype, shapes)

        def step(grads: list[np.ndarray]) -> None:
            opt.apply_gradients(zip(grads, vs, strict=True))

        strategy.run(step, args=(pv.PerReplica(per_replica),))
        # The per-variable reduction: per device, in device order.
        reduced = [
            add_n_by_device([(strategy.worker_devices[r], per_replica[r][i]) for r in range(n)])
            for i in range(len(shapes))
        ]
        with strategy.scope():
            ref_opt.distributed_apply(strategy, list(zip(reduced, ref_vs, strict=True)))
    # The step took the fused path, reading the replicas' arrays as they are (nothing packed).
    lines = _lines(opt)
    assert lines.staging == [None] * n and lines._gather is not None
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))


def test_the_fused_sum_follows_device_order() -> None:
    # The same gradients handed to replicas in another order give the device-order bits.
    strategy = pv.MirroredStrategy(["cpu:1", "cpu:0"])
    vs, opt = _model(strategy, np.float32, lambda: opts.SGD(1.0))
    g_big = [np.full(s, 1e8, np.float32) for s in SHAPES]
    g_small = [np.full(s, 3.0, np.float32) for s in SHAPES]

    def step(grads: list[np.ndarray]) -> None:
        opt.apply_gradients(zip(grads, vs, strict=True))

    before = [v.read_value().astype(np.float64) for v in vs]
    strategy.run(step, args=(pv.PerReplica([g_small, g_big]),))
    want = np.float32(np.float32(1e8) + np.float32(3.0))  # device cpu:0 (replica 1) first
    for b, v in zip(before, vs, strict=True):
        np.testing.assert_array_equal(
            v.read_value(), (b.astype(np.float32) - want).astype(np.float32)
        )


def _mixed_run(fusion: bool) -> list[Any]:
    strategy = pv.MirroredStrategy(3)
    if not fusion:
        strategy.fusion = False  # type: ignore[attr-defined]
    rng = np.random.default_rng(5)
    with strategy.scope():
        a = pv.Variable(rng.normal(size=(5, 3)).astype(np.float32), name="a")
        emb = pv.Variable(rng.normal(size=(6, 2)).astype(np.float32), name="emb")
        b = pv.Variable(rng.normal(size=(7,)).astype(np.float32), name="b")
        shared = pv.Variable(rng.normal(size=(2,)).astype(np.float32), name="shared")
        bf = pv.Variable(rng.normal(size=(4,)).astype(np.float32), name="bf")
        opt = opts.Momentum(0.1, 0.9)
    one = np.ones(2, np.float32)
    gs = [[rng.normal(size=(5, 3)).astype(np.float32) for _ in range(3)] for _ in range(2)]
    g64 = [[rng.normal(size=(7,)) for _ in range(3)] for _ in range(2)]

    def step(ga: np.ndarray, gb: np.ndarray, idx: np.ndarray) -> None:
        sparse = pv.IndexedSlices(np.ones((2, 2), np.float32), idx, (6, 2))
        opt.apply_gradients(
            [(ga, a), (sparse, emb), (gb, b), (one, shared), (np.ones(4, np.float32), bf)]
        )

    rows = [np.array([r, 5]) for r in range(3)]
    for k in range(2):
        strategy.run(step, args=(pv.PerReplica(gs[k]), pv.PerReplica(g64[k]), pv.PerReplica(rows)))
    return _state([a, emb, b, shared, bf], opt)


def test_mixed_steps_match_the_per_variable_path() -> None:
    # Dense float32 (fused), sparse, float64 gradients of a float32 variable, one object that
    # every replica gives, and per-replica arrays that are equal: the same bits either way.
    _assert_same(_mixed_run(True), _mixed_run(False))


def _objects_run(fusion: bool, torch: Any) -> tuple[list[Any], int]:
    # Gradients that are not numpy arrays (nor lists, which merge_call regroups as
    # structures): torch tensors (float64 and float32; memoryviews of arrays where torch is
    # not installed), array.array, a Python float and int for scalars, numpy scalars, and one
    # object every replica hands in.
    strategy = pv.MirroredStrategy(["cpu:2", "cpu:0", "cpu:10"])
    if not fusion:
        strategy.fusion = False  # type: ignore[attr-defined]
    shapes = [(3, 4), (5,), (), (), (6,), (2,)]
    vs, opt = _model(strategy, np.float32, lambda: opts.Adam(0.01), seed=3, shapes=shapes)
    reduces = [0]
    batch_reduce = strategy.batch_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        reduces[0] += 1
        return batch_reduce(*args, **kwargs)

    strategy.batch_reduce = counted  # type: ignore[method-assign]
    rng = np.random.default_rng(9)
    wrap = torch.from_numpy if torch is not None else memoryview
    shared = wrap(np.array([1.5, -2.0], np.float32))

    def grads(r: int) -> list[Any]:
        return [
            wrap(rng.normal(size=(3, 4)) * 10.0 ** (r - 1)),
            array.array("d", rng.normal(size=5)),
            float(rng.normal()),
            int(rng.integers(-9, 9)),
            wrap(rng.normal(size=6).astype(np.float32)),
            shared,
        ]

    for _ in range(3):
        per_replica = [grads(r) for r in range(3)]

        def step(gs: list[Any]) -> None:
            opt.apply_gradients(zip(gs, vs, strict=True))

        strategy.run(step, args=(pv.PerReplica(per_replica),))
    return _state(vs, opt), reduces[0]


@pytest.mark.parametrize("with_torch", [True, False], ids=["torch", "memoryview"])
def test_gradients_that_are_not_arrays_take_the_fused_path_with_its_bits(with_torch: bool) -> None:
    torch = pytest.importorskip("torch") if with_torch else None
    fused, reduced = _objects_run(True, torch)
    ref, ref_reduced = _objects_run(False, torch)
    assert reduced == 0 and ref_reduced == 3  # read with np.asarray, then fused or cast
    _assert_same(fused, ref)


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "per-variable"])
def test_replicas_that_disagree_about_a_gradients_form_sum_it_dense(fusion: bool) -> None:
    # One replica's gradient of w is an IndexedSlices (a repeated row), the others' arrays; the
    # replicas before and after it in device order too. The sparse one is made dense and the
    # values summed in device order, as add_n sums a dense mix; the other variable is fused.
    strategy = pv.MirroredStrategy(["cpu:2", "cpu:0", "cpu:1"])
    if not fusion:
        strategy.fusion = False  # type: ignore[attr-defined]
    shapes = [(4, 3), (5,)]
    vs, opt = _model(strategy, np.float32, lambda: opts.Adam(0.01), shapes=shapes)
    ref_vs, ref_opt = _model(strategy, np.float32, lambda: opts.Adam(0.01), shapes=shapes)
    rng = np.random.default_rng(21)
    for sparse_replica in (0, 1, 2):
        per_replica = _grads(rng, 3, np.float32, shapes)
        rows = pv.IndexedSlices(per_replica[sparse_replica][0][:2] * 3, np.array([3, 3]), (4, 3))
        given = [list(g) for g in per_replica]
        given[sparse_replica][0] = rows

        def step(grads: list[Any]) -> None:
            opt.apply_gradients(zip(grads, vs, strict=True))

        strategy.run(step, args=(pv.PerReplica(given),))
        dense = [list(g) for g in per_replica]
        dense[sparse_replica][0] = rows.to_dense((4, 3))
        reduced = [
            add_n_by_device([(strategy.worker_devices[r], dense[r][i]) for r in range(3)])
            for i in range(2)
        ]
        with strategy.scope():
            ref_opt.distributed_apply(strategy, list(zip(reduced, ref_vs, strict=True)))
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))
    bad = pv.IndexedSlices(np.ones((1, 3), np.float32), np.array([4]), (4, 3))

    def bad_step() -> None:
        r = pv.get_replica_context().replica_id_in_sync_group
        opt.apply_gradients([(bad if r == 1 else np.ones((4, 3), np.float32), vs[0])])

    before = vs[0].read_value().copy()
    with pytest.raises(GradientError, match="index out of range"):
        strategy.run(bad_step)
    np.testing.assert_array_equal(vs[0].read_value(), before)


@pytest.mark.parametrize("other", ["dense", "sparse", "dense after"])
@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "per-variable"])
def test_a_replicas_gradient_of_another_shape_is_refused_when_the_others_fit(
    fusion: bool, other: str
) -> None:
    # One replica's dense gradient of w has a shape that broadcasts to w's, the other
    # replicas' fit (arrays, or rows of w): the sum would have w's shape. Each replica's
    # gradient is checked, as one replica's alone is, and nothing is written.
    strategy = pv.MirroredStrategy(3)
    if not fusion:
        strategy.fusion = False  # type: ignore[attr-defined]
    shapes = [(5,), (4, 3)]
    vs, opt = _model(strategy, np.float32, lambda: opts.Adam(0.01), shapes=shapes)
    strategy.run(
        lambda: opt.apply_gradients(
            [(np.ones(s, np.float32), v) for s, v in zip(shapes, vs, strict=True)]
        )
    )
    odd = 2 if other == "dense after" else 0

    def step() -> None:
        r = pv.get_replica_context().replica_id_in_sync_group
        g: Any = np.ones((4, 3), np.float32)
        if r == odd:
            g = np.ones((1, 3), np.float32)
        elif other == "sparse":
            g = pv.IndexedSlices(np.ones((1, 3), np.float32), np.array([2]), (4, 3))
        opt.apply_gradients([(np.ones(5, np.float32), vs[0]), (g, vs[1])])

    before = [np.array(c) for v in _state(vs, opt) for c in v.components]
    with pytest.raises(GradientError, match="gradient of another shape") as raised:
        strategy.run(step)
    assert "(4, 3)" in str(raised.value) and "(1, 3)" in str(raised.value)
    after = [np.array(c) for v in _state(vs, opt) for c in v.components]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert int(opt.iterations.read_value()) == 1


@pytest.mark.parametrize("sparse_replica", [0, 1])
@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "per-variable"])
def test_a_subclass_of_indexed_slices_among_dense_gradients_is_summed_dense(
    fusion: bool, sparse_replica: int
) -> None:
    class Rows(pv.IndexedSlices):
        pass

    strategy = pv.MirroredStrategy(2)
    if not fusion:
        strategy.fusion = False  # type: ignore[attr-defined]
    vs, opt = _model(strategy, np.float32, lambda: opts.SGD(1.0), shapes=[(4, 3)])
    before = vs[0].read_value().copy()

    def step() -> None:
        r = pv.get_replica_context().replica_id_in_sync_group
        g: Any = np.ones((4, 3), np.float32)
        if r == sparse_replica:
            g = Rows(np.ones((1, 3), np.float32), np.array([1]), (4, 3))
        opt.apply_gradients([(g, vs[0])])

    strategy.run(step)
    want = before - np.float32(1.0)
    want[1] -= np.float32(1.0)
    np.testing.assert_array_equal(vs[0].read_value(), want)


def test_sharded_and_bfloat16_variables_next_to_fused_ones() -> None:
    import ml_dtypes

    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        w = pv.Variable(np.ones(3, np.float32), name="w")
        e = pv.Variable(np.ones((4, 2), np.float32), name="e", shard_axis=0)
        h = pv.Variable(np.ones(3, ml_dtypes.bfloat16), name="h")
        opt = opts.SGD(0.5)

    def step(g: np.ndarray) -> None:
        opt.apply_gradients(
            [(g, w), (np.ones((4, 2), np.float32), e), (np.ones(3, ml_dtypes.bfloat16), h)]
        )

    strategy.run(step, args=(pv.PerReplica([np.ones(3, np.float32), np.full(3, 2.0, np.float32)]),))
    np.testing.assert_array_equal(w.read_value(), np.full(3, -0.5, np.float32))
    assert int(opt.iterations.read_value()) == 1


def test_steady_steps_reuse_the_plan_and_buffers() -> None:
    strategy = pv.MirroredStrategy(2)
    vs, opt = _model(strategy, np.float32, lambda: opts.SGD(0.1))
    rng = np.random.default_rng(2)

    def step(grads: list[np.ndarray]) -> None:
        opt.apply_gradients(zip(grads, vs, strict=True))

    strategy.run(step, args=(pv.PerReplica(_grads(rng, 2, np.float32)),))
    plans, lines = dict(opt._pv_transport.plans), dict(opt._pv_transport.lines)
    strategy.run(step, args=(pv.PerReplica(_grads(rng, 2, np.float32)),))
    assert opt._pv_transport.plans == plans and len(lines) == 1
    assert all(opt._pv_transport.lines[k] is lines[k] for k in lines)


def test_gradient_buffers_are_summed_without_packing() -> None:
    strategy = pv.MirroredStrategy(3)
    vs, opt = _model(strategy, np.float32, lambda: opts.Adam(0.01))
    ref_vs, ref_opt = _model(strategy, np.float32, lambda: opts.Adam(0.01))
    with strategy.scope():
        bufs = opt.gradient_buffers(vs)
    assert len(bufs) == 3 and opt.gradient_buffers(vs) is bufs
    rng = np.random.default_rng(4)
    for _ in range(2):
        per_replica = _grads(rng, 3, np.float32)

        def step(grads: list[np.ndarray]) -> None:
            views = bufs.views()
            for view, g in zip(views, grads, strict=True):
                view[...] = g  # what torch / jax / numpy code writes in place
            opt.apply_gradients(bufs.grads_and_vars())

        def ref_step(grads: list[np.ndarray]) -> None:
            ref_opt.apply_gradients(zip(grads, ref_vs, strict=True))

        strategy.run(step, args=(pv.PerReplica(per_replica),))
        strategy.run(ref_step, args=(pv.PerReplica(per_replica),))
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))
    # Nothing went through the packing buffers, nor was gathered.
    assert _lines(opt).staging == [None] * 3 and _lines(opt)._gather is None
    views = bufs.views(replica=1)
    assert views[0].shape == SHAPES[0] and np.shares_memory(
        views[0], bufs.buffers(1)[np.dtype(np.float32)]
    )
    bufs.zero()
    assert not any(v.any() for r in range(3) for v in bufs.views(r))


def test_arrays_other_than_the_views_are_packed() -> None:
    # Another array in place of a view (here: in a list the caller changed) is not mistaken
    # for the buffer's contents.
    strategy = pv.MirroredStrategy(2)
    vs, opt = _model(strategy, np.float32, lambda: opts.SGD(1.0))
    with strategy.scope():
        bufs = opt.gradient_buffers(vs)
    before = vs[0].read_value().copy()

    def step() -> None:
        views = bufs.views()
        views[0] = np.ones(SHAPES[0], np.float32)  # not in the buffer, which holds zeros
        opt.apply_gradients(zip(views, vs, strict=True))

    strategy.run(step)
    np.testing.assert_array_equal(vs[0].read_value(), before - 2.0)

    def changed_pairs_step() -> None:
        pairs = bufs.grads_and_vars()
        pairs[0] = (np.ones(SHAPES[0], np.float32), vs[0])  # the list handed out, changed
        opt.apply_gradients(pairs)

    for _ in range(2):  # the second step is a steady one
        strategy.run(changed_pairs_step)
    two = np.float32(2.0)
    np.testing.assert_array_equal(vs[0].read_value(), before - two - two - two)


def test_gradient_buffers_errors() -> None:
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        w = pv.Variable(np.ones(3, np.float32), name="w")
        e = pv.Variable(np.ones((4, 2), np.float32), name="e", shard_axis=0)
        opt = opts.SGD(0.1)
        bufs = opt.gradient_buffers([w])
        # A sharded variable's full value is a run of its own; one in Fortran order is not.
        assert len(opt.gradient_buffers([w, e]).views(0)) == 2
        f = ShardedVariable(
            np.asfortranarray(np.ones((4, 2), np.float32)),
            device=e.device,
            name="f",
            shard_axis=0,
            trainable=True,
        )
        with pytest.raises(GradientError, match="runs over"):
            opt.gradient_buffers([w, f])
        with pytest.raises(GradientError, match="twice"):
            opt.gradient_buffers([w, w])
        with pytest.raises(ContextError, match="replica function"):
            bufs.views()  # cross-replica context
    with pytest.raises(ContextError, match="made for 2 replica"):
        bufs.views()  # the default strategy's one replica
    with pytest.raises(ContextError, match="replica 2"):
        bufs.views(2)
    assert isinstance(bufs, pv.GradientBuffers)


def test_gradients_in_any_memory_layout_give_the_same_bits() -> None:
    # Fortran-ordered and strided gradients are copied by numpy instead of joined as bytes.
    strategy = pv.MirroredStrategy(3)
    vs, opt = _model(strategy, np.float32, lambda: opts.Adam(0.01))
    ref_vs, ref_opt = _model(strategy, np.float32, lambda: opts.Adam(0.01))
    rng = np.random.default_rng(6)

    def odd_layout(g: np.ndarray) -> np.ndarray:
        if g.ndim >= 2:
            return np.asfortranarray(g)
        wide = np.zeros(2 * g.size + 1, g.dtype)
        wide[1::2] = g.reshape(-1)
        return wide[1::2].reshape(g.shape)

    for _ in range(2):
        per_replica = _grads(rng, 3, np.float32)
        odd = [[odd_layout(g) for g in gs] for gs in per_replica]
        assert not all(g.flags.c_contiguous for g in odd[0])

        def step(grads: list[np.ndarray], o: opts.Optimizer, v: list[Any]) -> None:
            o.apply_gradients(zip(grads, v, strict=True))

        strategy.run(step, args=(pv.PerReplica(odd), opt, vs))
        strategy.run(step, args=(pv.PerReplica(per_replica), ref_opt, ref_vs))
    assert _lines(opt).staging == [None] * 3
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))


def test_a_gradient_in_a_variables_memory_is_read_before_the_step_writes() -> None:
    # b's gradient is a view of a's memory, and a (large: updated first, in place) changes in
    # the step: the gradient must be the value before the step, as a packed copy has it.
    strategy = pv.MirroredStrategy(2)
    shapes = [(20000,), (10,), (3,)]
    vs, opt = _model(strategy, np.float32, lambda: opts.SGD(1.0), shapes=shapes)
    ref_vs, ref_opt = _model(strategy, np.float32, lambda: opts.SGD(1.0), shapes=shapes)
    rng = np.random.default_rng(8)
    per_replica = _grads(rng, 2, np.float32, shapes)

    def step(grads: list[np.ndarray]) -> None:
        mine = [grads[0], np.asarray(vs[0])[:10], grads[2]]  # this replica's component of a
        opt.apply_gradients(zip(mine, vs, strict=True))

    def ref_step(grads: list[np.ndarray]) -> None:
        mine = [grads[0], np.array(np.asarray(ref_vs[0])[:10]), grads[2]]  # a copy
        ref_opt.apply_gradients(zip(mine, ref_vs, strict=True))

    for _ in range(2):
        strategy.run(step, args=(pv.PerReplica(per_replica),))
        strategy.run(ref_step, args=(pv.PerReplica(per_replica),))
    assert _lines(opt).staging != [None] * 2  # packed first
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))


@pytest.mark.parametrize("devices", [1, 3])
def test_apply_of_two_lists_is_apply_gradients_of_their_pairs(devices: int) -> None:
    # Same bits, None gradients skipped, the lists left as they were; each replica's lists,
    # or one list of variables every replica shares.
    strategy = pv.MirroredStrategy(devices)
    vs, opt = _model(strategy, np.float32, lambda: opts.Adam(0.01))
    ref_vs, ref_opt = _model(strategy, np.float32, lambda: opts.Adam(0.01))
    rng = np.random.default_rng(5)

    def step(grads: list[Any], k: int) -> None:
        mine: list[Any] = list(grads)
        if k:
            mine[1] = None
        given = (list(mine), vs if k < 2 else tuple(vs))
        opt.apply(*given)
        assert all(a is b for a, b in zip(given[0], mine, strict=True))

    def ref_step(grads: list[Any], k: int) -> None:
        mine: list[Any] = list(grads)
        if k:
            mine[1] = None
        ref_opt.apply_gradients(zip(mine, ref_vs, strict=True))

    for k in range(3):
        per_replica = pv.PerReplica(_grads(rng, devices, np.float32))
        strategy.run(step, args=(per_replica, k))
        strategy.run(ref_step, args=(per_replica, k))
    assert int(opt.iterations.read_value()) == 3
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))
    with pytest.raises(GradientError, match="one gradient per variable"):
        strategy.run(lambda: opt.apply([np.ones(s, np.float32) for s in SHAPES[:2]], vs))
    with strategy.scope(), pytest.raises(ContextError, match="apply\\(\\) was called"):
        opt.apply([np.ones(s, np.float32) for s in SHAPES], vs)


def test_a_partly_iterated_zip_applies_its_remaining_pairs() -> None:
    strategy = pv.MirroredStrategy(2)
    vs, opt = _model(strategy, np.float32, lambda: opts.SGD(1.0))
    before = [v.read_value().copy() for v in vs]
    ones = [np.ones(s, np.float32) for s in SHAPES]

    def step() -> None:
        pairs = zip(ones, vs, strict=True)
        next(pairs)
        opt.apply_gradients(pairs)

    strategy.run(step)
    for i, (b, v) in enumerate(zip(before, vs, strict=True)):
        np.testing.assert_array_equal(v.read_value(), b if i == 0 else b - np.float32(2.0))


def test_zip_steps_keep_the_semantics_of_their_pairs() -> None:
    # None gradients, a shorter zip and zip(strict=True) of unequal lengths, all in replicas.
    strategy = pv.MirroredStrategy(2)
    vs, opt = _model(strategy, np.float32, lambda: opts.SGD(1.0))
    before = [v.read_value().copy() for v in vs]
    ones = [np.ones(s, np.float32) for s in SHAPES]

    def step(k: int) -> None:
        grads: list[Any] = list(ones)
        grads[1] = None
        opt.apply_gradients(zip(grads[:k], vs, strict=False))

    for k in (len(SHAPES), 3):
        strategy.run(step, args=(k,))
    for i, (b, v) in enumerate(zip(before, vs, strict=True)):
        want = b
        for _ in range(0 if i == 1 else (2 if i < 3 else 1)):  # None: never; past 3: once
            want = want - np.float32(2.0)
        np.testing.assert_array_equal(v.read_value(), want)

    def strict_step() -> None:
        opt.apply_gradients(zip(ones[:2], vs, strict=True))

    with pytest.raises(ValueError, match="longer"):
        strategy.run(strict_step)


def test_a_zip_of_two_sequences_applies_what_iterating_it_gives() -> None:
    # zip(grads, variables) of lists or tuples is read as its two sequences (from where it
    # stands), and left exhausted; a list subclass is iterated as zip iterates it.
    class Doubled(list[Any]):
        def __getitem__(self, i: Any) -> Any:  # indexing differs from iterating
            return 2 * super().__getitem__(i)

    strategy = pv.MirroredStrategy(2)
    vs, opt = _model(strategy, np.float32, lambda: opts.SGD(1.0))
    before = [v.read_value().copy() for v in vs]
    ones = [np.ones(s, np.float32) for s in SHAPES]
    left: list[list[Any]] = []

    def step(k: int) -> None:
        grads: Any = (tuple(ones), ones, Doubled(ones))[k]
        pairs = zip(grads, tuple(vs), strict=True)
        next(pairs)
        opt.apply_gradients(pairs)
        left.append(list(pairs))

    for k in range(3):
        strategy.run(step, args=(k,))
    assert left == [[]] * 6
    for i, (b, v) in enumerate(zip(before, vs, strict=True)):
        want = b
        for _ in range(0 if i == 0 else 3):  # each step: 2 replicas x 1.0, not the doubled
            want = want - np.float32(2.0)
        np.testing.assert_array_equal(v.read_value(), want)


def test_a_zip_of_one_iterator_with_itself_pairs_what_iterating_it_gives() -> None:
    # zip(it, it), the grouper idiom, reads (gradient, variable) pairs from one interleaved
    # sequence: each pair takes two items, it is not the sequence zipped with itself.
    strategy = pv.MirroredStrategy(2)
    vs, opt = _model(strategy, np.float32, lambda: opts.SGD(1.0))
    before = [v.read_value().copy() for v in vs]
    flat: list[Any] = []
    for s, v in zip(SHAPES, vs, strict=True):
        flat += [np.ones(s, np.float32), v]
    strategy.run(lambda: opt.apply_gradients(zip(*[iter(flat)] * 2, strict=True)))
    for b, v in zip(before, vs, strict=True):
        np.testing.assert_array_equal(v.read_value(), b - np.float32(2.0))

    # A variable as the gradient (an accumulator): zipped with itself it would pair with
    # itself and be applied where nothing is to be changed.
    w = pv.Variable(np.zeros(3, np.float32), name="w")
    acc = pv.Variable(np.ones(3, np.float32), name="acc", trainable=False)
    it = iter([acc, w])
    opts.SGD(1.0).apply_gradients(zip(it, it, strict=False))
    np.testing.assert_array_equal(w.read_value(), -np.ones(3, np.float32))
    np.testing.assert_array_equal(acc.read_value(), np.ones(3, np.float32))


def test_a_zip_leaves_its_iterators_where_iterating_it_would() -> None:
    # zip stops at the first iterator that runs out: the variables' iterator then stays where
    # it stands, and a gradient read before the variables ran out is consumed. Every length,
    # start and strictness, lists and tuples, against iterating an identical zip.
    vs = [pv.Variable(np.zeros(2, np.float32), name=f"u{i}") for i in range(4)]
    gs = [np.ones(2, np.float32) for _ in range(5)]
    opt = opts.SGD(1.0)
    cases = 0
    for seq, ng, nv, skip_g, skip_v, strict in itertools.product(
        (list, tuple), range(len(gs) + 1), range(len(vs) + 1), range(3), range(3), (False, True)
    ):
        if skip_g > ng or skip_v > nv:
            continue
        left: list[tuple[list[int], list[int]]] = []
        for applied in (False, True):
            g_seq, v_seq = seq(gs[:ng]), seq(vs[:nv])
            g_it, v_it = iter(g_seq), iter(v_seq)
            for _ in range(skip_g):
                next(g_it)
            for _ in range(skip_v):
                next(v_it)
            pairs = zip(g_it, v_it, strict=strict)
            try:
                if applied:
                    opt.apply_gradients(pairs)
                else:
                    list(pairs)
            except ValueError:  # strict and unequal; no gradient at all
                pass
            if isinstance(g_seq, list) and isinstance(v_seq, list):
                g_seq.append(gs[-1])  # an exhausted iterator stays exhausted
                v_seq.append(vs[-1])
            left.append(([id(g) for g in g_it], [id(v) for v in v_it]))
        assert left[0] == left[1], (seq, ng, nv, skip_g, skip_v, strict)
        cases += 1
    assert cases > 300

    vi = iter(vs)
    opt.apply_gradients(zip(gs[:3], vi, strict=False))
    assert next(vi) is vs[3]
    gi = iter(gs)
    opt.apply_gradients(zip(gi, vs[:3], strict=False))
    assert next(gi) is gs[4]  # zip read gs[3] before it found the variables ran out


def test_the_array_a_sharded_variable_is_made_around_is_read_before_the_step_writes() -> None:
    # Each variable's gradient is the very array the other one is made around (an array owning
    # its memory, of the variable's size): read before the step writes it, as a copy would be.
    strategy = pv.MirroredStrategy(2)
    a0 = np.arange(8, dtype=np.float32).reshape(4, 2)
    b0 = a0 * np.float32(10.0)
    with strategy.scope():
        dev = pv.Variable(np.ones(2, np.float32), name="d").device
        a, b = (
            ShardedVariable(x.copy(), device=dev, name=n, shard_axis=0, trainable=True)
            for x, n in ((a0, "a"), (b0, "b"))
        )
        opt = opts.SGD(1.0)
    assert a.__wrapped__.base is None and a.placement is None

    def step() -> None:
        opt.apply_gradients([(b.__wrapped__, a), (a.__wrapped__, b)])

    strategy.run(step)
    np.testing.assert_array_equal(a.read_value(), a0 - b0 - b0)
    np.testing.assert_array_equal(b.read_value(), b0 - a0 - a0)
    assert opt._pv_transport._steady is not None


def test_reduced_gradients_in_a_variables_memory_are_read_before_the_step_writes() -> None:
    # The same through distributed_apply (one reduced gradient per variable, no replicas).
    strategy = pv.MirroredStrategy(2)
    shapes = [(20000,), (10,), (3,)]
    vs, opt = _model(strategy, np.float32, lambda: opts.SGD(1.0), shapes=shapes)
    ref_vs, ref_opt = _model(strategy, np.float32, lambda: opts.SGD(1.0), shapes=shapes)
    grads = _grads(np.random.default_rng(9), 1, np.float32, shapes)[0]
    with strategy.scope():
        for _ in range(2):
            opt.distributed_apply(strategy, zip([grads[0], vs[0][:10], grads[2]], vs, strict=True))
            ref = [grads[0], np.array(ref_vs[0][:10]), grads[2]]
            ref_opt.distributed_apply(strategy, zip(ref, ref_vs, strict=True))
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))


@pytest.mark.parametrize(
    "devices, dtype, shapes",
    pairwise(
        {"2": 2, "4": 4, "unordered": ["cpu:2", "cpu:0", "cpu:10", "cpu:1"]},
        {"float32": np.float32, "float64": np.float64},
        {"packed": SHAPES, "direct": LARGE},
    ),
)
def test_one_array_object_from_every_replica_is_summed_once_per_replica_on_the_fused_path(
    dtype: Any, devices: Any, shapes: Any
) -> None:
    # The README's pv.PerReplica([g] * n): the same objects in every replica, and (second
    # case) some positions shared by two replicas only. The fused sum counts each replica's
    # term, in device order: the bits of the per-variable path, which sums [g] * n.
    strategy = pv.MirroredStrategy(devices)
    n = strategy.num_replicas_in_sync
    vs, opt = _model(strategy, dtype, lambda: opts.Adam(0.01), shapes=shapes)
    ref_vs, ref_opt = _model(strategy, dtype, lambda: opts.Adam(0.01), shapes=shapes)
    rng = np.random.default_rng(11)
    for k in range(3):
        if k < 2:
            one = _grads(rng, 1, dtype, shapes)[0]
            per_replica = [one] * n
        else:  # replicas 0 and 1 share an object at even positions only
            per_replica = _grads(rng, n, dtype, shapes)
            per_replica[1] = [
                g0 if i % 2 == 0 else g1
                for i, (g0, g1) in enumerate(zip(per_replica[0], per_replica[1], strict=True))
            ]

        def step(grads: list[np.ndarray]) -> None:
            opt.apply_gradients(zip(grads, vs, strict=True))

        strategy.run(step, args=(pv.PerReplica(per_replica),))
        reduced = [
            add_n_by_device([(strategy.worker_devices[r], per_replica[r][i]) for r in range(n)])
            for i in range(len(shapes))
        ]
        with strategy.scope():
            ref_opt.distributed_apply(strategy, list(zip(reduced, ref_vs, strict=True)))
    # The steps took the fused path, reading the arrays as they are (a shape () gradient
    # here is a numpy scalar: a 0-d array of its own), and the loop is a steady one.
    lines = _lines(opt)
    assert lines.staging == [None] * n and lines._gather is not None
    assert opt._pv_transport._steady is not None
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))


def test_a_shared_gradient_object_matches_the_per_variable_path() -> None:
    # The same steps with fusion off (every gradient through batch_reduce): the same bits.
    def run(fusion: bool) -> list[Any]:
        strategy = pv.MirroredStrategy(3)
        if not fusion:
            strategy.fusion = False  # type: ignore[attr-defined]
        vs, opt = _model(strategy, np.float32, lambda: opts.Adam(0.01), shapes=SHAPES[:3])
        rng = np.random.default_rng(12)
        for _ in range(3):
            one = _grads(rng, 1, np.float32, SHAPES[:3])[0]

            def step(grads: list[np.ndarray]) -> None:
                opt.apply_gradients(zip(grads, vs, strict=True))

            strategy.run(step, args=(pv.PerReplica([one] * 3),))
        assert (opt._pv_transport._steady is not None) == fusion
        return _state(vs, opt)

    _assert_same(run(True), run(False))


def test_a_shared_gradient_in_a_variables_memory_is_read_before_the_step_writes() -> None:
    # Every replica hands the same view of a's memory as b's gradient; a is updated first.
    strategy = pv.MirroredStrategy(2)
    shapes = [(20000,), (10,), (3,)]
    vs, opt = _model(strategy, np.float32, lambda: opts.SGD(1.0), shapes=shapes)
    ref_vs, ref_opt = _model(strategy, np.float32, lambda: opts.SGD(1.0), shapes=shapes)
    rng = np.random.default_rng(13)
    grads = _grads(rng, 1, np.float32, shapes)[0]
    view = np.asarray(vs[0].components[0])[:10]
    for _ in range(2):

        def step() -> None:
            opt.apply_gradients(zip([grads[0], view, grads[2]], vs, strict=True))

        def ref_step(copied: np.ndarray) -> None:
            ref_opt.apply_gradients(zip([grads[0], copied, grads[2]], ref_vs, strict=True))

        copied = np.array(np.asarray(ref_vs[0].components[0])[:10])
        strategy.run(step)
        strategy.run(ref_step, args=(copied,))
    assert _lines(opt).staging != [None] * 2  # packed first
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))


def _widened_compute(
    opt: opts.Optimizer, var2d: np.ndarray, slots2d: list[np.ndarray], g: np.ndarray, hp: Any
) -> None:
    # The per-variable arithmetic of bfloat16 / float8 variables before the fused step took
    # them: the whole variable and its slots widened to float32, updated, rounded back once.
    from parallelvars import update_core

    f32 = np.dtype(np.float32)
    v32 = var2d.astype(f32)
    s32 = [s.astype(f32) for s in slots2d]
    update_core.apply_blocked(opt._kernel, v32, s32, g.astype(f32), hp, opt._scratch(f32))
    var2d[...] = v32.astype(var2d.dtype)
    for s, w in zip(slots2d, s32, strict=True):
        s[...] = w.astype(s.dtype)


def _narrow_dtypes() -> list[Any]:
    import ml_dtypes

    return [
        np.float16,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
    ]


# Narrow floats overflow and underflow (Adam's epsilon is 0 in float16): inf and nan bits are
# compared like the others.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "devices, make_opt, dtype, shapes",
    pairwise(
        {"1": 1, "3": 3, "unordered": ["cpu:2", "cpu:0", "cpu:10", "cpu:1"]},
        {"adam": lambda: opts.Adam(0.01), "momentum": lambda: opts.Momentum(0.1, 0.9)},
        {np.dtype(d).name: d for d in _narrow_dtypes()},
        {"packed": SHAPES, "direct": LARGE},
    ),
)
def test_narrow_float_variables_on_the_fused_path_keep_the_per_variable_bits(
    dtype: Any, devices: Any, shapes: Any, make_opt: Callable[[], opts.Optimizer]
) -> None:
    # bfloat16 / float8 variables: the replicas' gradients are summed in the variable's dtype
    # in device order (add_n's bits), the update is computed in float32 and rounded once into
    # the variable and its slots: the bits of the per-variable arithmetic as it was (widen
    # the whole variable, update, round). float16 keeps its own float16 arithmetic.
    _check_narrow_against_per_variable(dtype, devices, shapes, make_opt)


# Mirrored variables of one, two and three blocks of a 16-bit dtype (65,536 columns: see
# update_core.block_width), each read in place and summed block by block.
BLOCKS_16 = [(70001,), (140003,), (300, 230), (17,)]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "devices, make_opt, dtype",
    [
        (3, lambda: opts.Adam(0.01), "bfloat16"),
        (["cpu:2", "cpu:0", "cpu:10", "cpu:1"], lambda: opts.Momentum(0.1, 0.9), "bfloat16"),
        (["cpu:2", "cpu:0", "cpu:10", "cpu:1"], lambda: opts.Adam(0.01), "float16"),
        (2, lambda: opts.Momentum(0.1, 0.9), "float16"),
    ],
    ids=[
        "bfloat16-3-adam",
        "bfloat16-unordered-momentum",
        "float16-unordered-adam",
        "float16-2-momentum",
    ],
)
def test_narrow_float_variables_of_several_blocks_keep_the_per_variable_bits(
    dtype: str, devices: Any, make_opt: Callable[[], opts.Optimizer]
) -> None:
    narrow = np.dtype({"bfloat16": _narrow_dtypes()[1], "float16": np.float16}[dtype])
    width = update_core.block_width(1, narrow)
    assert [int(np.prod(s)) // width for s in BLOCKS_16[:3]] == [1, 2, 1]  # 2, 3 and 2 blocks
    _check_narrow_against_per_variable(narrow, devices, BLOCKS_16, make_opt)


def _check_narrow_against_per_variable(
    dtype: Any, devices: Any, shapes: Any, make_opt: Callable[[], opts.Optimizer]
) -> None:
    strategy = pv.MirroredStrategy(devices)
    n = strategy.num_replicas_in_sync
    vs, opt = _model(strategy, dtype, make_opt, shapes=shapes)
    ref_vs, ref_opt = _model(strategy, dtype, make_opt, shapes=shapes)
    # The reference takes the per-variable path with the arithmetic of before.
    ref_opt._info = lambda v: (*opts.Optimizer._info(ref_opt, v)[:2], False)  # type: ignore[method-assign]
    if np.dtype(dtype) != np.dtype(np.float16):
        ref_opt._compute = (  # type: ignore[method-assign]
            lambda v, s, g, hp: _widened_compute(ref_opt, v, s, g, hp)
        )
    rng = np.random.default_rng(14)
    for _ in range(3):
        per_replica = _grads(rng, n, dtype, shapes)

        def step(grads: list[np.ndarray]) -> None:
            opt.apply_gradients(zip(grads, vs, strict=True))

        strategy.run(step, args=(pv.PerReplica(per_replica),))
        reduced = [
            add_n_by_device([(strategy.worker_devices[r], per_replica[r][i]) for r in range(n)])
            for i in range(len(shapes))
        ]
        with strategy.scope():
            ref_opt.distributed_apply(strategy, list(zip(reduced, ref_vs, strict=True)))
    lines = _lines(opt)
    assert lines.staging == [None] * n and lines._gather is not None
    assert opt._pv_transport._steady is not None  # numpy scalars too, as 0-d arrays
    assert all(np.dtype(s.dtype) == np.dtype(dtype) for _, _, s in opt._checkpoint_slots())
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))


@pytest.mark.parametrize("dtype", _narrow_dtypes()[1:2], ids=["bfloat16"])
def test_narrow_float_gradient_buffers(dtype: Any) -> None:
    # Gradient buffers of bfloat16 variables: written through a uint16 view (what torch's
    # from_numpy accepts), summed on the fused path with the bits of plain arrays.
    strategy = pv.MirroredStrategy(2)
    vs, opt = _model(strategy, dtype, lambda: opts.Adam(0.01))
    ref_vs, ref_opt = _model(strategy, dtype, lambda: opts.Adam(0.01))
    with strategy.scope():
        bufs = opt.gradient_buffers(vs)
    assert all(b.dtype == np.dtype(dtype) for b in bufs.buffers(0).values())
    rng = np.random.default_rng(15)
    for _ in range(2):
        per_replica = _grads(rng, 2, dtype)

        def step(grads: list[np.ndarray]) -> None:
            for view, g in zip(bufs.views(), grads, strict=True):
                view.view(np.uint16)[...] = np.asarray(g).view(np.uint16)
            opt.apply_gradients(bufs.grads_and_vars())

        def ref_step(grads: list[np.ndarray]) -> None:
            ref_opt.apply_gradients(zip(grads, ref_vs, strict=True))

        strategy.run(step, args=(pv.PerReplica(per_replica),))
        strategy.run(ref_step, args=(pv.PerReplica(per_replica),))
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))


def _sharded_model(
    strategy: pv.Strategy, dtype: Any, make_opt: Callable[[], opts.Optimizer], shapes: Any
) -> tuple[list[Any], opts.Optimizer]:
    # Every variable of at least one dimension sharded along axis 0, next to mirrored ones.
    rng = np.random.default_rng(0)
    with strategy.scope():
        vs = [
            pv.Variable(
                rng.normal(size=s).astype(dtype),
                name=f"v{i}",
                shard_axis=0 if len(s) and i % 3 != 1 else None,
            )
            for i, s in enumerate(shapes)
        ]
        opt = make_opt()
    return vs, opt


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "buffers, devices, make_opt, dtype, shapes",
    pairwise(
        {"arrays": False, "buffers": True},
        {"2": 2, "3": 3, "unordered": ["cpu:2", "cpu:0", "cpu:10", "cpu:1"]},
        {"adam": lambda: opts.Adam(0.01), "momentum": lambda: opts.Momentum(0.1, 0.9)},
        {np.dtype(d).name: d for d in [np.float32, np.float64, *_narrow_dtypes()[:2]]},
        {"packed": SHAPES, "direct": LARGE},
    ),
)
def test_sharded_variables_on_the_fused_path_keep_the_per_variable_bits(
    dtype: Any, devices: Any, shapes: Any, make_opt: Callable[[], opts.Optimizer], buffers: bool
) -> None:
    # A sharded variable's shards are views of its full value: the fused step runs over that
    # value (and its slots') as one row, each shard updated from its slice of the device-order
    # sum, with the bits of the per-variable path (reduce, then update the full value).
    strategy = pv.MirroredStrategy(devices)
    n = strategy.num_replicas_in_sync
    vs, opt = _sharded_model(strategy, dtype, make_opt, shapes)
    ref_vs, ref_opt = _sharded_model(strategy, dtype, make_opt, shapes)
    assert all(
        (v.kind == "sharded") == (len(s) > 0 and i % 3 != 1)
        for i, (v, s) in enumerate(zip(vs, shapes, strict=True))
    )
    ref_opt._info = lambda v: (*opts.Optimizer._info(ref_opt, v)[:2], False)  # type: ignore[method-assign]
    if np.dtype(dtype) == np.dtype(_narrow_dtypes()[1]):
        ref_opt._compute = (  # type: ignore[method-assign]
            lambda v, s, g, hp: _widened_compute(ref_opt, v, s, g, hp)
        )
    bufs = None
    if buffers:
        with strategy.scope():
            bufs = opt.gradient_buffers(vs)
    rng = np.random.default_rng(16)
    for _ in range(3):
        per_replica = _grads(rng, n, dtype, shapes)

        def step(grads: list[np.ndarray]) -> None:
            if bufs is None:
                opt.apply_gradients(zip(grads, vs, strict=True))
                return
            for view, g in zip(bufs.views(), grads, strict=True):
                view[...] = g
            opt.apply_gradients(bufs.grads_and_vars())

        strategy.run(step, args=(pv.PerReplica(per_replica),))
        reduced = [
            add_n_by_device([(strategy.worker_devices[r], per_replica[r][i]) for r in range(n)])
            for i in range(len(shapes))
        ]
        with strategy.scope():
            ref_opt.distributed_apply(strategy, list(zip(reduced, ref_vs, strict=True)))
    # Every gradient took the fused path (a scalar's, a numpy scalar, as a 0-d array).
    assert opt._pv_transport._steady is not None
    for v, rv in zip(vs, ref_vs, strict=True):
        assert np.array_equal(_bits(v.read_value()), _bits(rv.read_value())), v.name
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))


def test_sharded_variables_values_as_gradients_are_read_before_the_step_writes() -> None:
    strategy = pv.MirroredStrategy(2)
    a0 = np.arange(8, dtype=np.float32).reshape(4, 2)
    b0 = a0 * np.float32(10.0)
    with strategy.scope():
        a = pv.Variable(a0, name="a", shard_axis=0)
        b = pv.Variable(b0, name="b", shard_axis=0)
        opt = opts.SGD(1.0)
    # Each variable's gradient is the other's value: the array its shards are views of, then
    # a view of it. Each replica gives it, so the gradient is twice the other's old value.
    for ga, gb in ((b.__wrapped__, a.__wrapped__), (np.asarray(b), np.asarray(a))):
        a.assign(a0)
        b.assign(b0)

        def step(ga: np.ndarray = ga, gb: np.ndarray = gb) -> None:
            opt.apply_gradients([(ga, a), (gb, b)])

        strategy.run(step)
        np.testing.assert_array_equal(a.read_value(), a0 - b0 - b0)
        np.testing.assert_array_equal(b.read_value(), b0 - a0 - a0)
        assert opt._pv_transport._steady is not None


def test_sharded_variables_around_arrays_of_their_own_keep_the_per_variable_bits() -> None:
    # A sharded variable made around an array of its own (no arena row) is a run of its own.
    strategy = pv.MirroredStrategy(3)
    rng = np.random.default_rng(17)
    init = [rng.normal(size=s).astype(np.float32) for s in ((6, 4), (9,), (3, 2, 2))]

    def model() -> tuple[list[Any], opts.Optimizer]:
        with strategy.scope():
            dev = pv.Variable(np.ones(2, np.float32), name="d").device
            vs = [
                ShardedVariable(a.copy(), device=dev, name=f"s{i}", shard_axis=0, trainable=True)
                for i, a in enumerate(init)
            ]
            return vs, opts.Adam(0.01)

    vs, opt = model()
    ref_vs, ref_opt = model()
    assert all(v.placement is None for v in vs)
    ref_opt._info = lambda v: (*opts.Optimizer._info(ref_opt, v)[:2], False)  # type: ignore[method-assign]
    for _ in range(3):
        per_replica = _grads(rng, 3, np.float32, [a.shape for a in init])

        def step(grads: list[np.ndarray]) -> None:
            opt.apply_gradients(zip(grads, vs, strict=True))

        def ref_step(grads: list[np.ndarray]) -> None:
            ref_opt.apply_gradients(zip(grads, ref_vs, strict=True))

        strategy.run(step, args=(pv.PerReplica(per_replica),))
        strategy.run(ref_step, args=(pv.PerReplica(per_replica),))
    assert opt._pv_transport._steady is not None and ref_opt._pv_transport._steady is None
    assert any(isinstance(r.arena, update_core.FlatArena) for r in _lines(opt).runs)
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))


SPARSE_SHAPES = [(9, 4), (6,), (5, 2, 3), (7, 4), (1, 4)]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "sharded, devices, make_opt, dtype",
    pairwise(
        {"mirrored": False, "sharded": True},
        {"1": 1, "3": 3, "unordered": ["cpu:2", "cpu:0", "cpu:10", "cpu:1"]},
        {
            "sgd": lambda: opts.SGD(0.1),
            "momentum": lambda: opts.Momentum(0.1, 0.9),
            "adagrad": lambda: opts.Adagrad(0.1),
            "rmsprop": lambda: opts.RMSProp(0.01),
            "adam": lambda: opts.Adam(0.01),
        },
        {np.dtype(d).name: d for d in [np.float32, np.float64, *_narrow_dtypes()[:2]]},
    ),
)
def test_sparse_gradients_applied_together_keep_the_per_variable_bits(
    dtype: Any, devices: Any, make_opt: Callable[[], opts.Optimizer], sharded: bool
) -> None:
    # Every variable's IndexedSlices deduplicated and applied a group at a time (one arena and
    # row width): the bits of the per-variable path, which deduplicates and updates each
    # variable on its own. Repeated indices within and across replicas, variables without any
    # (their values, -0.0 included, taken as they are), empty gradients, a dense neighbour.
    strategy = pv.MirroredStrategy(devices)
    n = strategy.num_replicas_in_sync

    def model() -> tuple[list[Any], opts.Optimizer]:
        rng = np.random.default_rng(3)
        with strategy.scope():
            vs = [
                pv.Variable(
                    rng.normal(size=s).astype(dtype),
                    name=f"v{i}",
                    shard_axis=0 if sharded and i % 2 == 0 else None,
                )
                for i, s in enumerate(SPARSE_SHAPES)
            ]
            return vs, make_opt()

    vs, opt = model()
    ref_vs, ref_opt = model()
    ref_opt._info = lambda v: (*opts.Optimizer._info(ref_opt, v)[:2], False)  # type: ignore[method-assign]
    rng = np.random.default_rng(18)

    def grads_of(r: int) -> list[Any]:
        out: list[Any] = []
        for i, s in enumerate(SPARSE_SHAPES):
            if i == 3:  # a dense gradient next to the sparse ones
                out.append(rng.normal(size=s).astype(dtype))
                continue
            k = [3, 0, 2, 1, 1][i] if i != 1 else r + 1
            # Variable 2 repeats rows within each replica; variable 0 across replicas only.
            idx = (
                rng.integers(0, s[0], k) if i != 0 else np.array([(r + j) % s[0] for j in range(k)])
            )
            vals = (rng.normal(size=(k, *s[1:])) * 10.0 ** (r - 1)).astype(dtype)
            if i == 4:
                vals[...] = -0.0
            out.append(pv.IndexedSlices(vals, idx, s))
        return out

    for _ in range(3):
        per_replica = [grads_of(r) for r in range(n)]

        def step(grads: list[Any], o: opts.Optimizer, vars_: list[Any]) -> None:
            o.apply_gradients(zip(grads, vars_, strict=True))

        strategy.run(step, args=(pv.PerReplica(per_replica), opt, vs))
        strategy.run(step, args=(pv.PerReplica(per_replica), ref_opt, ref_vs))
    _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))


def _sparse_pair(
    strategy: pv.Strategy, make_opt: Callable[[], opts.Optimizer], dtype: Any = np.float32
) -> tuple[list[Any], opts.Optimizer, list[Any], opts.Optimizer]:
    """Two equal models of SPARSE_SHAPES; the second's optimizer takes the per-variable path."""

    def model() -> tuple[list[Any], opts.Optimizer]:
        rng = np.random.default_rng(3)
        with strategy.scope():
            vs = [
                pv.Variable(rng.normal(size=s).astype(dtype), name=f"v{i}")
                for i, s in enumerate(SPARSE_SHAPES)
            ]
            return vs, make_opt()

    vs, opt = model()
    ref_vs, ref_opt = model()
    ref_opt._info = lambda v: (*opts.Optimizer._info(ref_opt, v)[:2], False)  # type: ignore[method-assign]
    return vs, opt, ref_vs, ref_opt


def _step(grads: list[Any], o: opts.Optimizer, vars_: list[Any]) -> None:
    o.apply_gradients(zip(grads, vars_, strict=True))


@pytest.mark.parametrize(
    "make_opt", [lambda: opts.Adam(0.01), lambda: opts.Momentum(0.1, 0.9)], ids=["adam", "momentum"]
)
def test_sparse_steps_of_changing_sizes_shared_objects_and_odd_slices(
    make_opt: Callable[[], opts.Optimizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A steady loop whose slices change size from step to step (the kept offsets are remade),
    # one IndexedSlices object every replica hands in (a term once per replica), slices
    # without a dense shape, and a slice of another dtype (its group keeps the per-variable
    # path): the bits of the per-variable path every step.
    from parallelvars.optimizers import _base

    strategy = pv.MirroredStrategy(3)
    vs, opt, ref_vs, ref_opt = _sparse_pair(strategy, make_opt)
    rng = np.random.default_rng(21)
    for step in range(4):
        per_replica: list[list[Any]] = [[] for _ in range(3)]
        for i, s in enumerate(SPARSE_SHAPES):
            shared = i == 1 and step % 2 == 0
            for r in range(3):
                if shared and r:
                    per_replica[r].append(per_replica[0][i])
                    continue
                k = int(rng.integers(0, 5))
                dt = np.float64 if (i == 3 and step == 3) else np.float32
                per_replica[r].append(
                    pv.IndexedSlices(
                        rng.normal(size=(k, *s[1:])).astype(dt),
                        rng.integers(0, s[0], k),
                        None if i == 2 else s,
                    )
                )
        if step == 2:
            # Every slice of arena variables takes the sparse route: no per-variable sum.
            def no_sum(parts: Any) -> Any:
                raise AssertionError("summed per variable")

            monkeypatch.setattr(_base, "sum_indexed_slices", no_sum)
        strategy.run(_step, args=(pv.PerReplica(per_replica), opt, vs))
        monkeypatch.undo()
        strategy.run(_step, args=(pv.PerReplica(per_replica), ref_opt, ref_vs))
        _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))
        if step == 2:  # one variable list: its groups made once
            assert len(opt._pv_transport.sparse._groups) == 1


def _values_dtypes() -> dict[str, Any]:
    return {
        "float32": np.float32,
        "bfloat16": _narrow_dtypes()[1],
        "float16": np.float16,
        "float64": np.float64,
    }


def _sparse_models(
    strategy: pv.Strategy, var_dtype: Any, sharded: bool, make_opt: Callable[[], opts.Optimizer]
) -> tuple[list[Any], opts.Optimizer, list[Any], opts.Optimizer]:
    """Two equal models of SPARSE_SHAPES (sharded: every other variable along axis 0); the
    second's optimizer takes the per-variable path."""

    def model() -> tuple[list[Any], opts.Optimizer]:
        rng = np.random.default_rng(3)
        with strategy.scope():
            vs = [
                pv.Variable(
                    rng.normal(size=s).astype(var_dtype),
                    name=f"v{i}",
                    shard_axis=0 if sharded and i % 2 == 0 else None,
                )
                for i, s in enumerate(SPARSE_SHAPES)
            ]
            return vs, make_opt()

    vs, opt = model()
    ref_vs, ref_opt = model()
    ref_opt._info = lambda v: (*opts.Optimizer._info(ref_opt, v)[:2], False)  # type: ignore[method-assign]
    return vs, opt, ref_vs, ref_opt


def _slices_of(
    rng: np.random.Generator, r: int, values_dtype: Any, dtypes: list[Any] | None = None
) -> list[Any]:
    """Replica ``r``'s IndexedSlices for SPARSE_SHAPES: rows repeated within a replica
    (variable 2) and across replicas only (variable 0), -0.0 rows (variable 4), an empty slice
    (variable 1 of replica 0 gets one row fewer than the next); ``dtypes``: each variable's
    values dtype (default: ``values_dtype`` for all)."""
    out: list[Any] = []
    for i, s in enumerate(SPARSE_SHAPES):
        k = [3, r, 4, 2, 1][i]
        idx = rng.integers(0, s[0], k) if i != 0 else np.array([(r + j) % s[0] for j in range(k)])
        vals = rng.normal(size=(k, *s[1:])) * 10.0 ** (r - 1)
        if i == 4:
            vals[...] = -0.0
        out.append(pv.IndexedSlices(vals.astype(dtypes[i] if dtypes else values_dtype), idx, s))
    return out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "var_dtype, values_dtype, sharded, make_opt, form",
    pairwise(
        {k: v for k, v in _values_dtypes().items() if k != "float64"},
        _values_dtypes(),
        {"mirrored": False, "sharded": True},
        {
            "sgd": lambda: opts.SGD(0.1),
            "momentum": lambda: opts.Momentum(0.1, 0.9),
            "adam": lambda: opts.Adam(0.01),
        },
        {"per-replica": "per-replica", "shared": "shared", "reduced": "reduced"},
    ),
)
def test_sparse_values_of_another_dtype_take_the_sparse_route_with_the_per_variable_bits(
    var_dtype: Any,
    values_dtype: Any,
    sharded: bool,
    make_opt: Callable[[], opts.Optimizer],
    form: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Values of another dtype than the variable's (float32 rows for bfloat16 variables, ...)
    # are summed in their own dtype and rounded once to the variable's, as the per-variable
    # path sums them: the same bits, a group at a time (no per-variable deduplicate). The
    # forms: every replica its own slices, one slices object every replica hands in, one
    # reduced gradient per variable (distributed_apply).
    strategy = pv.MirroredStrategy(3)
    vs, opt, ref_vs, ref_opt = _sparse_models(strategy, var_dtype, sharded, make_opt)
    rng = np.random.default_rng(29)

    def per_variable(*args: Any) -> Any:
        raise AssertionError("deduplicated per variable")

    for _ in range(3):
        per_replica = [_slices_of(rng, r, values_dtype) for r in range(3)]
        if form == "shared":
            per_replica = [per_replica[0]] * 3
        with monkeypatch.context() as m:
            m.setattr(pv.IndexedSlices, "deduplicate", per_variable)
            if form == "reduced":
                with strategy.scope():
                    opt.distributed_apply(strategy, list(zip(per_replica[0], vs, strict=True)))
            else:
                strategy.run(_step, args=(pv.PerReplica(per_replica), opt, vs))
        if form == "reduced":
            with strategy.scope():
                ref_opt.distributed_apply(strategy, list(zip(per_replica[0], ref_vs, strict=True)))
        else:
            strategy.run(_step, args=(pv.PerReplica(per_replica), ref_opt, ref_vs))
        _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "make_opt", [lambda: opts.Adam(0.01), lambda: opts.SGD(0.1)], ids=["adam", "sgd"]
)
def test_values_dtypes_that_differ_from_variable_to_variable_are_grouped_by_dtype(
    make_opt: Callable[[], opts.Optimizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # bfloat16 variables of one arena whose gradients come in several dtypes, one per
    # variable (a group per values dtype), and one variable whose replicas disagree (float32
    # and float16: their rows concatenated into float32, as the per-variable sum does, and
    # then taken with the reduced gradients): the per-variable bits, and no variable
    # deduplicated on its own.
    bf16 = _narrow_dtypes()[1]
    strategy = pv.MirroredStrategy(3)
    vs, opt, ref_vs, ref_opt = _sparse_models(strategy, bf16, False, make_opt)
    rng = np.random.default_rng(31)
    dtypes = [np.float32, bf16, np.float32, np.float64, np.float16]
    calls: list[int] = []
    deduplicate = pv.IndexedSlices.deduplicate

    def counted(self: pv.IndexedSlices) -> pv.IndexedSlices:
        calls.append(self.indices.shape[0])
        return deduplicate(self)

    for _ in range(3):
        per_replica = [_slices_of(rng, r, None, dtypes) for r in range(3)]
        v3 = per_replica[1][3]
        per_replica[1][3] = pv.IndexedSlices(
            v3.values.astype(np.float16), v3.indices, v3.dense_shape
        )
        with monkeypatch.context() as m:
            m.setattr(pv.IndexedSlices, "deduplicate", counted)
            strategy.run(_step, args=(pv.PerReplica(per_replica), opt, vs))
        strategy.run(_step, args=(pv.PerReplica(per_replica), ref_opt, ref_vs))
        _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))
    assert calls == []
    groups = opt._pv_transport.sparse._groups  # in the run, and the reduced variable 3
    assert sorted(len(g) for _, g in groups.values()) == [1, 4]  # made once


@pytest.mark.parametrize("bad", ["index", "negative", "shape"])
def test_a_bad_sparse_gradient_raises_before_any_update(bad: str) -> None:
    strategy = pv.MirroredStrategy(2)
    vs, opt, _, _ = _sparse_pair(strategy, lambda: opts.Adam(0.01))
    good = [
        [pv.IndexedSlices(np.ones((1, *s[1:]), np.float32), [0], s) for s in SPARSE_SHAPES]
        for _ in range(2)
    ]
    strategy.run(_step, args=(pv.PerReplica(good), opt, vs))
    before = [np.array(c) for x in _state(vs, opt) for c in x.components]
    s = SPARSE_SHAPES[2]
    wrong = {
        "index": pv.IndexedSlices(np.ones((1, *s[1:]), np.float32), [s[0]], s),
        "negative": pv.IndexedSlices(np.ones((1, *s[1:]), np.float32), [-1], s),
        "shape": pv.IndexedSlices(np.ones((1, 6), np.float32), [0], (s[0], 6)),
    }[bad]
    grads = [list(good[0]), list(good[1])]
    grads[1][2] = wrong
    with pytest.raises(GradientError, match="range" if bad != "shape" else "shape") as err:
        strategy.run(_step, args=(pv.PerReplica(grads), opt, vs))
    assert "v2" in str(err.value)
    after = [np.array(c) for x in _state(vs, opt) for c in x.components]
    for x, y in zip(before, after, strict=True):
        assert np.array_equal(x, y)


def _dedupe_per_variable(
    grads: list[pv.IndexedSlices], rows: list[int], width: int, **kw: Any
) -> dict[tuple[int, int], np.ndarray]:
    """``dedupe_rows`` over several variables laid end to end: ``{(variable, row): summed}``."""
    from parallelvars.optimizers._sparse_step import dedupe_rows

    base = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    counts = np.array([g.indices.shape[0] for g in grads])
    var_of = np.repeat(np.arange(len(grads)), counts)
    keys = base[var_of] + np.concatenate([g.indices for g in grads])
    values = np.concatenate([g.values.reshape(-1, width) for g in grads])
    unique, summed = dedupe_rows(keys, var_of, counts, values, **kw)
    assert len(set(unique.tolist())) == unique.shape[0]
    out = {}
    for key, row in zip(unique.tolist(), summed, strict=True):
        k = int(np.searchsorted(base, key, side="right") - 1)
        out[(k, key - int(base[k]))] = row
    return out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, *_narrow_dtypes()[1:2]], ids=["float32", "float16", "bf16"]
)
def test_dedupe_rows_is_deduplicate_per_variable(dtype: Any) -> None:
    # Variables with and without repeated rows (their -0.0 kept as it is), an empty one, a
    # row repeated many times (several rounds), a NaN: each variable's rows are those of
    # IndexedSlices.deduplicate, and, made dense, those of to_dense.
    rng = np.random.default_rng(19)
    big = rng.integers(0, 3, 40)
    grads = [
        pv.IndexedSlices(rng.normal(size=(5, 2)).astype(dtype), [3, 1, 3, 0, 1]),
        pv.IndexedSlices(np.array([[-0.0, 1.0], [2.0, -0.0]], dtype), [2, 0]),
        pv.IndexedSlices(np.zeros((0, 2), dtype), np.zeros(0, np.int64)),
        pv.IndexedSlices(
            (rng.normal(size=(40, 2)) * 10.0 ** rng.integers(-4, 5, (40, 1))).astype(dtype), big
        ),
        pv.IndexedSlices(np.array([[np.nan, -0.0], [1.0, -0.0], [-0.0, -0.0]], dtype), [1, 1, 0]),
    ]
    rows = [4, 3, 2, 3, 2]
    got = _dedupe_per_variable(grads, rows, 2)
    dense = _dedupe_per_variable(grads, rows, 2, all_from_zero=True)
    assert len(got) == sum(np.unique(g.indices).shape[0] for g in grads)
    for k, g in enumerate(grads):
        want = g.deduplicate()
        for i, row in zip(want.indices.tolist(), want.values, strict=True):
            assert np.array_equal(_bits(got[(k, i)]), _bits(row)), (k, i)
        made = g.to_dense((rows[k], 2))
        for i in want.indices.tolist():
            assert np.array_equal(_bits(dense[(k, i)]), _bits(made[i])), (k, i)


def test_a_restore_after_gradient_buffers_makes_the_counters_at_once(tmp_path: Path) -> None:
    """``gradient_buffers()`` makes the slots before the restore; the file's counters are
    made and restored all the same (was: ``iterations`` None and ``assert_consumed`` failing
    on them until the first step)."""

    def make() -> tuple[Any, Any, Any]:
        with pv.MirroredStrategy(4).scope() as strategy:
            w = pv.Variable(np.ones((3, 2), np.float32), name="w")
            opt = pv.optimizers.Adam(0.1)
        return strategy, w, opt

    strategy, w, opt = make()
    opt.distributed_apply(strategy, [(np.ones((3, 2), np.float32), w)])
    opt.distributed_apply(strategy, [(np.ones((3, 2), np.float32), w)])
    path = pv.Checkpoint(model={"w": w}, optimizer=opt).write(tmp_path / "a.h5")
    strategy, w2, opt2 = make()
    with strategy.scope():
        opt2.gradient_buffers([w2])
    status = pv.Checkpoint(model={"w": w2}, optimizer=opt2).restore(path)
    status.assert_consumed()
    assert opt2.iterations is not None and int(opt2.iterations.read_value()) == 2
    assert float(opt2.beta1_power.read_value()) == float(opt.beta1_power.read_value())


def test_gradient_buffers_outside_the_scope_says_so_at_once() -> None:
    """Was: 1-replica buffers, failing at the first step without a hint."""
    with pv.MirroredStrategy(4).scope():
        w = pv.Variable(np.ones((3, 2), np.float32), name="w")
        opt = pv.optimizers.Adam(0.1)
    with pytest.raises(ContextError, match=r"outside any strategy's scope.*'w' on 4 devices"):
        opt.gradient_buffers([w])


def _cast_cases() -> list[tuple[Any, Any]]:
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    return [
        (np.float32, np.float64),
        (np.float32, bf16),
        (np.float32, np.int16),
        (bf16, np.float32),
        (np.float16, np.float32),
        (np.float64, np.float32),
    ]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "devices, make_opt, var_dtype, grad_dtype",
    pairwise(
        {"1": 1, "3": 3, "unordered": ["cpu:2", "cpu:0", "cpu:10", "cpu:1"]},
        {"adam": lambda: opts.Adam(0.01), "momentum": lambda: opts.Momentum(0.1, 0.9)},
        {f"{np.dtype(v).name}-{np.dtype(g).name}": Args((v, g)) for v, g in _cast_cases()},
    ),
)
def test_gradients_of_another_dtype_are_summed_in_it_and_cast_once(
    var_dtype: Any, grad_dtype: Any, make_opt: Callable[[], opts.Optimizer], devices: Any
) -> None:
    # Gradients of another dtype than their variables (a float32 gradient of a bfloat16
    # variable, as mixed precision hands them in) are summed in their own dtype in device order
    # and cast once, over all of them: the bits of the per-variable path (add_n in the
    # gradients' dtype, then the update's cast). Next to them, gradients of the variables' own
    # dtype (fused as they are) and a shared object of another dtype; a steady loop.
    strategy = pv.MirroredStrategy(devices)
    n = strategy.num_replicas_in_sync
    vs, opt = _model(strategy, var_dtype, make_opt)
    ref_vs, ref_opt = _model(strategy, var_dtype, make_opt)
    ref_opt._info = lambda v: (*opts.Optimizer._info(ref_opt, v)[:2], False)  # type: ignore[method-assign]
    rng = np.random.default_rng(23)
    for _ in range(3):
        scales = [1e-3, 1.0, 1e3, 7.0]
        per_replica = [
            [
                (
                    rng.normal(size=s) * scales[r % 4] * (100 if grad_dtype == np.int16 else 1)
                ).astype(var_dtype if i % 3 == 0 else grad_dtype)
                for i, s in enumerate(SHAPES)
            ]
            for r in range(n)
        ]
        for r in range(1, n):
            per_replica[r][1] = per_replica[0][1]  # one object every replica hands in
        strategy.run(_step, args=(pv.PerReplica(per_replica), opt, vs))
        strategy.run(_step, args=(pv.PerReplica(per_replica), ref_opt, ref_vs))
        _assert_same(_state(vs, opt), _state(ref_vs, ref_opt))
    # Every gradient took a fused route: the cast positions are known for the steady loop.
    ((_, plan),) = opt._pv_transport.plans.values()
    assert plan.mixed is not None and len(plan.mixed[2]) == len(SHAPES) - 3
