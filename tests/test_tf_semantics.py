"""TensorFlow's own test cases for the seeds' behaviours, on this project's public API.

Each test restates, in its own words and without TensorFlow, one case of a TensorFlow test file
(named in its docstring: ``<file>::<test>``) that exercises what the seeds define: contexts and
scopes, ``merge_call``, reductions, mirrored and on-read variables, creation inside replica
functions, the distributed optimizer apply and the parallel device. TensorFlow's names map onto
ours as docs/training.md's porting table says (``call_for_each_replica`` is ``run``,
``extended.update`` is ``update``, a one-device test strategy is ``OneDeviceStrategy``, two GPUs
are ``MirroredStrategy(2)``, ``experimental_local_results(v)`` are ``v.components``, variable
names carry no ``:0``). Where a documented difference remains, the test pins ours and says so.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from _strategy_support import run_with_deadline

import parallelvars as pv
from parallelvars.errors import ContextError, DistributedValueError, GradientError, ReplicaError

DL = "distribute_lib_test.py"
MS = "mirrored_strategy_test.py"
MV = "mirrored_variable_test.py"
ML = "minimize_loss_test.py"


def rid() -> int:
    ctx = pv.get_replica_context()
    assert ctx is not None
    return ctx.replica_id_in_sync_group


def _assert_default_state() -> None:
    default = pv.get_strategy()
    assert not pv.has_strategy() and repr(default) == "DefaultStrategy()"
    assert pv.get_replica_context() is not None and pv.get_cross_replica_context() is None
    assert not pv.in_cross_replica_context()


def _in_and_out_of_scope(check: Any) -> None:
    """distribute_lib_test's ``_run_in_and_out_of_scope``: ``check(strategy)`` works in the
    default context and in the strategy's scope, and fails inside another strategy's scope."""
    strategy = pv.OneDeviceStrategy()
    _assert_default_state()
    check(strategy)
    with strategy.scope():
        check(strategy)
    _assert_default_state()
    with (
        pytest.raises(ContextError, match="mixing different Strategy objects"),
        pv.OneDeviceStrategy().scope(),
    ):
        check(strategy)


# ============================================================================ distribute_lib_test
def test_call_for_each_replica_contexts() -> None:
    """distribute_lib_test.py::TestStrategyTest::testCallForEachReplica: inside a replica
    function there is a replica context, no cross-replica context, and the strategy is current;
    a variable made there keeps its synchronization and aggregation."""
    strategy = pv.OneDeviceStrategy()

    def fn() -> None:
        assert pv.get_replica_context() is not None
        assert pv.get_cross_replica_context() is None and not pv.in_cross_replica_context()
        assert pv.has_strategy() and pv.get_strategy() is strategy
        assert pv.get_replica_context().merge_call(lambda s, x: x, args=("foo",)) == "foo"
        v = pv.Variable(1.0, name="bar")
        assert (v.name, v.aggregation) == ("bar", pv.Aggregation.NONE)

    strategy.run(fn)
    with strategy.scope():
        strategy.run(fn)
    _assert_default_state()


def test_scope_contexts() -> None:
    """distribute_lib_test.py::TestStrategyTest::testScope."""
    strategy = pv.OneDeviceStrategy()
    with strategy.scope():
        assert pv.get_replica_context() is None and pv.get_cross_replica_context() is strategy
        assert pv.in_cross_replica_context() and pv.has_strategy()
        assert pv.get_strategy() is strategy
        assert pv.Variable(1.0, name="baz").name == "baz"
    _assert_default_state()


def test_setting_synchronization_and_aggregation() -> None:
    """distribute_lib_test.py::TestStrategyTest::testSettingSynchronizationAndAggregation."""
    with pv.MirroredStrategy(2).scope():
        v = pv.Variable(1.0, name="baz", synchronization="on_write", aggregation="mean")
    assert v.synchronization is pv.Synchronization.ON_WRITE
    assert v.aggregation is pv.Aggregation.MEAN


def test_same_scope_nesting() -> None:
    """distribute_lib_test.py::TestStrategyTest::testSameScopeNesting: a strategy's scope may
    be entered again inside itself; another strategy's scope inside it is refused."""
    strategy = pv.OneDeviceStrategy()
    with strategy.scope():
        with strategy.scope():
            assert pv.get_strategy() is strategy
            with strategy.scope():
                assert pv.get_strategy() is strategy
        assert pv.get_strategy() is strategy
        with (
            pytest.raises(ContextError, match="mixing different Strategy objects"),
            pv.OneDeviceStrategy().scope(),
        ):
            pass
    _assert_default_state()


def test_reduce_in_and_out_of_scope() -> None:
    """distribute_lib_test.py::TestStrategyTest::testReduce: the MEAN of a plain value is
    itself, in and out of the scope; another strategy's scope is refused."""
    _in_and_out_of_scope(lambda s: np.testing.assert_equal(s.reduce("mean", 1.0), 1.0))


@pytest.mark.parametrize("op", ["mean", "MEAN", "sum", "SUM"])
def test_reductions_accept_string_ops(op: str) -> None:
    """distribute_lib_test.py::TestStrategyTest::testReductions_acceptStringOps: reduce,
    reduce with a destination and batch_reduce take the op's name in either case."""
    s = pv.OneDeviceStrategy()
    assert float(s.reduce(op, 1.0)) == 1.0
    assert float(s.reduce(op, 1.0, "cpu:0")) == 1.0
    x, y = s.batch_reduce(op, [(1.0, "cpu:0"), (1.0, "cpu:0")])
    assert (float(x), float(y)) == (1.0, 1.0)


def test_batch_reduce_to() -> None:
    """distribute_lib_test.py::TestStrategyTest::testBatchReduceTo and testReduceTo."""

    def check(s: Any) -> None:
        x, y = s.batch_reduce(pv.ReduceOp.MEAN, [(1.0, "cpu:0"), (1.0, "cpu:0")])
        assert (float(x), float(y)) == (1.0, 1.0)
        assert float(s.reduce(pv.ReduceOp.MEAN, 1.0, destinations="cpu:0")) == 1.0

    _in_and_out_of_scope(check)


def test_update_hands_the_variable() -> None:
    """distribute_lib_test.py::TestStrategyTest::testUpdate: on a one-device strategy ``fn``
    receives the variable itself and the arguments as given."""

    def check(s: Any) -> None:
        with s.scope():
            v = pv.Variable(1.0)
        t = np.float32(2.0)
        seen: list[Any] = []
        s.update(v, lambda vv, tt: seen.append((vv, tt)), t)
        assert seen[0][0] is v and seen[0][1] is t

    _in_and_out_of_scope(check)


def test_update_non_slot_calls_once() -> None:
    """distribute_lib_test.py::TestStrategyTest::testUpdateNonSlot."""

    def check(s: Any) -> None:
        calls: list[int] = []
        s.update_non_slot(np.float32(2.0), lambda: calls.append(1))
        assert calls == [1]

    _in_and_out_of_scope(check)


def test_default_strategy_merge_call() -> None:
    """distribute_lib_test.py::DefaultDistributionStrategyTest::testMergeCall: the default
    replica context's merge_call runs ``fn`` in the default strategy's cross-replica context."""
    _assert_default_state()

    def merge_fn(dist: Any, s: str) -> str:
        assert dist is pv.get_strategy() and not pv.has_strategy()
        assert pv.get_replica_context() is None and pv.get_cross_replica_context() is dist
        assert pv.in_cross_replica_context()
        return "foo_" + s

    assert pv.get_replica_context().merge_call(merge_fn, args=("bar",)) == "foo_bar"
    _assert_default_state()


