"""The cross-replica API, deterministic reductions, host code, loss scaling and distributed input."""

from __future__ import annotations

import contextvars
import random
import threading
import time
from typing import Any, NamedTuple

import numpy as np
import pytest
from _strategy_support import run_with_deadline
from hypothesis import given, settings
from hypothesis import strategies as st

import parallelvars as pv
from parallelvars.errors import ContextError, CrossReplicaOnlyError, DistributedValueError
from parallelvars.strategy import add_n_by_device, get_update_device, split_batch


class SparseGrad(NamedTuple):
    values: np.ndarray
    indices: np.ndarray
    dense_shape: tuple[int, ...]


# ---------------------------------------------------------------------------- reduce
def test_reduce_sum_and_mean() -> None:
    s = pv.MirroredStrategy(4)
    x = pv.PerReplica([np.full(2, i, np.float32) for i in range(4)])
    np.testing.assert_array_equal(s.reduce(pv.ReduceOp.SUM, x), [6.0, 6.0])
    np.testing.assert_array_equal(s.reduce("mean", x), [1.5, 1.5])
    assert s.reduce(pv.ReduceOp.SUM, x).dtype == np.float32
    # A plain value is one value every replica holds: its MEAN is itself, a SUM over four
    # replicas is refused as in TensorFlow (but zero sums to zero); a Mirrored one counts
    # once per copy.
    assert float(s.reduce(pv.ReduceOp.MEAN, 2.0)) == 2.0
    np.testing.assert_array_equal(s.reduce(pv.ReduceOp.MEAN, np.ones((3, 2)), axis=0), [1.0, 1.0])
    with pytest.raises(DistributedValueError, match=r"not per-replica.*SUM over 4 replicas"):
        s.reduce(pv.ReduceOp.SUM, 2.0)
    with pytest.raises(DistributedValueError, match=r"not per-replica"):
        s.reduce(pv.ReduceOp.SUM, np.ones((3, 2)), axis=0)
    assert float(s.reduce(pv.ReduceOp.SUM, 0.0)) == 0.0
    assert float(pv.MirroredStrategy(1).reduce(pv.ReduceOp.SUM, 2.0)) == 2.0
    assert float(s.reduce(pv.ReduceOp.SUM, s.broadcast(2.0))) == 8.0


def test_reduce_mean_with_axis_is_the_global_mean_of_uneven_batches() -> None:
    s = pv.MirroredStrategy(3)
    data = np.arange(10, dtype=np.float64).reshape(5, 2) ** 2
    parts = pv.PerReplica([data[:3], data[3:5], data[5:]])  # 3, 2 and 0 rows
    np.testing.assert_allclose(s.reduce(pv.ReduceOp.MEAN, parts, axis=0), data.mean(axis=0))
    np.testing.assert_allclose(s.reduce(pv.ReduceOp.SUM, parts, axis=0), data.sum(axis=0))
    mean_of_means = np.mean([data[:3].mean(axis=0), data[3:5].mean(axis=0)], axis=0)
    assert not np.allclose(mean_of_means, data.mean(axis=0))


def test_reduce_rejects_bad_values() -> None:
    s = pv.MirroredStrategy(2)
    with pytest.raises(DistributedValueError, match=r"3 values for 2 replicas"):
        s.reduce(pv.ReduceOp.SUM, pv.PerReplica([1, 2, 3]))
    with pytest.raises(DistributedValueError, match="different shapes"):
        s.reduce(pv.ReduceOp.SUM, pv.PerReplica([np.zeros(2), np.zeros(3)]))
    with pytest.raises(ValueError, match="invalid ReduceOp"):
        s.reduce("max", pv.PerReplica([1, 2]))


def test_batch_reduce_with_variables_as_destinations() -> None:
    s = pv.MirroredStrategy(2)
    with s.scope():
        a = pv.Variable(np.zeros(2, np.float32), name="a")
        b = pv.Variable(np.zeros(3, np.float32), name="b")
    ga = pv.PerReplica([np.ones(2, np.float32), np.full(2, 2, np.float32)])
    gb = pv.PerReplica([np.arange(3, dtype=np.float32)] * 2)
    sa, sb = s.batch_reduce(pv.ReduceOp.SUM, [(ga, a), (gb, b)])
    np.testing.assert_array_equal(sa, [3, 3])
    np.testing.assert_array_equal(sb, [0, 2, 4])
    sparse = pv.PerReplica(
        [
            SparseGrad(np.ones((1, 2)), np.array([0]), (4, 2)),
            SparseGrad(np.full((1, 2), 3.0), np.array([2]), (4, 2)),
        ]
    )
    (red,) = s.batch_reduce(pv.ReduceOp.MEAN, [(sparse, None)])
    assert isinstance(red, SparseGrad) and red.indices.tolist() == [0, 2]
    np.testing.assert_array_equal(red.values, [[0.5, 0.5], [1.5, 1.5]])
    with pytest.raises(DistributedValueError, match="pairs"):
        s.batch_reduce(pv.ReduceOp.SUM, [ga])


