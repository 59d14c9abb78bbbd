"""Sparse gradients (:class:`IndexedSlices`) and global-norm clipping."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from parallelvars._dtypes import sum_dtype
from parallelvars.errors import GradientError, GradientTypeError

__all__ = [
    "IndexedSlices",
    "clip_by_global_norm",
    "global_norm",
    "sum_indexed_slices",
]


class IndexedSlices:
    """A sparse gradient: rows ``indices`` of a tensor of shape ``dense_shape`` hold ``values``.

    Row ``indices[i]`` of the dense tensor is ``values[i]``; an index may repeat, and repeated
    rows add up (see :meth:`deduplicate`).

    Args:
        values: array of shape ``(k, *dense_shape[1:])``.
        indices: ``k`` integer row indices.
        dense_shape: the shape of the dense tensor (optional; checked against the variable).

    Example:
        >>> import numpy as np, parallelvars as pv
        >>> g = pv.IndexedSlices(np.ones((3, 2)), [0, 2, 0], dense_shape=(4, 2))
        >>> g.to_dense()[:, 0].tolist()
        [2.0, 0.0, 1.0, 0.0]
    """

    __slots__ = ("dense_shape", "indices", "values")

    def __init__(self, values: Any, indices: Any, dense_shape: Sequence[int] | None = None) -> None:
        self.values = np.asarray(values)
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise GradientError(
                "IndexedSlices indices must be a 1-D integer array",
                expected="shape (k,) of integers",
                found=f"shape {idx.shape} of {idx.dtype}",
            )
        self.indices = idx.astype(np.int64, copy=False)
        if self.values.ndim == 0 or self.values.shape[0] != self.indices.shape[0]:
            raise GradientError(
                "IndexedSlices needs one row of values per index",
                expected=f"values of shape ({self.indices.shape[0]}, ...)",
                found=self.values.shape,
            )
        self.dense_shape = None if dense_shape is None else tuple(int(d) for d in dense_shape)
        if self.dense_shape is not None and (
            not self.dense_shape or tuple(self.values.shape[1:]) != self.dense_shape[1:]
        ):
            raise GradientError(
                "IndexedSlices values do not match dense_shape",
                expected=f"rows of shape {self.dense_shape[1:]}",
                found=tuple(self.values.shape[1:]),
            )

    def deduplicate(self) -> IndexedSlices:
        """Sum the values of repeated indices; the result has sorted, unique indices."""
        unique, inverse = np.unique(self.indices, return_inverse=True)
        if unique.shape[0] == self.indices.shape[0]:
            order = np.argsort(self.indices, kind="stable")
            return IndexedSlices(self.values[order], self.indices[order], self.dense_shape)
        summed = np.zeros((unique.shape[0], *self.values.shape[1:]), self.values.dtype)
        np.add.at(summed, inverse.reshape(-1), self.values)  # in occurrence order: deterministic
        return IndexedSlices(summed, unique, self.dense_shape)

    def to_dense(self, shape: Sequence[int] | None = None) -> np.ndarray:
        """The dense tensor (repeated rows summed)."""
        shape = self.dense_shape if shape is None else tuple(shape)
        if shape is None:
            raise GradientError("IndexedSlices without dense_shape cannot be made dense")
        out = np.zeros(shape, self.values.dtype)
        np.add.at(out, self.indices, self.values)
        return out

    @property
    def shape(self) -> tuple[int, ...] | None:
        return self.dense_shape

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    def __repr__(self) -> str:
        return (
            f"IndexedSlices(values shape={self.values.shape}, indices={self.indices.shape[0]}, "
            f"dense_shape={self.dense_shape})"
        )


def sum_indexed_slices(
    parts: Sequence[IndexedSlices], variable: str | None = None
) -> IndexedSlices:
    """The sum of sparse gradients: their rows side by side (duplicates add up later), in
    one dtype: the parts' values', or, when they differ, the one they are added in
    (:func:`~parallelvars._dtypes.sum_dtype`: their common dtype, float32 for bfloat16 with
    float16 or a float8 type), the sum then rounded once to the variable's dtype by the update.

    Raises:
        GradientError: the parts' rows have different shapes (``variable`` named).
        GradientTypeError: the parts' values have dtypes that do not add (``variable`` named).
    """
    rows = {p.values.shape[1:] for p in parts}
    if len(rows) > 1:
        first, *_ = (p.values.shape[1:] for p in parts)
        raise GradientError(
            "sparse gradients of the replicas have rows of different shapes",
            variable=variable,
            expected=first,
            found=sorted(rows - {first}),
        )
    shapes = {p.dense_shape for p in parts if p.dense_shape is not None}
    arrays = [p.values for p in parts]
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) == 1:
        values = np.concatenate(arrays)
    else:
        try:
            dtype = sum_dtype(arrays)
        except TypeError:
            raise GradientTypeError(
                "sparse gradients of the replicas have values of dtypes that do not add",
                variable=variable,
                expected="dtypes with a common one",
                found=sorted(map(str, dtypes)),
            ) from None
        values = np.concatenate(arrays, dtype=dtype)
    if len(shapes) > 1 or values.ndim == 0:
        return IndexedSlices(values, np.concatenate([p.indices for p in parts]), None)
    # Each part was checked when it was made: so is their concatenation (one dense shape,
    # 1-D int64 indices, a row of values per index).
    out = IndexedSlices.__new__(IndexedSlices)
    out.values = values
    out.indices = np.concatenate([p.indices for p in parts])
    out.dense_shape = next(iter(shapes)) if shapes else None
    return out


def _squares(t: Any) -> float:
    arr = t.values if isinstance(t, IndexedSlices) else np.asarray(t)
    flat = arr.astype(np.float64, copy=False).reshape(-1)
    return float(np.dot(flat, flat))


def global_norm(t_list: Sequence[Any]) -> float:
    """``sqrt(sum(||t||^2))`` over the non-None entries, in float64."""
    return math.sqrt(sum(_squares(t) for t in t_list if t is not None))


def _scaled(t: Any, scale: float) -> Any:
    if t is None:
        return None
    if isinstance(t, IndexedSlices):
        return IndexedSlices(_scaled(t.values, scale), t.indices, t.dense_shape)
    arr = np.asarray(t)
    return (arr * scale).astype(arr.dtype, copy=False)


def clip_by_global_norm(
    t_list: Sequence[Any], clip_norm: float, use_norm: float | None = None
) -> tuple[list[Any], float]:
    """Scale a list of gradients so that their joint L2 norm is at most ``clip_norm``.

    ``t_list[i] * clip_norm / max(global_norm, clip_norm)`` (TensorFlow's rule): nothing changes
    when the norm is within bounds. ``None`` entries stay ``None``; :class:`IndexedSlices` are
    scaled through their values. Works the same on one replica's gradients inside a replica
    function (each replica clips by its own norm) and on reduced gradients; a per-replica value
    (anything with a ``values`` tuple, such as ``pv.PerReplica``) is clipped replica by replica.

    Args:
        t_list: gradients (arrays, IndexedSlices, None, or per-replica values of them).
        clip_norm: the largest norm allowed (> 0).
        use_norm: a precomputed global norm to use instead of computing it.

    Returns:
        ``(clipped list, global norm before clipping)``. A non-finite norm gives NaN everywhere,
        so a blown-up step is visible rather than silently scaled to zero.
    """
    if not clip_norm > 0:
        raise GradientError("clip_norm must be positive", expected="> 0", found=clip_norm)
    items = list(t_list)
    per_replica = [t for t in items if isinstance(getattr(t, "values", None), (tuple, list))]
    if per_replica and use_norm is None:
        n = len(per_replica[0].values)
        columns = [
            [
                t.values[i] if isinstance(getattr(t, "values", None), (tuple, list)) else t
                for t in items
            ]
            for i in range(n)
        ]
        clipped = [clip_by_global_norm(col, clip_norm) for col in columns]
        rebuilt: list[Any] = []
        for j, t in enumerate(items):
            if isinstance(getattr(t, "values", None), (tuple, list)):
                rebuilt.append(type(t)([c[0][j] for c in clipped]))
            else:
                rebuilt.append(clipped[0][0][j])
        return rebuilt, max(c[1] for c in clipped)
    norm = global_norm(items) if use_norm is None else float(use_norm)
    if not math.isfinite(norm):
        return [_scaled(t, math.nan) for t in items], norm
    scale = clip_norm / max(norm, clip_norm)
    return [_scaled(t, scale) for t in items], norm
