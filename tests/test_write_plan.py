"""One write plan (parallelvars._write_plan) for every way of writing a variable.

The route table, then the cases where the ways of writing used to disagree: each now follows
the route of its kind and context like assign() does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import parallelvars as pv
from parallelvars._write_plan import Route, route
from parallelvars.errors import ReplicaError, ShapeMismatchError, UnsupportedOperationError

N = 3


def _variables(strategy: pv.MirroredStrategy) -> dict[str, Any]:
    with strategy.scope():
        out = {
            "mirrored": pv.Variable(np.zeros(4), name="m", aggregation="mean"),
            "on_read": pv.Variable(np.zeros(4), synchronization="on_read", aggregation="sum"),
            "sharded": pv.Variable(np.zeros((6, 2)), name="s", shard_axis=0),
        }
    with pv.independent_buffers(strategy.devices):
        out["independent"] = pv.Variable(np.zeros(4), name="i")
    out["single"] = pv.Variable(np.zeros(4), name="one")
    return out


CROSS = {
    "single": Route.EVERY,
    "mirrored": Route.EVERY,
    "independent": Route.EVERY,
    "on_read": Route.LOGICAL,
    "sharded": Route.FULL,
}
IN_REPLICA = {
    "single": Route.EVERY,  # one component, not one per replica: written as it is
    "mirrored": Route.MERGE,
    "independent": Route.OWN,
    "on_read": Route.OWN,
    "sharded": Route.FULL,
}


@pytest.mark.parametrize("kind", sorted(CROSS))
def test_route_table(kind: str) -> None:
    strategy = pv.MirroredStrategy(N)
    var = _variables(strategy)[kind]
    assert var.kind == kind
    assert route(var) == (CROSS[kind], None)
    seen: dict[int, tuple[Route, int | None]] = {}

    def fn() -> None:
        seen[pv.get_replica_context().replica_id_in_sync_group] = route(var)

    strategy.run(fn)
    assert sorted(seen) == list(range(N))
    for replica, (where, index) in seen.items():
        assert where is IN_REPLICA[kind]
        assert index == (replica if where in (Route.OWN, Route.MERGE) else None)


# Every way of writing, each doubling the value of a variable of four elements.
WRITES: dict[str, Callable[[Any], None]] = {
    "assign": lambda v: v.assign(np.asarray(v) * 2),
    "assign_add": lambda v: v.assign_add(np.asarray(v)),
    "iadd": lambda v: v.__iadd__(np.asarray(v).copy()),
    "imul": lambda v: v.__imul__(2.0),
    "setitem": lambda v: v.__setitem__(slice(None), np.asarray(v) * 2),
    "ufunc-out": lambda v: np.multiply(v, 2.0, out=v),
    "copyto": lambda v: np.copyto(v, np.asarray(v) * 2),
    "fill-sorted": lambda v: v.fill(float(np.asarray(v)[0]) * 2),  # equal elements: same result
}


@pytest.mark.parametrize("how", sorted(WRITES))
def test_every_way_of_writing_a_mirrored_variable_in_a_replica_function_merges(how: str) -> None:
    strategy = pv.MirroredStrategy(N)
    with strategy.scope():
        v = pv.Variable(np.ones(4), name="v", aggregation="mean")
    strategy.run(lambda: WRITES[how](v))
    for comp in v.components:  # merged (MEAN of equal writes) and applied once, everywhere
        assert comp.tolist() == [2.0] * 4, how


@pytest.mark.parametrize("how", sorted(WRITES))
def test_every_way_of_writing_without_an_aggregation_takes_one_value(how: str) -> None:
    # Aggregation NONE (TensorFlow 2 writes each replica's own copy): the replicas' equal
    # writes are applied once; different ones are refused and nothing is written.
    strategy = pv.MirroredStrategy(N)
    with strategy.scope():
        v = pv.Variable(np.ones(4), name="w_none")
    strategy.run(lambda: WRITES[how](v))
    for comp in v.components:
        assert comp.tolist() == [2.0] * 4, how

    def differently() -> None:
        v.assign(np.full(4, pv.get_replica_context().replica_id_in_sync_group, np.float64))

    with pytest.raises(ReplicaError, match=r"w_none.*aggregation NONE.*different values"):
        strategy.run(differently)
    for comp in v.components:
        assert comp.tolist() == [2.0] * 4, how


# Ways of writing that change the variable from its own value, whatever it reads as.
CHANGES: dict[str, Callable[[Any], None]] = {
    "assign_add": lambda v: v.assign_add(6.0),
    "iadd": lambda v: v.__iadd__(6.0),
    "imul": lambda v: v.__imul__(2.0),
    "ufunc-out": lambda v: np.multiply(v, 2.0, out=v),
    "ufunc-out-add": lambda v: np.add(v, 6.0, out=v),
}


@pytest.mark.parametrize("how", sorted(CHANGES))
def test_every_way_of_changing_an_on_read_sum_changes_its_total(how: str) -> None:
    # Outside replica functions an on-read SUM variable is its total, and every in-place way of
    # writing starts from the total (a ufunc with the variable as `out` used the primary alone).
    with pv.MirroredStrategy(N).scope():
        v = pv.Variable(np.zeros(4), synchronization="on_read", aggregation="sum")
    for i, comp in enumerate(v.components):
        comp[...] = i + 1  # total 6
    CHANGES[how](v)
    np.testing.assert_array_equal(v.read_value(), np.full(4, 12.0))


@pytest.mark.parametrize("how", sorted(WRITES))
def test_every_way_of_writing_an_independent_variable_in_a_replica_writes_its_own(how: str) -> None:
    strategy = pv.MirroredStrategy(N)
    with pv.independent_buffers(strategy.devices):
        v = pv.Variable(np.zeros(4), name="i")
    for i, comp in enumerate(v.components):
        comp[...] = i + 1
    strategy.run(lambda: WRITES[how](v))
    assert [c.tolist() for c in v.components] == [[2.0 * (i + 1)] * 4 for i in range(N)]


def _sharded() -> Any:
    with pv.MirroredStrategy(N).scope():
        return pv.Variable(np.arange(12.0).reshape(6, 2), name="s", shard_axis=0)


def test_writing_numpy_functions_write_a_sharded_variable_s_full_value() -> None:
    s = _sharded()
    np.copyto(s, np.full((6, 2), 7.0))  # was applied per shard: a broadcast error
    assert [c.tolist() for c in s.components] == [[[7.0, 7.0]] * 2] * 3
    np.put(s, [11], -1.0)  # flat index 11 of the full value: was index 11 of every shard
    assert np.asarray(s)[5, 1] == -1.0 and np.asarray(s)[:5].tolist() == [[7.0, 7.0]] * 5


@pytest.mark.parametrize("name", ["__iadd__", "__imul__"])
def test_in_place_operator_of_another_shape_is_refused_on_every_kind(name: str) -> None:
    strategy = pv.MirroredStrategy(N)
    for kind, var in _variables(strategy).items():
        with pytest.raises(ShapeMismatchError):  # the sharded kind raised numpy's ValueError
            getattr(var, name)(np.ones((2, 5)))
        assert not np.any(np.asarray(var)), kind


def test_sharded_ufunc_out_is_a_plain_call_with_one_output() -> None:
    s = _sharded()
    with pytest.raises(UnsupportedOperationError, match="one output"):
        np.add.accumulate(np.ones((6, 2)), out=s)  # the sharded kind ran np.add(x, out=full)


def test_in_place_operator_casts_alike_inside_and_outside_replica_functions() -> None:
    # numpy's rule for in-place operators (same_kind casting) everywhere: inside a replica
    # function `*= 0.5` on an integer variable truncated silently, outside it raised.
    strategy = pv.MirroredStrategy(N)
    with strategy.scope():
        v = pv.Variable(np.full(4, 3, np.int64), name="n", aggregation="mean")
    with pytest.raises(TypeError):
        v *= 0.5
    with pytest.raises(TypeError):
        strategy.run(lambda: v.__imul__(0.5))
    assert [c.tolist() for c in v.components] == [[3] * 4] * N
    strategy.run(lambda: v.__imul__(2))
    assert [c.tolist() for c in v.components] == [[6] * 4] * N
