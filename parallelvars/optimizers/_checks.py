"""What an optimizer accepts as a gradient: checked against its variable before any update."""

from __future__ import annotations

from typing import Any

import numpy as np

from parallelvars._dtypes import is_float_dtype as _is_float
from parallelvars.errors import GradientError, GradientTypeError
from parallelvars.optimizers._sparse import IndexedSlices
from parallelvars.variables import ParallelVariable


def is_numeric(dtype: np.dtype) -> bool:
    """Whether a gradient of ``dtype`` is a number (an int or a float of any width)."""
    return dtype.kind in "fiu" or _is_float(dtype)


def castable(found: np.dtype, wanted: np.dtype) -> bool:
    """Whether a dense gradient of dtype ``found`` (another than its variable's) is one the
    update casts to the variable's dtype ``wanted``: a number that casts ``same_kind``, or a
    float of any width onto a float variable (rounded to nearest even, as ``astype`` rounds:
    numpy does not call bfloat16 to float16, or float8_e4m3fn to float16, ``same_kind``)."""
    return is_numeric(found) and (
        bool(np.can_cast(found, wanted, "same_kind")) or (_is_float(found) and _is_float(wanted))
    )


def _dense_checked(arr: np.ndarray, var: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``arr`` when it can be the dense gradient of ``var`` (its shape, a numeric dtype)."""
    # The dtype first: a string or an object is a TypeError (as in TensorFlow), not a shape error.
    if not is_numeric(arr.dtype):
        raise GradientTypeError(
            "gradient is not numeric", variable=var.name, expected="a float array", found=arr.dtype
        )
    if arr.shape != shape:
        raise GradientError(
            "gradient of another shape", variable=var.name, expected=shape, found=arr.shape
        )
    return arr


def check_replica_shapes(parts: Any, var: Any, shape: tuple[int, ...]) -> None:
    """Check that every dense gradient in ``parts`` (one value per local replica, before they
    are summed) has ``var``'s ``shape``: summed, one of another shape would broadcast and the
    sum alone would be checked. Sparse parts are checked where they are made dense. A shard of
    a variable sharded across processes takes gradients of the variable's full shape (its
    ``full_shape``; the reduce-scatter hands each rank its shard's rows of the sum).

    Raises:
        GradientError: a replica's dense gradient has another shape.
    """
    full = getattr(var, "full_shape", None)
    if full is not None:
        shape = tuple(full)
    for r, p in enumerate(parts):
        if type(p) is np.ndarray and p.shape == shape:
            continue  # the common case, kept cheap
        if isinstance(p, IndexedSlices):
            continue
        found = getattr(p, "shape", None)
        found = np.shape(p) if found is None else tuple(found)
        if found != shape:
            raise GradientError(
                f"gradient of another shape (local replica {r})",
                variable=var.name,
                expected=shape,
                found=found,
            )


def check_gradient(g: Any, var: Any, shape: tuple[int, ...], sparse_as_dense: bool) -> Any:
    """``g`` as the gradient the update applies to ``var`` of ``shape``: a checked dense array,
    or deduplicated sparse rows (made dense when ``sparse_as_dense``).

    Raises:
        GradientTypeError: the gradient is not numeric.
        GradientError: its shape, sparse rows or indices do not fit the variable.
    """
    if type(g) is np.ndarray:  # the common case, kept cheap
        return _dense_checked(g, var, shape)
    # A reduced gradient may come back wrapped (a mirrored value): its primary is the value.
    if not isinstance(g, IndexedSlices) and isinstance(getattr(g, "values", None), (tuple, list)):
        g = g.values[0]
    if isinstance(g, IndexedSlices):
        if not shape:
            raise GradientError(
                "a scalar variable cannot take a sparse gradient", variable=var.name
            )
        if g.dense_shape is not None and g.dense_shape != shape:
            raise GradientError(
                "sparse gradient for another shape",
                variable=var.name,
                expected=shape,
                found=g.dense_shape,
            )
        if tuple(g.values.shape[1:]) != shape[1:]:
            raise GradientError(
                "sparse gradient rows have another shape",
                variable=var.name,
                expected=shape[1:],
                found=tuple(g.values.shape[1:]),
            )
        if g.indices.size and (g.indices.min() < 0 or g.indices.max() >= shape[0]):
            raise GradientError(
                "sparse gradient index out of range",
                variable=var.name,
                expected=f"0 <= index < {shape[0]}",
                found=f"{int(g.indices.min())}..{int(g.indices.max())}",
            )
        g = g.deduplicate()
        if sparse_as_dense:
            return g.to_dense(shape)
        return g
    arr = (
        g
        if type(g) is np.ndarray
        else np.asarray(g.read_value() if isinstance(g, ParallelVariable) else g)
    )
    return _dense_checked(arr, var, shape)