def test_reduction_inside_merge_call_of_run_results() -> None:
    s = pv.MirroredStrategy(4)

    def fn(x: Any) -> Any:
        return x * 2

    out = run_with_deadline(s, fn, args=(pv.PerReplica([np.float32(i) for i in range(4)]),))
    assert float(s.reduce(pv.ReduceOp.SUM, out)) == 12.0


# ---------------------------------------------------------------------------- determinism
def test_add_n_groups_by_device_then_adds_in_device_order() -> None:
    big, one = np.float32(1e8), np.float32(1.0)
    # cpu:10 sorts after cpu:2 (by index, not as text); the two cpu:2 summands add first.
    summands = [("cpu:10", -big), ("cpu:2", big), ("cpu:0", one), ("cpu:2", one)]
    expected = (one + (big + one)) + -big
    assert add_n_by_device(summands) == expected
    assert add_n_by_device(list(reversed(summands))) == (one + (one + big)) + -big


def test_sums_are_bit_identical_whatever_the_thread_timing() -> None:
    s = pv.MirroredStrategy(4)
    rng = np.random.default_rng(7)
    # Values spanning many magnitudes: their float32 sum depends on the order of addition.
    values = [
        (rng.standard_normal(64) * 10.0 ** rng.integers(-3, 8, 64)).astype(np.float32)
        for _ in range(4)
    ]
    in_order = ((values[0] + values[1]) + values[2]) + values[3]
    reordered = ((values[3] + values[1]) + values[0]) + values[2]
    assert in_order.tobytes() != reordered.tobytes()  # the order is observable
    jitter = random.Random(3)
    delays = [[jitter.random() * 2e-4 for _ in range(4)] for _ in range(300)]

    def fn(x: np.ndarray, step: int) -> Any:
        ctx = pv.get_replica_context()
        assert ctx is not None
        time.sleep(delays[step][ctx.replica_id_in_sync_group])  # arrive in a varying order
        return ctx.merge_call(lambda st, v: st.reduce(pv.ReduceOp.SUM, v), args=(x,))

    per = pv.PerReplica(values)
    seen = {run_with_deadline(s, fn, args=(per, step)).tobytes() for step in range(300)}
    assert seen == {in_order.tobytes()}


# ---------------------------------------------------------------------------- broadcast, update
def test_broadcast_gives_each_replica_its_own_copy() -> None:
    s = pv.MirroredStrategy(3)
    x = np.arange(3.0)
    m = s.broadcast(x)
    assert isinstance(m, pv.Mirrored) and len(m) == 3
    assert len({id(v) for v in m.values}) == 3
    for v in m.values:
        np.testing.assert_array_equal(v, x)
    out = run_with_deadline(s, lambda c: id(c), args=(m,))
    assert set(out.values) == {id(v) for v in m.values}
    assert float(s.reduce(pv.ReduceOp.SUM, m)[1]) == 3.0
    assert len(s.broadcast(1.0, destinations=["gpu:0", "gpu:1"])) == 2


def test_update_calls_fn_per_component_with_unwrapped_arguments() -> None:
    s = pv.MirroredStrategy(2)
    with s.scope():
        w = pv.Variable(np.ones(2, np.float32), name="w")
        slot = pv.Variable(np.zeros(2, np.float32), name="slot")
    slot.components[1][...] = 5.0  # make the components tell apart
    calls: list[Any] = []

    def fn(comp: np.ndarray, g: Any, m: Any, *, lr: float) -> str:
        calls.append((get_update_device(), m is slot.components[calls.__len__()]))
        comp -= lr * (g + m)
        return "done"

    grads = pv.PerReplica([np.full(2, 1.0, np.float32), np.full(2, 2.0, np.float32)])
    with s.scope():
        out = s.update(w, fn, grads, slot, lr=0.5)
    assert out == "done"
    assert calls == [("cpu:0", True), ("cpu:1", True)]
    np.testing.assert_array_equal(w.components[0], [0.5, 0.5])
    np.testing.assert_array_equal(w.components[1], [-2.5, -2.5])
    assert get_update_device() is None


