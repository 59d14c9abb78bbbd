"""Parallel variables: a ``wrapt.ObjectProxy`` over the primary component of a stacked buffer.

The one module over 900 lines, on purpose: the proxy and its overridden dunders belong together.

A :class:`ParallelVariable` holds all its components in one ``(n, *shape)`` numpy buffer;
component ``i`` is the view ``stacked[i]`` and the proxy wraps ``stacked[0]`` (the primary), so
``np.asarray(v)``, ``v.shape``, ``v + 1`` and ``v[2:]`` behave like the primary array. Inside a
replica function of the variable's strategy, reads see the replica's own component instead.
An on-read variable outside its replica functions reads as its aggregate, as TensorFlow's
SyncOnRead variables do (``np.asarray``, ``repr``, ``int``, arithmetic, ``read_value()``: the
SUM total, the MEAN, the primary for ONLY_FIRST_REPLICA); ``.primary``, ``.components`` and
``.stacked`` are always the raw parts.

Kinds (``v.kind``):

* ``single``: one component, made outside any strategy.
* ``mirrored``: made in a strategy scope (``Synchronization.ON_WRITE``); every write reaches
  every component.
* ``on_read``: ``Synchronization.ON_READ`` with an aggregation (SUM / MEAN /
  ONLY_FIRST_REPLICA); each replica writes and reads its own component, every read outside
  the replica functions gives the aggregate.
* ``independent``: made in :func:`~parallelvars.variables.independent_buffers`; each component holds its own value,
  and outside replica functions operations on it run per component (a parallel value, as on
  the seed's parallel device; see :class:`_IndependentVariable`).
* ``sharded``: :class:`~parallelvars.variables.ShardedVariable`, made with ``shard_axis=k``; the components are slices
  of one logical value, and the proxy wraps the full value.

Overridden dunders and why (everything else is forwarded to the wrapped array by wrapt):

* arithmetic, comparison, unary, conversion (``__int__``, ``__float__``, ``__bool__``,
  ``__index__``), ``__getitem__``, ``__len__``, ``__iter__``, ``__array__``,
  ``__array_ufunc__``, ``__array_function__``: read the *local* value (the replica's component
  inside replica functions; outside, the primary, or an on-read variable's aggregate) and
  unwrap other variables, so numpy never sees a proxy. For an on-read variable, attributes that
  do not depend on the values (``shape``, ``dtype``, ``ndim``, ``size``, ...) come from the
  primary, so reading them computes no aggregate.
* ``__array_interface__`` / ``__array_struct__``: numpy consults them *before* ``__array__``.
  For ordinary dtypes they describe the local component (so ``np.asarray(v)`` shares its
  memory); for the ml_dtypes extension types (bfloat16, float8 ...) they are absent, because
  their type string is a bare ``|V2`` and numpy would read raw void bytes; ``__array__`` then
  gives the real dtype. They are absent for an on-read SUM / MEAN aggregate too (a temporary:
  numpy would keep a pointer into freed memory). (``memoryview(v)`` is refused like for any
  proxy: use ``memoryview(np.asarray(v))``.)
* in-place operators (``+=``, ``-=``, ``*=``, ``/=``, ``//=``, ``%=``, ``**=``, ``<<=``,
  ``>>=``, ``&=``, ``|=``, ``^=``) and ``__setitem__``: must reach *every* component of a
  mirrored variable, not only the primary that wrapt would update. ``+=`` and ``-=`` are
  ``assign_add`` / ``assign_sub``. Where every write goes (this replica's component, merged
  across replicas, every component, the full value) is decided in one place:
  :func:`parallelvars._write_plan.route`.
* ``fill``, ``sort``, ``partition``, ``put``: array methods that write in place; same reason.
* ``__hash__``: by identity (an array is unhashable; a variable is a key in optimizer state).
  Like any numpy array, ``==`` compares element-wise.
* ``__repr__``: says kind, name, shape, dtype and devices.
* ``__copy__`` / ``__deepcopy__`` / ``__reduce_ex__``: a copy of a variable is a plain array of
  its value (a variable is bound to its devices and its checkpoint identity).

Writes through a *view* taken from a variable (``v.T``, ``v.reshape(...)``, ``v[1:]``) change
only the array they view (the primary); write through the variable itself.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import wrapt

from parallelvars import _modes, _storage, _write_plan
from parallelvars._aggregate import aggregate_parts
from parallelvars._dtypes import is_extension_dtype
from parallelvars._values import PARALLEL_OPERATORS, PerReplica, each_part, part_attribute
from parallelvars._write_plan import Route
from parallelvars.devices import ParallelDevice
from parallelvars.enums import Aggregation, Synchronization
from parallelvars.errors import (
    ContextError,
    DistributedValueError,
    InvalidArgumentError,
    ShapeMismatchError,
    UnsupportedOperationError,
)

# The routes as module constants: a class attribute of an Enum costs a lookup on every write.
_OWN, _MERGE, _EVERY, _FULL = Route.OWN, Route.MERGE, Route.EVERY, Route.FULL


def _unwrap(x: Any) -> Any:
    """Replace variables by the array they read as here (recursively in lists and tuples)."""
    if isinstance(x, ParallelVariable):
        return x._local()
    if isinstance(x, (list, tuple)) and any(
        isinstance(i, (ParallelVariable, list, tuple)) for i in x
    ):
        return (
            type(x)(_unwrap(i) for i in x)
            if not hasattr(x, "_fields")
            else type(x)(*(_unwrap(i) for i in x))
        )
    return x


def _unwrap_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: _unwrap(v) for k, v in kwargs.items()}


def _fitting_value(value: Any, shape: tuple[int, ...], name: str) -> np.ndarray:
    """``value`` as an array that broadcasts to ``shape`` (a write into variable ``name``)."""
    arr = np.asarray(value)
    try:
        ok = np.broadcast_shapes(arr.shape, shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise ShapeMismatchError(
            "cannot write a value of another shape", variable=name, expected=shape, found=arr.shape
        )
    return arr


def _shares(total: np.ndarray, n: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """``total`` (of a shape that broadcasts to ``shape``) split into ``n`` parts that add up
    to it: an array that broadcasts to ``(n, *shape)``.

    Floating point: ``total / n`` in each part (TensorFlow's split of an on-read SUM variable's
    assigned value). Integers: ``total // n`` in each part and the remainder spread one unit at
    a time over the first parts, so that the total stays exact where a division would drop it.
    """
    if dtype.kind not in "iub":
        return np.divide(np.asarray(total, dtype=dtype), n).astype(dtype, copy=False)
    whole, rest = np.divmod(np.broadcast_to(np.asarray(total, dtype=np.int64), shape), n)
    ranks = np.arange(n).reshape((n,) + (1,) * whole.ndim)
    return (whole[None] + (ranks < rest[None])).astype(dtype)


def _write_array(target: np.ndarray, op: str, arr: np.ndarray) -> None:
    """Apply ``op`` (``assign`` / ``assign_add`` / ``assign_sub``) of ``arr`` to ``target`` in
    place: a component, the stacked buffer (every component) or a sharded variable's full value."""
    if op == "assign":
        target[...] = arr
    elif op == "assign_add":
        np.add(target, arr, out=target, casting="same_kind")
    else:
        np.subtract(target, arr, out=target, casting="same_kind")


