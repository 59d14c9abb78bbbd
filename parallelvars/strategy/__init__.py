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
from parallelvars.strategy._loss import compute_average_loss, scale_regularization_loss
from parallelvars.strategy._mirrored import MirroredStrategy
from parallelvars.strategy._reduce import add_n_by_device
from parallelvars.strategy._values import Mirrored, ParallelValue, PerReplica


def __getattr__(name: str) -> object:
    # Imported on first use: the MPI strategy's module is light, but keep the strategy package
    # free of it until asked for.
    if name == "MultiWorkerMirroredStrategy":
        from parallelvars.strategy._mpi import MultiWorkerMirroredStrategy

        return MultiWorkerMirroredStrategy
    raise AttributeError(f"module 'parallelvars.strategy' has no attribute {name!r}")


__all__ = [
    "DistributedDataset",
    "Mirrored",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParallelValue",
    "PerReplica",
    "ReplicaContext",
    "Strategy",
    "UpdateContext",
    "add_n_by_device",
    "compute_average_loss",
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
    "scale_regularization_loss",
    "set_loss_reduction",
    "split_batch",
    "variable_creator_scope",
]
