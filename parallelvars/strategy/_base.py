"""Strategy and replica-context base classes: scopes and variable placement.

A strategy owns a :class:`~parallelvars.devices.ParallelDevice` (its replicas' devices) and,
inside ``scope()``, decides what kind of variable ``pv.Variable(...)`` makes. Running replica
functions (``run``, ``merge_call``) and cross-replica reductions build on this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from parallelvars.devices import ParallelDevice
from parallelvars.errors import ContextError
from parallelvars.strategy import _context

__all__ = ["Strategy", "ReplicaContext", "MirroredStrategy", "OneDeviceStrategy"]


class ReplicaContext:
    """What a replica function sees of its strategy: its id and the merge point.

    Attributes:
        strategy: the strategy running this replica.
        replica_id_in_sync_group: this replica's index, ``0 .. num_replicas_in_sync - 1``.
    """

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int) -> None:
        self.strategy = strategy
        self.replica_id_in_sync_group = int(replica_id_in_sync_group)

    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple[str, ...]:
        """The device(s) of this replica."""
        return (self.strategy.devices.components[self.replica_id_in_sync_group],)

    def merge_call(self, fn: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Run ``fn(strategy, *args, **kwargs)`` once in cross-replica context.

        With one replica this is a direct call inside the cross-replica mode.
        """
        with _context.push_mode(_context.Mode(self.strategy, None)):
            return fn(self.strategy, *args, **(kwargs or {}))

    def _write_variable(self, var: Any, op: str, value: Any) -> Any:
        """Apply a write to a mirrored variable from this replica (``op``: assign / assign_add / assign_sub).

        One replica writes directly; strategies with several replicas merge the writes of all
        replicas (see ``MirroredStrategy``).
        """
        if self.num_replicas_in_sync == 1:
            return var._apply_write(op, value)
        raise ContextError(
            f"variable {var.name!r}: writing a mirrored variable from a replica context needs "
            f"{type(self.strategy).__name__} to merge the writes of its replicas"
        )

    def __repr__(self) -> str:
        return (
            f"<ReplicaContext replica {self.replica_id_in_sync_group} of "
            f"{self.num_replicas_in_sync} in {type(self.strategy).__name__}>"
        )


class Strategy:
    """Base class: a set of replica devices and the variables placed on them."""

    _is_default = False

    def __init__(self, devices: int | Sequence[str] | ParallelDevice) -> None:
        self._devices = ParallelDevice(devices)

    @property
    def devices(self) -> ParallelDevice:
        return self._devices

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

    @property
    def worker_devices(self) -> tuple[str, ...]:
        return self._devices.components

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return self._devices.components

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Enter the cross-replica context: variables made inside are placed by this strategy.

        Re-entering the scope of the strategy already current is a no-op; entering another
        strategy's scope inside one raises :class:`~parallelvars.errors.ContextError`.
        """
        mode = _context.current_mode()
        if mode.strategy is self:
            if mode.replica_context is not None:
                # Inside one of our replica functions: scope() makes it cross-replica again
                # only through merge_call; here it just keeps the replica mode.
                yield self
                return
            yield self
            return
        if not mode.strategy._is_default:
            raise ContextError(
                f"cannot enter the scope of {self!r} inside the scope of {mode.strategy!r}: "
                "strategies do not nest"
            )
        with _context.push_mode(_context.Mode(self, None)), _context.variable_creator_scope(
            self._variable_creator
        ):
            yield self

    def _variable_creator(self, next_creator: Any, **kwargs: Any) -> Any:
        from parallelvars.variables import _make_distributed_variable

        return _make_distributed_variable(self._devices, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self._devices.components)!r})"


class _DefaultStrategy(Strategy):
    """The strategy in force outside every scope: one replica, plain variables."""

    _is_default = True

    def __init__(self) -> None:
        super().__init__(1)
        self._default_replica_context = ReplicaContext(self, 0)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        yield self

    def __repr__(self) -> str:
        return "DefaultStrategy()"


class MirroredStrategy(Strategy):
    """Synchronous replication over several devices of one machine (one thread per replica).

    Args:
        devices: a number of replicas (``cpu:0 .. cpu:N-1``) or a list of device names.
            Defaults to one device.

    Example:
        >>> import numpy as np, parallelvars as pv
        >>> strategy = pv.MirroredStrategy(2)
        >>> with strategy.scope():
        ...     w = pv.Variable(np.zeros(3, np.float32), name="w")
        >>> w.kind, len(w.components)
        ('mirrored', 2)
    """

    def __init__(self, devices: int | Sequence[str] | ParallelDevice | None = None) -> None:
        super().__init__(1 if devices is None else devices)


class OneDeviceStrategy(Strategy):
    """A strategy with a single replica on one named device."""

    def __init__(self, device: str = "cpu:0") -> None:
        super().__init__([device])
