"""A coarse look at what a path holds, and hints for a restore that cannot read it.

``Checkpoint.restore`` reads our HDF5 layout and, through source plug-ins
(:mod:`parallelvars.checkpoint.sources`), every other format we read. :func:`foreign_kind`
decides, from names and first bytes only, whether a path is worth handing to the plug-ins (so a
restore of a native file never loads them). When nothing can read the path (a manager's directory, an HDF5
file of another writer, a damaged file of another format), the error says what the path
seems to be and what to do.
"""

from __future__ import annotations

import os
import re
import zipfile

from parallelvars._fileio import open_input
from parallelvars.checkpoint._h5policy import HDF5_SIGNATURE
from parallelvars.errors import CheckpointError, CheckpointNotFoundError, NotACheckpointError

__all__ = [
    "PLUGIN_MISSING",
    "TORCH_PICKLE_HINT",
    "foreign_hint",
    "foreign_kind",
    "is_torch_pickle",
    "with_foreign_hint",
]

#: What a restore of another format says when no source plug-in is installed.
PLUGIN_MISSING = "no reader of this format is installed"

_LABELS = {
    "tf": "a TensorFlow checkpoint",
    "safetensors": "a safetensors file",
    "npz": "an npz archive",
    "keras": "a Keras file",
    "hdf5": "an HDF5 file of another writer: neither our layout nor a Keras weight file",
}
#: What a restore or the CLI says of a ``torch.save`` file.
TORCH_PICKLE_HINT = (
    "a PyTorch pickle archive (torch.save): pickles are never loaded (unpickling runs code); "
    "save the state_dict with safetensors.torch.save_file(model.state_dict(), "
    "'model.safetensors') and read that"
)
_TF_FILE = re.compile(r"\.(index|data-\d+-of-\d+)$")


def foreign_kind(path: str) -> str | None:
    if os.path.isdir(path):
        try:
            names = os.listdir(path)
        except OSError:
            return None
        if "checkpoint" in names or any(n.endswith(".index") for n in names):
            return "tf"
        # A Hugging Face model folder: model.safetensors, or a shard set's index (with
        # config.json and the rest beside it), as the safetensors format opens a folder.
        if "model.safetensors" in names or any(
            n.endswith(".safetensors.index.json") for n in names
        ):
            return "safetensors"
        return None
    if _TF_FILE.search(path) or (not os.path.exists(path) and os.path.exists(path + ".index")):
        return "tf"
    try:
        fd = open_input(path)  # never a FIFO (opening one blocks), a device or a socket
    except (OSError, CheckpointError):
        return None
    try:
        head = os.pread(fd, 9, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    lower = path.lower()
    if lower.endswith((".safetensors", ".safetensors.index.json")) or head[8:9] == b"{":
        return "safetensors"
    if head.startswith(b"PK"):
        return "keras" if lower.endswith(".keras") else "npz"
    if head.startswith(HDF5_SIGNATURE):
        return "keras" if lower.endswith(".weights.h5") else "hdf5"
    return None


def is_torch_pickle(path: str) -> bool:
    """Whether ``path`` is a zip archive as ``torch.save`` writes it (a ``data.pkl`` member in
    its one top folder). Only the zip's central directory is read; nothing is unpickled."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return False
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()[:10_000]
    except (OSError, zipfile.BadZipFile, ValueError, RuntimeError):
        return False
    return any(n == "data.pkl" or n.endswith("/data.pkl") for n in names)


def foreign_hint(path: str) -> str | None:
    """Why a restore could not read ``path`` and what to do, or None if unknown."""
    if os.path.isfile(path) and is_torch_pickle(path):
        return TORCH_PICKLE_HINT
    name = foreign_kind(path)
    if name == "hdf5":
        return _LABELS[name]
    if name is not None:
        return f"{_LABELS[name]} that does not open as one: 'parallelvars verify {path}' says why"
    if os.path.isdir(path):
        from parallelvars.checkpoint._state import latest_checkpoint

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
    if hint is None or hint in str(exc) or PLUGIN_MISSING in str(exc):
        return exc
    return type(exc)(
        exc.what,
        file=exc.file,
        variable=exc.variable,
        expected=exc.expected,
        found=exc.found,
        hint=hint,
    )
