"""Strategy and replica-context base classes: scopes, placement and the cross-replica API.

A strategy owns a :class:`~parallelvars.devices.ParallelDevice` (its replicas' devices) and,
inside ``scope()``, decides what kind of variable ``pv.Variable(...)`` makes. The base class
runs a single replica in the caller's thread; :class:`~parallelvars.strategy.MirroredStrategy`
runs one thread per replica. Reductions and broadcasts go through ``_reduce_to`` /
``_broadcast_to`` so that a strategy with one process per replica can override just those.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import numpy as np

from parallelvars import _modes
from parallelvars._geometry import shard_index
from parallelvars.devices import ParallelDevice, canonical_device
from parallelvars.enums import Aggregation, ReduceOp
from parallelvars.errors import (
    ContextError,
    CrossReplicaOnlyError,
    DistributedValueError,
)
from parallelvars.strategy._reduce import device_key, reduce_values
from parallelvars.strategy._shared_variables import _create_once, _Creation
from parallelvars.strategy._values import (
    Mirrored,
    PerReplica,
    _needs_walk,
    local_results,
    map_leaves,
    regroup,
    select_replica,
)

__all__ = [
    "Strategy",
    "ReplicaContext",
    "OneDeviceStrategy",
    "UpdateContext",
    "get_update_device",
    "increment_var",
]

# The update-device stack lives below variables (which read it); re-exported here, its public home.
get_update_device = _modes.get_update_device
UpdateContext = _modes.UpdateContext
_default_mode: _modes.Mode[Strategy, ReplicaContext] | None = None


def _get_default_mode() -> _modes.Mode[Strategy, ReplicaContext]:
    global _default_mode
    if _default_mode is None:
        strategy = _DefaultStrategy()
        _default_mode = _modes.Mode(strategy, strategy._default_replica_context)
    return _default_mode


_modes.set_default_strategy(lambda: _get_default_mode().strategy)


def current_mode() -> _modes.Mode[Strategy, ReplicaContext]:
    """The innermost mode of this thread (the default replica context when none was pushed)."""
    stack = _modes._MODES.get()
    return stack[-1] if stack else _get_default_mode()


def _is_variable(x: Any) -> bool:
    from parallelvars.variables import ParallelVariable

    return isinstance(x, ParallelVariable)


def _creators_below(creator: Any) -> bool:
    """Whether creator scopes entered before ``creator``'s run below it in the chain."""
    stack = _modes.creator_stack()
    for i, c in enumerate(stack):
        if c == creator:
            return i > 0
    return False


