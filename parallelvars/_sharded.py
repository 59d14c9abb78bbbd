"""Sharded variables: components that are slices of one logical value along ``shard_axis``.

:class:`ShardedVariable` holds the full value on one process, its components views of it;
:class:`RankShardedVariable` is one process's shard of a value split across the processes of a
multi-process strategy. Re-exported by :mod:`parallelvars.variables`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import wrapt

from parallelvars import _storage
from parallelvars._geometry import (
    shard_bounds,
    shard_index,
    shard_offsets,
    shard_sizes,
    shard_slices,
)
from parallelvars._proxy import ParallelVariable, _fitting_value, _unwrap, _write_array
from parallelvars.devices import ParallelDevice
from parallelvars.enums import Aggregation, Synchronization
from parallelvars.errors import (
    DistributedValueError,
)


class ShardedVariable(ParallelVariable):
    """A variable whose components are slices of one logical value along ``shard_axis``.

    The proxy wraps the *full* value; component ``i`` is the view of rows
    ``offsets[i] : offsets[i] + sizes[i]`` along the axis (uneven splits: 10 rows over 4 devices
    are 3, 3, 2, 2). Writes through the variable reach the shards because the shards are views
    of the value.

    ``placement``: where ``full`` lives when it is the one row of an arena (see
    :mod:`parallelvars._storage`): the update core then runs over it, and over its slots at the
    same columns of their shadow arenas, in the same blocks as other arena variables.
    """

    def __init__(
        self,
        full: np.ndarray,
        *,
        device: ParallelDevice,
        name: str,
        shard_axis: int,
        trainable: bool,
        aggregation: Aggregation = Aggregation.NONE,
        placement: _storage.Placement | None = None,
    ) -> None:
        ndim = full.ndim
        axis = _check_shard_axis(name, shard_axis, ndim)
        n = len(device)
        offsets = shard_offsets(full.shape[axis], n)
        comps = [full[index] for index in shard_slices(full.shape, axis, offsets)]
        self._init_sharded(full, comps, device, name, aggregation, trainable, placement)
        self._self_shard_axis = axis
        self._self_shard_offsets = tuple(offsets)

    def _init_sharded(
        self,
        wrapped: np.ndarray,
        components: Sequence[np.ndarray],
        device: ParallelDevice,
        name: str,
        aggregation: Aggregation,
        trainable: bool,
        placement: _storage.Placement | None,
    ) -> None:
        """The proxy state every sharded variable has (one process's or across processes)."""
        wrapt.ObjectProxy.__init__(self, wrapped)
        self._self_stacked: Any = None
        self._self_components = tuple(components)
        self._self_device = device
        self._self_name = name
        self._self_kind = "sharded"
        self._self_synchronization = Synchronization.ON_WRITE
        self._self_aggregation = aggregation
        self._self_trainable = bool(trainable)
        self._self_placement = placement

    @property
    def shard_axis(self) -> int:
        return self._self_shard_axis

    @property
    def shard_offsets(self) -> tuple[int, ...]:
        return self._self_shard_offsets

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return tuple(c.shape[self._self_shard_axis] for c in self._self_components)

    @property
    def stacked(self) -> np.ndarray:
        raise AttributeError(
            f"variable {self._self_name!r}: shards have different shapes and no stacked buffer; "
            "use .components or the full value"
        )

    def _local(self) -> np.ndarray:
        return self.__wrapped__

    def _replica_index(self) -> int | None:
        return None

    def read_value(self) -> np.ndarray:
        return np.array(self.__wrapped__, copy=True)

    def _apply_write(self, op: str, value: Any) -> None:
        _write_array(self.__wrapped__, op, self._check_value_shape(value))


class RankShardedVariable(ShardedVariable):
    """One process's shard of a variable sharded across the processes of a multi-process
    strategy (``shard_axis=k`` under :class:`~parallelvars.MultiWorkerMirroredStrategy`).

    The whole variable has one shard per process, split as one process splits it
    (``numpy.array_split``); process ``r`` holds shard ``r`` only, and the proxy wraps that
    shard: reads (``read_value()``, ``np.asarray``, arithmetic) give the local shard, and
    ``shape`` is the shard's. :attr:`full_shape`, :attr:`shard_offsets` and
    :attr:`shard_sizes` describe the whole variable. Its full value is never gathered by a read:
    ``strategy.gather(var)`` is the explicit collective. A cross-replica ``assign`` takes the
    full value (each process keeps its rows) or the shard.
    """

    _repr_name = "ShardedVariable"

    def __init__(
        self,
        local: np.ndarray,
        *,
        device: ParallelDevice,
        name: str,
        shard_axis: int,
        full_shape: tuple[int, ...],
        index: int,
        count: int,
        trainable: bool,
        aggregation: Aggregation = Aggregation.NONE,
    ) -> None:
        axis = _check_shard_axis(name, shard_axis, len(full_shape))
        offsets = shard_offsets(full_shape[axis], count)
        expected = list(full_shape)
        expected[axis] = shard_sizes(full_shape[axis], count)[index]
        if local.shape != tuple(expected):
            raise DistributedValueError(
                f"variable {name!r}: shard {index} of {count} of shape {full_shape} along axis "
                f"{axis} (expected a shard of {tuple(expected)}, found {local.shape})"
            )
        self._init_sharded(local, (local,), device, name, aggregation, trainable, None)
        self._self_shard_axis = axis
        self._self_shard_offsets = tuple(offsets)
        self._self_full_shape = tuple(int(d) for d in full_shape)
        self._self_global = (int(index), int(count))

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The shape of the whole variable, across processes."""
        return self._self_full_shape

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        bounds = shard_bounds(
            self._self_shard_offsets, self._self_full_shape[self._self_shard_axis]
        )
        return tuple(hi - lo for lo, hi in itertools.pairwise(bounds))

    def _index(self) -> int:
        placed = self._self_global
        assert placed is not None  # set at construction
        return placed[0]

    def local_slice(self) -> tuple[slice, ...]:
        """Where the local shard sits in the full value."""
        index = self._index()
        lo = self._self_shard_offsets[index]
        return shard_index(
            len(self._self_full_shape), self._self_shard_axis, lo, lo + self.shard_sizes[index]
        )

    def like(self, local: np.ndarray, name: str, trainable: bool = False) -> RankShardedVariable:
        """A variable of the same geometry (an optimizer slot) holding ``local``."""
        index, count = self._index(), len(self._self_shard_offsets)
        return RankShardedVariable(
            local,
            device=self._self_device,
            name=name,
            shard_axis=self._self_shard_axis,
            full_shape=self._self_full_shape,
            index=index,
            count=count,
            trainable=trainable,
        )

    def _check_value_shape(self, value: Any) -> np.ndarray:
        arr = np.asarray(_unwrap(value))
        if arr.shape == self._self_full_shape and arr.shape != self.__wrapped__.shape:
            arr = arr[self.local_slice()]
        return _fitting_value(arr, self.__wrapped__.shape, self._self_name)


def _check_shard_axis(name: str, shard_axis: Any, ndim: int) -> int:
    """``shard_axis`` as a non-negative axis of an ``ndim``-d value, checked with or without a strategy."""
    if isinstance(shard_axis, bool) or not isinstance(shard_axis, (int, np.integer)):
        raise DistributedValueError(
            f"variable {name!r}: shard_axis must be an int, got {shard_axis!r}"
        )
    if ndim == 0:
        raise DistributedValueError(f"variable {name!r}: a scalar cannot be sharded")
    axis = int(shard_axis) + ndim if shard_axis < 0 else int(shard_axis)
    if not 0 <= axis < ndim:
        raise DistributedValueError(
            f"variable {name!r}: shard_axis {shard_axis} out of range for {ndim} dims"
        )
    return axis
