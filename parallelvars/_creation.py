"""Making variables: :func:`Variable`, :func:`ReplicatedVariable`, the creator scopes.

``Variable()`` runs the creator stack of :mod:`parallelvars._modes` (a strategy's scope pushes
one); the creator at its bottom makes the proxy of the kind the arguments ask for
(:mod:`parallelvars._proxy`, :mod:`parallelvars._sharded`). Re-exported by
:mod:`parallelvars.variables`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from parallelvars import _modes, _storage
from parallelvars._dtypes import as_dtype, is_extension_dtype
from parallelvars._proxy import (
    ComponentVariable,
    ParallelVariable,
    _IndependentVariable,
    _OnReadVariable,
    _unwrap,
    component_variable,
)
from parallelvars._sharded import RankShardedVariable, ShardedVariable, _check_shard_axis
from parallelvars.devices import ParallelDevice
from parallelvars.enums import Aggregation, Synchronization
from parallelvars.errors import (
    DistributedTypeError,
    DistributedValueError,
    ShapeMismatchError,
    UnsupportedDtypeError,
)

variable_creator_scope = _modes.variable_creator_scope

_name_counter = itertools.count()
_name_lock = threading.Lock()


def _unique_name(name: str | None) -> str:
    if name:
        return str(name)
    with _name_lock:
        return f"Variable_{next(_name_counter)}"


def _initial_array(initial_value: Any, dtype: Any, name: str) -> np.ndarray:
    if callable(initial_value) and not isinstance(initial_value, (np.ndarray, ParallelVariable)):
        initial_value = initial_value()
    value = _unwrap(initial_value)
    if dtype is not None:
        return np.asarray(value, dtype=as_dtype(dtype))
    arr = np.asarray(value)
    if (
        arr.dtype == np.float64
        and not isinstance(value, np.ndarray)
        and not isinstance(value, np.generic)
    ):
        # Python floats and lists of them become float32, the usual parameter dtype.
        arr = arr.astype(np.float32)
    if is_extension_dtype(arr.dtype):  # bfloat16, float8 ...: numpy reports them as kind "V"
        return arr
    if arr.dtype.kind in "USV" or (arr.dtype.kind == "O"):
        if arr.dtype.kind == "O" and all(isinstance(x, bytes) for x in arr.flat):
            return arr
        raise UnsupportedDtypeError(
            f"variable {name!r}: unsupported initial value dtype {arr.dtype}"
        )
    return arr


def _base_creator(**kwargs: Any) -> ParallelVariable | ComponentVariable:
    """The creator at the bottom of the stack: a variable on ``device`` (a creator above set
    it), else a single-device variable; for a strategy's per-device call, the component."""
    component_of = kwargs.pop("_component_of", None)
    if component_of is not None:  # a strategy's per-device call (see Strategy._create)
        return component_variable(*component_of)
    device = kwargs.pop("device", None)
    return _make_distributed_variable(ParallelDevice(1) if device is None else device, **kwargs)


def _policies(
    name: str,
    synchronization: Synchronization | str | None,
    aggregation: Aggregation | str | None,
) -> tuple[Synchronization, Aggregation]:
    """The variable ``name``'s synchronization and aggregation, parsed (``None``: the default,
    as TensorFlow takes it); a value neither names is an error that names the variable."""
    try:
        sync = Synchronization.parse(
            Synchronization.AUTO if synchronization is None else synchronization
        )
        agg = Aggregation.parse(Aggregation.NONE if aggregation is None else aggregation)
    except DistributedValueError as e:
        raise DistributedValueError(f"variable {name!r}: {e}") from None
    return sync, agg


