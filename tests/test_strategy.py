"""Strategies: the mode stack, scopes, run(), merge_call and failures inside replicas.

Every multi-replica run goes through ``run_with_deadline`` so that a rendezvous bug fails the
test within seconds instead of hanging the suite.
"""

from __future__ import annotations

import contextvars
import threading
import time
from typing import Any

import numpy as np
import pytest
from _strategy_support import DEADLINE_S, run_with_deadline

import parallelvars as pv
from parallelvars.errors import ContextError, DistributedValueError, ReplicaError


# ---------------------------------------------------------------------------- mode stack
def test_execution_starts_in_the_default_replica_context() -> None:
    strategy = pv.get_strategy()
    assert not pv.has_strategy()
    assert strategy.num_replicas_in_sync == 1
    ctx = pv.get_replica_context()
    assert ctx is not None and ctx.replica_id_in_sync_group == 0
    assert pv.get_cross_replica_context() is None
    v = pv.Variable(np.ones(2, np.float32), name="plain")
    assert v.kind == "single"


def test_scope_enters_cross_replica_context_and_places_variables() -> None:
    strategy = pv.MirroredStrategy(3)
    with strategy.scope() as s:
        assert s is strategy
        assert pv.get_strategy() is strategy and pv.has_strategy()
        assert pv.get_replica_context() is None
        assert pv.get_cross_replica_context() is strategy
        w = pv.Variable(np.zeros((2, 2), np.float32), name="w")
        n = pv.Variable(
            0.0,
            name="n",
            synchronization=pv.Synchronization.ON_READ,
            aggregation=pv.Aggregation.SUM,
        )
        e = pv.Variable(np.zeros((7, 2)), name="e", shard_axis=0)
    assert (w.kind, n.kind, e.kind) == ("mirrored", "on_read", "sharded")
    assert w.devices == ("cpu:0", "cpu:1", "cpu:2")
    assert [c.shape[0] for c in e.components] == [3, 2, 2]
    assert pv.get_strategy() is not strategy
    assert pv.get_replica_context() is not None


def test_reentering_the_same_scope_is_a_noop() -> None:
    strategy = pv.MirroredStrategy(2)
    with strategy.scope(), strategy.scope():
        assert pv.get_cross_replica_context() is strategy
        v = pv.Variable(1.0, name="v")
    assert v.kind == "mirrored"
    assert pv.get_cross_replica_context() is None


def test_entering_another_strategys_scope_names_both() -> None:
    outer = pv.MirroredStrategy(2)
    inner = pv.OneDeviceStrategy("cpu:5")
    with outer.scope(), pytest.raises(ContextError) as err, inner.scope():
        pass
    assert "OneDeviceStrategy(['cpu:5'])" in str(err.value)
    assert "MirroredStrategy(['cpu:0', 'cpu:1'])" in str(err.value)


def test_mode_stack_is_per_thread() -> None:
    strategy = pv.MirroredStrategy(2)
    seen: list[Any] = []
    with strategy.scope():
        t = threading.Thread(target=lambda: seen.append(pv.get_strategy()))
        t.start()
        t.join(DEADLINE_S)
    assert seen and seen[0] is not strategy


# ---------------------------------------------------------------------------- strategies and run()
def test_default_strategy_runs_one_replica_inline() -> None:
    default = pv.get_strategy()
    caller = threading.get_ident()

    def fn(x: float) -> tuple[int, int, float]:
        ctx = pv.get_replica_context()
        assert ctx is not None
        return ctx.replica_id_in_sync_group, threading.get_ident(), x * 2

    rid, ident, y = default.run(fn, args=(1.5,))
    assert (rid, ident, y) == (0, caller, 3.0)


