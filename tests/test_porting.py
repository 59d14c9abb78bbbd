"""Behaviours of the TensorFlow seeds that ported code relies on (shared/seeds/).

Each test names the seed function whose behaviour it reproduces.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _strategy_support import run_with_deadline

import parallelvars as pv


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
        run_with_deadline(strategy, step, args=(pv.PerReplica([np.ones(2, np.float32), np.ones(2, np.float32)]),))
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
    a creator installed outside them still runs."""
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
        elif scope == "replicated":
            with pv.replicated_scope(3):
                v = pv.Variable(1.0, name="v")
            assert v.kind == "mirrored" and len(v.components) == 3
        else:
            with pv.independent_buffers(2):
                v = pv.Variable(1.0, name="v")
            assert v.kind == "independent"
    assert seen == ["v"]


def test_inner_creator_sees_and_can_change_the_arguments() -> None:
    """``next_creator(**kwargs)``: a creator passes (possibly changed) arguments down."""

    def rename(next_creator: Any, **kwargs: Any) -> Any:
        kwargs["name"] = "renamed/" + kwargs["name"]
        return next_creator(**kwargs)

    with pv.MirroredStrategy(2).scope(), pv.variable_creator_scope(rename):
        v = pv.Variable(1.0, name="v")
    assert v.name == "renamed/v" and v.kind == "mirrored"
