"""Deterministic cross-replica reductions.

Floating-point addition is not associative, so a sum must not depend on which replica thread
arrived first. Summands are grouped by device, the summands of one device are added in the
order given, and the per-device sums are added in device order (kind, then index: ``cpu:2``
before ``cpu:10``). The same inputs therefore give the same bits on every run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from parallelvars._dtypes import is_extension_dtype, sum_dtype
from parallelvars.devices import canonical_device
from parallelvars.enums import ReduceOp
from parallelvars.errors import DistributedTypeError, DistributedValueError

__all__ = ["device_key", "add_n", "add_n_by_device", "reduce_values"]


def device_key(device: str) -> tuple[str, int]:
    """Sort key of a device name: its kind, then its index as a number."""
    kind, _, index = canonical_device(device).rpartition(":")
    return kind, int(index)


def add_n(values: Sequence[Any]) -> np.ndarray:
    """Add ``values`` left to right into a fresh array of their common dtype."""
    arrays = [np.asarray(v) for v in values]
    if not arrays:
        raise DistributedValueError("add_n needs at least one value")
    try:
        dtype = sum_dtype(arrays)
    except TypeError:
        raise DistributedTypeError(
            "cannot add per-replica values of these dtypes (expected dtypes with a common "
            f"one, found {sorted({str(a.dtype) for a in arrays})})"
        ) from None
    if dtype.kind in "OSUV" and not is_extension_dtype(dtype):
        raise DistributedTypeError(
            f"cannot add non-numeric values (expected numbers, found dtype {dtype})"
        )
    try:
        shape = np.broadcast_shapes(*(a.shape for a in arrays))
    except ValueError:
        raise DistributedValueError(
            "cannot add per-replica values of different shapes "
            f"(expected one shape, found {[a.shape for a in arrays]})"
        ) from None
    total = np.empty(shape, dtype)
    total[...] = arrays[0]
    for a in arrays[1:]:
        np.add(total, a, out=total, casting="unsafe")
    return total


def add_n_by_device(summands: Sequence[tuple[str, Any]]) -> np.ndarray:
    """Sum ``(device, value)`` pairs: per device in the given order, then across devices in
    device order (the grouping of a multi-device ``add_n``)."""
    groups: dict[str, list[Any]] = {}
    for device, value in summands:
        groups.setdefault(canonical_device(device), []).append(value)
    partials = [add_n(groups[d]) for d in sorted(groups, key=device_key)]
    return partials[0] if len(partials) == 1 else add_n(partials)


def _is_sparse(value: Any) -> bool:
    return all(hasattr(value, a) for a in ("values", "indices", "dense_shape")) and not isinstance(
        value, np.ndarray
    )


def _mean_of(total: np.ndarray, count: int) -> np.ndarray:
    """The mean of ``count`` values that add up to ``total``.

    Integers (and booleans) are divided truly, into float64, as TensorFlow's ``reduce(MEAN)``
    divides (``truediv``): the mean of 0 and 1 is 0.5, not 0. Floats keep their dtype.
    """
    if total.dtype.kind in "iub":
        return np.true_divide(total, count)
    return np.divide(total, count).astype(total.dtype, copy=False)


def reduce_values(
    op: ReduceOp, values: Sequence[Any], devices: Sequence[str], axis: int | None = None
) -> Any:
    """Reduce one value per device (``values[i]`` on ``devices[i]``) with ``op``.

    Args:
        op: ``SUM`` or ``MEAN`` (of integers: float64, a true division).
        values: the per-device values.
        devices: the device of each value.
        axis: also reduce along this axis of each value; ``MEAN`` then divides by the total
            number of elements along the axis over all devices (the global mean of uneven
            batches), not by the number of devices.

    Returns:
        A numpy array (or, for sparse values with ``values``/``indices``/``dense_shape``, a
        sparse value of the same type holding every device's rows, in device order).
    """
    op = ReduceOp.parse(op)
    if len(values) != len(devices):
        raise DistributedValueError(
            f"cannot reduce {len(values)} values placed on {len(devices)} devices "
            f"(expected {len(devices)}, found {len(values)})"
        )
    if _is_sparse(values[0]):
        return _reduce_sparse(op, values, devices)
    if axis is None:
        total = add_n_by_device(list(zip(devices, values, strict=True)))
        return _mean_of(total, len(values)) if op is ReduceOp.MEAN else total
    arrays = [np.asarray(v) for v in values]
    count = 0
    partial = []
    for a in arrays:
        ax = axis + a.ndim if axis < 0 else axis
        if not 0 <= ax < a.ndim:
            raise DistributedValueError(
                f"cannot reduce along axis {axis} of a per-replica value of shape {a.shape}"
            )
        count += a.shape[ax]
        # np.sum of an empty batch is a zero of the right shape: uneven last batches work.
        partial.append(np.sum(a, axis=ax))
    total = add_n_by_device(list(zip(devices, partial, strict=True)))
    if op is ReduceOp.MEAN:
        if count == 0:
            raise DistributedValueError(f"cannot take the mean along axis {axis} of empty values")
        return _mean_of(total, count)
    return total


def _reduce_sparse(op: ReduceOp, values: Sequence[Any], devices: Sequence[str]) -> Any:
    order = sorted(range(len(values)), key=lambda i: device_key(devices[i]))
    rows = [np.asarray(values[i].values) for i in order]
    idx = [np.asarray(values[i].indices) for i in order]
    try:
        dtype = rows[0].dtype if len({r.dtype for r in rows}) == 1 else sum_dtype(rows)
    except TypeError:
        raise DistributedTypeError(
            "cannot add sparse per-replica values of these dtypes (expected dtypes with a "
            f"common one, found {sorted({str(r.dtype) for r in rows})})"
        ) from None
    cat = np.concatenate(rows, axis=0, dtype=dtype)
    if op is ReduceOp.MEAN:
        cat = _mean_of(cat, len(values))
    first = values[0]
    return type(first)(cat, np.concatenate(idx, axis=0), first.dense_shape)
