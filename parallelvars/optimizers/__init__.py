"""Optimizers with TensorFlow 1.x update rules, applied by the vectorized update core.

Example:
    >>> import numpy as np, parallelvars as pv
    >>> strategy = pv.MirroredStrategy(2)
    >>> with strategy.scope():
    ...     w = pv.Variable(np.ones(3, np.float32), name="w")
    ...     opt = pv.optimizers.Adam(learning_rate=0.1)
    >>> opt.distributed_apply(strategy, [(np.ones(3, np.float32), w)])
    >>> opt.get_slot_names()
    ['m', 'v']
    >>> len(opt.get_slot(w, "m").components)
    2
"""

from parallelvars.optimizers._base import GradientBuffers, Optimizer
from parallelvars.optimizers._rules import SGD, Adagrad, Adam, AdamW, Momentum, RMSProp
from parallelvars.optimizers._sparse import IndexedSlices, clip_by_global_norm, global_norm

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "GradientBuffers",
    "IndexedSlices",
    "Momentum",
    "Optimizer",
    "RMSProp",
    "clip_by_global_norm",
    "global_norm",
]
