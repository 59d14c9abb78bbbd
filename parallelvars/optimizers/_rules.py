"""The optimizers: TensorFlow 1.x update rules, each written once as a formula and as a kernel.

A kernel updates ``(rows, width)`` blocks in place (see :mod:`parallelvars.update_core`): ``g``
is the ``(1, width)`` reduced gradient every replica row receives, ``tmp`` / ``gtmp`` are
scratch. Scalars are Python floats, so numpy keeps the variable's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from parallelvars.errors import InvalidArgumentError
from parallelvars.optimizers._base import Optimizer

__all__ = ["SGD", "Momentum", "Adam", "AdamW", "Adagrad", "RMSProp"]

LearningRate = float | Callable[[int], float]


def _check_range(name: str, value: float, lo: float, hi: float) -> float:
    value = float(value)
    if not lo <= value <= hi:
        raise InvalidArgumentError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


class SGD(Optimizer):
    """Plain gradient descent.

    ``var -= lr * g``

    A sparse gradient updates only its rows.

    Example:
        >>> import numpy as np, parallelvars as pv
        >>> w = pv.Variable(np.ones(2, np.float32))
        >>> pv.optimizers.SGD(0.5).apply_gradients([(np.ones(2), w)])
        >>> w.tolist()
        [0.5, 0.5]
    """

    def __init__(self, learning_rate: LearningRate, name: str = "SGD") -> None:
        super().__init__(learning_rate, name)

    @staticmethod
    def _kernel(var: Any, slots: Any, g: Any, hp: Any, tmp: Any, gtmp: Any) -> None:
        step = gtmp[0]
        np.multiply(g, hp.lr, out=step)
        np.subtract(var, step, out=var)


class Momentum(Optimizer):
    """Gradient descent with momentum (slot ``momentum``).

    ``accum = momentum * accum + g``;
    ``var -= lr * accum``, or with ``use_nesterov``: ``var -= lr * g + lr * momentum * accum``.

    A sparse gradient updates only its rows (of the variable and of the accumulator).
    """

    def __init__(
        self,
        learning_rate: LearningRate,
        momentum: float,
        use_nesterov: bool = False,
        name: str = "Momentum",
    ) -> None:
        super().__init__(learning_rate, name)
        self.momentum = float(momentum)
        self.use_nesterov = bool(use_nesterov)

    def _slot_specs(self) -> list[tuple[str, float]]:
        return [("momentum", 0.0)]

    def _hyper(self, step: int) -> SimpleNamespace:
        lr = self._lr(step)
        return SimpleNamespace(
            lr=lr,
            momentum=self.momentum,
            lr_momentum=lr * self.momentum,
            nesterov=self.use_nesterov,
        )

    @staticmethod
    def _kernel(var: Any, slots: Any, g: Any, hp: Any, tmp: Any, gtmp: Any) -> None:
        accum = slots[0]
        np.multiply(accum, hp.momentum, out=accum)
        np.add(accum, g, out=accum)
        step = tmp[0]
        if hp.nesterov:
            np.multiply(accum, hp.lr_momentum, out=step)
            lg = gtmp[0]
            np.multiply(g, hp.lr, out=lg)
            np.add(step, lg, out=step)
        else:
            np.multiply(accum, hp.lr, out=step)
        np.subtract(var, step, out=var)


class Adam(Optimizer):
    """Adam in TensorFlow 1.x's "epsilon hat" form (slots ``m``, ``v``, and ``vhat``).

    With ``t`` the step number (1 on the first step) and the beta powers ``beta1^t``,
    ``beta2^t`` kept as non-slot variables (``beta1_power``, ``beta2_power``)::

        lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
        m    = beta1 * m + (1 - beta1) * g
        v    = beta2 * v + (1 - beta2) * g^2
        var -= lr_t * m / (sqrt(v) + epsilon)

    With ``amsgrad``: ``vhat = max(vhat, v)`` and ``sqrt(vhat)`` replaces ``sqrt(v)``.
    The moments decay in every row, so a sparse gradient is applied as its dense equivalent
    (TensorFlow 1.x's non-lazy sparse Adam gives the same values).
    """

    _sparse_as_dense = True

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        amsgrad: bool = False,
        name: str = "Adam",
    ) -> None:
        super().__init__(learning_rate, name)
        self.beta1 = _check_range("beta1", beta1, 0.0, 1.0)
        self.beta2 = _check_range("beta2", beta2, 0.0, 1.0)
        self.epsilon = float(epsilon)
        self.amsgrad = bool(amsgrad)
        self.beta1_power: Any = None
        self.beta2_power: Any = None

    def _slot_specs(self) -> list[tuple[str, float]]:
        return [("m", 0.0), ("v", 0.0)] + ([("vhat", 0.0)] if self.amsgrad else [])

    def _create_extra_non_slots(self, device: Any) -> None:
        # float64 whatever the variables' dtype: beta^t is then exact to ~1e-16 after any
        # number of steps, and lr_t is computed in float64 before it meets the variables.
        self._add_non_slot("beta1_power", self.beta1, np.float64, device)
        self._add_non_slot("beta2_power", self.beta2, np.float64, device)

    def _finish_extra(self) -> None:
        self.beta1_power.assign(self.beta1_power.read_value() * self.beta1)
        self.beta2_power.assign(self.beta2_power.read_value() * self.beta2)

    def _hyper(self, step: int) -> SimpleNamespace:
        lr = self._lr(step)
        b1p = float(self.beta1_power.read_value())
        b2p = float(self.beta2_power.read_value())
        return SimpleNamespace(
            lr=lr,
            lr_t=lr * math.sqrt(1.0 - b2p) / (1.0 - b1p),
            beta1=self.beta1,
            beta2=self.beta2,
            one_minus_beta1=1.0 - self.beta1,
            one_minus_beta2=1.0 - self.beta2,
            epsilon=self.epsilon,
            amsgrad=self.amsgrad,
            decay=0.0,
        )

    @staticmethod
    def _kernel(var: Any, slots: Any, g: Any, hp: Any, tmp: Any, gtmp: Any) -> None:
        m, v = slots[0], slots[1]
        if hp.decay:
            # AdamW's decoupled decay, on the value before the Adam step.
            shrink = tmp[1]
            np.multiply(var, hp.decay, out=shrink)
            np.subtract(var, shrink, out=var)
        gm, gv = gtmp
        np.multiply(g, hp.one_minus_beta1, out=gm)
        np.multiply(m, hp.beta1, out=m)
        np.add(m, gm, out=m)
        np.multiply(g, g, out=gv)
        np.multiply(gv, hp.one_minus_beta2, out=gv)
        np.multiply(v, hp.beta2, out=v)
        np.add(v, gv, out=v)
        if hp.amsgrad:
            vhat = slots[2]
            np.maximum(vhat, v, out=vhat)
            v = vhat
        step = tmp[0]
        np.sqrt(v, out=step)
        np.add(step, hp.epsilon, out=step)
        np.divide(m, step, out=step)
        np.multiply(step, hp.lr_t, out=step)
        np.subtract(var, step, out=var)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), slots as :class:`Adam`.

    Before the Adam step: ``var -= learning_rate * weight_decay * var`` (``learning_rate`` the
    undecayed rate of this step, not ``lr_t``); then exactly :class:`Adam`'s update. The decay
    reaches every row, so sparse gradients are applied as their dense equivalent.
    """

    def __init__(
        self,
        weight_decay: float,
        learning_rate: LearningRate = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        amsgrad: bool = False,
        name: str = "AdamW",
    ) -> None:
        super().__init__(learning_rate, beta1, beta2, epsilon, amsgrad, name)
        self.weight_decay = float(weight_decay)

    def _hyper(self, step: int) -> SimpleNamespace:
        hp = super()._hyper(step)
        hp.decay = hp.lr * self.weight_decay
        return hp


class Adagrad(Optimizer):
    """Adagrad, TensorFlow 1.x form: no epsilon (slot ``accumulator``).

    ``accum += g^2``; ``var -= lr * g / sqrt(accum)``. The accumulator starts at
    ``initial_accumulator_value`` (> 0, so the division is always defined). A sparse gradient
    updates only its rows.
    """

    def __init__(
        self,
        learning_rate: LearningRate,
        initial_accumulator_value: float = 0.1,
        name: str = "Adagrad",
    ) -> None:
        if not initial_accumulator_value > 0:
            raise InvalidArgumentError(
                f"initial_accumulator_value must be positive, got {initial_accumulator_value}"
            )
        super().__init__(learning_rate, name)
        self.initial_accumulator_value = float(initial_accumulator_value)

    def _slot_specs(self) -> list[tuple[str, float]]:
        return [("accumulator", self.initial_accumulator_value)]

    @staticmethod
    def _kernel(var: Any, slots: Any, g: Any, hp: Any, tmp: Any, gtmp: Any) -> None:
        accum = slots[0]
        gg = gtmp[0]
        np.multiply(g, g, out=gg)
        np.add(accum, gg, out=accum)
        step = tmp[0]
        np.sqrt(accum, out=step)
        np.divide(g, step, out=step)
        np.multiply(step, hp.lr, out=step)
        np.subtract(var, step, out=var)


class RMSProp(Optimizer):
    """RMSProp, TensorFlow 1.x form (slots ``rms``, ``momentum``, and ``mg`` when centered).

    The mean square ``rms`` starts at 1, epsilon sits inside the square root::

        rms  = decay * rms + (1 - decay) * g^2
        mom  = momentum * mom + lr * g / sqrt(rms + epsilon)
        var -= mom

    Centered: ``mg = decay * mg + (1 - decay) * g`` and the denominator is
    ``sqrt(rms - mg^2 + epsilon)``. A sparse gradient updates only its rows.
    """

    def __init__(
        self,
        learning_rate: LearningRate,
        decay: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-10,
        centered: bool = False,
        name: str = "RMSProp",
    ) -> None:
        super().__init__(learning_rate, name)
        self.decay = _check_range("decay", decay, 0.0, 1.0)
        self.momentum = float(momentum)
        self.epsilon = float(epsilon)
        self.centered = bool(centered)

    def _slot_specs(self) -> list[tuple[str, float]]:
        return [("rms", 1.0), ("momentum", 0.0)] + ([("mg", 0.0)] if self.centered else [])

    def _hyper(self, step: int) -> SimpleNamespace:
        return SimpleNamespace(
            lr=self._lr(step),
            decay=self.decay,
            one_minus_decay=1.0 - self.decay,
            momentum=self.momentum,
            epsilon=self.epsilon,
            centered=self.centered,
        )

    @staticmethod
    def _kernel(var: Any, slots: Any, g: Any, hp: Any, tmp: Any, gtmp: Any) -> None:
        rms, mom = slots[0], slots[1]
        gg = gtmp[0]
        np.multiply(g, g, out=gg)
        np.multiply(gg, hp.one_minus_decay, out=gg)
        np.multiply(rms, hp.decay, out=rms)
        np.add(rms, gg, out=rms)
        denom = tmp[0]
        if hp.centered:
            mg = slots[2]
            gm = gtmp[1]
            np.multiply(g, hp.one_minus_decay, out=gm)
            np.multiply(mg, hp.decay, out=mg)
            np.add(mg, gm, out=mg)
            np.multiply(mg, mg, out=denom)
            np.subtract(rms, denom, out=denom)
            np.add(denom, hp.epsilon, out=denom)
        else:
            np.add(rms, hp.epsilon, out=denom)
        np.sqrt(denom, out=denom)
        np.divide(g, denom, out=denom)
        np.multiply(denom, hp.lr, out=denom)
        np.multiply(mom, hp.momentum, out=mom)
        np.add(mom, denom, out=mom)
        np.subtract(var, mom, out=var)
