"""Distributed input: global numpy batches split across replicas along their first axis."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from parallelvars._geometry import shard_bounds, shard_offsets
from parallelvars.errors import DistributedValueError
from parallelvars.strategy._values import PerReplica

__all__ = ["DistributedDataset", "split_batch"]


def _leaves(batch: Any) -> list[np.ndarray]:
    if isinstance(batch, dict):
        return [x for v in batch.values() for x in _leaves(v)]
    if isinstance(batch, (list, tuple)):
        return [x for v in batch for x in _leaves(v)]
    return [np.asarray(batch)]


def _take(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, dict):
        return type(batch)((k, _take(v, start, stop)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_take(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(v, start, stop) for v in batch)
    return np.asarray(batch)[start:stop]


def _batch_length(batch: Any) -> int:
    leaves = _leaves(batch)
    if not leaves:
        raise DistributedValueError("a batch needs at least one array")
    lengths = set()
    for a in leaves:
        if a.ndim == 0:
            raise DistributedValueError(
                "a batch element is a scalar: batches are split along their first axis "
                "(expected arrays of at least one dimension, found shape ())"
            )
        lengths.add(a.shape[0])
    if len(lengths) != 1:
        raise DistributedValueError(
            "the arrays of a batch have different lengths along the first axis "
            f"(expected one length, found {sorted(lengths)})"
        )
    return lengths.pop()


def split_batch(batch: Any, num_replicas: int) -> PerReplica:
    """Split one global batch (an array, or a tuple / list / dict of arrays of one length)
    across ``num_replicas`` replicas along the first axis.

    Uneven batches give the first replicas one row more (10 rows over 4 replicas: 3, 3, 2, 2);
    a batch shorter than the number of replicas leaves some replicas an empty batch.

    Example:
        >>> import numpy as np
        >>> [p.tolist() for p in split_batch(np.arange(5), 2)]
        [[0, 1, 2], [3, 4]]
    """
    length = _batch_length(batch)
    bounds = shard_bounds(shard_offsets(length, num_replicas), length)
    return PerReplica([_take(batch, lo, hi) for lo, hi in itertools.pairwise(bounds)])


class DistributedDataset:
    """Global batches, each split across the replicas (iterating gives :class:`PerReplica`).

    Args:
        dataset: an iterable of batches; or an array (or tuple / dict of arrays) of samples
            to cut into global batches of ``batch_size`` rows (the last one may be shorter).
        num_replicas: the number of replicas to split each batch across.
        batch_size: the global batch size, for array input.

    Iterating twice re-reads ``dataset`` (a generator can be read only once).
    """

    def __init__(self, dataset: Any, num_replicas: int, batch_size: int | None = None) -> None:
        self._num_replicas = int(num_replicas)
        self._batch_size = batch_size
        is_arrays = isinstance(dataset, (np.ndarray, dict)) or (
            isinstance(dataset, tuple) and all(isinstance(x, np.ndarray) for x in dataset)
        )
        if batch_size is not None:
            if not is_arrays:
                raise DistributedValueError(
                    "batch_size is for array input (an array or a tuple / dict of arrays), "
                    f"found {type(dataset).__name__}"
                )
            if int(batch_size) < 1:
                raise DistributedValueError(
                    f"batch_size must be positive (expected >= 1, found {batch_size})"
                )
            self._length = _batch_length(dataset)
        elif is_arrays:
            raise DistributedValueError(
                "an array of samples needs a batch_size to be cut into global batches (or pass "
                "an iterable of batches, e.g. [batch])"
            )
        elif not isinstance(dataset, Iterable):
            raise DistributedValueError(
                f"a dataset is an iterable of batches, found {type(dataset).__name__}"
            )
        self._dataset = dataset

    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    def _batches(self) -> Iterator[Any]:
        if self._batch_size is None:
            yield from self._dataset
            return
        size = int(self._batch_size)
        for start in range(0, self._length, size):
            yield _take(self._dataset, start, min(start + size, self._length))

    def __iter__(self) -> Iterator[PerReplica]:
        for batch in self._batches():
            yield split_batch(batch, self._num_replicas)

    def __repr__(self) -> str:
        return f"<DistributedDataset over {self._num_replicas} replicas>"