def _make_distributed_variable(
    device: ParallelDevice,
    *,
    initial_value: Any,
    name: str | None = None,
    trainable: bool | None = None,
    dtype: Any = None,
    synchronization: Synchronization | str | None = Synchronization.AUTO,
    aggregation: Aggregation | str | None = Aggregation.NONE,
    shard_axis: int | None = None,
    kind: str | None = None,
) -> ParallelVariable:
    """Make a variable of the kind the arguments ask for, on ``device``."""
    name = _unique_name(name)
    sync, agg = _policies(name, synchronization, aggregation)
    arr = _initial_array(initial_value, dtype, name)
    n = len(device)
    if shard_axis is not None:
        _check_shard_axis(name, shard_axis, arr.ndim)
    if trainable is None:
        trainable = sync is not Synchronization.ON_READ
    if shard_axis is not None and n > 1:
        if sync is Synchronization.ON_READ:
            raise DistributedValueError(f"variable {name!r}: a sharded variable cannot be ON_READ")
        # The full value is the one row of an arena, where the update core finds it.
        one_row, placement = _storage.allocate(1, arr.shape, arr.dtype)
        full = one_row[0]
        full[...] = arr
        return ShardedVariable(
            full,
            device=device,
            name=name,
            shard_axis=int(shard_axis),
            trainable=trainable,
            aggregation=agg,
            placement=placement,
        )
    if kind is None:
        if n == 1:
            kind = "single"
        elif sync is Synchronization.ON_READ:
            kind = "on_read"
        else:
            kind = "mirrored"
    if sync is Synchronization.AUTO and kind != "single":
        sync = Synchronization.ON_WRITE
    stacked, placement = _storage.allocate(n, arr.shape, arr.dtype)
    stacked[...] = arr  # every component, on-read SUM parts too (their total is n times it)
    cls = (
        ParallelVariable
        if n == 1
        else _OnReadVariable
        if kind == "on_read"
        else _IndependentVariable
        if kind == "independent"
        else ParallelVariable
    )
    return cls(
        stacked,
        device=device,
        name=name,
        kind=kind,
        synchronization=sync,
        aggregation=agg,
        trainable=trainable,
        placement=placement,
    )


def _make_rank_sharded(
    device: ParallelDevice,
    index: int,
    count: int,
    scatter: Callable[[np.ndarray, int, str], np.ndarray],
    *,
    initial_value: Any,
    name: str | None = None,
    trainable: bool | None = None,
    dtype: Any = None,
    synchronization: Synchronization | str | None = Synchronization.AUTO,
    aggregation: Aggregation | str | None = Aggregation.NONE,
    shard_axis: int,
    kind: str | None = None,
) -> RankShardedVariable:
    """Process ``index`` of ``count``'s shard of a variable sharded across processes.

    ``scatter(full, axis, name)`` turns this process's initial value into its shard of the
    value every process agrees on (a multi-process strategy scatters rank 0's).
    """
    name = _unique_name(name)
    sync, agg = _policies(name, synchronization, aggregation)
    if sync is Synchronization.ON_READ or kind not in (None, "sharded"):
        raise DistributedValueError(
            f"variable {name!r}: a sharded variable cannot be "
            f"{'ON_READ' if sync is Synchronization.ON_READ else kind}"
        )
    arr = _initial_array(initial_value, dtype, name)
    axis = _check_shard_axis(name, shard_axis, arr.ndim)
    local = np.ascontiguousarray(scatter(arr, axis, name))
    return RankShardedVariable(
        local,
        device=device,
        name=name,
        shard_axis=axis,
        full_shape=tuple(arr.shape),
        index=index,
        count=count,
        trainable=True if trainable is None else trainable,
        aggregation=agg,
    )


def Variable(
    initial_value: Any,
    name: str | None = None,
    *,
    trainable: bool | None = None,
    dtype: Any = None,
    synchronization: Synchronization | str | None = Synchronization.AUTO,
    aggregation: Aggregation | str | None = Aggregation.NONE,
    shard_axis: int | None = None,
) -> ParallelVariable:
    """Create a variable; the current creator scopes (a strategy's scope) decide its kind.

    Args:
        initial_value: an array-like, or a callable returning one. Python floats become float32.
        name: the variable's name (a unique ``Variable_N`` when omitted).
        trainable: whether optimizers update it (default: not for ON_READ variables).
        dtype: the dtype (names like ``"bfloat16"`` work).
        synchronization: ``AUTO`` / ``ON_WRITE`` make mirrored variables in a strategy scope,
            ``ON_READ`` per-replica variables aggregated on read.
        aggregation: how replica writes (mirrored) or values (on-read) combine.
        shard_axis: in a strategy scope, split the value along this axis across the devices.

    Returns:
        A :class:`ParallelVariable` (a :class:`ShardedVariable` for ``shard_axis``).
    """
    kwargs = dict(
        initial_value=initial_value,
        name=name,
        trainable=trainable,
        dtype=dtype,
        synchronization=synchronization,
        aggregation=aggregation,
        shard_axis=shard_axis,
    )
    creators = _modes.creator_stack()

    def call(index: int, **kw: Any) -> Any:
        if index < 0:
            return _base_creator(**kw)
        return creators[index](lambda **k: call(index - 1, **k), **kw)

    var: ParallelVariable = call(len(creators) - 1, **kwargs)
    return var


