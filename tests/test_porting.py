"""Behaviours of the TensorFlow seeds that ported code relies on (shared/seeds/).

Each test names the seed function whose behaviour it reproduces.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _strategy_support import run_with_deadline
from hypothesis import given, settings
from hypothesis import strategies as st

import parallelvars as pv
from parallelvars.errors import ParallelVarsError


# ---------------------------------------------------------------------------- 1. creation in replica fns
def test_variable_created_in_replica_fn_is_one_mirrored_variable() -> None:
    """MirroredStrategy's ``_create_variable`` in tower context (seed distribute.py,
    ``call_for_each_tower``): every replica calls the creator, one mirrored variable results,
    with the first replica's initial value, shared by all replicas."""
    strategy = pv.MirroredStrategy(3)
    made: list[Any] = []

    def model_fn() -> Any:
        rid = pv.get_replica_context().replica_id_in_sync_group
        w = pv.Variable(np.full(2, 10.0 + rid, np.float32), name="w")
        made.append(w)
        return w

    out = run_with_deadline(strategy, model_fn)
    assert all(w is out for w in made) and len(made) == 3
    assert out.kind == "mirrored" and out.devices == strategy.devices.components
    assert [c.tolist() for c in out.components] == [[10.0, 10.0]] * 3


def test_variables_created_in_replica_fn_keep_their_order_and_train() -> None:
    """``call_for_each_tower`` model building with an optimizer built lazily on the first
    step (seed optimizer_distribution.diff, ``_distributed_apply`` creating slots)."""
    strategy = pv.MirroredStrategy(2)
    opt = pv.optimizers.SGD(learning_rate=0.5)
    model: dict[str, Any] = {}

    def step(x: Any) -> Any:
        if not model:
            model["a"] = pv.Variable(np.ones(2, np.float32), name="a")
            model["b"] = pv.Variable(np.zeros(2, np.float32), name="b")
        opt.apply_gradients([(x, model["a"]), (x * 2, model["b"])])
        return model["a"]

    with strategy.scope():
        run_with_deadline(
            strategy, step, args=(pv.PerReplica([np.ones(2, np.float32), np.ones(2, np.float32)]),)
        )
    a, b = model["a"], model["b"]
    assert (a.name, b.name) == ("a", "b")
    # Two replicas' gradients summed: 1 + 1 = 2 (and 4 for b), times 0.5.
    assert [c.tolist() for c in a.components] == [[0.0, 0.0]] * 2
    assert [c.tolist() for c in b.components] == [[-2.0, -2.0]] * 2
    assert int(opt.iterations.read_value()) == 1


def test_variable_created_in_replica_fn_with_callable_initial_value() -> None:
    """``_create_variable``: the initial value is taken from the first replica only."""
    strategy = pv.MirroredStrategy(2)
    calls: list[int] = []

    def init() -> np.ndarray:
        calls.append(1)
        return np.arange(3, dtype=np.float32)

    v = run_with_deadline(strategy, lambda: pv.Variable(init, name="v"))
    assert calls == [1]
    assert [c.tolist() for c in v.components] == [[0.0, 1.0, 2.0]] * 2


def test_replicas_creating_different_numbers_of_variables_is_an_error() -> None:
    """``call_for_each_tower``: every tower must make the same calls (a merge point each)."""
    strategy = pv.MirroredStrategy(2)

    def fn() -> None:
        if pv.get_replica_context().replica_id_in_sync_group == 0:
            pv.Variable(1.0, name="only_one")

    with pytest.raises(pv.errors.ReplicaError):
        run_with_deadline(strategy, fn)