def test_default_scope_refuses_another_strategys_variables() -> None:
    """distribute_lib_test.py::DefaultDistributionStrategyTest::testScopeMostlyNoOp: inside the
    default strategy's scope another strategy's scope may be entered, but a variable made there
    is refused (mixing different strategies); outside it, it is made."""
    other = pv.MirroredStrategy(2)
    with other.scope():
        pv.Variable(1.0, name="before")
    default = pv.get_strategy()
    with default.scope():
        _assert_default_state()
        with other.scope(), pytest.raises(ContextError, match="mixing different Strategy"):
            pv.Variable(1.0, name="error")
        with default.scope():
            _assert_default_state()
            with other.scope(), pytest.raises(ContextError, match="mixing different Strategy"):
                pv.Variable(1.0, name="also_error")
        _assert_default_state()
    with other.scope():
        assert pv.Variable(1.0, name="after").kind == "mirrored"


def test_default_strategy_run_and_distributed_dataset() -> None:
    """distribute_lib_test.py::DefaultDistributionStrategyTest::testExperimentalRunV2 and
    testDistributedDatasets: the default strategy runs a step and hands out whole batches."""
    default = pv.get_strategy()
    batches = list(default.experimental_distribute_dataset(np.arange(10), batch_size=2))
    assert default.experimental_local_results(batches[0])[0].tolist() == [0, 1]
    for _ in range(2):
        assert default.run(lambda x: x, args=(batches[0],)).tolist() == [0, 1]


# ============================================================================ mirrored_strategy_test
@pytest.fixture(params=[1, 2], ids=["one_device", "two_devices"])
def strategy(request: Any) -> pv.MirroredStrategy:
    return pv.MirroredStrategy(request.param)


def _minimize_loss(d: Any) -> None:
    """strategy_test_lib's ``_test_minimize_loss_eager``: y = x @ kernel - 1, loss y^2;
    per-replica gradients, reduced to the variable with SUM, applied through update()."""
    with d.scope():
        kernel = pv.Variable(np.full((1, 1), 0.3, np.float32), name="kernel")

    def grad_fn(x: np.ndarray) -> tuple[np.ndarray, Any]:
        y = (x @ np.asarray(kernel)).reshape(()) - 1.0
        return (2.0 * y * x.T).astype(np.float32), kernel

    one = np.ones((1, 1), np.float32)
    before = after = None
    for i in range(10):
        with d.scope():
            g, v = d.run(grad_fn, args=(one,))
            fetched = d.read_var(v)
            g = d.reduce(pv.ReduceOp.SUM, g, destinations=v)
            d.update(v, lambda vv, gg: vv.assign_sub(0.2 * gg), g)
            if i == 0:
                before = fetched
            after = d.read_var(v)
    assert abs(float(after[0, 0]) - 1) < abs(float(before[0, 0]) - 1)


def test_minimize_loss(strategy: Any) -> None:
    """mirrored_strategy_test.py::Mirrored{One,Two}DeviceDistributionTest::testMinimizeLoss."""
    _minimize_loss(strategy)


def test_replica_id(strategy: Any) -> None:
    """mirrored_strategy_test.py::Mirrored{One,Two}DeviceDistributionTest::testReplicaId:
    each replica id appears once."""
    marks = [False] * strategy.num_replicas_in_sync

    def mark() -> None:
        assert not marks[rid()]
        marks[rid()] = True

    with strategy.scope():
        run_with_deadline(strategy, mark)
    assert all(marks)


def test_num_replicas_in_sync() -> None:
    """mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testNumReplicasInSync."""
    assert pv.MirroredStrategy(2).num_replicas_in_sync == 2


class _Raised(Exception):
    pass


def _raise(_: Any = None) -> None:
    raise _Raised


def _merge_raises() -> None:
    pv.get_replica_context().merge_call(_raise)


def _call_raises(dist: Any) -> None:
    dist.run(_raise)


def _merge_call_raises() -> None:
    pv.get_replica_context().merge_call(_call_raises)


def _call_merge_raises(dist: Any) -> None:
    dist.run(_merge_raises)


def _merge_call_merge_raises() -> None:
    pv.get_replica_context().merge_call(_call_merge_raises)


@pytest.mark.parametrize(
    "fn", [_raise, _merge_raises, _merge_call_raises, _merge_call_merge_raises]
)
def test_call_and_merge_exceptions(strategy: Any, fn: Any) -> None:
    """mirrored_strategy_test.py::Mirrored{One,Two}DeviceDistributionTest::
    testCallAndMergeExceptions (strategy_test_lib): an exception raised in a replica function,
    in a merge function, in a run() called from a merge function, or in a merge function of
    that run reaches the caller; the strategy works afterwards."""
    with strategy.scope():
        with pytest.raises(_Raised):
            run_with_deadline(strategy, fn)
        assert run_with_deadline(strategy, lambda: 7) == 7


def test_run_regroup_error() -> None:
    """Issue item 5. mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::
    testRunRegroupError:
    replicas returning lists of different lengths cannot be regrouped (an error, not a
    PerReplica of lists)."""
    strategy = pv.MirroredStrategy(2)
    with strategy.scope(), pytest.raises(ReplicaError, match="another structure"):
        run_with_deadline(strategy, lambda: list(range(rid())))


def test_reduce_to_cpu(strategy: Any) -> None:
    """mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testReduceToCpu."""
    with strategy.scope():
        result = run_with_deadline(strategy, rid)
        reduced = strategy.reduce(pv.ReduceOp.SUM, result)
    assert reduced == sum(range(strategy.num_replicas_in_sync))


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_reduce_axis_to_cpu(strategy: Any, dtype: Any) -> None:
    """Issue item 6. mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::
    testReduceAxisToCpu:
    replica r holds r + 1 copies of r; the SUM along axis 0 is sum(r * (r + 1)), the MEAN
    divides it by the number of elements, truly for integers too (2 / 3, not 0)."""
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        result = run_with_deadline(strategy, lambda: np.array([rid()] * (rid() + 1), dtype))
        total = strategy.reduce(pv.ReduceOp.SUM, result, axis=0)
        mean = strategy.reduce(pv.ReduceOp.MEAN, result, axis=0)
    expected = sum(x * (x + 1) for x in range(n))
    assert abs(float(total) - expected) < 1e-5
    assert abs(float(mean) - expected / sum(x + 1 for x in range(n))) < 1e-5


def test_global_step_update() -> None:
    """mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testGlobalStepUpdate
    (strategy_test_lib): an int64 ONLY_FIRST_REPLICA step counter grows once per step and every
    replica reads 1."""
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        step = pv.Variable(
            np.int64(0), name="global_step", trainable=False, aggregation="only_first_replica"
        )

        def fn() -> Any:
            step.assign_add(1)
            return step.read_value()

        values = run_with_deadline(strategy, fn)
    assert [int(v) for v in values.values] == [1, 1]


def test_run_two_devices() -> None:
    """mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testRun
    (strategy_test_lib's TwoDeviceDistributionTestBase._test_run): per-replica results feed the
    next run as positional and keyword arguments, dicts regroup element by element."""
    s = pv.MirroredStrategy(2)
    out1 = s.run(lambda: rid() + 1)
    assert s.experimental_local_results(out1) == (1, 2)
    out2 = s.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    assert out2["a"].values == (2, 4) and out2["b"].values == (1, 4)
    out3 = s.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    assert out3.values == (6, 14)


def test_run_one_device() -> None:
    """mirrored_strategy_test.py::MirroredOneDeviceDistributionTest::testRun
    (OneDeviceDistributionTestBase._test_run)."""
    s = pv.MirroredStrategy(1)
    out1 = s.run(lambda: np.float32(4.0))
    out2 = s.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    assert (float(out2["a"]), float(out2["b"])) == (8.0, 16.0)
    assert float(s.run(lambda b, a: a + 2 * b + 2, kwargs=out2)) == 42.0