def _wrap_components(
    name: str, values: Sequence[Any], device: ParallelDevice, kind: str
) -> ParallelVariable:
    """A variable of ``kind`` on ``device`` whose component ``i`` is a copy of ``values[i]``."""
    arrays = [np.asarray(_unwrap(v)) for v in values]
    first = arrays[0]
    for i, a in enumerate(arrays[1:], start=1):
        if a.shape != first.shape:
            raise ShapeMismatchError(
                f"component {i} has another shape than component 0",
                variable=name,
                expected=first.shape,
                found=a.shape,
            )
        if a.dtype != first.dtype:
            raise DistributedTypeError(
                f"variable {name!r}: component {i} has another dtype than component 0 "
                f"(expected {first.dtype}, found {a.dtype})"
            )
    var = _make_distributed_variable(device, initial_value=first, name=name, kind=kind)
    for comp, a in zip(var.components[1:], arrays[1:], strict=True):
        comp[...] = a
    mode = _modes.innermost()  # None: outside every strategy
    strategy = None if mode is None else mode.strategy
    if strategy is not None and not strategy._is_default and strategy.devices == device:
        strategy._register(var)  # so that run() maps its components back to it
    return var


def ReplicatedVariable(
    name: str, variables: Sequence[Any], devices: ParallelDevice | int | Sequence[str] | None = None
) -> ParallelVariable:
    """One mirrored variable from existing per-device values (the seed's
    ``ReplicatedVariable(name, variables)``).

    Component ``i`` is a copy of ``variables[i]`` (arrays, or single-device variables); reads
    give the primary, ``assign`` reaches every component, as in the seed.

    Args:
        name: the variable's name.
        variables: one value per device, all of one shape and dtype.
        devices: the devices (default: the current strategy's when it has as many, else
            ``cpu:0 .. cpu:n-1``).

    Raises:
        ShapeMismatchError: the values have different shapes.
        DistributedTypeError: the values have different dtypes (also a ``TypeError``).
        DistributedValueError: no values, or not one per device.
    """
    values = list(variables)
    if not values:
        raise DistributedValueError(
            f"variable {name!r}: ReplicatedVariable needs at least one value"
        )
    if devices is None:
        mode = _modes.innermost()  # None: outside every strategy
        strategy: Any = None if mode is None else mode.strategy
        same = (
            strategy is not None
            and not strategy._is_default
            and len(strategy.devices) == len(values)
        )
        pdev = strategy.devices if same else ParallelDevice(len(values))
    else:
        pdev = devices if isinstance(devices, ParallelDevice) else ParallelDevice(devices)
    if len(pdev) != len(values):
        raise DistributedValueError(
            f"variable {name!r}: {len(values)} values for {len(pdev)} devices (expected "
            f"{len(pdev)}, found {len(values)})"
        )
    return _wrap_components(name, values, pdev, "mirrored" if len(values) > 1 else "single")


def independent_buffers(device: ParallelDevice | int | Sequence[str]) -> Any:
    """A creator scope whose variables keep one independent buffer per component device.

    Each component may hold its own value (write them through ``v.components[i]``); a
    checkpoint saves every component and restores only onto the same number of devices.
    """
    pdev = ParallelDevice(device) if not isinstance(device, ParallelDevice) else device

    def creator(next_creator: Any, **kwargs: Any) -> ParallelVariable:
        # Chained like every creator: scopes installed outside this one still run. An inner
        # creator that already placed the variable wins.
        if "device" not in kwargs:
            kwargs.pop("shard_axis", None)
            kwargs["device"] = pdev
            kwargs["kind"] = "independent" if len(pdev) > 1 else "single"
        return next_creator(**kwargs)

    return variable_creator_scope(creator)


def replicated_scope(num_replicas: int) -> Any:
    """A creator scope making mirrored variables on ``num_replicas`` devices (no strategy)."""
    pdev = ParallelDevice(num_replicas)

    def creator(next_creator: Any, **kwargs: Any) -> ParallelVariable:
        kwargs.setdefault("device", pdev)
        return next_creator(**kwargs)

    return variable_creator_scope(creator)