def test_one_device_strategy() -> None:
    strategy = pv.OneDeviceStrategy("gpu:1")
    assert strategy.num_replicas_in_sync == 1
    assert strategy.worker_devices == ("gpu:1",)
    with strategy.scope():
        v = pv.Variable(np.arange(3.0), name="v")
    assert v.kind == "single"

    def fn() -> tuple[str, ...]:
        v.assign_add(1.0)  # one replica writes directly
        ctx = pv.get_replica_context()
        assert ctx is not None
        return ctx.devices

    assert strategy.run(fn) == ("gpu:1",)
    np.testing.assert_array_equal(v.read_value(), [1.0, 2.0, 3.0])


@pytest.mark.parametrize("devices", [4, ["cpu:0", "cpu:1", "gpu:0", "gpu:1"]])
def test_each_replica_runs_in_its_own_thread_with_its_own_context(devices: Any) -> None:
    strategy = pv.MirroredStrategy(devices)
    names = strategy.worker_devices
    caller = threading.get_ident()

    def fn() -> tuple[int, int, tuple[str, ...], int]:
        ctx = pv.get_replica_context()
        assert ctx is not None and ctx.strategy is strategy
        return (
            ctx.replica_id_in_sync_group,
            ctx.num_replicas_in_sync,
            ctx.devices,
            threading.get_ident(),
        )

    out = run_with_deadline(strategy, fn)
    assert isinstance(out, tuple) and isinstance(out[0], pv.PerReplica)
    assert out[0].values == (0, 1, 2, 3)
    assert out[1] == 4  # the same object from every replica: returned as is
    assert out[2][0].values == names  # tuples are merged element by element
    idents = out[3].values
    assert len(set(idents)) == 4 and caller not in idents


def test_run_unwraps_per_replica_and_passes_shared_values_through() -> None:
    strategy = pv.MirroredStrategy(3)
    shared = np.arange(4)
    per = pv.PerReplica([10, 20, 30])

    def fn(a: Any, b: Any, *, c: Any) -> Any:
        assert b is shared
        return a + c["k"]

    out = run_with_deadline(
        strategy, fn, args=(per, shared), kwargs={"c": {"k": pv.PerReplica([1, 2, 3])}}
    )
    assert out.values == (11, 22, 33)


def test_run_merges_results() -> None:
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        w = pv.Variable(np.zeros(3, np.float32), name="w")
    token = object()

    def fn() -> Any:
        ctx = pv.get_replica_context()
        assert ctx is not None
        i = ctx.replica_id_in_sync_group
        return {"same": token, "diff": [i, "x"], "comp": w.components[i], "var": w, "none": None}

    out = run_with_deadline(strategy, fn)
    assert out["same"] is token
    assert (
        isinstance(out["diff"], list) and out["diff"][0].values == (0, 1) and out["diff"][1] == "x"
    )
    assert out["comp"] is w  # the components of one mirrored variable -> that variable
    assert out["var"] is w
    assert out["none"] is None


def test_run_rejects_per_replica_of_wrong_length() -> None:
    strategy = pv.MirroredStrategy(2)
    with pytest.raises(DistributedValueError, match="3 values for 2 replicas"):
        strategy.run(lambda x: x, args=(pv.PerReplica([1, 2, 3]),))


def test_run_inside_a_replica_function_is_an_error() -> None:
    strategy = pv.MirroredStrategy(2)

    def fn() -> None:
        strategy.run(lambda: None)

    with pytest.raises(ContextError, match="runs do not nest"):
        run_with_deadline(strategy, fn)


def test_creating_a_variable_in_a_replica_function_makes_one_mirrored_variable() -> None:
    strategy = pv.MirroredStrategy(2)
    v = run_with_deadline(strategy, lambda: pv.Variable(1.0, name="late"))
    assert v.kind == "mirrored" and [float(c) for c in v.components] == [1.0, 1.0]


def test_run_carries_the_callers_context_into_replicas() -> None:
    strategy = pv.MirroredStrategy(2)
    var: contextvars.ContextVar[str] = contextvars.ContextVar("test_var", default="unset")

    def fn() -> str:
        return var.get()

    var.set("caller")
    assert run_with_deadline(strategy, fn) == "caller"