@pytest.mark.parametrize(
    ("op", "expected"), [(pv.ReduceOp.SUM, (4.0, [42.0, 43.0])), ("mean", (2.0, [21.0, 21.5]))]
)
def test_all_reduce(op: Any, expected: Any) -> None:
    """mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testAllReduceSum and
    testAllReduceMean (strategy_test_lib's _test_collective_comms): every replica receives
    the reduction of a nested value."""
    s = pv.MirroredStrategy(2)
    inputs = (
        pv.PerReplica([1.0, 3.0]),
        pv.PerReplica([np.array([39.0, 2.0]), np.array([3.0, 41.0])]),
    )
    out = s.run(lambda a, b: pv.get_replica_context().all_reduce(op, (a, b)), args=inputs)
    for replica in range(2):
        assert float(out[0].values[replica]) == expected[0]
        assert out[1].values[replica].tolist() == expected[1]


@pytest.mark.parametrize(("op", "value"), [(pv.ReduceOp.SUM, 4.0), (pv.ReduceOp.MEAN, 2.0)])
def test_all_reduce_one_device(op: Any, value: float) -> None:
    """mirrored_strategy_test.py::MirroredOneDeviceDistributionTest::testAllReduceSum and
    testAllReduceMean: on one replica the all-reduce is the value."""
    s = pv.MirroredStrategy(1)
    out = s.run(
        lambda a: pv.get_replica_context().all_reduce(op, (a, np.array([42.0, 43.0]))),
        args=(value,),
    )
    assert float(out[0]) == value and out[1].tolist() == [42.0, 43.0]


def test_trainable_variables() -> None:
    """mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testTrainableVariables
    (strategy_test_lib._test_trainable_variable): ON_READ variables are not trainable unless
    asked, even without an aggregation."""
    with pv.MirroredStrategy(2).scope():
        assert pv.Variable(1.0).trainable
        assert not pv.Variable(1.0, synchronization="on_read").trainable
        assert pv.Variable(1.0, synchronization="on_read", trainable=True).trainable
        assert not pv.Variable(1.0, synchronization="on_read", trainable=False).trainable


def test_creator_stacks_are_thread_local() -> None:
    """mirrored_strategy_test.py::MirroredStrategyVariableCreatorStackTest::
    testCreatorStacksAreThreadLocal: a creator entered inside a replica function is that
    replica's only, and chains to the one entered in the scope."""
    strategy = pv.MirroredStrategy(2)

    def model_fn() -> Any:
        mine = str(rid())

        def thread_creator(next_creator: Any, **kwargs: Any) -> Any:
            return next_creator(**kwargs) + ":thread_" + mine

        with pv.variable_creator_scope(thread_creator):
            v = pv.Variable(1.0)
            pv.get_replica_context().merge_call(lambda _: _)
        return v

    def main_thread_creator(next_creator: Any, **kwargs: Any) -> str:
        return "main_thread"

    with strategy.scope(), pv.variable_creator_scope(main_thread_creator):
        result = run_with_deadline(strategy, model_fn)
        assert strategy.experimental_local_results(result) == (
            "main_thread:thread_0",
            "main_thread:thread_1",
        )


def test_name_scope_with_variable() -> None:
    """mirrored_strategy_test.py::MirroredStrategyNameScopeTest::testNameScopeWithVariable:
    variables made in the scope, in a replica function and in its merge function are mirrored,
    and a creator below the strategy sees each device's copy, ``<name>/replica_1`` for the
    second (TensorFlow's name scopes have no counterpart)."""
    strategy = pv.MirroredStrategy(2)
    names: list[str] = []

    def record(next_creator: Any, **kwargs: Any) -> Any:
        names.append(kwargs["name"])
        return next_creator(**kwargs)

    def model_fn() -> Any:
        b = pv.Variable(1.0, name="b")
        c = pv.get_replica_context().merge_call(lambda _: pv.Variable(1.0, name="c"))
        return b, c

    with pv.variable_creator_scope(record), strategy.scope():
        a = pv.Variable(1.0, name="a")
        b, c = run_with_deadline(strategy, model_fn)
    assert all(v.kind == "mirrored" for v in (a, b, c))
    assert names == ["a", "a/replica_1", "b", "b/replica_1", "c", "c/replica_1"]


def test_three_devices() -> None:
    """mirrored_strategy_test.py::MirroredThreeDeviceDistributionTest::testThreeDevices."""
    strategy = pv.MirroredStrategy(["gpu:0", "gpu:1", "cpu:0"])

    def model_fn() -> Any:
        v = pv.Variable(1.0, name="foo")
        pv.get_replica_context().merge_call(lambda _: _)
        return v

    with strategy.scope():
        result = run_with_deadline(strategy, model_fn)
    assert result.kind == "mirrored" and result.name == "foo" and len(result.components) == 3


def _mirrored(aggregation: str = "none", value: float = 1.0) -> tuple[Any, Any]:
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        var = run_with_deadline(
            strategy, lambda: pv.Variable(value, name="foo", aggregation=aggregation)
        )
    assert var.kind == "mirrored"
    return strategy, var


def test_assign_mirrored_var_replica_context_without_aggregation_type() -> None:
    """Issue item 3 (current TensorFlow 2). mirrored_strategy_test.py::
    MirroredVariableUpdateTest::testAssignMirroredVarReplicaContextWithoutAggregationType: every replica assigning 5.0."""
    strategy, var = _mirrored()
    with strategy.scope():
        run_with_deadline(strategy, lambda: var.assign(5.0))
    assert float(var) == 5.0 and [float(c) for c in var.components] == [5.0, 5.0]


def test_assign_mirrored_var_replica_context_with_sum() -> None:
    """Issue item 3. mirrored_strategy_test.py::MirroredVariableUpdateTest::
    testAssignMirroredVarReplicaContextWithSum: one value from every replica cannot be
    reduced with SUM (a ValueError)."""
    strategy, var = _mirrored("sum")
    with strategy.scope(), pytest.raises(ValueError, match="cannot be summed"):
        run_with_deadline(strategy, lambda: var.assign(5.0))
    assert [float(c) for c in var.components] == [1.0, 1.0]


def test_assign_mirrored_var_cross_device_context() -> None:
    """mirrored_strategy_test.py::MirroredVariableUpdateTest::
    testAssignMirroredVarCrossDeviceContext."""
    strategy, var = _mirrored()
    with strategy.scope():
        assert float(var) == 1.0
        assert float(var.assign(6.0)) == 6.0


def test_assign_mirrored_var_replica_context() -> None:
    """mirrored_strategy_test.py::MirroredVariableUpdateTest::
    testAssignMirroredVarReplicaContext: MEAN of the replicas' ids."""
    strategy, var = _mirrored("mean")
    with strategy.scope():
        run_with_deadline(strategy, lambda: var.assign(np.float32(rid())))
    assert float(var) == 0.5


@pytest.mark.parametrize(
    ("method", "start", "delta", "expected"),
    [
        ("assign", 1.0, 5.0, 5.0),
        ("assign_add", 1.0, 5.0, 6.0),
        ("assign_sub", 5.0, 1.0, 4.0),
    ],
)
def test_write_mirrored_var_replica_context_with_single_value(
    method: str, start: float, delta: float, expected: float
) -> None:
    """mirrored_strategy_test.py::MirroredVariableUpdateTest::
    testAssign{,Add,Sub}MirroredVarReplicaContextWithSingleValue: MEAN of one shared value."""
    strategy, var = _mirrored("mean", start)
    with strategy.scope():
        run_with_deadline(strategy, lambda: getattr(var, method)(delta))
    assert float(var) == expected


