"""The per-thread stacks every layer reads: modes, variable creators, the device being updated.

A *mode* pairs a strategy with a replica context (``None``: the cross-replica context). A
strategy's ``scope()`` pushes a cross-replica mode, ``Strategy.run`` pushes a replica mode in
each replica thread, and ``pv.Variable(...)`` runs the creators pushed by scopes. The stacks
live in :class:`contextvars.ContextVar` objects, so every thread starts with empty stacks, and a
replica thread started with ``contextvars.copy_context().run`` inherits its parent's (the
replica runner relies on that).

This module sits below variables and strategies and knows neither: with no mode pushed,
:func:`innermost` is ``None`` and a variable behaves as outside every strategy. The default
strategy that the public functions report there (``pv.get_strategy()``) belongs to the strategy
layer (:func:`parallelvars.strategy._base.current_mode`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = [
    "Mode",
    "UpdateContext",
    "creator_stack",
    "default_strategy",
    "get_update_device",
    "innermost",
    "push_mode",
    "replica_context",
    "variable_creator_scope",
]

S = TypeVar("S", covariant=True)
R = TypeVar("R", covariant=True)


@dataclass(frozen=True)
class Mode(Generic[S, R]):
    """One entry of the mode stack: a strategy and its replica context (None: cross-replica)."""

    strategy: S
    replica_context: R | None


_MODES: contextvars.ContextVar[tuple[Mode[Any, Any], ...]] = contextvars.ContextVar(
    "parallelvars_modes", default=()
)
_CREATORS: contextvars.ContextVar[tuple[Callable[..., Any], ...]] = contextvars.ContextVar(
    "parallelvars_creators", default=()
)
_UPDATE_DEVICE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "parallelvars_update_device", default=None
)


# The function giving the default strategy: the strategy layer installs it when it is imported
# (importing parallelvars imports it), so this module need not know strategies.
_default_strategy: Callable[[], Any] | None = None


def set_default_strategy(get: Callable[[], Any]) -> None:
    """Install ``get()`` as the source of :func:`default_strategy` (the strategy layer's)."""
    global _default_strategy
    _default_strategy = get


def default_strategy() -> Any:
    """The strategy in force outside every scope, as the strategy layer defines it."""
    get = _default_strategy
    assert get is not None, "importing parallelvars installs the default strategy"
    return get()


def innermost() -> Mode[Any, Any] | None:
    """The innermost mode pushed in this thread, or None outside every strategy."""
    stack = _MODES.get()
    return stack[-1] if stack else None


def replica_context() -> Any:
    """The innermost mode's replica context; None in a cross-replica context or when no mode
    was pushed (a variable's writes and reads then need no replica)."""
    stack = _MODES.get()
    return stack[-1].replica_context if stack else None


@contextlib.contextmanager
def push_mode(mode: Mode[Any, Any]) -> Iterator[Mode[Any, Any]]:
    """Enter ``mode`` for the duration of the ``with`` block."""
    token = _MODES.set((*_MODES.get(), mode))
    try:
        yield mode
    finally:
        _MODES.reset(token)


@contextlib.contextmanager
def variable_creator_scope(creator: Callable[..., Any]) -> Iterator[None]:
    """Install ``creator(next_creator, **kwargs)`` around ``pv.Variable(...)`` calls.

    Creators nest: the innermost runs first and calls ``next_creator(**kwargs)`` to delegate.
    """
    token = _CREATORS.set((*_CREATORS.get(), creator))
    try:
        yield
    finally:
        _CREATORS.reset(token)


def creator_stack() -> tuple[Callable[..., Any], ...]:
    return _CREATORS.get()


def get_update_device() -> Any:
    """The device (or devices) being updated inside ``update()`` / ``update_non_slot()``, else None."""
    return _UPDATE_DEVICE.get()


@contextlib.contextmanager
def UpdateContext(device: Any) -> Iterator[None]:
    """Mark the code inside as updating ``device`` (see :func:`get_update_device`)."""
    token = _UPDATE_DEVICE.set(device)
    try:
        yield
    finally:
        _UPDATE_DEVICE.reset(token)
