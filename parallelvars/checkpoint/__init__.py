"""Checkpoints: the saved-entry model, the saveable registry, the native HDF5 layout,
``Checkpoint``."""

from parallelvars.checkpoint.checkpoint import Checkpoint
from parallelvars.checkpoint.entry import ArrayEntry, Entry
from parallelvars.checkpoint.h5io import H5Reader, StoredVariable, write_h5
from parallelvars.checkpoint.manager import CheckpointManager, latest_checkpoint
from parallelvars.checkpoint.registry import Saveable, SaveRecord, get_saveable, register_saveable
from parallelvars.checkpoint.retention import EveryNSeconds, KeepAll, LatestN, RetentionPolicy
from parallelvars.checkpoint.status import CheckpointLoadStatus

__all__ = [
    "ArrayEntry",
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "Entry",
    "EveryNSeconds",
    "H5Reader",
    "KeepAll",
    "LatestN",
    "RetentionPolicy",
    "SaveRecord",
    "Saveable",
    "StoredVariable",
    "get_saveable",
    "latest_checkpoint",
    "register_saveable",
    "write_h5",
]
