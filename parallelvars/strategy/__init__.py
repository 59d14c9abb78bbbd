"""Distribution strategies, replica and cross-replica contexts."""

from parallelvars.strategy._base import (
    OneDeviceStrategy,
    ReplicaContext,
    Strategy,
    UpdateContext,
    get_update_device,
    increment_var,
)
from parallelvars.strategy._context import (
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
    variable_creator_scope,
)
from parallelvars.strategy._host import (
    get_loss_reduction,
    in_outside_compilation,
    loss_reduction,
    outside_compilation,
    scale_loss_for_replicas,
    set_loss_reduction,
)
from parallelvars.strategy._input import DistributedDataset, split_batch
from parallelvars.strategy._mirrored import MirroredStrategy
from parallelvars.strategy._reduce import add_n_by_device
from parallelvars.strategy._values import Mirrored, PerReplica

__all__ = [
    "DistributedDataset",
    "Mirrored",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "PerReplica",
    "ReplicaContext",
    "Strategy",
    "UpdateContext",
    "add_n_by_device",
    "get_cross_replica_context",
    "get_loss_reduction",
    "get_replica_context",
    "get_strategy",
    "get_update_device",
    "has_strategy",
    "in_cross_replica_context",
    "in_outside_compilation",
    "increment_var",
    "loss_reduction",
    "outside_compilation",
    "scale_loss_for_replicas",
    "set_loss_reduction",
    "split_batch",
    "variable_creator_scope",
]