@pytest.mark.parametrize(
    ("method", "start", "expected"), [("assign_add", 1.0, 1.5), ("assign_sub", 5.0, 4.5)]
)
def test_write_mirrored_var_replica_context(method: str, start: float, expected: float) -> None:
    """mirrored_strategy_test.py::MirroredVariableUpdateTest::
    testAssignAddMirroredVarReplicaContext and testAssignSubMirroredVarReplicaContext."""
    strategy, var = _mirrored("mean", start)
    with strategy.scope():
        run_with_deadline(strategy, lambda: getattr(var, method)(np.float32(rid())))
    assert float(var) == expected


def test_assign_add_mirrored_var_cross_device_context() -> None:
    """mirrored_strategy_test.py::MirroredVariableUpdateTest::
    testAssignAddMirroredVarCrossDeviceContext: read_value=True gives the new value,
    read_value=False nothing; every component follows, on the strategy's devices."""
    strategy, var = _mirrored()
    with strategy.scope():
        assert float(var.assign_add(6.0, read_value=True)) == 7.0
        assert [float(c) for c in strategy.experimental_local_results(var)] == [7.0, 7.0]
        assert var.assign_add(2.0, read_value=False) is None
        assert [float(c) for c in strategy.experimental_local_results(var)] == [9.0, 9.0]
        assert var.devices == strategy.worker_devices


def test_assign_sub_mirrored_var_cross_device_context() -> None:
    """mirrored_strategy_test.py::MirroredVariableUpdateTest::
    testAssignSubMirroredVarCrossDeviceContext."""
    strategy, var = _mirrored(value=5.0)
    with strategy.scope():
        assert float(var.assign_sub(2.0, use_locking=True, name="sub")) == 3.0
        assert [float(c) for c in var.components] == [3.0, 3.0]


@pytest.mark.parametrize(
    ("aggregation", "first", "expected"), [("sum", 2.0, 6.0), ("mean", 1.0, 6.0)]
)
def test_assign_replica_local_var(aggregation: str, first: float, expected: float) -> None:
    """mirrored_strategy_test.py::SyncOnReadVariableAssignTest::
    testAssignReplicaLocalVar{Sum,Mean}Aggregation: every replica holds the initial value 1.0
    (a SUM reads 2.0); a cross-replica assign of 6.0 reads back 6.0."""
    strategy = pv.MirroredStrategy(2)

    def model_fn() -> Any:
        return pv.Variable(1.0, synchronization="on_read", aggregation=aggregation)

    with strategy.scope():
        v = run_with_deadline(strategy, model_fn)
        assert v.kind == "on_read"
        assert float(strategy.read_var(v)) == first
        v.assign(6.0)
        assert float(strategy.read_var(v)) == expected


class _MockModel:
    def __init__(self, two_variables: bool = False) -> None:
        self.variables = [pv.Variable(1.25, name="dummy_var1")]
        if two_variables:
            self.variables.append(pv.Variable(2.0, name="dummy_var2"))

    def __call__(self, factor: Any = 2) -> Any:
        x = factor * self.variables[0]
        if len(self.variables) > 1:
            x += self.variables[1]
        return x


@pytest.mark.parametrize(
    ("two", "args", "expected"),
    [
        (False, (), [2.5, 2.5]),
        (True, (), [4.5, 4.5]),
        (False, (pv.PerReplica([5.0, 3.0]),), [6.25, 3.75]),
    ],
    ids=["variable", "two_variables", "per_replica_factor"],
)
def test_model_reads_variables_in_replica_functions(two: bool, args: Any, expected: Any) -> None:
    """mirrored_strategy_test.py::MirroredStrategyDefunTest::testVariableInDefun,
    testTwoVariablesInNestedDefun (without the +1 of its outer function) and
    testPassPerReplica: each replica computes with its own copy of the variables."""
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        model = _MockModel(two)
        result = run_with_deadline(strategy, lambda *a: model(*a), args=args)
    assert [float(r) for r in strategy.experimental_local_results(result)] == expected


# ============================================================================ mirrored_variable_test
def _check_mirrored(var: Any, name: str, strategy: Any) -> None:
    assert var.kind == "mirrored" and var.name == name
    assert var.distribute_strategy is strategy
    assert var.devices == strategy.worker_devices


def test_single_variable() -> None:
    """mirrored_variable_test.py::MirroredVariableCreationTest::testSingleVariable (and
    testVariableInFuncGraph without the graph): one variable for every replica."""
    strategy = pv.MirroredStrategy(2)

    def model_fn() -> Any:
        v = pv.Variable(1.0, name="foo")
        pv.get_replica_context().merge_call(lambda _: _)
        return v

    with strategy.scope():
        outside = pv.Variable(1.0, name="bar")
        result = run_with_deadline(strategy, model_fn)
    _check_mirrored(result, "foo", strategy)
    _check_mirrored(outside, "bar", strategy)


def test_unnamed_variable() -> None:
    """mirrored_variable_test.py::MirroredVariableCreationTest::testUnnamedVariable."""
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        result = run_with_deadline(strategy, lambda: pv.Variable(1.0))
    assert result.kind == "mirrored" and result.name.startswith("Variable")


def test_variable_with_initial_value_made_in_replica_function() -> None:
    """mirrored_variable_test.py::MirroredVariableCreationTest::
    testVariableWithTensorInitialValueInFunction: made once, on the first step."""
    strategy = pv.MirroredStrategy(2)
    made: list[Any] = [None]

    def model_fn() -> Any:
        if made[0] is None:
            made[0] = pv.Variable(np.zeros([], np.float32))
        pv.get_replica_context().merge_call(lambda _: _)
        return made[0]

    with strategy.scope():
        out = run_with_deadline(strategy, model_fn)
    assert [float(c) for c in strategy.experimental_local_results(out)] == [0.0, 0.0]


def test_multiple_variables() -> None:
    """mirrored_variable_test.py::MirroredVariableCreationTest::testMultipleVariables."""
    strategy = pv.MirroredStrategy(2)

    def model_fn() -> Any:
        vs = [pv.Variable(1.0, name=f"foo{i}") for i in range(5)]
        pv.get_replica_context().merge_call(lambda _: _)
        return vs

    with strategy.scope():
        result = run_with_deadline(strategy, model_fn)
    for i, v in enumerate(result):
        _check_mirrored(v, f"foo{i}", strategy)


def test_multiple_variables_with_same_canonical_name() -> None:
    """mirrored_variable_test.py::MirroredVariableCreationTest::
    testMultipleVariablesWithSameCanonicalName."""
    strategy = pv.MirroredStrategy(2)
    names = ["foo/bar", "foo_1/bar", "foo_1/bar_1", "foo/bar_1"]

    def model_fn() -> Any:
        vs = [pv.Variable(1.0, name=n) for n in names]
        pv.get_replica_context().merge_call(lambda _: _)
        return vs

    with strategy.scope():
        result = run_with_deadline(strategy, model_fn)
    assert [v.name for v in result] == names and all(v.kind == "mirrored" for v in result)


def test_variable_with_same_canonical_name_across_threads() -> None:
    """mirrored_variable_test.py::MirroredVariableCreationTest::
    testVariableWithSameCanonicalNameAcrossThreads: ``foo_0`` and ``foo_1`` are one variable,
    named by the first replica."""
    strategy = pv.MirroredStrategy(2)

    def model_fn() -> Any:
        v = pv.Variable(1.0, name=f"foo_{rid()}")
        pv.get_replica_context().merge_call(lambda _: _)
        return v

    with strategy.scope():
        result = run_with_deadline(strategy, model_fn)
    assert result.kind == "mirrored" and result.name == "foo_0"