def test_update_of_a_sharded_variable_slices_full_arguments() -> None:
    s = pv.MirroredStrategy(2)
    with s.scope():
        e = pv.Variable(np.zeros((5, 2), np.float32), name="e", shard_axis=0)
    grad = np.arange(10, dtype=np.float32).reshape(5, 2)

    def fn(shard: np.ndarray, g: np.ndarray) -> None:
        shard += g

    with s.scope():
        s.update(e, fn, grad)
    np.testing.assert_array_equal(e.read_value(), grad)


def test_update_non_slot_runs_once() -> None:
    s = pv.MirroredStrategy(3)
    with s.scope():
        w = pv.Variable(np.zeros(2, np.float32), name="w")
        where = s.non_slot_devices([w])
        assert where == ("cpu:0", "cpu:1", "cpu:2")
        with s.colocate_vars_with(where):
            power = pv.Variable(1.0, name="beta_power")
        seen: list[Any] = []

        def finish(factor: float) -> str:
            seen.append(get_update_device())
            power.assign(power * factor)
            return "ok"

        assert s.update_non_slot(where, finish, 0.9) == "ok"
        with pytest.raises(DistributedValueError, match="per-replica"):
            s.update_non_slot(where, finish, pv.PerReplica([1, 2, 3]))
    assert seen == [where]
    assert [float(c) for c in power.components] == pytest.approx([0.9] * 3)


def test_colocate_vars_with_places_on_the_variables_devices() -> None:
    s = pv.MirroredStrategy(["cpu:0", "gpu:0"])
    with s.scope():
        w = pv.Variable(np.zeros(2), name="w")
        with s.colocate_vars_with(w):
            m = pv.Variable(np.zeros(2), name="m")
        with s.colocate_vars_with(["gpu:3"]):
            single = pv.Variable(0.0, name="single")
    assert m.devices == w.devices and m.kind == "mirrored"
    assert single.devices == ("gpu:3",)
    with pytest.raises(ContextError, match="needs its scope"), s.colocate_vars_with(w):
        pass


def test_default_strategy_non_slot_devices_and_update() -> None:
    default = pv.get_strategy()
    a = pv.Variable(1.0, name="b_var")
    b = pv.Variable(2.0, name="a_var")
    assert default.non_slot_devices([a, b]) is b
    default.update(a, lambda c, d: np.add(c, d, out=c), 2.0)
    assert float(a) == 3.0


def test_local_results_group_read_var_and_devices() -> None:
    s = pv.MirroredStrategy(2)
    with s.scope():
        w = pv.Variable(np.ones(2), name="w")
        n = pv.Variable(
            1.0,
            name="n",
            synchronization=pv.Synchronization.ON_READ,
            aggregation=pv.Aggregation.MEAN,
        )
        n.components[1][...] = 3.0
        assert s.experimental_local_results(w) == w.components
        assert s.experimental_local_results(pv.PerReplica([1, 2])) == (1, 2)
        assert s.experimental_local_results(5) == (5,)
        assert s.group({"a": pv.PerReplica([1, 2]), "b": [3]}) == (1, 2, 3)
        assert float(s.read_var(n)) == 2.0
    assert s.num_replicas_in_sync == 2
    assert s.worker_devices == s.parameter_devices == ("cpu:0", "cpu:1")


def test_increment_var_once_per_step() -> None:
    s = pv.MirroredStrategy(4)
    with s.scope():
        step = pv.Variable(np.int64(0), name="step")
    for _ in range(3):
        run_with_deadline(s, lambda: pv.increment_var(step))
    assert [int(c) for c in step.components] == [3] * 4
    with s.scope():
        pv.increment_var(step, 10)
    assert int(step) == 13


CROSS_REPLICA_ONLY = {
    "reduce": lambda s: s.reduce(pv.ReduceOp.MEAN, 1.0),
    "batch_reduce": lambda s: s.batch_reduce(pv.ReduceOp.SUM, []),
    "broadcast": lambda s: s.broadcast(1.0),
    "update": lambda s: s.update(np.zeros(1), lambda c: None),
    "update_non_slot": lambda s: s.update_non_slot(s.non_slot_devices([]), lambda: None),
    "read_var": lambda s: s.read_var(np.zeros(1)),
    "experimental_local_results": lambda s: s.experimental_local_results(1),
    "group": lambda s: s.group(1),
}