# ---------------------------------------------------------------------------- merge_call
def test_merge_call_example_with_four_replicas() -> None:
    strategy = pv.MirroredStrategy(4)

    def merge_fn(distribution: pv.Strategy, three_plus_replica_id: Any) -> Any:
        assert pv.get_cross_replica_context() is distribution
        return sum(distribution.experimental_local_results(three_plus_replica_id))

    def fn(three: int) -> Any:
        ctx = pv.get_replica_context()
        assert ctx is not None
        v = three + ctx.replica_id_in_sync_group
        s = ctx.merge_call(merge_fn, args=(v,))
        assert pv.get_replica_context() is ctx  # back in the replica context
        return s + v

    with strategy.scope():
        merged = run_with_deadline(strategy, fn, args=(3,))
        assert strategy.experimental_local_results(merged) == (21, 22, 23, 24)


def test_merge_call_groups_arguments_and_hands_out_parts() -> None:
    strategy = pv.MirroredStrategy(3)
    with strategy.scope():
        w = pv.Variable(np.zeros(2, np.float32), name="w")
    seen: dict[str, Any] = {}

    def merge_fn(s: pv.Strategy, x: Any, var: Any, *, tag: Any) -> Any:
        seen.update(x=x, var=var, tag=tag)
        return pv.PerReplica([v * 10 for v in x.values]), "shared"

    def fn() -> Any:
        ctx = pv.get_replica_context()
        assert ctx is not None
        i = ctx.replica_id_in_sync_group
        return ctx.merge_call(merge_fn, args=(i, w), kwargs={"tag": "t"})

    out = run_with_deadline(strategy, fn)
    assert isinstance(seen["x"], pv.PerReplica) and seen["x"].values == (0, 1, 2)
    assert seen["var"] is w and seen["tag"] == "t"
    assert out[0].values == (0, 10, 20) and out[1] == "shared"


def test_several_merge_calls_per_step() -> None:
    strategy = pv.MirroredStrategy(4)

    def fn() -> Any:
        ctx = pv.get_replica_context()
        assert ctx is not None
        total = ctx.replica_id_in_sync_group
        for _ in range(5):
            # float() gives each replica its own object, so the next merge sees a PerReplica.
            total = float(ctx.merge_call(lambda s, t: s.reduce(pv.ReduceOp.SUM, t), args=(total,)))
        return total

    # float() makes a new object per replica: equal values, still one per replica.
    assert run_with_deadline(strategy, fn).values == (6.0 * 4**4,) * 4


@pytest.mark.parametrize("extra_replica", [0, 3])
def test_different_numbers_of_merge_calls_is_an_error(extra_replica: int) -> None:
    strategy = pv.MirroredStrategy(4)

    def fn() -> None:
        ctx = pv.get_replica_context()
        assert ctx is not None
        ctx.merge_call(lambda s: None)
        if ctx.replica_id_in_sync_group == extra_replica:
            time.sleep(0.02)  # the others have returned by now, or soon will
            ctx.merge_call(lambda s: None)

    with pytest.raises(ReplicaError, match="same number of merge_calls"):
        run_with_deadline(strategy, fn)
    assert run_with_deadline(strategy, lambda: 1) == 1  # usable again


def test_missing_merge_call_while_others_wait_is_an_error() -> None:
    strategy = pv.MirroredStrategy(3)

    def fn() -> None:
        ctx = pv.get_replica_context()
        assert ctx is not None
        if ctx.replica_id_in_sync_group != 1:
            ctx.merge_call(lambda s: None)
        else:
            time.sleep(0.02)  # let the others park in merge_call first

    with pytest.raises(ReplicaError, match=r"wait in merge_call"):
        run_with_deadline(strategy, fn)


