"""Hints for a restore pointed at something that is not a native checkpoint.

``Checkpoint.restore`` reads only the native HDF5 layout. When it is handed a TensorFlow
checkpoint, a safetensors, npz or Keras file, or a manager's directory, the error it raises
says what the path is and how to get a native checkpoint from it.

The core never imports the format adapters (``parallelvars.formats`` builds on the core), so
this is a coarse look at names and first bytes, only on the error path; the adapters' own
detection (``formats.detect_format``) stays the one that decides how a file is read.
"""

from __future__ import annotations

import os
import re
import stat

from parallelvars.checkpoint._h5policy import HDF5_SIGNATURE
from parallelvars.errors import CheckpointError, CheckpointNotFoundError, NotACheckpointError

__all__ = ["foreign_hint", "with_foreign_hint"]

_LABELS = {
    "tf": "a TensorFlow checkpoint",
    "safetensors": "a safetensors file",
    "npz": "an npz archive",
    "keras": "a Keras file",
    "hdf5": "an HDF5 file of another writer (Keras?)",
}
_TF_FILE = re.compile(r"\.(index|data-\d+-of-\d+)$")


def _kind(path: str) -> str | None:
    if os.path.isdir(path):
        try:
            names = os.listdir(path)
        except OSError:
            return None
        return "tf" if "checkpoint" in names or any(n.endswith(".index") for n in names) else None
    if _TF_FILE.search(path) or (not os.path.exists(path) and os.path.exists(path + ".index")):
        return "tf"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # opening a FIFO would block
            return None
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return None
    lower = path.lower()
    if lower.endswith((".safetensors", ".safetensors.index.json")) or head[8:9] == b"{":
        return "safetensors"
    if head.startswith(b"PK"):
        return "keras" if lower.endswith(".keras") else "npz"
    if head.startswith(HDF5_SIGNATURE):
        return "keras" if lower.endswith(".weights.h5") else "hdf5"
    return None


def foreign_hint(path: str) -> str | None:
    """How to restore from ``path`` when it is not a native checkpoint, or None if unknown."""
    name = _kind(path)
    if name is not None:
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
        exc.what,
        file=exc.file,
        variable=exc.variable,
        expected=exc.expected,
        found=exc.found,
        hint=hint,
    )
