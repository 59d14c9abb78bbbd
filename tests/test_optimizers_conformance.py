"""One conformance test for every optimizer: several steps against float64 reference formulas.

The references below are written from the formulas in the optimizers' docstrings (TensorFlow
1.x), independently of the kernels: plain float64 numpy on whole arrays, one variable at a time.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import parallelvars as pv
from parallelvars import optimizers as opts

# name -> (constructor, reference config)
CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "sgd": (lambda: opts.SGD(0.1), {"kind": "sgd", "lr": 0.1}),
    "momentum": (
        lambda: opts.Momentum(0.05, 0.9),
        {"kind": "momentum", "lr": 0.05, "mu": 0.9, "nesterov": False},
    ),
    "nesterov": (
        lambda: opts.Momentum(0.05, 0.8, use_nesterov=True),
        {"kind": "momentum", "lr": 0.05, "mu": 0.8, "nesterov": True},
    ),
    "adam": (
        lambda: opts.Adam(0.01),
        {"kind": "adam", "lr": 0.01, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "ams": False, "wd": 0.0},
    ),
    "amsgrad": (
        lambda: opts.Adam(0.02, beta1=0.8, beta2=0.95, epsilon=1e-6, amsgrad=True),
        {"kind": "adam", "lr": 0.02, "b1": 0.8, "b2": 0.95, "eps": 1e-6, "ams": True, "wd": 0.0},
    ),
    "adamw": (
        lambda: opts.AdamW(0.1, learning_rate=0.01),
        {"kind": "adam", "lr": 0.01, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "ams": False, "wd": 0.1},
    ),
    "adagrad": (lambda: opts.Adagrad(0.1, 0.2), {"kind": "adagrad", "lr": 0.1, "init": 0.2}),
    "rmsprop": (
        lambda: opts.RMSProp(0.01, decay=0.9, momentum=0.5),
        {"kind": "rmsprop", "lr": 0.01, "rho": 0.9, "mu": 0.5, "eps": 1e-10, "centered": False},
    ),
    "rmsprop_centered": (
        lambda: opts.RMSProp(0.01, decay=0.8, momentum=0.0, epsilon=1e-6, centered=True),
        {"kind": "rmsprop", "lr": 0.01, "rho": 0.8, "mu": 0.0, "eps": 1e-6, "centered": True},
    ),
}


class Reference:
    """The formulas, in float64, for one variable."""

    def __init__(self, cfg: dict[str, Any], value: np.ndarray) -> None:
        self.cfg = cfg
        self.var = value.astype(np.float64)
        z = np.zeros_like(self.var)
        kind = cfg["kind"]
        if kind == "momentum":
            self.s = {"accum": z.copy()}
        elif kind == "adam":
            self.s = {"m": z.copy(), "v": z.copy(), "vhat": z.copy()}
        elif kind == "adagrad":
            self.s = {"acc": np.full_like(self.var, cfg["init"])}
        elif kind == "rmsprop":
            self.s = {"ms": np.ones_like(self.var), "mom": z.copy(), "mg": z.copy()}
        else:
            self.s = {}

    def step(self, t: int, g: np.ndarray, rows: np.ndarray | None) -> None:
        """Step number ``t`` (1-based) with dense ``g``; ``rows``: a sparse step's touched rows."""
        c, kind = self.cfg, self.cfg["kind"]
        if kind == "adam":  # sparse Adam / AdamW is its dense equivalent
            var, m, v, vh = self.var, self.s["m"], self.s["v"], self.s["vhat"]
            var -= c["lr"] * c["wd"] * var
            m[...] = c["b1"] * m + (1 - c["b1"]) * g
            v[...] = c["b2"] * v + (1 - c["b2"]) * g * g
            lr_t = c["lr"] * math.sqrt(1 - c["b2"] ** t) / (1 - c["b1"] ** t)
            denom = v
            if c["ams"]:
                vh[...] = np.maximum(vh, v)
                denom = vh
            var -= lr_t * m / (np.sqrt(denom) + c["eps"])
            return
        sel = slice(None) if rows is None else rows
        var = self.var[sel]
        st = {k: s[sel] for k, s in self.s.items()}
        gs = g[sel]
        if kind == "sgd":
            var = var - c["lr"] * gs
        elif kind == "momentum":
            st["accum"] = c["mu"] * st["accum"] + gs
            if c["nesterov"]:
                var = var - (c["lr"] * gs + c["lr"] * c["mu"] * st["accum"])
            else:
                var = var - c["lr"] * st["accum"]
        elif kind == "adagrad":
            st["acc"] = st["acc"] + gs * gs
            var = var - c["lr"] * gs / np.sqrt(st["acc"])
        elif kind == "rmsprop":
            st["ms"] = c["rho"] * st["ms"] + (1 - c["rho"]) * gs * gs
            if c["centered"]:
                st["mg"] = c["rho"] * st["mg"] + (1 - c["rho"]) * gs
                denom = np.sqrt(st["ms"] - st["mg"] ** 2 + c["eps"])
            else:
                denom = np.sqrt(st["ms"] + c["eps"])
            st["mom"] = c["mu"] * st["mom"] + c["lr"] * gs / denom
            var = var - st["mom"]
        self.var[sel] = var
        for k, s in st.items():
            self.s[k][sel] = s


