"""parallelvars: one logical variable held as one component buffer per device.

Example:
    >>> import numpy as np, parallelvars as pv
    >>> strategy = pv.MirroredStrategy(4)
    >>> with strategy.scope():
    ...     w = pv.Variable(np.zeros((3, 2), np.float32), name="w")
    >>> len(w.components)
    4
"""

from parallelvars import errors
from parallelvars.checkpoint import (
    Checkpoint,
    CheckpointLoadStatus,
    CheckpointManager,
    Saveable,
    SaveRecord,
    latest_checkpoint,
    register_saveable,
)
from parallelvars.devices import ParallelDevice
from parallelvars.enums import Aggregation, ReduceOp, Synchronization
from parallelvars.errors import ParallelVarsError
from parallelvars.strategy import (
    MirroredStrategy,
    OneDeviceStrategy,
    ReplicaContext,
    Strategy,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from parallelvars.tracking import Module, TrackedDict, TrackedList
from parallelvars.variables import (
    ParallelVariable,
    ShardedVariable,
    Variable,
    independent_buffers,
    replicated_scope,
    variable_creator_scope,
)

__version__ = "0.1.0"

__all__ = [
    "Aggregation",
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "MirroredStrategy",
    "Module",
    "OneDeviceStrategy",
    "ParallelDevice",
    "ParallelVarsError",
    "ParallelVariable",
    "ReduceOp",
    "ReplicaContext",
    "SaveRecord",
    "Saveable",
    "ShardedVariable",
    "Strategy",
    "Synchronization",
    "TrackedDict",
    "TrackedList",
    "Variable",
    "__version__",
    "errors",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "independent_buffers",
    "latest_checkpoint",
    "register_saveable",
    "replicated_scope",
    "variable_creator_scope",
]