# ---------------------------------------------------------------------------- 4. creator chaining
@pytest.mark.parametrize("scope", ["strategy", "colocate", "replicated", "independent"])
def test_creators_chain_to_outer_creator_scopes(scope: str) -> None:
    """``variable_creator_scope`` chaining: the seeds' creators (``_DefaultDistributionStrategy
    .scope``'s ``creator``, ``replicated_scope``'s getter) call ``next_creator(**kwargs)``, so
    a creator installed outside them still runs. Under a strategy it runs once per device
    (TensorFlow's mirrored creator calls the creators below it per device, the others named
    ``<name>/replica_<i>``)."""
    seen: list[str] = []

    def outer(next_creator: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["name"])
        return next_creator(**kwargs)

    strategy = pv.MirroredStrategy(2)
    with pv.variable_creator_scope(outer):
        if scope == "strategy":
            with strategy.scope():
                v = pv.Variable(1.0, name="v")
            assert v.kind == "mirrored"
        elif scope == "colocate":
            with strategy.scope():
                anchor = pv.Variable(0.0, name="anchor")
                with strategy.colocate_vars_with(anchor):
                    v = pv.Variable(1.0, name="v")
            assert v.devices == anchor.devices
            seen.remove("anchor")
            seen.remove("anchor/replica_1")
        elif scope == "replicated":
            with pv.replicated_scope(3):
                v = pv.Variable(1.0, name="v")
            assert v.kind == "mirrored" and len(v.components) == 3
        else:
            with pv.independent_buffers(2):
                v = pv.Variable(1.0, name="v")
            assert v.kind == "independent"
    assert seen == (["v", "v/replica_1"] if scope in ("strategy", "colocate") else ["v"])


def test_inner_creator_sees_and_can_change_the_arguments() -> None:
    """``next_creator(**kwargs)``: a creator passes (possibly changed) arguments down."""

    def rename(next_creator: Any, **kwargs: Any) -> Any:
        kwargs["name"] = "renamed/" + kwargs["name"]
        return next_creator(**kwargs)

    with pv.MirroredStrategy(2).scope(), pv.variable_creator_scope(rename):
        v = pv.Variable(1.0, name="v")
    assert v.name == "renamed/v" and v.kind == "mirrored"


# ---------------------------------------------------------------------------- 2. loss scaling
def test_compute_average_loss_divides_by_the_global_batch() -> None:
    """TF2 ``compute_average_loss(per_example_loss, global_batch_size, sample_weight)``: the
    replica's summed losses over the global batch size, which defaults to the replica's batch
    times the number of replicas in sync."""
    strategy = pv.MirroredStrategy(2)

    def fn(x: np.ndarray) -> Any:
        return pv.compute_average_loss(x)

    out = run_with_deadline(
        strategy, fn, args=(pv.PerReplica([np.array([1.0, 3.0]), np.array([5.0, 7.0])]),)
    )
    assert [float(v) for v in out.values] == [1.0, 3.0]  # 4 / 4 and 12 / 4
    with strategy.scope():
        assert float(strategy.reduce(pv.ReduceOp.SUM, out)) == 4.0  # the global mean
    assert float(pv.compute_average_loss(np.array([1.0, 3.0]), global_batch_size=8)) == 0.5
    weighted = pv.compute_average_loss(np.array([1.0, 3.0]), sample_weight=np.array([2.0, 0.0]))
    assert float(weighted) == 1.0
    assert float(pv.compute_average_loss(np.zeros((0,)), global_batch_size=0)) == 0.0
    with pytest.raises(pv.errors.DistributedValueError, match="rank >= 1"):
        pv.compute_average_loss(np.float32(1.0))
    with pytest.raises(pv.errors.DistributedValueError):
        pv.compute_average_loss(np.ones(2), global_batch_size=-1)


def test_compute_average_loss_keeps_the_autodiff_type() -> None:
    """``compute_average_loss`` uses only ``*``, ``/`` and ``.sum()``, so an autodiff array
    type (here a numpy subclass standing in for a torch tensor) stays that type."""

    class Tracked(np.ndarray):
        pass

    x = np.array([2.0, 4.0]).view(Tracked)
    out = pv.compute_average_loss(x, global_batch_size=2)
    assert isinstance(out, Tracked) and float(out) == 3.0


def test_scale_regularization_loss_divides_by_replicas() -> None:
    """TF2 ``scale_regularization_loss``: a list is summed, then divided by the replicas."""
    strategy = pv.MirroredStrategy(4)
    out = run_with_deadline(strategy, lambda: pv.scale_regularization_loss([1.0, 3.0]))
    assert [float(v) for v in out.values] == [1.0] * 4
    assert pv.scale_regularization_loss(2.0) == 2.0  # one replica


