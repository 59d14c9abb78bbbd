"""Loss helpers for replica functions: averaging per-example losses over the global batch.

Each replica sees ``1 / num_replicas`` of the global batch and the optimizers *sum* the
replicas' gradients. A loss that is the mean over the replica's own examples therefore gives
gradients ``num_replicas`` times too large once summed; dividing the summed per-example loss by
the *global* batch size (:func:`compute_average_loss`) makes the summed gradients those of the
global mean. Regularization terms, which every replica adds once, are divided by the number of
replicas (:func:`scale_regularization_loss`).

The helpers only use ``*``, ``/``, ``.sum()`` and ``.shape`` on the values they get, so a
torch tensor or a jax array stays one (and differentiable); numpy arrays and Python numbers
work too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from parallelvars.errors import DistributedValueError
from parallelvars.strategy._host import _num_replicas

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def _sum(x: Any) -> Any:
    summed = getattr(x, "sum", None)
    return summed() if callable(summed) else np.sum(x)


def _shape(x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    return tuple(int(d) for d in (np.shape(x) if shape is None else shape))


def compute_average_loss(
    per_example_loss: Any, global_batch_size: int | None = None, sample_weight: Any = None
) -> Any:
    """The loss of the replica's examples divided by the global batch size.

    Summing this over the replicas (what the optimizers do with its gradients) gives the mean
    loss of the global batch. As ``tf.nn.compute_average_loss``.

    Args:
        per_example_loss: one loss per example, shape ``(batch, ...)`` (further axes are
            summed too).
        global_batch_size: the examples of all replicas together; defaults to this replica's
            batch size times the number of replicas in sync.
        sample_weight: optional weights multiplied into the losses (a scalar, or broadcastable
            to ``per_example_loss``).

    Returns:
        A scalar of the loss's own type.

    Raises:
        DistributedValueError: ``per_example_loss`` is a scalar, or ``global_batch_size`` is
            not an integer ``>= 0`` (0 gives a loss of 0).

    Example:
        >>> import numpy as np, parallelvars as pv
        >>> float(pv.compute_average_loss(np.array([1.0, 3.0]), global_batch_size=8))
        0.5
    """
    shape = _shape(per_example_loss)
    if not shape:
        raise DistributedValueError(
            "compute_average_loss() takes one loss per example (expected a value of rank >= 1, "
            "found a scalar)"
        )
    if sample_weight is not None:
        per_example_loss = per_example_loss * sample_weight
    if global_batch_size is None:
        global_batch_size = shape[0] * _num_replicas()
    elif isinstance(global_batch_size, bool) or not isinstance(
        global_batch_size, (int, np.integer)
    ):
        raise DistributedValueError(
            f"global_batch_size must be an integer (found {type(global_batch_size).__name__})"
        )
    if global_batch_size < 0:
        raise DistributedValueError(
            f"global_batch_size must not be negative (expected >= 0, found {global_batch_size})"
        )
    if global_batch_size == 0:
        return _sum(per_example_loss) * 0  # an empty global batch: 0, as TensorFlow's div_no_nan
    return _sum(per_example_loss) / global_batch_size


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """Divide a regularization loss by the number of replicas in sync.

    Every replica adds the same regularization term; after the replicas' gradients are summed
    it counts once. A list or tuple of losses is summed first. As
    ``tf.nn.scale_regularization_loss``.

    Example:
        >>> import parallelvars as pv
        >>> float(pv.scale_regularization_loss([1.0, 3.0]))
        4.0
    """
    if isinstance(regularization_loss, (list, tuple)):
        items: Sequence[Any] = regularization_loss
        if not items:
            return 0.0
        total = items[0]
        for x in items[1:]:
            total = total + x
        regularization_loss = total
    n = _num_replicas()
    return regularization_loss / n if n > 1 else regularization_loss
