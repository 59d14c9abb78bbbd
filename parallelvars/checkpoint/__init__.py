"""Checkpoints: the saveable registry, the native HDF5 layout, ``Checkpoint``."""

from parallelvars.checkpoint.checkpoint import Checkpoint, CheckpointLoadStatus
from parallelvars.checkpoint.h5io import H5Reader, StoredVariable, write_h5
from parallelvars.checkpoint.registry import Saveable, SaveRecord, get_saveable, register_saveable

__all__ = [
    "Checkpoint",
    "CheckpointLoadStatus",
    "H5Reader",
    "SaveRecord",
    "Saveable",
    "StoredVariable",
    "get_saveable",
    "register_saveable",
    "write_h5",
]