def test_with_variable_and_variable_scope() -> None:
    """mirrored_variable_test.py::MirroredVariableCreationTest::testWithVariableAndVariableScope
    (variable scopes have no counterpart): kinds and aggregations of variables made in a
    replica function, ``aggregation=None`` meaning NONE."""
    strategy = pv.MirroredStrategy(2)

    def model_fn() -> Any:
        v0 = pv.Variable(1.0, name="var0", aggregation=None)
        v1 = pv.Variable(1.0, name="common/var1")
        pv.get_replica_context().merge_call(lambda _: _)
        v2 = pv.Variable(1.0, name="common/var2", synchronization="on_read", aggregation="sum")
        v3 = pv.Variable(1.0, name="common/var3", synchronization="on_write", aggregation="mean")
        return v0, v1, v2, v3

    with strategy.scope():
        assert pv.Variable(1.0, name="var-main0").name == "var-main0"
        v0, v1, v2, v3 = run_with_deadline(strategy, model_fn)
    assert (v0.kind, v0.name, v0.aggregation) == ("mirrored", "var0", pv.Aggregation.NONE)
    assert (v1.kind, v1.name) == ("mirrored", "common/var1")
    assert (v2.kind, v2.name, v2.aggregation) == ("on_read", "common/var2", pv.Aggregation.SUM)
    assert (v3.kind, v3.name, v3.aggregation) == ("mirrored", "common/var3", pv.Aggregation.MEAN)


def test_only_first_replica_updates_variables() -> None:
    """mirrored_variable_test.py::MirroredVariableCreationTest::
    testOnlyFirstReplicaUpdatesVariables: an ON_READ variable's replicas write their own parts
    (read_var gives the first); an ON_WRITE one takes the first replica's write everywhere."""
    strategy = pv.MirroredStrategy(2)

    def create() -> Any:
        agg = "only_first_replica"
        v0 = pv.Variable(2.0, name="on_read", synchronization="on_read", aggregation=agg)
        v1 = pv.Variable(3.0, name="on_write", synchronization="on_write", aggregation=agg)
        return v0, v1

    with strategy.scope():
        v0, v1 = run_with_deadline(strategy, create)
        assert [float(c) for c in v0.components] == [2.0, 2.0] and float(
            strategy.read_var(v0)
        ) == 2.0
        assert [float(c) for c in v1.components] == [3.0, 3.0] and float(
            strategy.read_var(v1)
        ) == 3.0

        def update() -> None:
            v0.assign_add(5.0 * (rid() + 1))
            v1.assign_add(7.0 * (rid() + 1))

        run_with_deadline(strategy, update)
        assert [float(c) for c in v0.components] == [7.0, 12.0]
        assert float(strategy.read_var(v0)) == 7.0
        assert [float(c) for c in v1.components] == [10.0, 10.0]
        assert float(strategy.read_var(v1)) == 10.0


@pytest.mark.parametrize(
    "kwargs",
    [{"synchronization": "none"}, {"synchronization": "Invalid"}, {"aggregation": "invalid"}],
    ids=["none_synchronization", "invalid_synchronization", "invalid_aggregation"],
)
def test_invalid_synchronization_and_aggregation(kwargs: dict[str, str]) -> None:
    """mirrored_variable_test.py::MirroredVariableCreationTest::
    testNoneSynchronizationWithVariable, testInvalidSynchronizationWithVariable and
    testInvalidAggregationWithVariable: a ValueError naming the variable."""
    with pv.MirroredStrategy(2).scope(), pytest.raises(ValueError, match=r"variable 'v'.*invalid"):
        pv.Variable(1.0, name="v", **kwargs)


def test_non_matching_variable_creation() -> None:
    """Issue item 4. mirrored_variable_test.py::MirroredVariableCreationTest::
    testNonMatchingVariableCreation:
    replicas creating variables of different names raise a RuntimeError."""
    strategy = pv.MirroredStrategy(2)

    def model_fn(name: str) -> Any:
        v = pv.Variable(1.0, name=name)
        pv.get_replica_context().merge_call(lambda _: _)
        return v

    with strategy.scope(), pytest.raises(RuntimeError, match=r"'foo'.*'bar'.*differ in name"):
        run_with_deadline(strategy, model_fn, args=(pv.PerReplica(["foo", "bar"]),))


def test_sync_on_read_variable() -> None:
    """mirrored_variable_test.py::MirroredVariableCreationTest::testSyncOnReadVariable: SUM
    parts start at 1.0 each, replica r adds 2 + r; MEAN parts are assigned 6 r; each replica
    reads its own part, the reads outside give the SUM and the MEAN."""
    strategy = pv.MirroredStrategy(2)
    seen: dict[int, Any] = {}

    def model_fn() -> Any:
        v_sum = pv.Variable(1.0, synchronization="on_read", aggregation="sum")
        v_mean = pv.Variable(4.0, synchronization="on_read", aggregation="mean")
        v_sum.assign_add(2.0 + rid())
        v_mean.assign(6.0 * rid())
        seen[rid()] = (v_sum, v_mean, float(v_sum.get()), float(v_mean.get()))
        return v_sum, v_mean

    with strategy.scope():
        v_sum, v_mean = run_with_deadline(strategy, model_fn)
    assert seen[0][0] is seen[1][0] is v_sum and seen[0][1] is seen[1][1] is v_mean
    assert [seen[i][2] for i in range(2)] == [3.0, 4.0]
    assert [seen[i][3] for i in range(2)] == [0.0, 6.0]
    with strategy.scope():
        assert float(strategy.read_var(v_sum)) == 7.0 and float(v_sum) == 7.0
        assert float(strategy.read_var(v_mean)) == 3.0 and float(v_mean.read_value()) == 3.0


def test_sync_on_read_variable_update() -> None:
    """mirrored_variable_test.py::MirroredVariableCreationTest::testSyncOnReadVariableUpdate:
    update() assigns 5.0 to each part; the SUM reads 10.0."""
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        v = run_with_deadline(
            strategy, lambda: pv.Variable(1.0, synchronization="on_read", aggregation="sum")
        )
        assert float(v.components[0]) == 1.0 and float(v) == 2.0
        strategy.update(v, lambda var, value: var.assign(value), 5.0)
        assert float(v.components[0]) == 5.0 and float(v) == 10.0


def test_var_distribute_strategy() -> None:
    """mirrored_variable_test.py::MirroredVariableCreationTest::testVarDistributeStrategy."""
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        mirrored = pv.Variable(1.0)
        sync_on_read = pv.Variable(1.0, synchronization="on_read")
    assert mirrored.distribute_strategy is strategy
    assert sync_on_read.distribute_strategy is strategy


# ============================================================================ minimize_loss_test
OPTIMIZERS = {  # strategy_combinations' optimizers_v1
    "GradientDescent": lambda: pv.optimizers.SGD(0.001),
    "Adagrad": lambda: pv.optimizers.Adagrad(0.001),
    "Adam": lambda: pv.optimizers.Adam(0.001, epsilon=1.0),
    "RMSProp": lambda: pv.optimizers.RMSProp(0.001),
}


