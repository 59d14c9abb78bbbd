"""Which strategy is current, and replica or cross-replica context: the public functions.

Execution starts in the default replica context of the default strategy. A strategy's
``scope()`` pushes a cross-replica mode; ``Strategy.run`` pushes a replica mode in each replica
thread. The stacks themselves live below variables, in :mod:`parallelvars._modes`; this module
reads them with the default strategy in force where no mode was pushed
(:func:`parallelvars.strategy._base.current_mode`).
"""

from __future__ import annotations

# The stacks (the strategies that enter and leave modes by hand read _MODES and _CREATORS).
from parallelvars._modes import _CREATORS as _CREATORS
from parallelvars._modes import _MODES as _MODES
from parallelvars._modes import Mode, creator_stack, push_mode, variable_creator_scope
from parallelvars.strategy._base import ReplicaContext, Strategy, current_mode
from parallelvars.strategy._base import _get_default_mode as _get_default_mode

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
