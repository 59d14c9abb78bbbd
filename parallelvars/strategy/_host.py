"""Host code inside replica functions (``outside_compilation``) and loss scaling.

``outside_compilation(fn, *args)`` runs ``fn`` as plain host code: outside the replicated
section, in the default strategy's context, with no strategy variable creator, so it sees no
replica (variables read as their primary, new variables are single-device). Sections do not
nest, and ``fn`` must leave the context as it found it.

Loss scaling: when per-replica losses are means over the replica's own batch, summing the
replicas' gradients (what the optimizers do) counts each example ``num_replicas`` times too
often, so the loss (or its gradients) is scaled by ``1 / num_replicas``. With a ``SUM`` loss
reduction the gradients are already right.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from parallelvars.enums import ReduceOp
from parallelvars.errors import ContextError
from parallelvars.strategy import _context

__all__ = [
    "outside_compilation",
    "in_outside_compilation",
    "get_loss_reduction",
    "set_loss_reduction",
    "loss_reduction",
    "scale_loss_for_replicas",
]

_OUTSIDE: contextvars.ContextVar[int] = contextvars.ContextVar("parallelvars_outside", default=0)
_LOSS_REDUCTION: contextvars.ContextVar[ReduceOp] = contextvars.ContextVar(
    "parallelvars_loss_reduction", default=ReduceOp.MEAN
)


def in_outside_compilation() -> bool:
    """True inside an :func:`outside_compilation` section."""
    return _OUTSIDE.get() > 0


def outside_compilation(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` as host code, outside the replicated section.

    Inside a replica function, ``fn`` runs in this replica's thread but in the default
    strategy's context (no replica, no strategy variable creator). Outside replica functions it
    is a plain call.

    Raises:
        ContextError: called inside another ``outside_compilation`` section, or ``fn`` left a
            different strategy context current than the one it was entered with (for example a
            ``scope()`` entered and never exited).
    """
    if _OUTSIDE.get():
        raise ContextError("outside_compilation sections cannot be nested")
    mode = _context.current_mode()
    ctx = mode.replica_context
    depth_token = _OUTSIDE.set(1)
    try:
        if ctx is None or mode.strategy._is_default:
            return _checked_call(fn, args, kwargs)
        host = _context._get_default_mode()
        modes_token = _context._MODES.set((host,))
        creators_token = _context._CREATORS.set(())
        try:
            return _checked_call(fn, args, kwargs)
        finally:
            _context._CREATORS.reset(creators_token)
            _context._MODES.reset(modes_token)
    finally:
        _OUTSIDE.reset(depth_token)


def _checked_call(fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    modes, creators = _context._MODES.get(), _context._CREATORS.get()
    result = fn(*args, **kwargs)
    if _context._MODES.get() is not modes or _context._CREATORS.get() is not creators:
        entered = modes[-1] if modes else _context._get_default_mode()
        left = _context.current_mode()
        raise ContextError(
            "the strategy context changed inside an outside_compilation section (entered in "
            f"{_describe(entered)}, left in {_describe(left)}); exit every scope it enters"
        )
    return result


def _describe(mode: _context.Mode) -> str:
    where = "cross-replica context" if mode.replica_context is None else repr(mode.replica_context)
    return f"{mode.strategy!r}, {where}"


def get_loss_reduction() -> ReduceOp:
    """How the current loss combines its examples: ``ReduceOp.MEAN`` (the default) or ``SUM``.

    Set with :func:`set_loss_reduction` or :func:`loss_reduction`; the setting is per context,
    and replica threads inherit the caller's.
    """
    return _LOSS_REDUCTION.get()


def set_loss_reduction(op: ReduceOp | str) -> None:
    """Record how the loss being computed reduces its examples (what :func:`get_loss_reduction` returns)."""
    _LOSS_REDUCTION.set(ReduceOp.parse(op))


@contextlib.contextmanager
def loss_reduction(op: ReduceOp | str) -> Iterator[None]:
    """Use ``op`` as the loss reduction inside the ``with`` block."""
    token = _LOSS_REDUCTION.set(ReduceOp.parse(op))
    try:
        yield
    finally:
        _LOSS_REDUCTION.reset(token)


def _num_replicas() -> int:
    ctx = _context.get_replica_context()
    return (
        ctx.num_replicas_in_sync
        if ctx is not None
        else _context.get_strategy().num_replicas_in_sync
    )


def _is_sparse(x: Any) -> bool:
    """A sparse gradient (``values``, ``indices``, ``dense_shape``), possibly a named tuple."""
    return all(hasattr(x, a) for a in ("values", "indices", "dense_shape"))


def scale_loss_for_replicas(value: Any, num_replicas: int | None = None) -> Any:
    """Scale a loss, or gradients, by ``1 / num_replicas`` when the loss reduction is ``MEAN``.

    Args:
        value: a loss (number or array), a list / tuple of gradients, or of
            ``(gradient, variable)`` pairs (the variables are left alone; ``None`` gradients too).
        num_replicas: defaults to the current replica context's (or strategy's) number.

    Returns:
        The scaled value, in the same structure; float arrays keep their dtype. Unchanged for a
        ``SUM`` loss reduction or a single replica.

    Example:
        >>> import parallelvars as pv
        >>> float(pv.scale_loss_for_replicas(2.0, num_replicas=4))
        0.5
    """
    n = _num_replicas() if num_replicas is None else int(num_replicas)
    if n <= 1 or get_loss_reduction() is ReduceOp.SUM:
        return value
    factor = 1.0 / n

    def scale(x: Any) -> Any:
        if x is None:
            return None
        if _is_sparse(x):
            return type(x)(scale(x.values), x.indices, x.dense_shape)
        arr = np.asarray(x)
        if arr.dtype.kind == "f":
            return arr * arr.dtype.type(factor)
        return arr * factor

    if isinstance(value, (list, tuple)) and not _is_sparse(value):
        out = [
            (scale(item[0]), *item[1:]) if isinstance(item, tuple) else scale(item)
            for item in value
        ]
        return type(value)(out)
    return scale(value)