def test_compute_gradients_scales_a_mean_loss() -> None:
    """The seed's ``Optimizer.compute_gradients``: with a "mean" loss reduction and several
    towers the loss (here its gradients) is scaled by ``1 / num_towers``, so the summed
    replica gradients are those of the global mean; with "sum" nothing is scaled."""
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        w = pv.Variable(np.zeros(2, np.float32), name="w")
    opt = pv.optimizers.SGD(learning_rate=1.0)

    def step(g: np.ndarray) -> Any:
        pairs = opt.compute_gradients(lambda: [g], [w])
        opt.apply_gradients(pairs, name="train")
        return pairs[0][0]

    grads = pv.PerReplica([np.array([2.0, 2.0], np.float32), np.array([4.0, 4.0], np.float32)])
    scaled = run_with_deadline(strategy, step, args=(grads,))
    assert [v.tolist() for v in scaled.values] == [[1.0, 1.0], [2.0, 2.0]]
    assert [c.tolist() for c in w.components] == [[-3.0, -3.0]] * 2  # minus the mean (3)

    with pv.loss_reduction("sum"):
        run_with_deadline(strategy, step, args=(grads,))
    assert [c.tolist() for c in w.components] == [[-9.0, -9.0]] * 2  # minus the sum (6)


def test_compute_gradients_checks_the_count() -> None:
    """``compute_gradients``: one gradient per variable of ``var_list``."""
    w = pv.Variable(np.zeros(2, np.float32), name="w")
    opt = pv.optimizers.SGD(learning_rate=1.0)
    assert opt.compute_gradients(lambda: [np.ones(2)], [w])[0][1] is w  # one replica: unscaled
    with pytest.raises(pv.errors.GradientError, match=r"1 gradients.*2 gradients"):
        opt.compute_gradients(lambda: [np.ones(2), np.ones(2)], [w])


# ---------------------------------------------------------------------------- 3. update views
def test_update_fn_receives_a_per_device_variable() -> None:
    """The seed's ``_distributed_apply`` ``update(v, g)`` and ``increment_var``'s
    ``update(vu)``: ``fn`` gets the per-device variable and calls ``assign_sub`` /
    ``assign_add`` / ``assign`` / ``read_value`` on it."""
    strategy = pv.MirroredStrategy(3)
    with strategy.scope():
        w = pv.Variable(np.ones(2, np.float32), name="w")
        seen: list[tuple[str, str, list[float]]] = []

        def fn(v: Any, g: np.ndarray) -> Any:
            seen.append((v.name, v.device, v.read_value().tolist()))
            v.assign_sub(g)
            v.assign_add(np.float32(0.5))
            return v

        out = strategy.update(w, fn, pv.PerReplica([np.full(2, i, np.float32) for i in range(3)]))
        assert out is w
        names = ["w", "w/replica_1", "w/replica_2"]  # TensorFlow's per-device variable names
        assert seen == [(names[i], f"cpu:{i}", [1.0, 1.0]) for i in range(3)]
        assert [c.tolist() for c in w.components] == [[1.5, 1.5], [0.5, 0.5], [-0.5, -0.5]]
        strategy.update(w, lambda v: v.assign(np.zeros(2)))
        assert all(not c.any() for c in w.components)
        strategy.update(w, lambda v: v.__isub__(1))  # numpy-style writes still work
        assert [c.tolist() for c in w.components] == [[-1.0, -1.0]] * 3
        with pytest.raises(pv.errors.ShapeMismatchError, match="'w"):
            strategy.update(w, lambda v: v.assign(np.zeros(3)))


def test_component_variable_arithmetic_gives_plain_arrays() -> None:
    """What ``update``'s ``fn`` gets is a view: arithmetic results are plain numpy arrays."""
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        w = pv.Variable(np.ones(2, np.float32), name="w")
        kinds = strategy.update(w, lambda v: type(v * 2))
    assert kinds is np.ndarray
    assert isinstance(pv.ComponentVariable, type)


def test_increment_var_and_update_non_slot_still_write_once() -> None:
    """Seed ``increment_var`` (a global step grows once per step) and ``update_non_slot``
    (here ``fn`` runs once: writes through a mirrored variable reach every device)."""
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        step = pv.Variable(0, name="step", aggregation=pv.Aggregation.ONLY_FIRST_REPLICA)
    run_with_deadline(strategy, lambda: pv.increment_var(step))
    assert [int(c) for c in step.components] == [1, 1]
    with strategy.scope():
        strategy.update_non_slot(step, lambda: step.assign_add(1))
    assert [int(c) for c in step.components] == [2, 2]


