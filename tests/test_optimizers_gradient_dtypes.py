"""Gradients of other float dtypes than their variable, and replicas that hand values of
different dtypes for one variable: bfloat16 with float16 (which numpy does not promote, nor
cast ``same_kind`` from bfloat16 to float16) and the float8 types. The rule (docs/training.md):
the replicas' values are added in their common dtype, float32 for floats numpy cannot promote
(it holds each value exactly), and the sum is rounded once to the variable's dtype, on the
vectorised and on the per-variable path alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import parallelvars as pv
from parallelvars import optimizers as opts
from parallelvars.errors import GradientTypeError
from parallelvars.testing import sum_dtype

BF16 = np.dtype(ml_dtypes.bfloat16)
F8 = np.dtype(ml_dtypes.float8_e4m3fn)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
SHAPES = [(6, 4), (5, 2, 3), (3,)]

OPTIMIZERS: dict[str, Callable[[], opts.Optimizer]] = {
    "sgd": lambda: opts.SGD(0.1),
    "momentum": lambda: opts.Momentum(0.1, 0.9),
    "adam": lambda: opts.Adam(0.01),
}


def test_sum_dtype_promotes_floats_numpy_cannot_to_float32() -> None:
    assert sum_dtype([BF16, F16]) == F32
    assert sum_dtype([F16, BF16, BF16]) == F32
    assert sum_dtype([F8, F16]) == F32
    assert sum_dtype([F8, np.dtype(ml_dtypes.float8_e5m2)]) == F32
    assert sum_dtype([BF16, F32]) == F32  # numpy's own promotion where it has one
    assert sum_dtype([BF16, np.dtype(np.float64)]) == np.dtype(np.float64)
    assert sum_dtype([np.zeros(2, BF16), np.zeros(2, F16)]) == F32  # arrays too
    assert sum_dtype([BF16, np.dtype(np.int64)]) == np.dtype(np.float64)  # as int64 + float32
    with pytest.raises(TypeError):
        sum_dtype([np.dtype("M8[s]"), BF16])


Model = tuple[pv.Strategy, list[Any], opts.Optimizer]


def _model(
    replicas: int, dtype: Any, make_opt: Callable[[], opts.Optimizer], fused: bool = True
) -> Model:
    strategy = pv.MirroredStrategy(replicas)
    rng = np.random.default_rng(7)
    with strategy.scope():
        vs = [
            pv.Variable(rng.normal(size=s).astype(dtype), name=f"v{i}")
            for i, s in enumerate(SHAPES)
        ]
        opt = make_opt()
    if not fused:  # the per-variable path
        opt._info = lambda v: (*opts.Optimizer._info(opt, v)[:2], False)  # type: ignore[method-assign]
    return strategy, vs, opt


def _step(grads: list[Any], o: opts.Optimizer, vars_: list[Any]) -> None:
    o.apply_gradients(zip(grads, vars_, strict=True))


def _run(model: Model, per_replica: list[list[Any]]) -> None:
    strategy, vs, opt = model
    strategy.run(_step, args=(pv.PerReplica(per_replica), opt, vs))


def _state(model: Model) -> list[np.ndarray]:
    _, vs, opt = model
    slots = sorted((s for _, _, s in opt._checkpoint_slots()), key=lambda s: s.name)
    return [np.array(c) for x in [*vs, *slots] for c in x.components]


def _assert_same(got: Model, want: Model) -> None:
    a, b = _state(got), _state(want)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        assert x.tobytes() == y.tobytes()


def _sparse(rng: np.random.Generator, dtype: Any) -> list[pv.IndexedSlices]:
    out = []
    for s in SHAPES:
        idx = np.array([0, s[0] - 1, 0])  # a repeated row
        vals = rng.normal(size=(3, *s[1:])).astype(dtype)
        out.append(pv.IndexedSlices(vals, idx, s))
    return out


def _as(dtype: Any, grads: list[pv.IndexedSlices]) -> list[pv.IndexedSlices]:
    return [pv.IndexedSlices(g.values.astype(dtype), g.indices, g.dense_shape) for g in grads]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("var_dtype", [F16, BF16, F32], ids=str)
@pytest.mark.parametrize("make_opt", list(OPTIMIZERS.values()), ids=list(OPTIMIZERS))
@pytest.mark.parametrize("fused", [True, False], ids=["vectorised", "per-variable"])
def test_sparse_values_of_bfloat16_float16_and_float8_replicas_are_summed_in_float32(
    var_dtype: np.dtype, make_opt: Callable[[], opts.Optimizer], fused: bool
) -> None:
    # Replica 0 hands bfloat16 rows, replica 1 float16 rows, replica 2 float8 rows, for every
    # variable: concatenating them raised numpy's DTypePromotionError. They are summed as the
    # same values handed in float32 (each exact there) are summed: bit for bit.
    model = _model(3, var_dtype, make_opt, fused)
    ref = _model(3, var_dtype, make_opt, fused)
    rng = np.random.default_rng(11)
    for _ in range(3):
        per_replica = [_sparse(rng, d) for d in (BF16, F16, F8)]
        _run(model, per_replica)
        _run(ref, [_as(F32, grads) for grads in per_replica])
        _assert_same(model, ref)


def test_sparse_values_that_do_not_add_are_refused_naming_the_variable() -> None:
    model = _model(2, F32, OPTIMIZERS["sgd"])
    before = _state(model)
    good = _sparse(np.random.default_rng(1), F32)
    bad = list(good)
    bad[1] = pv.IndexedSlices(np.zeros((3, *SHAPES[1][1:]), "M8[s]"), good[1].indices, SHAPES[1])
    with pytest.raises(GradientTypeError, match=r"variable 'v1'.*datetime64") as info:
        _run(model, [good, bad])
    assert "float32" in str(info.value)
    for x, y in zip(before, _state(model), strict=True):
        assert x.tobytes() == y.tobytes()


def _dense(rng: np.random.Generator, dtype: Any) -> list[np.ndarray]:
    return [rng.normal(size=s).astype(dtype) for s in SHAPES]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "var_dtype, grad_dtype",
    [(F16, BF16), (F16, F8), (np.dtype(ml_dtypes.float8_e5m2), BF16), (BF16, F16), (F32, BF16)],
    ids=lambda d: str(d),
)
@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize("make_opt", list(OPTIMIZERS.values()), ids=list(OPTIMIZERS))
@pytest.mark.parametrize("fused", [True, False], ids=["vectorised", "per-variable"])
def test_a_dense_gradient_of_another_float_dtype_is_rounded_to_the_variable_dtype(
    var_dtype: np.dtype,
    grad_dtype: np.dtype,
    replicas: int,
    make_opt: Callable[[], opts.Optimizer],
    fused: bool,
) -> None:
    # A bfloat16 gradient of a float16 variable raised a builtin TypeError (numpy does not
    # cast bfloat16 to float16 "same_kind"). The replicas are summed in the gradient's dtype
    # in device order, and the sum rounded once to the variable's: the bits of handing that
    # rounded sum in the variable's dtype (the other replicas zeros).
    model = _model(replicas, var_dtype, make_opt, fused)
    ref = _model(replicas, var_dtype, make_opt, fused)
    rng = np.random.default_rng(5)
    for _ in range(3):
        per_replica = [_dense(rng, grad_dtype) for _ in range(replicas)]
        sums = [np.array(g) for g in per_replica[0]]
        for grads in per_replica[1:]:
            for s, g in zip(sums, grads, strict=True):
                s += g  # (in the gradient's dtype, each addition rounded)
        rounded = [s.astype(var_dtype) for s in sums]
        zeros = [np.zeros_like(r) for r in rounded]
        _run(model, per_replica)
        _run(ref, [rounded] + [zeros] * (replicas - 1))
        _assert_same(model, ref)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("var_dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("fused", [True, False], ids=["vectorised", "per-variable"])
def test_dense_replicas_of_bfloat16_float16_and_float8_are_summed_in_float32(
    var_dtype: np.dtype, fused: bool
) -> None:
    model = _model(3, var_dtype, OPTIMIZERS["adam"], fused)
    ref = _model(3, var_dtype, OPTIMIZERS["adam"], fused)
    rng = np.random.default_rng(13)
    for _ in range(3):
        per_replica = [_dense(rng, d) for d in (BF16, F16, F8)]
        _run(model, per_replica)
        _run(ref, [[g.astype(F32) for g in grads] for grads in per_replica])
        _assert_same(model, ref)