def test_merge_call_from_cross_replica_context_is_an_error() -> None:
    strategy = pv.MirroredStrategy(2)

    def fn() -> None:
        ctx = pv.get_replica_context()
        assert ctx is not None
        ctx.merge_call(lambda s: ctx.merge_call(lambda s2: None))

    with pytest.raises(ContextError, match="cross-replica context"):
        run_with_deadline(strategy, fn)


def test_merge_call_with_different_functions_is_an_error() -> None:
    strategy = pv.MirroredStrategy(2)

    def first(s: Any) -> None:
        return None

    def second(s: Any) -> None:
        return None

    def fn() -> None:
        ctx = pv.get_replica_context()
        assert ctx is not None
        ctx.merge_call(first if ctx.replica_id_in_sync_group == 0 else second)

    with pytest.raises(ReplicaError, match=r"replica 1 called .*second"):
        run_with_deadline(strategy, fn)


# ---------------------------------------------------------------------------- failures
class Boom(Exception):
    pass


@pytest.mark.parametrize("where", ["before", "during", "after"])
def test_an_exception_in_replica_2_reaches_the_caller(where: str) -> None:
    strategy = pv.MirroredStrategy(4)

    def merge_fn(s: Any, i: Any) -> Any:
        if where == "during" and pv.get_replica_context() is None:
            raise Boom("in the merge function")
        return i

    def fn() -> Any:
        ctx = pv.get_replica_context()
        assert ctx is not None
        i = ctx.replica_id_in_sync_group
        if where == "before" and i == 2:
            raise Boom("replica 2 before merge_call")
        if where == "during" and i == 2:
            time.sleep(0.02)  # arrive last, so replica 2 runs the merge function
        out = ctx.merge_call(merge_fn, args=(i,))
        if where == "after" and i == 2:
            raise Boom("replica 2 after merge_call")
        ctx.merge_call(lambda s: None)
        return out

    start = time.monotonic()
    with pytest.raises(Boom):
        run_with_deadline(strategy, fn)
    assert time.monotonic() - start < DEADLINE_S

    # No replica thread is left blocked: the strategy runs merge_calls again.
    def clean() -> Any:
        ctx = pv.get_replica_context()
        assert ctx is not None
        return ctx.merge_call(
            lambda s, i: s.reduce(pv.ReduceOp.SUM, i), args=(ctx.replica_id_in_sync_group,)
        )

    assert float(run_with_deadline(strategy, clean)) == 6.0
    alive = [
        t for t in threading.enumerate() if t.name.startswith(f"parallelvars-{id(strategy):x}")
    ]
    assert len(alive) == 4


def test_exception_in_replica_2_during_a_merge_call_releases_the_waiting_replicas() -> None:
    strategy = pv.MirroredStrategy(4)
    stopped: list[int] = []

    def fn() -> None:
        ctx = pv.get_replica_context()
        assert ctx is not None
        i = ctx.replica_id_in_sync_group
        if i == 2:
            time.sleep(0.05)  # the other three are parked in merge_call
            raise Boom("replica 2")
        try:
            ctx.merge_call(lambda s: None)
        except ReplicaError:
            stopped.append(i)
            raise

    with pytest.raises(Boom, match="replica 2"):
        run_with_deadline(strategy, fn)
    assert sorted(stopped) == [0, 1, 3]


def test_an_exception_names_its_replica() -> None:
    strategy = pv.MirroredStrategy(3)

    def fn() -> None:
        ctx = pv.get_replica_context()
        assert ctx is not None
        if ctx.replica_id_in_sync_group == 1:
            raise KeyError("k")

    with pytest.raises(KeyError) as err:
        run_with_deadline(strategy, fn)
    notes = getattr(err.value, "__notes__", None)
    if notes is not None:  # Python >= 3.11
        assert any("replica 1" in n for n in notes)


def test_strategy_threads_stop_when_the_strategy_is_dropped() -> None:
    import gc

    strategy = pv.MirroredStrategy(2)
    run_with_deadline(strategy, lambda: None)
    prefix = f"parallelvars-{id(strategy):x}"
    threads = [t for t in threading.enumerate() if t.name.startswith(prefix)]
    assert len(threads) == 2
    del strategy
    gc.collect()
    for t in threads:
        t.join(DEADLINE_S)
        assert not t.is_alive()