# ---------------------------------------------------------------------------- 5. independent -> plain
def test_independent_buffers_restore_into_a_plain_variable(tmp_path: Any) -> None:
    """Seed parallel_device_saving (``_save_slice_spec`` / the plain key): component 0 is saved
    under the plain key so that a non-parallel variable restores from it; the other
    components are unmatched (``assert_consumed`` fails, ``expect_partial`` accepts)."""
    with pv.independent_buffers(3):
        v = pv.Variable(np.zeros(2, np.float32), name="buf")
    for i, c in enumerate(v.components):
        c[...] = i + 1
    path = pv.Checkpoint(v=v).write(tmp_path / "ind.h5")

    plain = pv.Variable(np.zeros(2, np.float32), name="buf")
    status = pv.Checkpoint(v=plain).restore(path)
    np.testing.assert_array_equal(plain, [1.0, 1.0])
    with pytest.raises(
        pv.errors.RestoreMismatchError, match="v/parallel_component_1, v/parallel_component_2"
    ):
        status.assert_consumed()
    status.expect_partial()
    status.assert_existing_objects_matched()

    with pv.independent_buffers(2), pytest.raises(pv.errors.DeviceCountError):
        pv.Checkpoint(v=pv.Variable(np.zeros(2, np.float32))).restore(path)


# ---------------------------------------------------------------------------- 6. pack / unpack
def test_parallel_device_pack_and_unpack() -> None:
    """The parallel device's ``pack`` / ``unpack`` (seed parallel_device_saving uses
    ``device.pack`` / ``device.unpack`` for per-device values)."""
    device = pv.ParallelDevice(2)
    packed = device.pack([np.zeros(2), np.ones(2)])
    assert isinstance(packed, pv.PerReplica)
    assert [a.tolist() for a in device.unpack(packed)] == [[0.0, 0.0], [1.0, 1.0]]

    var = device.pack([np.zeros(2, np.float32), np.ones(2, np.float32)], name="packed")
    assert var.kind == "independent" and var.name == "packed"
    parts = device.unpack(var)
    assert [p.tolist() for p in parts] == [[0.0, 0.0], [1.0, 1.0]]
    parts[1][0] = 5.0  # views of the variable's buffers
    assert var.components[1][0] == 5.0

    with pytest.raises(pv.errors.DistributedValueError, match="expected 2 values, found 3"):
        device.pack([1, 2, 3])
    with pytest.raises(pv.errors.DistributedValueError, match="per-device value"):
        device.unpack(np.zeros(2))
    with pytest.raises(pv.errors.DistributedValueError, match="lives on"):
        pv.ParallelDevice(["cpu:5", "cpu:6"]).unpack(var)
    with pv.MirroredStrategy(2).scope():
        out = pv.get_strategy().run(lambda x: x * 2, args=(packed,))
    assert [a.tolist() for a in device.unpack(out)] == [[0.0, 0.0], [2.0, 2.0]]


def test_replicated_variable_wraps_per_device_values() -> None:
    """The seed's ``ReplicatedVariable(name, variables)``: one variable over existing
    per-device variables; ``get()`` is the primary, ``get_shape()`` the shape, ``assign``
    reaches every replica."""
    rv = pv.ReplicatedVariable("rv", [np.full(3, 1.0, np.float32), np.full(3, 2.0, np.float32)])
    assert rv.name == "rv" and rv.kind == "mirrored" and rv.get_shape() == (3,)
    assert rv.get().tolist() == [1.0, 1.0, 1.0]
    assert rv.get("cpu:1").tolist() == [2.0, 2.0, 2.0]
    assert rv.get("/device:CPU:1") is rv.components[1]
    rv.assign(np.zeros(3))
    assert all(not c.any() for c in rv.components)
    with pytest.raises(pv.errors.DistributedValueError, match="no component on cpu:7"):
        rv.get("cpu:7")
    with pytest.raises(pv.errors.DistributedValueError, match="invalid device name"):
        rv.get("nonsense")
    with pytest.raises(pv.errors.ShapeMismatchError):
        pv.ReplicatedVariable("bad", [np.zeros(2), np.zeros(3)])
    with pytest.raises(TypeError):
        pv.ReplicatedVariable("bad", [np.zeros(2, np.float32), np.zeros(2, np.int32)])

    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        sv = pv.ReplicatedVariable("sv", [np.zeros(1), np.ones(1)])
        assert sv.devices == strategy.devices.components
        got = strategy.update(sv, lambda v: float(sv.get()[0]))
    assert got.values == (0.0, 1.0)  # get() inside update: the device being updated
    mine = run_with_deadline(strategy, lambda: float(sv.get()[0]))
    assert mine.values == (0.0, 1.0)  # get() in a replica function: the replica's own
    assert run_with_deadline(strategy, lambda: sv) is sv