SHAPES = {"w": (6, 3), "b": (3,), "e": (5, 2)}  # "e" is sharded when there are 4 replicas


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("replicas", [1, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_conformance(case: str, replicas: int, dtype: Any, sparse: bool) -> None:
    make, cfg = CASES[case]
    rng = np.random.default_rng(7)
    init = {k: rng.normal(size=s).astype(dtype) for k, s in SHAPES.items()}
    strategy = pv.MirroredStrategy(replicas)
    with strategy.scope():
        live = {k: pv.Variable(init[k], name=k, shard_axis=0 if k == "e" else None) for k in SHAPES}
        opt = make()
    refs = {k: Reference(cfg, init[k]) for k in SHAPES}
    steps = 4
    for t in range(1, steps + 1):
        pairs = []
        for k, shape in SHAPES.items():
            if sparse and len(shape) == 2:
                idx = np.array([0, shape[0] - 1, 0, 2])  # a duplicate row, summed
                vals = rng.normal(size=(4, shape[1]))
                g = pv.IndexedSlices(vals.astype(dtype), idx, shape)
                dense = np.zeros(shape)
                np.add.at(dense, idx, vals.astype(dtype).astype(np.float64))
                refs[k].step(t, dense, np.unique(idx))
            else:
                g = rng.normal(size=shape).astype(dtype)
                refs[k].step(t, g.astype(np.float64), None)
            pairs.append((g, live[k]))
        if replicas > 1:
            with strategy.scope():  # cross-replica: the gradients are already reduced
                opt.distributed_apply(strategy, pairs)
        else:
            opt.apply_gradients(pairs)
    rtol, atol = (2e-5, 2e-6) if dtype == np.float32 else (1e-12, 1e-13)
    for k in SHAPES:
        var = live[k]
        assert var.dtype == dtype
        if var.kind != "sharded":
            assert len(var.components) == replicas
            for comp in var.components:
                np.testing.assert_allclose(comp, refs[k].var, rtol=rtol, atol=atol, err_msg=k)
        np.testing.assert_allclose(
            np.asarray(var.read_value()), refs[k].var, rtol=rtol, atol=atol, err_msg=k
        )
    assert int(opt.iterations.read_value()) == steps
    if cfg["kind"] == "adam":
        np.testing.assert_allclose(
            float(opt.beta1_power.read_value()), cfg["b1"] ** (steps + 1), rtol=1e-14
        )
        np.testing.assert_allclose(
            np.asarray(opt.get_slot(live["w"], "m").read_value()),
            refs["w"].s["m"],
            rtol=rtol,
            atol=atol,
        )


def _one_step(opt: Any, value: float, grad: float, steps: int = 1) -> float:
    w = pv.Variable(np.array([value], np.float64))
    for _ in range(steps):
        opt.apply_gradients([(np.array([grad]), w)])
    return float(w.read_value()[0])


def test_hand_checked_values() -> None:
    assert _one_step(opts.SGD(0.5), 1.0, 2.0) == 0.0
    # Momentum 0.9: accum 1, then 1.9: 1 - 0.1 - 0.19.
    assert _one_step(opts.Momentum(0.1, 0.9), 1.0, 1.0, steps=2) == pytest.approx(0.71, abs=1e-15)
    # Adam's first step moves by about lr whatever the gradient's size.
    assert _one_step(opts.Adam(0.1), 1.0, 1000.0) == pytest.approx(0.9, abs=1e-9)
    # Adagrad: accum 0.1 + 1 = 1.1.
    assert _one_step(opts.Adagrad(0.1), 1.0, 1.0) == pytest.approx(
        1.0 - 0.1 / math.sqrt(1.1), abs=1e-15
    )
    # RMSProp: rms starts at 1, so 0.9 * 1 + 0.1 * 1 = 1 and the step is lr.
    assert _one_step(opts.RMSProp(0.1, epsilon=0.0), 1.0, 1.0) == pytest.approx(0.9, abs=1e-15)
    # AdamW, zero gradient: only the decay, 1 - 0.1 * 0.5.
    assert _one_step(opts.AdamW(0.5, learning_rate=0.1), 1.0, 0.0) == pytest.approx(0.95, abs=1e-15)
