"""Parallel variables: one logical variable held as one component buffer per device.

The public home of the variable API; the pieces live one concept per module:

* :mod:`parallelvars._proxy`: :class:`ParallelVariable` (a ``wrapt.ObjectProxy`` over the
  primary component of a stacked buffer) with its overridden dunders, the on-read and
  independent kinds, and :class:`ComponentVariable`;
* :mod:`parallelvars._sharded`: :class:`ShardedVariable` and its multi-process form;
* :mod:`parallelvars._creation`: :func:`Variable`, :func:`ReplicatedVariable` and the creator
  scopes :func:`independent_buffers` and :func:`replicated_scope`.
"""

from __future__ import annotations

from parallelvars._creation import (
    ReplicatedVariable,
    Variable,
    independent_buffers,
    replicated_scope,
    variable_creator_scope,
)
from parallelvars._geometry import shard_sizes
from parallelvars._proxy import ComponentVariable, ParallelVariable
from parallelvars._sharded import RankShardedVariable, ShardedVariable

__all__ = [
    "ComponentVariable",
    "ParallelVariable",
    "RankShardedVariable",
    "ReplicatedVariable",
    "ShardedVariable",
    "Variable",
    "variable_creator_scope",
    "independent_buffers",
    "replicated_scope",
    "shard_sizes",
]