_BINARY = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
    "matmul": operator.matmul,
    "lshift": operator.lshift,
    "rshift": operator.rshift,
    "and": operator.and_,
    "or": operator.or_,
    "xor": operator.xor,
    "divmod": divmod,
}
_INPLACE_UFUNC = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "truediv": np.true_divide,
    "floordiv": np.floor_divide,
    "mod": np.remainder,
    "pow": np.power,
    "lshift": np.left_shift,
    "rshift": np.right_shift,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
}
# Attributes the proxy must not forward to the wrapped array (see __array_interface__).
_NOT_FORWARDED = frozenset({"__array_interface__", "__array_struct__"})
# Array attributes that do not depend on the values (no aggregate is computed for them).
_VALUE_FREE = frozenset({"shape", "dtype", "ndim", "size", "itemsize", "nbytes"})
# numpy functions that write into their first argument.
_MUTATING_FUNCTIONS = {np.copyto, np.put, np.putmask, np.place, np.fill_diagonal, np.put_along_axis}


class ParallelVariable(wrapt.ObjectProxy):
    """One logical variable with one component buffer per device.

    Do not construct directly; use :func:`Variable` (inside a strategy scope for parallel kinds).

    Example:
        >>> import numpy as np, parallelvars as pv
        >>> with pv.MirroredStrategy(2).scope():
        ...     w = pv.Variable(np.ones(3, np.float32), name="w")
        >>> w += 1
        >>> [c.tolist() for c in w.components]
        [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    """

    # (global index, global count) of the one component a multi-process strategy keeps here.
    _self_global: tuple[int, int] | None = None
    # The strategy that placed this variable (a weak reference; see distribute_strategy).
    _self_strategy: Callable[[], Any] | None = None
    # A restore converts saved values of another dtype without allow_cast when they convert
    # exactly (an optimizer's non-slot counters: float32 beta powers into float64 ones).
    _self_exact_cast: bool = False
    # The class name repr shows (private subclasses show their public base).
    _repr_name: ClassVar[str | None] = None

    def __init__(
        self,
        stacked: np.ndarray,
        *,
        device: ParallelDevice,
        name: str,
        kind: str,
        synchronization: Synchronization,
        aggregation: Aggregation,
        trainable: bool,
        placement: _storage.Placement | None = None,
    ) -> None:
        if stacked.shape[0] != len(device):
            raise DistributedValueError(
                f"variable {name!r}: {stacked.shape[0]} components for {len(device)} devices"
            )
        super().__init__(stacked[0, ...])  # a 0-d view for scalars, not a copy
        # Set here once and never changed (read-only properties): a checkpoint keeps a
        # variable's save record (name, devices, kind, shape, components) for as long as the
        # variable stays in its object graph (Checkpoint._gather).
        self._self_stacked = stacked
        self._self_components = tuple(stacked[i, ...] for i in range(stacked.shape[0]))
        self._self_device = device
        self._self_name = name
        self._self_kind = kind
        self._self_synchronization = synchronization
        self._self_aggregation = aggregation
        self._self_trainable = bool(trainable)
        self._self_placement = placement

    # ------------------------------------------------------------------ properties
    @property
    def components(self) -> tuple[np.ndarray, ...]:
        """One numpy view per device; component 0 is the primary."""
        return self._self_components

    @property
    def stacked(self) -> np.ndarray:
        """The ``(n, *shape)`` buffer holding every component."""
        return self._self_stacked

    @property
    def primary(self) -> np.ndarray:
        return self._self_components[0]

    @property
    def device(self) -> ParallelDevice:
        """The parallel device: ``device.components`` names one device per component."""
        return self._self_device

    @property
    def devices(self) -> tuple[str, ...]:
        return self._self_device.components

    @property
    def num_components(self) -> int:
        return len(self._self_components)

    @property
    def component_indices(self) -> tuple[int, ...]:
        """The global component index of each local component.

        ``(0, ..., n-1)`` in one process; a multi-process strategy holds one component of a
        larger variable per process (``(rank,)``), see :attr:`global_num_components`.
        """
        placed = self._self_global
        return tuple(range(len(self._self_components))) if placed is None else (placed[0],)

    @property
    def global_num_components(self) -> int:
        """The number of components of the whole variable, across processes."""
        placed = self._self_global
        return len(self._self_components) if placed is None else placed[1]

    @property
    def name(self) -> str:
        return self._self_name

    @property
    def kind(self) -> str:
        return self._self_kind

    @property
    def synchronization(self) -> Synchronization:
        return self._self_synchronization

    @property
    def aggregation(self) -> Aggregation:
        return self._self_aggregation

    @property
    def trainable(self) -> bool:
        return self._self_trainable

    @property
    def distribute_strategy(self) -> Any:
        """The strategy whose scope (or replica function) made this variable; the default
        strategy for a variable made outside every strategy (TensorFlow's
        ``Variable.distribute_strategy``)."""
        ref = self._self_strategy
        strategy = ref() if ref is not None else None
        return strategy if strategy is not None else _modes.default_strategy()

    @property
    def placement(self) -> _storage.Placement | None:
        """Where the stacked buffer lives in its arena (for the update core)."""
        return self._self_placement

    # ------------------------------------------------------------------ reading
    def _pv_parts(self) -> tuple[Any, ...] | None:
        """The parts this variable contributes to a per-component computation here, if it is a
        parallel value here (independent buffers outside replica functions); else None."""
        return None

    def _replica_index(self) -> int | None:
        """This thread's component index inside a replica function of our devices, else None."""
        ctx = _modes.replica_context()
        if ctx is None or ctx.strategy._is_default:
            return None
        n = ctx.num_replicas_in_sync
        if n == 1 or n != len(self._self_components) or ctx.strategy.devices != self._self_device:
            return None
        return ctx.replica_id_in_sync_group

    def _local(self) -> np.ndarray:
        """The array this variable reads as here: the replica's component, else the primary
        (an on-read variable: its aggregate, see :class:`_OnReadVariable`)."""
        i = self._replica_index()
        return self.__wrapped__ if i is None else self._self_components[i]

    def read_value(self) -> np.ndarray:
        """A copy of the value: aggregated for on-read variables outside replica functions."""
        if self._self_kind == "on_read" and self._replica_index() is None:
            return self._aggregate()
        return np.array(self._local(), copy=True)

    def value(self) -> np.ndarray:
        return self.read_value()

    def numpy(self) -> np.ndarray:
        return self.read_value()

    def get_shape(self) -> tuple[int, ...]:
        """The logical shape (TensorFlow's ``get_shape()``; ``shape`` is the same)."""
        return tuple(self.__wrapped__.shape)

    def get(self, device: str | None = None) -> np.ndarray:
        """The component on ``device`` (a numpy view of its buffer), TensorFlow's
        ``MirroredVariable.get(device)``.

        Without ``device``: the component being updated inside ``strategy.update`` /
        ``update_non_slot`` for one device, else this replica's own inside a replica function,
        else the primary (the seed's ``ReplicatedVariable.get()``).

        Raises:
            DistributedValueError: the variable has no component on ``device``.
        """
        from parallelvars.devices import canonical_device

        comps = self._self_components
        devices = self._self_device.components
        if device is None:
            current = _modes.get_update_device()
            if isinstance(current, str) and current in devices and len(devices) == len(comps):
                return comps[devices.index(current)]
            return self._local()
        try:
            name = canonical_device(device)
        except ValueError as e:
            raise DistributedValueError(f"variable {self._self_name!r}: {e}") from None
        if name not in devices or len(devices) != len(comps):
            raise DistributedValueError(
                f"variable {self._self_name!r} has no component on {name} (its devices: {list(devices)})"
            )
        return comps[devices.index(name)]

    def _aggregate(self) -> np.ndarray:
        agg = self._self_aggregation
        comps = self._self_components
        if agg is Aggregation.ONLY_FIRST_REPLICA or len(comps) == 1:
            return np.array(comps[0], copy=True)
        if agg is Aggregation.NONE:
            raise ContextError(
                f"variable {self._self_name!r}: an on-read variable with aggregation NONE has no "
                "value in cross-replica context; read its components"
            )
        return aggregate_parts(np.array(comps[0], copy=True), comps[1:], len(comps), agg)

    # ------------------------------------------------------------------ writing
    def assign(
        self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> ParallelVariable | None:
        """Set the value; on a mirrored variable every component receives it.

        ``use_locking`` and ``name`` are TensorFlow's arguments, accepted and ignored (writes
        are in place, there is no graph). Returns the variable, whose reads then give the new
        value (TensorFlow 2's lazily read result), or ``None`` with ``read_value=False``.
        """
        self._write("assign", value)
        return self if read_value else None

    def assign_add(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> ParallelVariable | None:
        """Add ``delta`` (arguments and result as :meth:`assign`)."""
        self._write("assign_add", delta)
        return self if read_value else None

    def assign_sub(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> ParallelVariable | None:
        """Subtract ``delta`` (arguments and result as :meth:`assign`)."""
        self._write("assign_sub", delta)
        return self if read_value else None

    def _write(self, op: str, value: Any) -> ParallelVariable:
        """A value write, where :func:`~parallelvars._write_plan.route` sends it."""
        value = _unwrap(value)
        where, i = _write_plan.route(self)
        if isinstance(value, PerReplica):
            self._write_per_replica(op, value, where)
        elif where is _OWN:
            assert i is not None
            _write_array(self._self_components[i], op, self._check_value_shape(value))
        elif where is _MERGE:
            ctx = _modes.replica_context()
            assert ctx is not None
            ctx._write_variable(self, op, value)
        else:
            self._apply_write(op, value)
        return self

    def _change(self, where: Route, i: int | None, change: Callable[[np.ndarray], object]) -> None:
        """An in-place change ``change(array)`` on the route ``where, i`` that
        :func:`~parallelvars._write_plan.route` gave, other than ``EVERY``: the callers
        change every component themselves, in one call over the stacked buffer where they can
        (and without a call per component where they cannot: the common case stays cheap)."""
        if where is _OWN:
            assert i is not None
            change(self._self_components[i])
        elif where is _FULL:
            change(self.__wrapped__)
        else:  # MERGE, LOGICAL: on the value as it reads here, then written like assign()
            assert where is not _EVERY
            new = self.read_value()
            change(new)
            if where is _MERGE:
                self.assign(new)
            else:  # what assign() does on this route
                self._apply_write("assign", new)

    def _check_value_shape(self, value: Any) -> np.ndarray:
        return _fitting_value(value, self.__wrapped__.shape, self._self_name)

    def _apply_write(self, op: str, value: Any) -> None:
        """Apply ``op`` in cross-replica terms: the write the whole variable sees once."""
        arr = self._check_value_shape(value)
        stacked = self._self_stacked
        if self._self_kind == "on_read" and self._self_aggregation is Aggregation.SUM:
            n = self.global_num_components
            if n > 1 and not self._process_part_written_by_its_replica():
                # A write of the total: each replica's part receives its share (TensorFlow's
                # SyncOnRead SUM assign in cross-replica context divides by the replica count);
                # a process of a multi-process strategy writes the shares of its components.
                shares = _shares(arr, n, stacked.dtype, self.__wrapped__.shape)
                if n != stacked.shape[0] and shares.ndim > arr.ndim:  # a process's own shares
                    shares = shares[list(self.component_indices)]
                arr = shares
        _write_array(stacked, op, arr)

    def _process_part_written_by_its_replica(self) -> bool:
        """Whether this is one process's part of a variable spread over processes, written from
        a replica function (its replica's own part, not a share of a total)."""
        if self._self_global is None:
            return False
        ctx = _modes.replica_context()
        return ctx is not None and not ctx.strategy._is_default

    def _write_per_replica(self, op: str, value: PerReplica, where: Route) -> None:
        """Write element ``i`` of a per-replica value into component ``i``: the write of a
        parallel value into a variable whose components hold their own values (independent
        buffers, on-read parts), outside the replica functions."""
        comps = self._self_components
        if self._self_kind not in ("independent", "on_read") or where is _OWN or where is _MERGE:
            raise DistributedValueError(
                f"variable {self._self_name!r} ({self._self_kind}): cannot {op}() a "
                f"{type(value).__name__} here; only the components of an independent-buffers "
                "or on-read variable take one value each, outside replica functions (reduce "
                "the per-replica value first, or write inside strategy.run)"
            )
        if len(value) != len(comps):
            raise DistributedValueError(
                f"variable {self._self_name!r}: {op}() of a {type(value).__name__} with "
                f"{len(value)} values into {len(comps)} components (expected {len(comps)}, "
                f"found {len(value)})"
            )
        for comp, part in zip(comps, value.values, strict=True):
            _write_array(comp, op, self._check_value_shape(_unwrap(part)))

    def _inplace(self, name: str, other: Any) -> ParallelVariable:
        if name == "add":
            return self._write("assign_add", other)
        if name == "sub":
            return self._write("assign_sub", other)
        other = _unwrap(other)
        if not np.isscalar(other):  # an in-place result keeps the variable's shape
            self._check_value_shape(other)
        ufunc = _INPLACE_UFUNC[name]
        where, i = _write_plan.route(self)
        if where is _EVERY:
            ufunc(self._self_stacked, other, out=self._self_stacked)
        else:
            self._change(where, i, lambda a: ufunc(a, other, out=a))
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        key = _unwrap(key)
        value = _unwrap(value)
        where, i = _write_plan.route(self)
        if where is _EVERY:
            self._setitem_all(key, value)
        else:
            self._change(where, i, lambda a: a.__setitem__(key, value))

    def _setitem_all(self, key: Any, value: Any) -> None:
        stacked = self._self_stacked
        if isinstance(key, tuple):
            stacked[(slice(None),) + key] = value  # noqa: RUF005 - the unpacking form confuses mypy on 3.10
        elif key is Ellipsis:
            stacked[...] = value
        else:
            stacked[:, key] = value

    def __delitem__(self, key: Any) -> None:
        raise UnsupportedOperationError(f"variable {self._self_name!r}: items cannot be deleted")

    def _for_each_component(self, method: str, *args: Any, **kwargs: Any) -> None:
        """An in-place array method (``fill``, ``sort``, ...), per component: its arguments
        (an axis) speak of one component's axes, not of the stacked buffer's."""
        args = tuple(_unwrap(a) for a in args)
        kwargs = _unwrap_kwargs(kwargs)
        where, i = _write_plan.route(self)
        if where is _EVERY:
            for comp in self._self_components:
                getattr(comp, method)(*args, **kwargs)
        else:
            self._change(where, i, lambda a: getattr(a, method)(*args, **kwargs))

    def fill(self, value: Any) -> None:
        self._for_each_component("fill", value)

    def sort(self, *args: Any, **kwargs: Any) -> None:
        self._for_each_component("sort", *args, **kwargs)

    def partition(self, *args: Any, **kwargs: Any) -> None:
        self._for_each_component("partition", *args, **kwargs)

    def put(self, *args: Any, **kwargs: Any) -> None:
        self._for_each_component("put", *args, **kwargs)

    def resize(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedOperationError(
            f"variable {self._self_name!r}: a variable's shape is fixed"
        )

    # ------------------------------------------------------------------ numpy protocol
    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self._local()
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise InvalidArgumentError("a copy is needed to change the dtype")
            return arr.astype(dtype)
        return np.array(arr, copy=True) if copy else arr

    def _interface_array(self, protocol: str) -> np.ndarray:
        arr = self._local()
        if is_extension_dtype(arr.dtype):
            raise AttributeError(f"{protocol} (a {arr.dtype} variable converts through __array__)")
        return arr

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self._interface_array("__array_interface__").__array_interface__

    @property
    def __array_struct__(self) -> Any:
        return self._interface_array("__array_struct__").__array_struct__

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        out = kwargs.get("out")
        targets = [o for o in (out or ()) if isinstance(o, ParallelVariable)]
        if targets:
            return self._ufunc_into(targets, ufunc, method, inputs, kwargs)
        return getattr(ufunc, method)(*(_unwrap(x) for x in inputs), **_unwrap_kwargs(kwargs))

    def _ufunc_into(
        self,
        targets: list[ParallelVariable],
        ufunc: np.ufunc,
        method: str,
        inputs: Any,
        kwargs: dict[str, Any],
    ) -> Any:
        if len(targets) != 1 or method != "__call__":
            raise UnsupportedOperationError(
                "a variable can be the `out` of a plain ufunc call with one output only"
            )
        (var,) = targets
        rest = {k: _unwrap(v) for k, v in kwargs.items() if k != "out"}

        where, i = _write_plan.route(var)
        if where is _EVERY:
            for comp in var._self_components:
                ufunc(*[comp if x is var else _unwrap(x) for x in inputs], out=comp, **rest)
        else:
            var._change(
                where,
                i,
                lambda a: ufunc(*[a if x is var else _unwrap(x) for x in inputs], out=a, **rest),
            )
        return var

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func in _MUTATING_FUNCTIONS and args and isinstance(args[0], ParallelVariable):
            var = args[0]
            rest = tuple(_unwrap(a) for a in args[1:])
            kw = _unwrap_kwargs(kwargs)

            where, i = _write_plan.route(var)
            if where is _EVERY:
                for comp in var._self_components:
                    func(comp, *rest, **kw)
            else:
                var._change(where, i, lambda a: func(a, *rest, **kw))
            return None
        return func(*(_unwrap(a) for a in args), **_unwrap_kwargs(kwargs))

    # ------------------------------------------------------------------ reads via the local component
    def __getitem__(self, key: Any) -> Any:
        return self._local()[_unwrap(key)]

    def __len__(self) -> int:
        return len(self.__wrapped__)

    def __iter__(self) -> Any:
        return iter(self._local())

    def __contains__(self, item: Any) -> bool:
        return _unwrap(item) in self._local()

    def __bool__(self) -> bool:
        return bool(self._local())

    def __int__(self) -> int:
        return int(self._local())

    def __float__(self) -> float:
        return float(self._local())

    def __complex__(self) -> complex:
        return complex(self._local())

    def __index__(self) -> int:
        return operator.index(self._local())

    def __neg__(self) -> Any:
        return -self._local()

    def __pos__(self) -> Any:
        return +self._local()

    def __abs__(self) -> Any:
        return abs(self._local())

    def __invert__(self) -> Any:
        return ~self._local()

    def __round__(self, ndigits: int | None = None) -> Any:
        value: Any = self._local()
        return round(value, ndigits) if ndigits is not None else round(value)

    def __lt__(self, other: Any) -> Any:
        return self._local() < _unwrap(other)

    def __le__(self, other: Any) -> Any:
        return self._local() <= _unwrap(other)

    def __eq__(self, other: Any) -> Any:
        return self._local() == _unwrap(other)

    def __ne__(self, other: Any) -> Any:
        return self._local() != _unwrap(other)

    def __gt__(self, other: Any) -> Any:
        return self._local() > _unwrap(other)

    def __ge__(self, other: Any) -> Any:
        return self._local() >= _unwrap(other)

    def __hash__(self) -> int:
        return id(self)

    def ref(self) -> Any:
        """A hashable reference comparing by identity (``==`` on a variable is element-wise)."""
        return _VariableRef(self)

    def __format__(self, spec: str) -> str:
        return format(self._local(), spec)

    def __str__(self) -> str:
        return str(self._local())

    def __repr__(self) -> str:
        shape = tuple(self.__wrapped__.shape)
        text = (
            f"<{self._repr_name or type(self).__name__} {self._self_name!r} kind={self._self_kind} shape={shape} "
            f"dtype={self.__wrapped__.dtype} devices={list(self._self_device.components)}"
        )
        if self.__wrapped__.size <= 8 and not (
            self._self_kind == "on_read"
            and self._self_aggregation is Aggregation.NONE
            and self._replica_index() is None
        ):  # an on-read variable without an aggregation has no value here, only its parts
            text += f" value={np.array2string(np.asarray(self._local()), separator=', ')}"
        return text + ">"

    def __copy__(self) -> np.ndarray:
        return np.array(self._local(), copy=True)

    def __deepcopy__(self, memo: Any) -> np.ndarray:
        return np.array(self._local(), copy=True)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (np.array, (np.array(self._local()),))

    def __dir__(self) -> list[str]:
        return sorted(set(dir(type(self))) | set(dir(self.__wrapped__)))

    def __getattr__(self, name: str) -> Any:
        # A protocol property that raised AttributeError must stay absent, not be forwarded.
        if name.startswith("_self_") or name in _NOT_FORWARDED:
            raise AttributeError(name)
        return getattr(self._local(), name)


def _make_binary(name: str) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    op = _BINARY[name]

    def forward(self: ParallelVariable, other: Any) -> Any:
        return op(self._local(), _unwrap(other))

    def reflected(self: ParallelVariable, other: Any) -> Any:
        return op(_unwrap(other), self._local())

    def inplace(self: ParallelVariable, other: Any) -> Any:
        return self._inplace(name, other)

    return forward, reflected, inplace


for _name in _BINARY:
    _fwd, _ref, _inp = _make_binary(_name)
    _fwd.__name__, _ref.__name__, _inp.__name__ = f"__{_name}__", f"__r{_name}__", f"__i{_name}__"
    setattr(ParallelVariable, f"__{_name}__", _fwd)
    setattr(ParallelVariable, f"__r{_name}__", _ref)
    if _name in _INPLACE_UFUNC:
        setattr(ParallelVariable, f"__i{_name}__", _inp)
del _name, _fwd, _ref, _inp


def _imatmul(self: ParallelVariable, other: Any) -> Any:
    # Not an element-wise write: refuse it rather than update only the primary.
    raise UnsupportedOperationError(
        f"variable {self.name!r}: in-place matmul is not supported; use assign(v @ m)"
    )


ParallelVariable.__imatmul__ = _imatmul  # type: ignore[method-assign,assignment]


class _OnReadVariable(ParallelVariable):
    """An on-read variable of several components: outside its replica functions it reads as its
    aggregate, as TensorFlow's SyncOnRead variables do in a cross-replica context.

    The SUM total and the MEAN are computed on each read (a new array, in the variable's
    dtype); ONLY_FIRST_REPLICA reads as the primary itself. Inside a replica function each
    replica reads its own component. A class of its own, so that the mirrored and single read
    path pays nothing for the check. A process of a multi-process strategy holds one component
    and reads it (this class is not used then); ``strategy.read_var(v)`` aggregates across
    processes.
    """

    _repr_name = "ParallelVariable"

    def _computed(self) -> bool:
        """Whether reads here give a computed aggregate (not a component's buffer)."""
        return (
            self._self_aggregation is not Aggregation.ONLY_FIRST_REPLICA
            and self._replica_index() is None
        )

    def _local(self) -> np.ndarray:
        i = self._replica_index()
        if i is not None:
            return self._self_components[i]
        if self._self_aggregation is Aggregation.ONLY_FIRST_REPLICA:
            return self.__wrapped__
        return self._aggregate()

    def _interface_array(self, protocol: str) -> np.ndarray:
        if self._computed():
            # A temporary array: numpy would keep a pointer into freed memory.
            raise AttributeError(f"{protocol} (an on-read aggregate converts through __array__)")
        return super()._interface_array(protocol)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy is False and self._computed():
            raise InvalidArgumentError(
                f"variable {self._self_name!r}: an on-read variable's aggregate is computed on "
                "each read and cannot be read without a copy (its parts: .components)"
            )
        return super().__array__(dtype, copy)

    def __getattr__(self, name: str) -> Any:
        if name in _VALUE_FREE:  # the same for every part and the aggregate: nothing to compute
            return getattr(self.__wrapped__, name)
        return super().__getattr__(name)


class _IndependentVariable(ParallelVariable):
    """An independent-buffers variable of several components: outside the replica functions of
    its devices it is a parallel value, as a variable on the seed's parallel device is.

    Arithmetic, comparisons, indexing, numpy ufuncs and functions, and array methods apply to
    every component and give a :class:`~parallelvars.strategy.ParallelValue` of the results,
    one per component (``ParallelDevice.unpack`` takes it, and it computes on the same way);
    other operands that are parallel values on as many devices contribute their element ``i``.
    Conversions to one array (``np.asarray``, ``float``, ``bool``, ``repr``) read component 0,
    the value the seed saves under the plain key. Inside a replica function each replica reads
    its own component.
    """

    _repr_name = "ParallelVariable"

    def _parallel(self) -> bool:
        return self._replica_index() is None

    def _pv_parts(self) -> tuple[Any, ...] | None:
        return self._self_components if self._replica_index() is None else None

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if kwargs.get("out") is not None or not self._parallel():
            return super().__array_ufunc__(ufunc, method, *inputs, **kwargs)
        return each_part(getattr(ufunc, method), inputs, kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func in _MUTATING_FUNCTIONS or not self._parallel():
            return super().__array_function__(func, types, args, kwargs)
        return each_part(func, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in _VALUE_FREE or name.startswith("_self_") or name in _NOT_FORWARDED:
            return super().__getattr__(name)
        if not self._parallel():
            return super().__getattr__(name)
        return part_attribute(self, name, getattr(self.__wrapped__, name))


def _make_parallel_ops() -> None:
    """The operators of :class:`_IndependentVariable`: per component outside replica functions."""

    def wrap(name: str, per_part: Callable[..., Any]) -> None:
        base = getattr(ParallelVariable, name)

        def method(self: _IndependentVariable, *other: Any) -> Any:
            if not self._parallel():
                return base(self, *other)
            return per_part(self, *other)

        method.__name__ = name
        setattr(_IndependentVariable, name, method)

    for name, per_part in PARALLEL_OPERATORS.items():
        wrap(name, per_part)


_make_parallel_ops()


class _VariableRef:
    """Hashable, identity-compared handle of a variable (``v.ref()``)."""

    __slots__ = ("_var",)

    def __init__(self, var: ParallelVariable) -> None:
        self._var = var

    def deref(self) -> ParallelVariable:
        return self._var

    def __hash__(self) -> int:
        return id(self._var)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _VariableRef) and other._var is self._var


class ComponentVariable(np.ndarray):
    """One component of a variable, as :meth:`Strategy.update` hands it to its ``fn``.

    A numpy view of the component's buffer (writes through it, ``c -= lr * g`` or
    ``np.add(c, d, out=c)``, land in the variable) that also has the per-device variable
    methods ported code calls on what ``fn`` receives in TensorFlow: ``assign``,
    ``assign_add``, ``assign_sub`` (each writes this component only and returns the view),
    ``read_value`` / ``value`` / ``numpy`` (a plain copy), plus ``name`` and ``device``.

    Arithmetic on it gives plain numpy arrays; only views of it (slices) keep the methods.
    """

    _pv_name: str = ""
    _pv_device: str = ""

    def __array_finalize__(self, obj: Any) -> None:
        if obj is not None:
            self._pv_name = getattr(obj, "_pv_name", "")
            self._pv_device = getattr(obj, "_pv_device", "")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        # Compute on plain arrays, so results are plain arrays; an ``out=`` view is written
        # through and returned as given (``c -= d`` keeps ``c`` the component view).
        args = [
            x.view(np.ndarray) if isinstance(x, ComponentVariable) else _unwrap(x) for x in inputs
        ]
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(
                x.view(np.ndarray) if isinstance(x, ComponentVariable) else x for x in out
            )
        result = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return result

    @property
    def name(self) -> str:
        """The variable's name."""
        return self._pv_name

    @property
    def device(self) -> str:  # type: ignore[override]  # numpy's array-API "cpu"
        """The device this component lives on (as TensorFlow's per-device variable)."""
        return self._pv_device

    def _write(self, op: str, value: Any) -> ComponentVariable:
        # Always this component alone: what fn receives from Strategy.update is one device's.
        base = self.view(np.ndarray)
        _write_array(base, op, _fitting_value(_unwrap(value), base.shape, self._pv_name))
        return self

    def assign(
        self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> ComponentVariable | None:
        """Set this component's value (``use_locking``, ``name``: TensorFlow's, ignored;
        ``read_value=False`` returns ``None``)."""
        self._write("assign", value)
        return self if read_value else None

    def assign_add(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> ComponentVariable | None:
        """Add ``delta`` to this component (arguments as :meth:`assign`)."""
        self._write("assign_add", delta)
        return self if read_value else None

    def assign_sub(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> ComponentVariable | None:
        """Subtract ``delta`` from this component (arguments as :meth:`assign`)."""
        self._write("assign_sub", delta)
        return self if read_value else None

    def read_value(self) -> np.ndarray:
        """A plain copy of this component's value."""
        return np.array(self.view(np.ndarray), copy=True)

    def value(self) -> np.ndarray:
        return self.read_value()

    def numpy(self) -> np.ndarray:
        return self.read_value()

    def get_shape(self) -> tuple[int, ...]:
        return tuple(self.shape)


def component_variable(var: ParallelVariable, i: int) -> ComponentVariable:
    """Component ``i`` of ``var`` as a :class:`ComponentVariable` view."""
    view = var.components[i].view(ComponentVariable)
    # The names of TensorFlow's per-device variables: the variable's, then "<name>/replica_i".
    view._pv_name = var.name if i == 0 else f"{var.name}/replica_{i}"
    view._pv_device = var.devices[i]
    return view
