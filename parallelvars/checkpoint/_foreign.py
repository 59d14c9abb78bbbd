"""Hints for a restore pointed at something that is not a native checkpoint.

``Checkpoint.restore`` reads only the native HDF5 layout. When it is handed a TensorFlow
checkpoint, a safetensors, npz or Keras file, or a manager's directory, the error it raises
says what the path is and how to get a native checkpoint from it. Which format a path holds is
decided by the format registry's own detection (one place), imported only on this error path.
"""

from __future__ import annotations

import os

from parallelvars.errors import CheckpointError, CheckpointNotFoundError, NotACheckpointError

__all__ = ["foreign_hint", "with_foreign_hint"]

_LABELS = {
    "tf": "a TensorFlow checkpoint",
    "safetensors": "a safetensors file",
    "npz": "an npz archive",
    "keras": "a Keras weights file",
    "keras-legacy": "a legacy Keras HDF5 file",
}


def foreign_hint(path: str) -> str | None:
    """How to restore from ``path`` when it is not a native checkpoint, or None if unknown."""
    try:
        from parallelvars.formats._registry import detect_format

        name: str | None = detect_format(path)
    except Exception:  # any refusal: the path is nothing we can name
        name = None
    if name in _LABELS:
        return f"{_LABELS[name]}: convert it first with 'parallelvars convert {path} out.h5'"
    if os.path.isdir(path):
        from parallelvars.checkpoint.manager import latest_checkpoint

        try:
            latest = latest_checkpoint(path)
        except Exception:
            latest = None
        if latest is not None:
            return (
                "a checkpoint directory: restore a file in it, e.g. "
                f"restore(latest_checkpoint({path!r})) (here {os.path.basename(latest)!r})"
            )
        return "a directory: restore a checkpoint file, e.g. one written by save() or write()"
    return None


def with_foreign_hint(exc: CheckpointError, path: str) -> CheckpointError:
    """``exc`` again, with :func:`foreign_hint`'s advice appended when there is some."""
    if not isinstance(exc, NotACheckpointError | CheckpointNotFoundError):
        return exc
    hint = foreign_hint(path)
    if hint is None or hint in str(exc):
        return exc
    return type(exc)(
        exc.what, file=exc.file, variable=exc.variable, expected=exc.expected, found=exc.found, hint=hint
    )