@pytest.mark.parametrize("method", sorted(CROSS_REPLICA_ONLY))
def test_cross_replica_only_methods_refuse_replica_context(method: str) -> None:
    s = pv.MirroredStrategy(2)
    with pytest.raises(CrossReplicaOnlyError, match=rf"{method}\(\) is cross-replica only"):
        run_with_deadline(s, lambda: CROSS_REPLICA_ONLY[method](s))
    # ... and work in the merge function of the same replica function.
    run_with_deadline(s, lambda: pv.get_replica_context().merge_call(CROSS_REPLICA_ONLY[method]))


def test_cross_replica_method_of_another_strategy_inside_a_scope_is_an_error() -> None:
    a, b = pv.MirroredStrategy(2), pv.MirroredStrategy(3)
    with a.scope(), pytest.raises(ContextError, match="strategies do not nest"):
        b.reduce(pv.ReduceOp.SUM, 1.0)


# ---------------------------------------------------------------------------- outside_compilation
def test_outside_compilation_runs_host_code() -> None:
    s = pv.MirroredStrategy(2)
    with s.scope():
        w = pv.Variable(np.zeros(2, np.float32), name="w")
    w.components[1][...] = 7.0

    def host(x: int) -> Any:
        ctx = pv.get_replica_context()
        assert ctx is not None and ctx.num_replicas_in_sync == 1
        assert not pv.has_strategy()
        v = pv.Variable(1.0, name="host_var")
        return x, float(w[0]), v.kind, threading.get_ident()

    def fn() -> Any:
        ctx = pv.get_replica_context()
        assert ctx is not None
        before = float(w[0])
        out = pv.outside_compilation(host, ctx.replica_id_in_sync_group)
        assert pv.get_replica_context() is ctx
        return before, out, threading.get_ident()

    before, out, ident = run_with_deadline(s, fn)
    assert before.values == (0.0, 7.0)  # replicas read their own component
    assert out[0].values == (0, 1) and out[1].values == (0.0, 0.0) and out[2] == "single"
    assert out[3].values == ident.values  # in the replica's own thread
    assert pv.outside_compilation(lambda a, b: a + b, 1, 2) == 3


def test_outside_compilation_cannot_nest() -> None:
    s = pv.MirroredStrategy(2)

    def fn() -> None:
        pv.outside_compilation(pv.outside_compilation, lambda: None)

    with pytest.raises(ContextError, match="cannot be nested"):
        run_with_deadline(s, fn)


def test_outside_compilation_must_leave_the_context_it_entered() -> None:
    s = pv.MirroredStrategy(2)
    other = pv.OneDeviceStrategy()

    left_open: list[Any] = []

    def leaky() -> None:
        scope = other.scope()
        scope.__enter__()  # entered and never exited
        left_open.append(scope)

    def fn() -> Any:
        try:
            pv.outside_compilation(leaky)
        finally:
            left_open.pop().__exit__(None, None, None)  # in the context that entered it

    with pytest.raises(
        ContextError, match=r"entered in DefaultStrategy.*left in OneDeviceStrategy"
    ):
        run_with_deadline(s, fn)

    def recovers() -> Any:
        with pytest.raises(ContextError):
            pv.outside_compilation(leaky)
        strategy = pv.get_replica_context().strategy  # the replica context is restored
        left_open.pop().__exit__(None, None, None)
        return strategy

    assert run_with_deadline(s, recovers) is s


# ---------------------------------------------------------------------------- loss scaling
def test_loss_reduction_and_scaling() -> None:
    assert pv.get_loss_reduction() is pv.ReduceOp.MEAN
    s = pv.MirroredStrategy(4)

    def fn() -> Any:
        loss = pv.scale_loss_for_replicas(np.float32(2.0))
        grads = pv.scale_loss_for_replicas([(np.ones(2, np.float32), "var"), (None, "other")])
        with pv.loss_reduction(pv.ReduceOp.SUM):
            unscaled = pv.scale_loss_for_replicas(2.0)
        return loss, grads, unscaled

    loss, grads, unscaled = run_with_deadline(s, fn)
    assert loss.values == (0.5,) * 4 and loss.values[0].dtype == np.float32
    np.testing.assert_array_equal(grads[0][0].values[0], [0.25, 0.25])
    assert grads[0][1] == "var" and grads[1][0] is None
    assert unscaled == 2.0
    assert pv.scale_loss_for_replicas(2.0) == 2.0  # one replica outside any strategy
    with s.scope():
        assert float(pv.scale_loss_for_replicas(2.0)) == 0.5
        sparse = pv.scale_loss_for_replicas(SparseGrad(np.ones(2), np.array([1]), (3,)))
        np.testing.assert_array_equal(sparse.values, [0.25, 0.25])