# ---------------------------------------------------------------------------- writes in replica context
def test_write_to_mirrored_variable_without_aggregation_takes_one_value() -> None:
    # TensorFlow 2 writes each replica's copy: equal writes keep the copies equal, once each.
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        w = pv.Variable(1.0, name="w_none")
    run_with_deadline(strategy, lambda: w.assign_add(1.0))
    assert [float(c) for c in w.components] == [2.0, 2.0]
    # Different values would leave the copies different: refused, nothing written.
    with pytest.raises(ReplicaError, match=r"w_none.*aggregation NONE.*different values"):
        run_with_deadline(
            strategy,
            lambda: w.assign(np.float32(pv.get_replica_context().replica_id_in_sync_group)),
        )
    assert [float(c) for c in w.components] == [2.0, 2.0]


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        (pv.Aggregation.MEAN, 6.0),
        (pv.Aggregation.SUM, 9.0),
        (pv.Aggregation.ONLY_FIRST_REPLICA, 6.0),
    ],
)
def test_assign_add_merges_across_replicas(aggregation: pv.Aggregation, expected: float) -> None:
    strategy = pv.MirroredStrategy(4)
    with strategy.scope():
        w = pv.Variable(5.0, name="w", aggregation=aggregation)
    run_with_deadline(strategy, lambda: w.assign_add(np.float32(1.0)))  # each replica's own
    assert [float(c) for c in w.components] == [expected] * 4


def test_sum_of_one_shared_value_is_refused() -> None:
    # One object from every replica under SUM: TensorFlow refuses to sum it (ValueError).
    strategy = pv.MirroredStrategy(4)
    with strategy.scope():
        w = pv.Variable(5.0, name="w_sum", aggregation=pv.Aggregation.SUM)
    with pytest.raises(DistributedValueError, match=r"w_sum.*same value 1\.0.*cannot be summed"):
        run_with_deadline(strategy, lambda: w.assign_add(1.0))
    assert [float(c) for c in w.components] == [5.0] * 4
    run_with_deadline(strategy, lambda: w.assign_add(0.0))  # zero from each sums to zero
    assert [float(c) for c in w.components] == [5.0] * 4


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        (pv.Aggregation.MEAN, 1.5),
        (pv.Aggregation.SUM, 6.0),
        (pv.Aggregation.ONLY_FIRST_REPLICA, 0.0),
    ],
)
def test_assign_of_different_values_merges(aggregation: pv.Aggregation, expected: float) -> None:
    strategy = pv.MirroredStrategy(4)
    with strategy.scope():
        w = pv.Variable(np.full(2, 9.0, np.float32), name="w", aggregation=aggregation)

    def fn() -> None:
        ctx = pv.get_replica_context()
        assert ctx is not None
        w.assign(np.full(2, ctx.replica_id_in_sync_group, np.float32))
        w.assign_sub(np.zeros(2, np.float32))

    run_with_deadline(strategy, fn)
    for c in w.components:
        np.testing.assert_array_equal(c, [expected, expected])


def test_on_read_variable_updates_only_the_local_component() -> None:
    strategy = pv.MirroredStrategy(3)
    with strategy.scope():
        n = pv.Variable(
            0.0,
            name="n",
            synchronization=pv.Synchronization.ON_READ,
            aggregation=pv.Aggregation.SUM,
        )

    def fn() -> None:
        ctx = pv.get_replica_context()
        assert ctx is not None
        n.assign_add(float(ctx.replica_id_in_sync_group + 1))

    run_with_deadline(strategy, fn)
    assert [float(c) for c in n.components] == [1.0, 2.0, 3.0]
    with strategy.scope():
        assert float(strategy.read_var(n)) == 6.0
