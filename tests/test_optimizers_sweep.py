"""Every optimizer, float dtype, kind, replica count and gradient form through the fused
routes: the bits of the per-variable path (the same model and steps with every variable off
the fused path) in each case. Long: marked slow; test_optimizers_fused.py pins each route."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import parallelvars as pv
from parallelvars import optimizers as opts

OPTIMIZERS: dict[str, Callable[[], opts.Optimizer]] = {
    "sgd": lambda: opts.SGD(0.1),
    "momentum": lambda: opts.Momentum(0.1, 0.9, use_nesterov=True),
    "adam": lambda: opts.Adam(0.01),
    "adamw": lambda: opts.AdamW(0.01, 0.01),
    "adagrad": lambda: opts.Adagrad(0.1),
    "rmsprop": lambda: opts.RMSProp(0.01, momentum=0.5),
}
DTYPES = [
    np.float32,
    np.float64,
    np.float16,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
]
SHAPES = [(6, 4), (5,), (), (3, 2, 2), (40, 3)]
FORMS = ["arrays", "shared", "buffers", "cast", "sparse", "mixed"]


def _no_batch_reduce(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a gradient was reduced one variable at a time")


def _name(v: Any) -> str:
    return str(v.name)


def _bits(a: Any) -> np.ndarray:
    arr = np.ascontiguousarray(a)
    return arr.view(np.dtype(f"u{arr.dtype.itemsize}"))


def _model(
    strategy: pv.Strategy, dtype: Any, make_opt: Callable[[], opts.Optimizer], sharded: bool
) -> tuple[list[Any], opts.Optimizer]:
    rng = np.random.default_rng(5)
    with strategy.scope():
        vs = [
            pv.Variable(
                (rng.normal(size=s) + 2.0).astype(dtype),
                name=f"v{i}",
                shard_axis=0 if sharded and len(s) >= 1 and s[0] % 2 == 0 else None,
            )
            for i, s in enumerate(SHAPES)
        ]
        return vs, make_opt()


def _gradients(form: str, dtype: Any, n: int, rng: np.random.Generator) -> list[list[Any]]:
    cast = np.float64 if np.dtype(dtype) == np.float32 else np.float32
    scales = [1e-2, 1.0, 1e2, 3.0]

    def dense(r: int, i: int, dt: Any) -> np.ndarray:
        return (rng.normal(size=SHAPES[i]) * scales[r % 4]).astype(dt)

    def sparse(r: int, i: int) -> Any:
        s = SHAPES[i]
        k = int(rng.integers(0, 4))
        vals = (rng.normal(size=(k, *s[1:])) * scales[r % 4]).astype(dtype)
        return pv.IndexedSlices(vals, rng.integers(0, s[0], k), s)

    out: list[list[Any]] = []
    for r in range(n):
        row: list[Any] = []
        for i, s in enumerate(SHAPES):
            if form in ("arrays", "shared", "buffers"):
                row.append(dense(r, i, dtype))
            elif form == "cast":
                row.append(dense(r, i, cast))
            elif form == "sparse":
                row.append(sparse(r, i) if s else dense(r, i, dtype))
            else:  # one of each, by position
                kind = i % 3
                row.append(
                    dense(r, i, dtype)
                    if kind == 0 or not s
                    else dense(r, i, cast)
                    if kind == 1
                    else sparse(r, i)
                )
        out.append(row)
    if form == "shared":
        out = [out[0]] * n
    return out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_route_keeps_the_per_variable_bits(name: str, dtype: Any) -> None:
    make_opt = OPTIMIZERS[name]
    for replicas in (1, 2, 4):
        for sharded in (False, True):
            for form in FORMS:
                strategy = pv.MirroredStrategy(replicas)
                ref_strategy = pv.MirroredStrategy(replicas)
                vs, opt = _model(strategy, dtype, make_opt, sharded)
                ref_vs, ref_opt = _model(ref_strategy, dtype, make_opt, sharded)
                # Every gradient of the model under test takes a fused route: nothing is
                # reduced one variable at a time.
                strategy.batch_reduce = _no_batch_reduce  # type: ignore[method-assign]
                ref_opt._info = lambda v, o=ref_opt: (*opts.Optimizer._info(o, v)[:2], False)  # type: ignore[method-assign]
                bufs = None
                if form == "buffers":
                    with strategy.scope():
                        bufs = opt.gradient_buffers(vs)
                rng = np.random.default_rng(9)
                for _ in range(2):
                    grads = _gradients(form, dtype, replicas, rng)

                    def step(g: list[Any], o: opts.Optimizer, vars_: list[Any], b: Any) -> None:
                        if b is not None:
                            for view, x in zip(b.views(), g, strict=True):
                                view[...] = x
                            o.apply_gradients(b.grads_and_vars())
                            return
                        o.apply_gradients(zip(g, vars_, strict=True))

                    strategy.run(step, args=(pv.PerReplica(grads), opt, vs, bufs))
                    ref_strategy.run(step, args=(pv.PerReplica(grads), ref_opt, ref_vs, None))
                case = f"{replicas} replicas, sharded={sharded}, {form}"
                got = [*vs, *sorted((s for _, _, s in opt._checkpoint_slots()), key=_name)]
                want = [
                    *ref_vs,
                    *sorted((s for _, _, s in ref_opt._checkpoint_slots()), key=_name),
                ]
                assert len(got) == len(want), case
                for x, y in zip(got, want, strict=True):
                    for cx, cy in zip(x.components, y.components, strict=True):
                        assert np.array_equal(_bits(cx), _bits(cy)), (case, x.name)
