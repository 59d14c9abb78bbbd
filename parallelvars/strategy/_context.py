"""The per-thread mode stack: which strategy is current, and replica or cross-replica context.

Execution starts in the default replica context of the default strategy. A strategy's
``scope()`` pushes a cross-replica mode; ``Strategy.run`` pushes a replica mode in each replica
thread. The stack lives in a :class:`contextvars.ContextVar`, so every thread starts with an
empty stack, and a replica thread started with ``contextvars.copy_context().run`` inherits its
parent's (the replica runner relies on that).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parallelvars.strategy._base import ReplicaContext, Strategy

__all__ = [
    "Mode",
    "current_mode",
    "push_mode",
    "get_strategy",
    "has_strategy",
    "get_replica_context",
    "get_cross_replica_context",
    "in_cross_replica_context",
    "variable_creator_scope",
    "creator_stack",
]


@dataclass(frozen=True)
class Mode:
    """One entry of the mode stack."""

    strategy: Strategy
    replica_context: ReplicaContext | None  # None: cross-replica context


_MODES: contextvars.ContextVar[tuple[Mode, ...]] = contextvars.ContextVar(
    "parallelvars_modes", default=()
)
_CREATORS: contextvars.ContextVar[tuple[Callable[..., Any], ...]] = contextvars.ContextVar(
    "parallelvars_creators", default=()
)
_default_mode: Mode | None = None


def _get_default_mode() -> Mode:
    global _default_mode
    if _default_mode is None:
        from parallelvars.strategy._base import _DefaultStrategy

        strategy = _DefaultStrategy()
        _default_mode = Mode(strategy, strategy._default_replica_context)
    return _default_mode


def current_mode() -> Mode:
    """The innermost mode of this thread (the default replica context when none was pushed)."""
    stack = _MODES.get()
    return stack[-1] if stack else _get_default_mode()


@contextlib.contextmanager
def push_mode(mode: Mode) -> Iterator[Mode]:
    """Enter ``mode`` for the duration of the ``with`` block."""
    token = _MODES.set((*_MODES.get(), mode))
    try:
        yield mode
    finally:
        _MODES.reset(token)


def get_strategy() -> Strategy:
    """The current strategy: the innermost ``scope()`` or ``run()``, else the default strategy."""
    return current_mode().strategy


def has_strategy() -> bool:
    """True inside a non-default strategy's scope or replica function."""
    return not current_mode().strategy._is_default


def get_replica_context() -> ReplicaContext | None:
    """The current replica context, or ``None`` in a cross-replica context.

    Outside every strategy this is the default strategy's replica context (one replica).
    """
    return current_mode().replica_context


def get_cross_replica_context() -> Strategy | None:
    """The current strategy when in a cross-replica context, else ``None``."""
    mode = current_mode()
    return mode.strategy if mode.replica_context is None else None


def in_cross_replica_context() -> bool:
    return current_mode().replica_context is None


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