def _short(value: Any) -> str:
    """A value for an error message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _top_default_replica_context() -> ReplicaContext:
    ctx = _get_default_mode().replica_context
    assert ctx is not None
    return ctx


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

    def _check_current(self) -> None:
        mode = current_mode()
        if mode.replica_context is not self:
            where = (
                "cross-replica context"
                if mode.replica_context is None
                else repr(mode.replica_context)
            )
            raise ContextError(
                f"merge_call of {self!r} called from {where}: call it from its own replica function"
            )

    def merge_call(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run ``fn(strategy, *args, **kwargs)`` once in cross-replica context.

        With several replicas every replica pauses here, the arguments of all replicas are
        grouped (values that differ become :class:`PerReplica`), ``fn`` runs once and each
        replica receives its part of the result. With one replica this is a direct call inside
        the cross-replica mode.
        """
        self._check_current()
        with _modes.push_mode(_modes.Mode(self.strategy, None)):
            result = fn(self.strategy, *args, **(kwargs or {}))
        try:
            return select_replica(0, result, 1)
        except ValueError as e:
            raise DistributedValueError(f"merge_call result: {e}") from None

    def all_reduce(self, op: ReduceOp | str, value: Any) -> Any:
        """Reduce ``value`` across the replicas and give every replica the result
        (TensorFlow 2's ``ReplicaContext.all_reduce``).

        Each replica contributes its own ``value`` (an array, a number, or a list, tuple or
        dict of them: the result has that structure); ``SUM`` adds them in device order,
        ``MEAN`` divides by the number of replicas. Every replica must call it.
        """

        def merge(strategy: Strategy, v: Any) -> Any:
            count = strategy._local_replica_count()

            def each(x: Any) -> Any:
                # One object that every replica handed in is still one contribution each.
                part = x if isinstance(x, PerReplica) else PerReplica([x] * count)
                total = strategy.reduce(op, part)
                return Mirrored([np.array(total, copy=True) for _ in range(count)])  # a copy each

            return map_leaves(each, v)

        return self.merge_call(merge, args=(value,))

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
    """Base class: a set of replica devices, the variables placed on them, and the
    cross-replica API (reduce, broadcast, update) over them.

    The base class runs its single replica in the caller's thread.
    """

    _is_default = False

    def _merges_writes_of(self, var: Any) -> bool:
        """True when writes to ``var`` from a replica function must go through
        ``ReplicaContext._write_variable`` although the variable has no component per replica
        in this process (a multi-process strategy's process-local variables)."""
        return False

    def __init__(self, devices: int | Sequence[str] | ParallelDevice) -> None:
        self._devices = ParallelDevice(devices)
        # id(component 0) -> variable, to map the components returned by replicas back to
        # their variable (checked component by component, so a reused id cannot mislead).
        self._owners: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        # The device list the fused sum order was worked out for, and that order.
        self._pv_sum_order: tuple[tuple[str, ...], tuple[int, ...] | None] | None = None

    # ------------------------------------------------------------------ devices
    @property
    def devices(self) -> ParallelDevice:
        return self._devices

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The devices replica functions run on, one per replica."""
        return self._devices.components

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices variables are placed on."""
        return self._devices.components

    # ------------------------------------------------------------------ scope and variables
    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Enter the cross-replica context: variables made inside are placed by this strategy.

        Re-entering the scope of the strategy already current is a no-op; entering another
        strategy's scope inside one raises :class:`~parallelvars.errors.ContextError`.
        """
        mode = current_mode()
        if mode.strategy is self:
            yield self
            return
        if not mode.strategy._is_default:
            raise ContextError(self._mixing_message("enter the scope of", mode.strategy))
        with (
            _modes.push_mode(_modes.Mode(self, None)),
            _modes.variable_creator_scope(self._variable_creator),
        ):
            yield self

    def _mixing_message(self, action: str, current: Strategy) -> str:
        same = " (another instance with the same devices)" if repr(current) == repr(self) else ""
        return (
            f"cannot {action} {self!r} inside the scope of {current!r}{same}: mixing "
            "different Strategy objects (strategies do not nest)"
        )

    def _variable_creator(self, next_creator: Any, **kwargs: Any) -> Any:
        """Place the variable on this strategy's devices (unless a creator inside already
        placed it) and hand it down the creator chain (``next_creator``), as every creator does.

        Inside a replica function every replica calls this; the variable is made once, from the
        first replica's arguments, in a ``merge_call``, and every replica receives it (the
        model-building pattern of TensorFlow's MirroredStrategy).
        """
        kwargs.setdefault("device", self._devices)
        ctx = current_mode().replica_context
        if ctx is not None and ctx.strategy is self and self.num_replicas_in_sync > 1:
            return ctx.merge_call(_create_once, args=(_Creation(next_creator, kwargs),))
        return self._create(next_creator, kwargs)

    def _create(self, next_creator: Any, kwargs: dict[str, Any]) -> Any:
        """Make the variable down the creator chain, then show the creators below this
        strategy's one call per further device, as TensorFlow's mirrored creator calls them
        once per device: with the name ``<name>/replica_<i>``, ``next_creator`` there returns
        component ``i`` (a :class:`~parallelvars.ComponentVariable`). The variable made first
        is the one returned."""
        var = self._register(next_creator(**kwargs))
        comps = getattr(var, "components", None)
        if comps is None or len(comps) < 2 or not _creators_below(self._variable_creator):
            return var
        for i in range(1, len(comps)):
            next_creator(**{**kwargs, "name": f"{var.name}/replica_{i}", "_component_of": (var, i)})
        return var

    def _check_creation_context(self, name: Any) -> None:
        ctx = current_mode().replica_context
        if ctx is not None and ctx.strategy is self and self.num_replicas_in_sync > 1:
            raise ContextError(
                f"variable {name!r}: cannot create a variable inside a replica function of "
                f"{self!r} (each replica would make its own); create it in strategy.scope() "
                "or in a merge_call function"
            )

    def _register(self, var: Any) -> Any:
        if _is_variable(var):
            self._owners[id(var.components[0])] = var
            var._self_strategy = weakref.ref(self)  # var.distribute_strategy
        return var

    def _owner_of(self, values: Sequence[Any]) -> Any:
        """The variable whose components ``values`` are, or None."""
        first = values[0]
        if not isinstance(first, np.ndarray):
            return None
        var = self._owners.get(id(first))
        if var is None:
            return None
        comps = var.components
        if len(comps) != len(values) or any(
            c is not v for c, v in zip(comps, values, strict=False)
        ):
            return None
        return var

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with: Any) -> Iterator[None]:
        """Variables made inside are placed on the devices of ``colocate_with``.

        Args:
            colocate_with: a variable, or devices as returned by :meth:`non_slot_devices`.
        """
        mode = current_mode()
        if mode.strategy is not self:
            raise ContextError(
                f"colocate_vars_with() of {self!r} needs its scope (current strategy: "
                f"{mode.strategy!r})"
            )
        if _is_variable(colocate_with):
            target = colocate_with.device
        elif isinstance(colocate_with, (ParallelDevice, str)) or (
            isinstance(colocate_with, (tuple, list))
            and all(isinstance(d, str) for d in colocate_with)
        ):
            target = ParallelDevice(colocate_with)
        else:
            raise DistributedValueError(
                f"colocate_vars_with() takes a variable or device names, found {type(colocate_with).__name__}"
            )

        def creator(next_creator: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("device", target)
            return next_creator(**kwargs)  # the strategy's creator, further down, registers it

        with _modes.variable_creator_scope(creator):
            yield

    def non_slot_devices(self, var_list: Sequence[Any]) -> Any:
        """Where to keep variables that belong to no single variable (an optimizer's step
        counters): pass the result to :meth:`colocate_vars_with` and :meth:`update_non_slot`."""
        return self.parameter_devices

    # ------------------------------------------------------------------ running replicas
    def _check_can_run(self) -> None:
        mode = current_mode()
        ctx = mode.replica_context
        if ctx is not None and ctx is not _top_default_replica_context():
            raise ContextError(
                f"run() of {self!r} called inside a replica function ({ctx!r}): runs do not "
                "nest; use get_replica_context().merge_call(...) to reach cross-replica context"
            )
        if mode.strategy is not self and not mode.strategy._is_default:
            raise ContextError(self._mixing_message("run", mode.strategy))

    def run(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Call ``fn(*args, **kwargs)`` once per replica, each in a replica context.

        :class:`PerReplica` arguments are unwrapped (replica ``i`` gets element ``i``); other
        arguments reach every replica as they are. The results are merged: the same object from
        every replica is returned as is, the components of one variable as that variable, and
        values that differ as a :class:`PerReplica`.

        Raises:
            ContextError: called inside a replica function or another strategy's scope.
            DistributedValueError: a per-replica argument has the wrong number of values.
        """
        self._check_can_run()
        args = tuple(args)
        kwargs = dict(kwargs or {})
        n = self.num_replicas_in_sync
        if _needs_walk(args) or _needs_walk(kwargs):
            for x in (args, kwargs):
                try:
                    select_replica(0, x, n)
                except ValueError as e:
                    raise DistributedValueError(f"run() of {self!r}: {e}") from None
        return self._run(fn, args, kwargs)

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ctx = ReplicaContext(self, 0)
        a = select_replica(0, args)
        kw = select_replica(0, kwargs)
        with self.scope(), _modes.push_mode(_modes.Mode(self, ctx)):
            return fn(*a, **kw)

    # ------------------------------------------------------------------ cross-replica API
    def _require_cross_replica(self, method: str) -> None:
        mode = current_mode()
        ctx = mode.replica_context
        if ctx is not None and ctx is not _top_default_replica_context():
            raise CrossReplicaOnlyError(
                f"{type(self).__name__}.{method}() is cross-replica only and was called from "
                f"{ctx!r}; call it inside get_replica_context().merge_call(fn) or outside run()"
            )
        if mode.strategy is not self and not mode.strategy._is_default:
            raise ContextError(self._mixing_message(f"call {method}() of", mode.strategy))

    def _values_of(self, value: Any, method: str) -> tuple[tuple[Any, ...], tuple[str, ...]]:
        """A value's per-device parts and their devices, for a reduction."""
        if isinstance(value, PerReplica):
            devices = self.worker_devices
            if len(value) != len(devices):
                raise DistributedValueError(
                    f"{method}(): a {type(value).__name__} with {len(value)} values for "
                    f"{len(devices)} replicas of {self!r} (expected {len(devices)}, found {len(value)})"
                )
            return value.values, devices
        if _is_variable(value):
            return tuple(value.components), tuple(value.devices)
        # A plain value is already one cross-replica value: reducing it changes nothing (the
        # optimizers hand batch_reduce gradients that were reduced before).
        return (value,), self.worker_devices[:1]

    def reduce(
        self,
        op: ReduceOp | Aggregation | str,
        value: Any,
        axis: Any = None,
        *,
        destinations: Any = None,
    ) -> Any:
        """Combine a per-replica value across replicas into one numpy array.

        Args:
            op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN``; an :class:`~parallelvars.Aggregation`
                is accepted too (``SUM``, ``MEAN``, and ``ONLY_FIRST_REPLICA``: the first
                replica's value), as the seeds' ``reduce(aggregation, value, destinations)``.
            value: a :class:`PerReplica` (for example the result of :meth:`run`), a
                :class:`Mirrored` value (one copy per device, each counted), a variable (its
                components), or a list, tuple or dict of them (the result has the same
                structure, each element reduced on its own, as TensorFlow 2's ``reduce``). A
                plain value is one cross-replica value, the same for every replica: ``MEAN``
                and ``ONLY_FIRST_REPLICA`` give it back (``MEAN`` along ``axis`` if given);
                ``SUM`` over several replicas is refused, as in TensorFlow (summing one value
                "from every replica" is not defined), except a scalar zero.
            axis: also reduce along this axis of each replica's value. ``MEAN`` then gives
                the mean over all elements of all replicas along the axis, which differs from
                the mean of per-replica means when replicas hold uneven batches. A variable,
                device name(s) or :class:`ParallelDevice` here is the seeds' ``destinations``
                argument (see below), not an axis.
            destinations: where the result is used (the seeds' third argument). As in
                :meth:`batch_reduce`, the result is one plain array whatever the destination,
                which every component of a variable there can take; an invalid destination is
                an error.

        Returns:
            A numpy array (or the structure of ``value`` holding one per element). Summation
            is deterministic: per device, then in device order. The ``MEAN`` of integers is a
            true division, in float64.

        Raises:
            DistributedValueError: a plain value summed over several replicas, or a
                per-replica value with the wrong number of values.
        """
        self._require_cross_replica("reduce")
        if axis is not None and not isinstance(axis, (int, np.integer)):
            if destinations is not None:
                raise DistributedValueError(
                    f"reduce() got destinations twice ({axis!r} and {destinations!r})"
                )
            axis, destinations = None, axis
        if destinations is not None:
            self._check_destinations(destinations)
        rop = self._parse_reduce_op(op)
        if isinstance(value, (list, tuple, dict)):
            return map_leaves(lambda v: self._reduce_one(op, rop, v, axis), value)
        return self._reduce_one(op, rop, value, axis)

    # Whether a plain (not per-replica) value handed to reduce() is one value that every
    # replica holds (threads of one process), rather than this process's part of a value
    # spread over processes (the multi-process strategy).
    _plain_is_shared = True

    def _reduce_one(self, op: Any, rop: ReduceOp | None, value: Any, axis: int | None) -> Any:
        """reduce() of one value (not a structure)."""
        if self._plain_is_shared and not isinstance(value, PerReplica) and not _is_variable(value):
            return self._reduce_shared(op, rop, value, axis)
        values, devices = self._values_of(value, "reduce")
        if rop is None:  # Aggregation.ONLY_FIRST_REPLICA
            if type(self)._reduce_to is not Strategy._reduce_to:
                raise DistributedValueError(
                    f"reduce() of {self!r}: ONLY_FIRST_REPLICA needs every replica's value in "
                    "this process (expected ReduceOp.SUM or MEAN)"
                )
            first = values[0]
            if axis is not None:
                return np.sum(np.asarray(first), axis=int(axis))
            return np.array(first.read_value() if _is_variable(first) else first, copy=True)
        return self._reduce_to(rop, values, devices, axis)

    def _reduce_shared(self, op: Any, rop: ReduceOp | None, value: Any, axis: int | None) -> Any:
        """reduce() of a plain value: one value that every replica holds (see :meth:`reduce`)."""
        arr = np.asarray(value.read_value() if _is_variable(value) else value)
        if rop is ReduceOp.SUM and self.num_replicas_in_sync > 1:
            if arr.ndim == 0 and arr.dtype.kind in "biufc" and arr == 0:
                return np.array(arr, copy=True)  # zero from every replica sums to zero
            raise DistributedValueError(
                f"reduce() of {self!r}: a value that is not per-replica ({_short(value)}) cannot "
                f"be reduced with {op} over {self.num_replicas_in_sync} replicas (expected a "
                "PerReplica value, e.g. the result of run(); MEAN or ONLY_FIRST_REPLICA "
                "give a shared value back)"
            )
        if axis is None:
            return np.array(arr, copy=True)
        mean = ReduceOp.MEAN if rop is ReduceOp.MEAN else ReduceOp.SUM
        return reduce_values(mean, [arr], self.worker_devices[:1], int(axis))

    @staticmethod
    def _parse_reduce_op(op: Any) -> ReduceOp | None:
        """A :class:`ReduceOp` from a ReduceOp, an Aggregation or their names; ``None`` for
        ``Aggregation.ONLY_FIRST_REPLICA``."""
        if isinstance(op, Aggregation):
            if op is Aggregation.NONE:
                raise DistributedValueError(
                    "cannot reduce with Aggregation.NONE (expected SUM, MEAN or ONLY_FIRST_REPLICA)"
                )
            if op is Aggregation.ONLY_FIRST_REPLICA:
                return None
            return ReduceOp.SUM if op is Aggregation.SUM else ReduceOp.MEAN
        if isinstance(op, str) and op.lower() == "only_first_replica":
            return None
        try:
            return cast(ReduceOp, ReduceOp.parse(op))
        except ValueError as e:
            raise DistributedValueError(str(e)) from None

    def _check_destinations(self, destinations: Any) -> None:
        if _is_variable(destinations):
            return
        try:
            ParallelDevice(destinations)
        except (TypeError, ValueError):
            raise DistributedValueError(
                f"reduce() destinations must be a variable or device names, found {destinations!r}"
            ) from None

    def _reduce_to(
        self, op: ReduceOp, values: Sequence[Any], devices: Sequence[str], axis: int | None = None
    ) -> Any:
        """Reduce ``values[i]`` (on ``devices[i]``); the hook a multi-process strategy overrides."""
        return reduce_values(op, values, devices, axis)

    def batch_reduce(
        self, op: ReduceOp | str, value_destination_pairs: Iterable[tuple[Any, Any]]
    ) -> list[Any]:
        """Reduce several values at once: ``[(per_replica_value, destination), ...]``.

        The destination (usually the variable the value is a gradient of) says where the result
        is used; the result is a plain numpy array that :meth:`update` hands to every component.

        Returns:
            One reduced value per pair, in order.
        """
        self._require_cross_replica("batch_reduce")
        rop = self._parse_reduce_op(op)
        if rop is None:
            raise DistributedValueError(
                "batch_reduce() takes ReduceOp.SUM or MEAN (or Aggregation.SUM / MEAN), found "
                f"{op!r}; reduce() takes ONLY_FIRST_REPLICA"
            )
        pairs = list(value_destination_pairs)
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise DistributedValueError(
                    f"batch_reduce() takes (value, destination) pairs, found {type(pair).__name__}"
                )
        if self._plain_is_shared:
            shared = [
                i
                for i, (v, _) in enumerate(pairs)
                if not isinstance(v, PerReplica) and not _is_variable(v)
            ]
            if shared:  # plain values follow reduce()'s rule, the others are reduced together
                out: list[Any] = [None] * len(pairs)
                for i in shared:
                    out[i] = self._reduce_shared(op, rop, pairs[i][0], None)
                rest = [i for i in range(len(pairs)) if out[i] is None]
                if rest:
                    reduced = self.batch_reduce(rop, [pairs[i] for i in rest])
                    for i, r in zip(rest, reduced, strict=True):
                        out[i] = r
                return out
        parts = [self._values_of(v, "batch_reduce") for v, _ in pairs]
        return self._batch_reduce_to(rop, [p[0] for p in parts], [p[1] for p in parts])

    def _batch_reduce_to(
        self, op: ReduceOp, values: Sequence[Sequence[Any]], devices: Sequence[Sequence[str]]
    ) -> list[Any]:
        return [self._reduce_to(op, v, d) for v, d in zip(values, devices, strict=False)]

    # ------------------------------------------------------------------ the fused gradient path
    # How ``Optimizer.apply_gradients`` reduces flat per-replica gradient buffers (see
    # parallelvars.optimizers._base): the replicas this process holds, the order in which a SUM
    # adds them, and the reduction across processes.
    def _local_replica_count(self) -> int:
        """How many replicas' values a merge_call of this process sees."""
        return self.num_replicas_in_sync

    def _fused_sum_order(self) -> tuple[int, ...] | None:
        """The local replicas in the order a SUM adds them (device order, as ``add_n_by_device``
        does), or ``None`` where two replicas share a device (their sum is grouped per device).
        Worked out once per device list (every step asks)."""
        given = self.worker_devices
        known = self._pv_sum_order
        if known is not None and known[0] == given:
            return known[1]
        devices = [canonical_device(d) for d in given]
        order = (
            None
            if len(set(devices)) != len(devices)
            else tuple(sorted(range(len(devices)), key=lambda i: device_key(devices[i])))
        )
        self._pv_sum_order = (given, order)
        return order

    def _allreduce_flat(self, buffer: np.ndarray) -> np.ndarray:
        """The SUM of ``buffer`` over processes (rank order); one process: the buffer itself."""
        return buffer

    def _merge_args(self, values: Sequence[Any]) -> Any:
        """The merge_call argument made of each local replica's ``values[i]`` (as ``merge_call``
        would have grouped it)."""
        return regroup(values, self._owner_of)

    def broadcast(self, value: Any, destinations: Any = None) -> Mirrored:
        """Copy ``value`` to every worker device (or to ``destinations``: a variable or devices).

        Returns:
            A :class:`Mirrored` value with one copy per device; passed to :meth:`run`, each
            replica receives its own copy.
        """
        self._require_cross_replica("broadcast")
        if isinstance(value, PerReplica):
            raise DistributedValueError("broadcast() takes one value, found a per-replica value")
        if destinations is None:
            devices = self.worker_devices
        elif _is_variable(destinations):
            devices = tuple(destinations.devices)
        else:
            devices = ParallelDevice(destinations).components
        return self._broadcast_to(value, devices)

    def gather(self, value: Any, axis: int = 0) -> np.ndarray:
        """The full value of a distributed value, in cross-replica context (TensorFlow's
        ``Strategy.gather``).

        A sharded variable gives its full value (``axis`` is not used); a per-replica value
        (or a variable's components) gives the replicas' parts concatenated along ``axis`` in
        replica order; a plain value is one value already and comes back as a copy. Under a
        multi-process strategy this is a collective (every process calls it): the one explicit
        way to see a sharded variable's full value there, whose reads give the local shard.
        """
        self._require_cross_replica("gather")
        if getattr(value, "kind", None) == "sharded" and _is_variable(value):
            return np.array(value.read_value(), copy=True)
        if isinstance(value, PerReplica) or _is_variable(value):
            parts = value.values if isinstance(value, PerReplica) else value.components
            arrays = [np.asarray(p.read_value() if _is_variable(p) else p) for p in parts]
            if arrays[0].ndim == 0:
                raise DistributedValueError("gather() needs values with at least one axis")
            return np.concatenate(arrays, axis=int(axis))
        return np.array(value, copy=True)

    def _broadcast_to(self, value: Any, devices: Sequence[str]) -> Mirrored:
        """Make one copy of ``value`` per device; the hook a multi-process strategy overrides."""
        src = np.asarray(value.read_value() if _is_variable(value) else value)
        return Mirrored([np.array(src, copy=True) for _ in devices])

    def update(self, var: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(component, *args, **kwargs)`` for every component of ``var``.

        ``component`` is a :class:`~parallelvars.ComponentVariable`: a numpy view of the
        component's buffer that also has ``assign`` / ``assign_add`` / ``assign_sub`` /
        ``read_value`` (the per-device variable TensorFlow hands ``fn``, named ``<name>`` on
        the first device and ``<name>/replica_<i>`` on the others), so both
        ``component -= lr * g`` and ``component.assign_sub(lr * g)`` write this component. A
        variable with one component is handed to ``fn`` itself, as TensorFlow's one-device
        strategies do.
        Arguments are unwrapped per component: a :class:`PerReplica` gives its element ``i``, a
        variable on the same devices its component ``i``, and for a sharded ``var`` an array of
        the full shape its shard. Each call runs inside an :func:`UpdateContext` for the
        component's device.

        Returns:
            The merged results (see :meth:`run`), e.g. ``None`` when ``fn`` returns nothing; a
            ``fn`` returning its component gives back ``var``.
        """
        self._require_cross_replica("update")
        if not _is_variable(var):
            with UpdateContext(self.parameter_devices[0]):
                return fn(var, *(select_replica(0, a) for a in args), **kwargs)
        from parallelvars._proxy import component_variable

        comps = var.components
        devices = var.devices
        if len(comps) == 1 and var.kind != "sharded":
            # One device: fn gets the variable itself, as from TensorFlow's one-device
            # strategies (there is no per-device variable to hand out).
            a = [self._unwrap_for(var, 0, x) for x in args]
            kw = {k: self._unwrap_for(var, 0, x) for k, x in kwargs.items()}
            with UpdateContext(devices[0]):
                return fn(var, *a, **kw)
        results = []
        for i, (comp, dev) in enumerate(zip(comps, devices, strict=False)):
            a = [self._unwrap_for(var, i, x) for x in args]
            kw = {k: self._unwrap_for(var, i, x) for k, x in kwargs.items()}
            view = component_variable(var, i)
            with UpdateContext(dev):
                result = fn(view, *a, **kw)
            results.append(comp if result is view else result)
        return regroup(results, self._owner_of)

    def _unwrap_for(self, var: Any, i: int, x: Any) -> Any:
        n = len(var.components)
        if isinstance(x, PerReplica):
            if len(x) != n:
                raise DistributedValueError(
                    f"variable {var.name!r}: update() argument {type(x).__name__} has {len(x)} "
                    f"values for {n} components (expected {n}, found {len(x)})"
                )
            return x.values[i]
        if _is_variable(x):
            if len(x.components) == n and (var.kind != "sharded" or x.kind == "sharded"):
                return x.components[i]
            return x
        if var.kind == "sharded" and isinstance(x, np.ndarray) and x.shape == var.shape:
            axis, off = var.shard_axis, var.shard_offsets[i]
            return x[shard_index(x.ndim, axis, off, off + var.components[i].shape[axis])]
        if isinstance(x, (list, tuple, dict)):
            return select_replica(i, x, n)
        return x

    def update_non_slot(
        self, colocate_with: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` once, updating the non-slot variables on ``colocate_with``.

        ``colocate_with`` is what :meth:`non_slot_devices` returned. ``fn`` runs once (not once
        per device): a write through a mirrored variable already reaches every component.

        Returns:
            ``fn``'s result.
        """
        self._require_cross_replica("update_non_slot")
        if _needs_walk(args) or _needs_walk(kwargs):
            raise DistributedValueError(
                "update_non_slot() arguments must be the same for every device, found a "
                "per-replica value"
            )
        devices = tuple(colocate_with.devices) if _is_variable(colocate_with) else colocate_with
        with UpdateContext(devices):
            return fn(*args, **kwargs)

    def read_var(self, var: Any) -> np.ndarray:
        """The value of ``var`` as cross-replica code sees it (aggregated for on-read variables)."""
        self._require_cross_replica("read_var")
        if _is_variable(var):
            return var.read_value()
        return np.array(var, copy=True)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The per-device parts of ``value``: a per-replica value's values, a variable's
        components, else ``(value,)``."""
        self._require_cross_replica("experimental_local_results")
        return local_results(value)

    def group(self, value: Any) -> tuple[Any, ...]:
        """Every per-device part of ``value`` (walking lists, tuples and dicts), flattened."""
        self._require_cross_replica("group")
        out: list[Any] = []

        def walk(x: Any) -> None:
            if isinstance(x, (list, tuple)) and not isinstance(x, PerReplica):
                for i in x:
                    walk(i)
            elif isinstance(x, dict):
                for i in x.values():
                    walk(i)
            else:
                out.extend(local_results(x))

        walk(value)
        return tuple(out)

    def experimental_distribute_dataset(self, dataset: Any, batch_size: int | None = None) -> Any:
        """Split global batches across the replicas (see :class:`DistributedDataset`)."""
        from parallelvars.strategy._input import DistributedDataset

        return DistributedDataset(dataset, self.num_replicas_in_sync, batch_size=batch_size)

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
        """The default strategy's scope: variables made inside are plain ones, and a variable
        made there by another strategy (whose scope was entered inside) is refused, as in
        TensorFlow."""
        mode = current_mode()
        if not mode.strategy._is_default:
            raise ContextError(self._mixing_message("enter the scope of", mode.strategy))
        with _modes.variable_creator_scope(self._variable_creator):
            yield self

    def _variable_creator(self, next_creator: Any, **kwargs: Any) -> Any:
        current = current_mode().strategy
        if not current._is_default:
            raise ContextError(
                f"variable {kwargs.get('name')!r} created by {current!r} inside the scope of "
                f"{self!r} entered before it: mixing different Strategy objects (create it "
                f"outside the default strategy's scope, or in {current!r}'s scope alone)"
            )
        return next_creator(**kwargs)

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with: Any) -> Iterator[None]:
        yield  # plain variables have nowhere else to go

    def non_slot_devices(self, var_list: Sequence[Any]) -> Any:
        # As a single-device strategy: the first variable by name, a stable choice.
        var_list = list(var_list)
        if not var_list:
            return self.parameter_devices
        return min(var_list, key=lambda v: str(getattr(v, "name", "")))

    def __repr__(self) -> str:
        return "DefaultStrategy()"


class OneDeviceStrategy(Strategy):
    """A strategy with a single replica on one named device."""

    def __init__(self, device: str = "cpu:0") -> None:
        super().__init__([device])


def increment_var(var: Any, amount: Any = 1) -> None:
    """Add ``amount`` to ``var`` once, whether called from replica or cross-replica context.

    In a replica function this goes through ``merge_call``, so the variable grows by
    ``amount`` once per step, not once per replica (a global step counter).
    """

    def add(component: np.ndarray) -> None:
        np.add(component, amount, out=component, casting="same_kind")

    def merge_fn(strategy: Strategy, v: Any) -> None:
        strategy.update(v, add)

    mode = current_mode()
    ctx = mode.replica_context
    if ctx is None:
        merge_fn(mode.strategy, var)
    else:
        ctx.merge_call(merge_fn, args=(var,))
