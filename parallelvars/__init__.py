"""parallelvars: one logical variable held as one component buffer per device.

Example:
    >>> import numpy as np, parallelvars as pv
    >>> strategy = pv.MirroredStrategy(4)
    >>> with strategy.scope():
    ...     w = pv.Variable(np.zeros((3, 2), np.float32), name="w")
    >>> len(w.components)
    4
"""

import importlib as _importlib
import importlib.util as _importlib_util
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from parallelvars import _source_tree

if _TYPE_CHECKING:  # the public names, imported on first use (see __getattr__)
    from parallelvars import errors, optimizers
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
    from parallelvars.optimizers import GradientBuffers, IndexedSlices, clip_by_global_norm
    from parallelvars.strategy import (
        DistributedDataset,
        Mirrored,
        MirroredStrategy,
        OneDeviceStrategy,
        ParallelValue,
        PerReplica,
        ReplicaContext,
        Strategy,
        compute_average_loss,
        get_cross_replica_context,
        get_loss_reduction,
        get_replica_context,
        get_strategy,
        get_update_device,
        has_strategy,
        in_cross_replica_context,
        increment_var,
        loss_reduction,
        outside_compilation,
        scale_loss_for_replicas,
        scale_regularization_loss,
        set_loss_reduction,
    )
    from parallelvars.tracking import Module, TrackedDict, TrackedList
    from parallelvars.variables import (
        ComponentVariable,
        ParallelVariable,
        ReplicatedVariable,
        ShardedVariable,
        Variable,
        independent_buffers,
        replicated_scope,
        variable_creator_scope,
    )

# Public name -> the module defining it. Importing parallelvars imports none of them, so that
# `parallelvars --version` and `import parallelvars.errors` stay fast; the first use does.
_LAZY: dict[str, str] = {
    "errors": "parallelvars.errors",
    "optimizers": "parallelvars.optimizers",
    **dict.fromkeys(
        ["Checkpoint", "CheckpointLoadStatus", "CheckpointManager", "Saveable", "SaveRecord",
         "latest_checkpoint", "register_saveable"],
        "parallelvars.checkpoint",
    ),
    "ParallelDevice": "parallelvars.devices",
    **dict.fromkeys(["Aggregation", "ReduceOp", "Synchronization"], "parallelvars.enums"),
    "ParallelVarsError": "parallelvars.errors",
    **dict.fromkeys(["GradientBuffers", "IndexedSlices", "clip_by_global_norm"], "parallelvars.optimizers"),
    **dict.fromkeys(
        ["DistributedDataset", "Mirrored", "MirroredStrategy", "OneDeviceStrategy", "ParallelValue", "PerReplica",
         "ReplicaContext", "Strategy", "compute_average_loss", "get_cross_replica_context", "get_loss_reduction",
         "get_replica_context", "get_strategy", "get_update_device", "has_strategy",
         "in_cross_replica_context", "increment_var", "loss_reduction", "outside_compilation",
         "scale_loss_for_replicas", "scale_regularization_loss", "set_loss_reduction"],
        "parallelvars.strategy",
    ),
    **dict.fromkeys(["Module", "TrackedDict", "TrackedList"], "parallelvars.tracking"),
    **dict.fromkeys(
        ["ComponentVariable", "ParallelVariable", "ReplicatedVariable", "ShardedVariable", "Variable", "independent_buffers",
         "replicated_scope", "variable_creator_scope"],
        "parallelvars.variables",
    ),
    # Imported on first use, so that importing parallelvars never imports mpi4py.
    "MultiWorkerMirroredStrategy": "parallelvars.strategy._mpi",
}  # fmt: skip

from parallelvars._version import __version__  # noqa: E402 - one number, in _version.py

# Run from a source checkout, parallelvars.formats and parallelvars.cli live beside this folder.
_source_tree.install(__path__[0])


def _make_variable(name: str, values: _Any, device: _Any, kind: str) -> _Any:
    """``ParallelDevice.pack(values, name=...)``: a variable whose components are ``values``."""
    from parallelvars._creation import _wrap_components

    return _wrap_components(name, values, device, kind)


# Devices sit below variables (a variable holds its ParallelDevice), so this layer, which sees
# both, hands pack(name=...) its constructor. devices imports no numpy: this stays light.
from parallelvars import devices as _devices  # noqa: E402

_devices.set_variable_constructor(_make_variable)


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        # A submodule (pv.checkpoint, pv.strategy ...) is an attribute once imported, as when
        # this package imported everything eagerly.
        if (
            not name.startswith("__")
            and _importlib_util.find_spec(f"{__name__}.{name}") is not None
        ):
            module = f"{__name__}.{name}"
        else:
            raise AttributeError(f"module 'parallelvars' has no attribute {name!r}")
    loaded = _importlib.import_module(module)
    value = loaded if module == f"{__name__}.{name}" else getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "Aggregation",
    "Checkpoint",
    "DistributedDataset",
    "GradientBuffers",
    "IndexedSlices",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "ComponentVariable",
    "Mirrored",
    "MirroredStrategy",
    "Module",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParallelDevice",
    "ParallelVarsError",
    "ParallelValue",
    "ParallelVariable",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "ReplicatedVariable",
    "SaveRecord",
    "Saveable",
    "ShardedVariable",
    "Strategy",
    "Synchronization",
    "TrackedDict",
    "TrackedList",
    "Variable",
    "__version__",
    "clip_by_global_norm",
    "compute_average_loss",
    "errors",
    "get_cross_replica_context",
    "get_loss_reduction",
    "get_replica_context",
    "get_strategy",
    "get_update_device",
    "has_strategy",
    "in_cross_replica_context",
    "increment_var",
    "independent_buffers",
    "latest_checkpoint",
    "loss_reduction",
    "optimizers",
    "outside_compilation",
    "register_saveable",
    "replicated_scope",
    "scale_loss_for_replicas",
    "scale_regularization_loss",
    "set_loss_reduction",
    "variable_creator_scope",
]