# ---------------------------------------------------------------------------- 7. smaller
def test_reduce_accepts_destinations_and_aggregations() -> None:
    """The seed's ``reduce(aggregation, value, destinations)``: an Aggregation (or its name)
    for the op, and a variable or device names as the third argument."""
    strategy = pv.MirroredStrategy(2)
    value = pv.PerReplica([np.array([1.0, 2.0]), np.array([3.0, 4.0])])
    with strategy.scope():
        w = pv.Variable(np.zeros(2), name="w")
        assert strategy.reduce(pv.Aggregation.SUM, value, w).tolist() == [4.0, 6.0]
        assert strategy.reduce("mean", value, destinations="cpu:0").tolist() == [2.0, 3.0]
        assert strategy.reduce(pv.Aggregation.MEAN, value, ["cpu:0", "cpu:1"]).tolist() == [
            2.0,
            3.0,
        ]
        assert strategy.reduce(pv.Aggregation.ONLY_FIRST_REPLICA, value).tolist() == [1.0, 2.0]
        assert float(strategy.reduce(pv.ReduceOp.SUM, value, 0)) == 10.0  # an int is an axis
        with pytest.raises(pv.errors.DistributedValueError, match="NONE"):
            strategy.reduce(pv.Aggregation.NONE, value)
        with pytest.raises(pv.errors.DistributedValueError, match="destinations"):
            strategy.reduce("sum", value, object())
        with pytest.raises(pv.errors.DistributedValueError):
            strategy.reduce("max", value)
        assert strategy.batch_reduce(pv.Aggregation.SUM, [(value, w)])[0].tolist() == [4.0, 6.0]


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("grad", ["abc", {"a": 1}, np.array(["x", "y"])])
def test_non_numeric_gradient_is_a_type_error(replicas: int, grad: Any) -> None:
    """The seed's ``_distributed_apply`` ``update``: "Gradient must be convertible to a Tensor
    or IndexedSlices, or None" is a ``TypeError``, not a shape error."""
    strategy = pv.MirroredStrategy(replicas)
    with strategy.scope():
        w = pv.Variable(np.zeros(2, np.float32), name="w")
    opt = pv.optimizers.SGD(learning_rate=1.0)
    with pytest.raises(TypeError) as info:
        run_with_deadline(strategy, lambda: opt.apply_gradients([(grad, w)], name="step"))
    assert isinstance(info.value, ParallelVarsError)


@settings(max_examples=40, deadline=None)
@given(
    # Equal per-replica batch sizes, drawn directly (a filter on random lengths rejects most).
    batches=st.tuples(st.integers(2, 4), st.integers(1, 6)).flatmap(
        lambda rb: st.lists(
            st.lists(
                st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=rb[1], max_size=rb[1]
            ),
            min_size=rb[0],
            max_size=rb[0],
        )
    ),
)
def test_average_losses_sum_to_the_global_mean(batches: list[list[float]]) -> None:
    """``compute_average_loss``: the replicas' results summed (what the optimizers do with
    gradients) are the mean over the global batch, for any equal per-replica batches."""
    strategy = pv.MirroredStrategy(len(batches))
    per_replica = pv.PerReplica([np.array(b, np.float64) for b in batches])
    out = strategy.run(pv.compute_average_loss, args=(per_replica,))
    with strategy.scope():
        total = float(strategy.reduce(pv.ReduceOp.SUM, out))
    expected = float(np.mean(np.concatenate([np.array(b) for b in batches])))
    assert total == pytest.approx(expected, rel=1e-9, abs=1e-9)