def test_set_loss_reduction_is_seen_by_replicas_and_not_leaked() -> None:
    s = pv.MirroredStrategy(2)
    ctx = contextvars.copy_context()

    def caller() -> Any:
        pv.set_loss_reduction("sum")
        return s.run(pv.get_loss_reduction)

    assert ctx.run(caller) is pv.ReduceOp.SUM
    assert pv.get_loss_reduction() is pv.ReduceOp.MEAN


# ---------------------------------------------------------------------------- distributed input
def test_distribute_dataset_splits_uneven_batches() -> None:
    s = pv.MirroredStrategy(4)
    x = np.arange(26, dtype=np.float32).reshape(13, 2)
    y = np.arange(13)
    ds = s.experimental_distribute_dataset((x, y), batch_size=10)
    batches = list(ds)
    assert len(batches) == 2
    first, last = batches
    assert [p[0].shape[0] for p in first] == [3, 3, 2, 2]
    assert [p[0].shape[0] for p in last] == [1, 1, 1, 0]  # the uneven last batch
    np.testing.assert_array_equal(np.concatenate([p[1] for p in last]), y[10:])
    assert len(list(ds)) == 2  # re-iterable

    def fn(batch: Any) -> Any:
        features, _ = batch
        return features

    total = [run_with_deadline(s, fn, args=(b,)) for b in batches]
    np.testing.assert_allclose(s.reduce(pv.ReduceOp.MEAN, total[1], axis=0), x[10:].mean(axis=0))


def test_distribute_dataset_of_an_iterable_of_dict_batches() -> None:
    s = pv.MirroredStrategy(2)
    batches = [
        {"a": np.arange(4), "b": np.ones((4, 3))},
        {"a": np.arange(3), "b": np.zeros((3, 3))},
    ]
    out = list(s.experimental_distribute_dataset(batches))
    assert out[1].values[0]["a"].tolist() == [0, 1] and out[1].values[1]["b"].shape == (1, 3)


@pytest.mark.parametrize(
    ("dataset", "batch_size", "match"),
    [
        (np.zeros((4, 2)), None, "needs a batch_size"),
        ([np.zeros(3)], 2, "batch_size is for array input"),
        (np.zeros((4, 2)), 0, "batch_size must be positive"),
        ((np.zeros(4), np.zeros(5)), 2, "different lengths"),
        (5, None, "iterable of batches"),
    ],
)
def test_distribute_dataset_rejects_bad_input(dataset: Any, batch_size: Any, match: str) -> None:
    with pytest.raises(DistributedValueError, match=match):
        pv.MirroredStrategy(2).experimental_distribute_dataset(dataset, batch_size=batch_size)


@settings(max_examples=50, deadline=None)
@given(length=st.integers(0, 40), n=st.integers(1, 8))
def test_split_batch_covers_the_batch_in_order(length: int, n: int) -> None:
    batch = np.arange(length)
    parts = split_batch(batch, n).values
    assert len(parts) == n
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    np.testing.assert_array_equal(np.concatenate(parts), batch)


@settings(max_examples=50, deadline=None)
@given(rows=st.lists(st.integers(0, 5), min_size=1, max_size=6))
def test_global_mean_matches_numpy(rows: list[int]) -> None:
    if sum(rows) == 0:
        return
    rng = np.random.default_rng(sum(rows))
    parts = [rng.integers(-50, 50, (r, 3)).astype(np.float64) for r in rows]
    s = pv.MirroredStrategy(len(rows))
    got = s.reduce(pv.ReduceOp.MEAN, pv.PerReplica(parts), axis=0)
    np.testing.assert_allclose(got, np.concatenate(parts).mean(axis=0))


def test_gather_gives_full_values_in_cross_replica_context() -> None:
    strategy = pv.MirroredStrategy(3)
    with strategy.scope():
        table = pv.Variable(np.arange(20.0).reshape(10, 2), name="table", shard_axis=0)
        mirrored = pv.Variable(np.ones(2), name="mirrored")
    np.testing.assert_array_equal(strategy.gather(table), np.arange(20.0).reshape(10, 2))
    per = strategy.run(lambda: np.full((1, 2), pv.get_replica_context().replica_id_in_sync_group))
    np.testing.assert_array_equal(strategy.gather(per, axis=0)[:, 0], [0, 1, 2])
    np.testing.assert_array_equal(strategy.gather(per, axis=1)[0], [0, 0, 1, 1, 2, 2])
    assert strategy.gather(mirrored).shape == (6,)  # one copy per replica, side by side
    with pytest.raises(CrossReplicaOnlyError):
        strategy.run(lambda: strategy.gather(table))