def _dense_example(optimizer: Any) -> tuple[Any, Any, Any]:
    """single_loss_example.minimize_loss_example: a Dense(1) layer with bias, input [[1.]],
    loss (x @ kernel + bias - 1)^2 as a per-replica mean (gradients scaled by the replicas)."""
    kernel = pv.Variable(np.zeros((1, 1), np.float32), name="dense/kernel", trainable=True)
    bias = pv.Variable(np.zeros(1, np.float32), name="dense/bias", trainable=True)

    def model_fn(x: np.ndarray) -> None:
        def grads() -> list[np.ndarray]:
            y = (x @ np.asarray(kernel) + np.asarray(bias) - 1.0).astype(np.float32)
            return [(2.0 * x.T @ y).astype(np.float32), (2.0 * y.sum(axis=0)).astype(np.float32)]

        optimizer.apply_gradients(optimizer.compute_gradients(grads, [kernel, bias]))

    return model_fn, kernel, bias


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_train_network(strategy: Any, name: str) -> None:
    """minimize_loss_test.py::MinimizeLossStepTest::testTrainNetwork and
    testTrainNetworkByCallForEachReplica: the error of kernel + bias - 1 does not grow."""
    with strategy.scope():
        optimizer = OPTIMIZERS[name]()
        model_fn, kernel, bias = _dense_example(optimizer)
    errors = []
    x = np.ones((1, 1), np.float32)
    for _ in range(10):
        run_with_deadline(strategy, model_fn, args=(x,))
        errors.append(abs(float(np.squeeze(kernel)) + float(np.squeeze(bias)) - 1))
    assert all(b <= a for a, b in itertools.pairwise(errors)), errors
    assert all(np.array_equal(c, kernel.components[0]) for c in kernel.components)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_inside_model_fn(name: str) -> None:
    """minimize_loss_test.py::MinimizeLossStepTest::testOptimizerInsideModelFn: a creator
    entered before the scope sees every variable once per device (``<name>/replica_1``).
    Documented difference (docs/training.md, "what creator scopes see of an optimizer"):
    TensorFlow 1.x's creators also see the slots (``dense/kernel/Adagrad``...), which ours
    place in the optimizer's own buffers without a creator call, and ours see ``iterations``
    (TensorFlow 2's step counter), which TensorFlow 1.x's optimizers do not have."""
    strategy = pv.MirroredStrategy(2)
    created: list[str] = []
    trainable: list[str] = []

    def appending_creator(next_creator: Any, **kwargs: Any) -> Any:
        v = next_creator(**kwargs)
        created.append(kwargs["name"])
        if kwargs.get("trainable"):
            trainable.append(kwargs["name"])
        return v

    with pv.variable_creator_scope(appending_creator), strategy.scope():
        optimizer = OPTIMIZERS[name]()
        model_fn, kernel, _ = _dense_example(optimizer)
        run_with_deadline(strategy, model_fn, args=(np.ones((1, 1), np.float32),))
    model = {"dense/kernel", "dense/bias"}
    non_slot = {v.name for v in optimizer.non_slot_variables}
    assert f"{optimizer.name}/iterations" in non_slot
    expected = model | non_slot
    expected |= {f"{v}/replica_1" for v in expected}
    assert sorted(created) == sorted(expected)
    assert set(trainable) == {
        "dense/kernel",
        "dense/bias",
        "dense/kernel/replica_1",
        "dense/bias/replica_1",
    }
    for slot in optimizer.get_slot_names():  # the slots exist, mirrored like their variable
        assert optimizer.get_slot(kernel, slot).devices == kernel.devices


def test_train_network_with_batch_norm_moving_mean() -> None:
    """minimize_loss_test.py::MinimizeLossStepTest::testTrainNetworkWithBatchNorm: a moving
    mean written from every replica with its own batch mean (aggregation MEAN) follows the
    mean over all replicas."""
    n, momentum = 2, 0.9
    strategy = pv.MirroredStrategy(n)
    with strategy.scope():
        moving_mean = pv.Variable(np.zeros(8, np.float32), name="moving_mean", aggregation="mean")

    def step() -> None:
        batch = (np.arange(16 * 8).reshape(16, 8) % 8 + 8 * (np.arange(16)[:, None])).astype(
            np.float32
        ) + 100.0 * rid()
        delta = (np.asarray(moving_mean) - batch.mean(axis=0)) * (1.0 - momentum)
        moving_mean.assign_sub(delta.astype(np.float32))

    expected = np.zeros(8)
    for _ in range(10):
        run_with_deadline(strategy, step)
        averaged = 60.0 + np.arange(8) + (n - 1) / 2.0 * 100.0
        expected -= (expected - averaged) * (1.0 - momentum)
        np.testing.assert_allclose(moving_mean.read_value(), expected, atol=1e-3)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_mean_vs_sum(strategy: Any, reduction: str) -> None:
    """minimize_loss_test.py::MinimizeLossStepTest::testMeanVsSum: every replica sees the batch
    x = [2, 7], y = [6, 21], w = 2, lr 0.001; a SUM loss moves w by 0.106 per replica, a mean
    loss (scaled over the replicas) by 0.053 in all."""
    with strategy.scope():
        w = pv.Variable(np.array([[2.0]], np.float32), name="w")
        optimizer = pv.optimizers.SGD(0.001)
    x = np.array([[2.0], [7.0]], np.float32)
    y = np.array([[6.0], [21.0]], np.float32)

    def model_fn() -> None:
        def grads() -> list[np.ndarray]:
            residual = x @ np.asarray(w) - y
            g = 2.0 * x.T @ residual
            return [g if reduction == "sum" else g / len(x)]

        optimizer.apply_gradients(optimizer.compute_gradients(grads, [w]))

    with pv.loss_reduction(reduction):
        run_with_deadline(strategy, model_fn)
    moved = 0.106 * strategy.num_replicas_in_sync if reduction == "sum" else 0.053
    assert abs(float(np.squeeze(w)) - (2 + moved)) < 1e-4


