"""Distribution strategies, replica and cross-replica contexts."""

from parallelvars.strategy._base import (
    MirroredStrategy,
    OneDeviceStrategy,
    ReplicaContext,
    Strategy,
)
from parallelvars.strategy._context import (
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
    variable_creator_scope,
)

__all__ = [
    "MirroredStrategy",
    "OneDeviceStrategy",
    "ReplicaContext",
    "Strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "variable_creator_scope",
]