# ============================================================================ optimizer_test (v1)
DTYPES = [np.float16, np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sgd_basic(dtype: Any) -> None:
    """optimizer_test.py::OptimizerTest::testBasic (and testAggregationMethod): one step of
    SGD(3.0) on 5 * var0 + 3 * var1, the global step incremented."""
    var0 = pv.Variable(np.array([1.0, 2.0], dtype), name="a")
    var1 = pv.Variable(np.array([3.0, 4.0], dtype), name="b")
    global_step = pv.Variable(np.int64(0), name="global_step", trainable=False)
    sgd = pv.optimizers.SGD(3.0)
    sgd.apply_gradients(
        [(np.full(2, 5.0, dtype), var0), (np.full(2, 3.0, dtype), var1)], global_step
    )
    assert var0.tolist() == [-14.0, -13.0] and var1.tolist() == [-6.0, -5.0]
    assert int(global_step) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_gradients(dtype: Any) -> None:
    """optimizer_test.py::OptimizerTest::testNoGradients and
    testNoGradientsForAnyVariables_ApplyGradients: a ValueError, nothing changed."""
    var0 = pv.Variable(np.array([1.0, 2.0], dtype))
    var1 = pv.Variable(np.array([3.0, 4.0], dtype))
    sgd = pv.optimizers.SGD(3.0)
    with pytest.raises(ValueError, match="no gradients provided for any variable"):
        sgd.apply_gradients([(None, var1)])
    with pytest.raises(ValueError, match="no gradients provided for any variable"):
        sgd.apply_gradients([(None, var0), (None, var1)])
    assert var0.tolist() == [1.0, 2.0] and var1.tolist() == [3.0, 4.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_as_variables(dtype: Any) -> None:
    """optimizer_test.py::OptimizerTest::testGradientsAsVariables."""
    var0 = pv.Variable(np.array([1.0, 2.0], dtype))
    var1 = pv.Variable(np.array([3.0, 4.0], dtype))
    grads = [pv.Variable(np.zeros(2, dtype)) for _ in range(2)]
    grads[0].assign(np.full(2, 5.0, dtype))
    grads[1].assign(np.full(2, 3.0, dtype))
    pv.optimizers.SGD(3.0).apply_gradients(list(zip(grads, [var0, var1], strict=True)))
    assert var0.tolist() == [-14.0, -13.0] and var1.tolist() == [-6.0, -5.0]


def test_apply_gradients_to_a_non_variable() -> None:
    """optimizer_test.py::OptimizerTest::testComputeGradientsWithTensors: compute_gradients
    pairs a gradient with what it was given; applying it to a plain array is refused."""
    x = np.float32(1.0)
    sgd = pv.optimizers.SGD(3.0)
    [(grad, same)] = sgd.compute_gradients(lambda: [2.0 * x], [x])
    assert same is x and float(grad) == 2.0
    with pytest.raises(GradientError, match=r"variables made by pv\.Variable"):
        sgd.apply_gradients([(grad, x)])


# ============================================================================ adam_test (v1)
def _adam_numpy(param: Any, g: Any, t: int, m: Any, v: Any) -> tuple[Any, Any, Any]:
    alpha_t = 0.001 * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
    m = 0.9 * m + 0.1 * g
    v = 0.999 * v + 0.001 * g * g
    return param - alpha_t * m / (np.sqrt(v) + 1e-8), m, v


def _close(got: Any, want: Any, dtype: Any) -> None:
    tol = 1e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "learning_rate", [0.001, lambda: 0.001, np.float32(0.001)], ids=["float", "callable", "tensor"]
)
def test_adam_basic(dtype: Any, learning_rate: Any) -> None:
    """adam_test.py::AdamOptimizerTest::testBasic, testResourceBasic, testBasicCallableParams
    and testTensorLearningRate: three steps against numpy's Adam; after step t the beta powers
    are 0.9^(t+1) and 0.999^(t+1), and they are among the optimizer's variables."""
    var0_np, var1_np = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    g0, g1 = np.array([0.1, 0.1], dtype), np.array([0.01, 0.01], dtype)
    var0 = pv.Variable(var0_np.astype(dtype), name="var0")
    var1 = pv.Variable(var1_np.astype(dtype), name="var1")
    opt = pv.optimizers.Adam(learning_rate=learning_rate)
    m0 = v0 = m1 = v1 = 0.0
    for t in range(1, 4):
        opt.apply_gradients(zip([g0, g1], [var0, var1], strict=True))
        assert any(b is opt.beta1_power for b in opt.variables)
        assert any(b is opt.beta2_power for b in opt.variables)
        _close(opt.beta1_power, 0.9 ** (t + 1), dtype)
        _close(opt.beta2_power, 0.999 ** (t + 1), dtype)
        var0_np, m0, v0 = _adam_numpy(var0_np, g0.astype(np.float64), t, m0, v0)
        var1_np, m1, v1 = _adam_numpy(var1_np, g1.astype(np.float64), t, m1, v1)
        _close(var0, var0_np, dtype)
        _close(var1, var1_np, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_sharing(dtype: Any) -> None:
    """adam_test.py::AdamOptimizerTest::testSharing: two update ops of one optimizer share its
    state; alternating them is three steps of one Adam."""
    var0_np, var1_np = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    g0, g1 = np.array([0.1, 0.1], dtype), np.array([0.01, 0.01], dtype)
    var0, var1 = pv.Variable(var0_np.astype(dtype)), pv.Variable(var1_np.astype(dtype))
    opt = pv.optimizers.Adam()
    update1 = lambda: opt.apply_gradients([(g0, var0), (g1, var1)])  # noqa: E731
    update2 = lambda: opt.apply_gradients(zip([g0, g1], [var0, var1], strict=True))  # noqa: E731
    m0 = v0 = m1 = v1 = 0.0
    for t in range(1, 4):
        _close(opt.beta1_power if t > 1 else 0.9, 0.9**t, dtype)
        (update1 if t % 2 == 0 else update2)()
        var0_np, m0, v0 = _adam_numpy(var0_np, g0.astype(np.float64), t, m0, v0)
        var1_np, m1, v1 = _adam_numpy(var1_np, g1.astype(np.float64), t, m1, v1)
        _close(var0, var0_np, dtype)
        _close(var1, var1_np, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_sparse(dtype: Any) -> None:
    """adam_test.py::AdamOptimizerTest::testSparse and testResourceSparse: sparse gradients
    covering every row follow numpy's dense Adam."""
    var0_np, var1_np = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    g0, g1 = np.array([0.1, 0.1], dtype), np.array([0.01, 0.01], dtype)
    var0, var1 = pv.Variable(var0_np.astype(dtype)), pv.Variable(var1_np.astype(dtype))
    idx = np.array([0, 1], np.int32)
    grads = [pv.IndexedSlices(g0, idx, (2,)), pv.IndexedSlices(g1, idx, (2,))]
    opt = pv.optimizers.Adam()
    m0 = v0 = m1 = v1 = 0.0
    for t in range(1, 4):
        opt.apply_gradients(zip(grads, [var0, var1], strict=True))
        var0_np, m0, v0 = _adam_numpy(var0_np, g0.astype(np.float64), t, m0, v0)
        var1_np, m1, v1 = _adam_numpy(var1_np, g1.astype(np.float64), t, m1, v1)
        _close(var0, var0_np, dtype)
        _close(var1, var1_np, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_sparse_repeated_indices(dtype: Any) -> None:
    """adam_test.py::AdamOptimizerTest::testSparseRepeatedIndices: a repeated index counts as
    the sum of its rows."""
    repeated = pv.Variable(np.array([[1.0], [2.0]], dtype))
    aggregated = pv.Variable(np.array([[1.0], [2.0]], dtype))
    g_rep = pv.IndexedSlices(np.array([[0.1], [0.1]], dtype), np.array([1, 1]), (2, 1))
    g_agg = pv.IndexedSlices(np.array([[0.2]], dtype), np.array([1]), (2, 1))
    opt_rep, opt_agg = pv.optimizers.Adam(), pv.optimizers.Adam()
    for _ in range(3):
        # In float16 an epsilon of 1e-8 is 0: the untouched row computes 0 / 0, in
        # TensorFlow too (its assertAllClose takes NaN as equal to NaN).
        with np.errstate(invalid="ignore"):
            opt_rep.apply_gradients([(g_rep, repeated)])
            opt_agg.apply_gradients([(g_agg, aggregated)])
        np.testing.assert_allclose(
            np.asarray(repeated), np.asarray(aggregated), rtol=1e-3, equal_nan=True
        )


def test_adam_slots_unique() -> None:
    """adam_test.py::AdamOptimizerTest::testSlotsUniqueEager: two slots per variable and the
    beta powers are distinct variables. Documented difference (docs/training.md): TensorFlow
    1.x's Adam holds 6 for two variables, ours 7 (also ``iterations``, as TensorFlow 2's)."""
    v1, v2 = pv.Variable(1.0), pv.Variable(1.0)
    opt = pv.optimizers.Adam(1.0)
    opt.apply_gradients([(np.float32(1.0), v1), (np.float32(1.0), v2)])
    unique = {id(v) for v in opt.variables}
    assert len(unique) == 7
    assert {id(v) for v in opt.variables if v is not opt.iterations} == {
        id(opt.beta1_power),
        id(opt.beta2_power),
        *(id(opt.get_slot(v, s)) for v in (v1, v2) for s in ("m", "v")),
    }


# ============================================================================ parallel_device_test
@pytest.fixture
def device() -> pv.ParallelDevice:
    return pv.ParallelDevice(["cpu:0", "cpu:1"])


def test_register_parallel_device(device: pv.ParallelDevice) -> None:
    """parallel_device_test.py::ParallelDeviceTests::test_register_parallel_device: an op on
    a parallel value runs on every component."""
    c = device.pack([np.float32(1.0)] * 2)
    outputs = device.unpack(c + np.float32(2.0))
    assert [float(o) for o in outputs] == [3.0, 3.0]


def test_device_id(device: pv.ParallelDevice) -> None:
    """parallel_device_test.py::ParallelDeviceTests::test_device_id."""
    assert [int(i) for i in device.unpack(device.device_ids)] == [0, 1]


def test_collective_reduce(device: pv.ParallelDevice) -> None:
    """parallel_device_test.py::ParallelDeviceTests::test_collective_reduce: a sum across the
    components gives every component the total."""
    x = device.pack([np.float32(-1.5), np.float32(3.5)])
    strategy = pv.MirroredStrategy(device)
    reduced = strategy.run(lambda v: pv.get_replica_context().all_reduce("sum", v), args=(x,))
    assert [float(o) for o in device.unpack(reduced)] == [2.0, 2.0]


def test_checkpointing(device: pv.ParallelDevice, tmp_path: Any) -> None:
    """parallel_device_test.py::ParallelDeviceTests::test_checkpointing (skipped in TensorFlow;
    the seed's parallel_device_saving): a variable with a value per device saves every
    component and restores them."""
    v = device.pack([np.float32(-1.0), np.float32(3.0)], name="v")
    checkpoint = pv.Checkpoint(v=v)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    v.assign(np.float32(0.0))
    assert [float(o) for o in device.unpack(v)] == [0.0, 0.0]
    checkpoint.restore(path).assert_consumed()
    assert [float(o) for o in device.unpack(v)] == [-1.0, 3.0]


class _Dense(pv.Module):
    """parallel_device_test's _Dense, its variables made on first call (one buffer per device)."""

    def __init__(self, device: pv.ParallelDevice, output_size: int) -> None:
        self.device = device
        self.output_size = output_size
        self.kernel: Any = None
        self.bias: Any = None

    def __call__(self, x: Any) -> Any:
        if self.kernel is None:
            with pv.independent_buffers(self.device):
                self.kernel = pv.Variable(np.ones((self.output_size, 1), np.float32), name="k")
                self.bias = pv.Variable(np.ones(self.output_size, np.float32), name="b")
        return x @ self.kernel.T + self.bias


def test_layer_forward(device: pv.ParallelDevice) -> None:
    """parallel_device_test.py::LayerTests::test_layer_forward: the layer runs on every
    component; different inputs per device give different outputs."""
    layer = _Dense(device, 5)
    outputs = device.unpack(layer(np.array([[2.0]], np.float32)))
    assert [o.tolist() for o in outputs] == [[[3.0] * 5]] * 2
    x = device.pack([np.array([[-0.5]], np.float32), np.array([[0.5]], np.float32)])
    outputs = device.unpack(layer(x))
    assert np.max(np.abs(outputs[0] - outputs[1])) > 1e-5


def _layer_gradients(layer: _Dense, x: Any) -> list[Any]:
    """d/dparams of sum((layer(x) - range(5))^2) on every component (a parallel value each)."""
    y = layer(x)
    d = 2.0 * (y - np.arange(5.0, dtype=np.float32))  # (1, 5) per component
    return [d.T @ x, d.sum(axis=0)]


@pytest.mark.parametrize("reduced", [True, False], ids=["sync", "divergent_buffers"])
def test_layer_training(device: pv.ParallelDevice, reduced: bool) -> None:
    """parallel_device_test.py::LayerTests::test_layer_sync_training and
    test_layer_divergent_buffer_training: with gradients summed across the components the
    copies stay equal; with each component's own gradients they diverge."""
    layer = _Dense(device, 5)
    x = device.pack([np.array([[-0.5]], np.float32), np.array([[0.5]], np.float32)])
    grads = _layer_gradients(layer, x)
    if reduced:
        strategy = pv.MirroredStrategy(device)
        grads = [
            strategy.run(lambda g: pv.get_replica_context().all_reduce("sum", g), args=(g,))
            for g in grads
        ]
    for grad, param in zip(grads, [layer.kernel, layer.bias], strict=True):
        param.assign_sub(pv.PerReplica([0.01 * g for g in device.unpack(grad)]))
    kernels = device.unpack(layer.kernel)
    biases = device.unpack(layer.bias)
    r = np.arange(5.0)
    if reduced:
        np.testing.assert_allclose(kernels[0], kernels[1])
        expected = 1.0 - 0.01 * 2.0 * (1.0 + 0.5 - r) - 0.01 * 2.0 * (1.0 - 0.5 - r)
        np.testing.assert_allclose(biases[0], expected, rtol=1e-6)
        np.testing.assert_allclose(biases[1], expected, rtol=1e-6)
    else:
        assert not np.allclose(kernels[0], kernels[1])
        np.testing.assert_allclose(biases[0], 1.0 - 0.01 * 2.0 * (1.0 - 0.5 - r), rtol=1e-6)
        np.testing.assert_allclose(biases[1], 1.0 - 0.01 * 2.0 * (1.0 + 0.5 - r), rtol=1e-6)


# ============================================================================ the list, one test each
def test_item1_on_read_sum_starts_once_per_replica() -> None:
    """Issue item 1 (mirrored_strategy_test.py::SyncOnReadVariableAssignTest): every replica
    holds the initial value of an on-read SUM variable, so 1.0 on two replicas reads 2.0."""
    with pv.MirroredStrategy(2).scope():
        v = pv.Variable(1.0, synchronization="on_read", aggregation="sum")
    assert float(v) == 2.0 and [float(c) for c in v.components] == [1.0, 1.0]


def test_item2_reduce_of_a_structure() -> None:
    """Issue item 2 (TensorFlow 2's Strategy.reduce of a nested structure): the structure of
    the reductions, not one stacked array."""
    s = pv.MirroredStrategy(2)
    a = pv.PerReplica([np.array([1.0, 1.0]), np.array([3.0, 3.0])])
    b = pv.PerReplica([np.array([1.0, 1.0]), np.array([1.0, 1.0])])
    out = s.reduce("SUM", (a, b), axis=0)
    assert isinstance(out, tuple) and [float(x) for x in out] == [8.0, 4.0]
    out = s.reduce("SUM", {"a": a, "b": [b]})
    assert out["a"].tolist() == [4.0, 4.0] and out["b"][0].tolist() == [2.0, 2.0]


def test_item7_deferred_restore_onto_the_checkpoint_object(tmp_path: Any) -> None:
    """Issue item 7 (TensorFlow's deferred restoration, checkpointing_test): a variable attached
    to the Checkpoint after restore() receives its saved value on attachment."""
    with pv.MirroredStrategy(2).scope():
        v = pv.Variable(np.arange(3, dtype=np.float32), name="v")
    path = pv.Checkpoint(v=v).save(str(tmp_path / "c"))
    fresh = pv.Checkpoint()
    status = fresh.restore(path)
    with pv.MirroredStrategy(2).scope():
        fresh.v = pv.Variable(np.zeros(3, np.float32), name="v")
    assert [c.tolist() for c in fresh.v.components] == [[0.0, 1.0, 2.0]] * 2
    status.assert_consumed()
    fresh.note = "not trackable"  # a plain attribute stays one
    assert fresh.note == "not trackable"


def test_item8_parallel_variable_arithmetic() -> None:
    """Issue item 8 (the seed's parallel device applies an op to every component): v * 2 on an
    independent-buffers variable outside run() is per component, and unpack() takes it."""
    device = pv.ParallelDevice(2)
    v = device.pack([np.ones(2, np.float32), np.full(2, 3.0, np.float32)], name="v")
    assert [o.tolist() for o in device.unpack(v * 2)] == [[2.0, 2.0], [6.0, 6.0]]
    assert [float(o) for o in device.unpack(np.sum(v))] == [2.0, 6.0]
    assert [float(o) for o in device.unpack(v.max())] == [1.0, 3.0]
    assert [o.tolist() for o in device.unpack(-v[:1] + device.pack([1.0, 2.0]))] == [[0.0], [-1.0]]
    with pytest.raises(DistributedValueError, match="different sizes"):
        v + pv.PerReplica([1.0, 2.0, 3.0])
    with pytest.raises(DistributedValueError, match="one value per device, not one array"):
        np.asarray(v * 2)  # as a parallel tensor has no one numpy value
    assert isinstance(v * 2, pv.ParallelValue) and isinstance(v * 2, pv.PerReplica)
