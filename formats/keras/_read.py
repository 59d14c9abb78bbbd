"""Opening either Keras layout: the parallel info, reserved components, format detection and
the view built from a layout scan.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import h5py

from parallelvars.checkpoint import _h5policy
from parallelvars.errors import (
    CorruptCheckpointError,
    NotACheckpointError,
)
from parallelvars.formats._h5 import (
    H5_ERRORS,
    attr_to_python,
    h5_errors,
    is_hdf5,
    open_h5,
)
from parallelvars.formats._info import StoreView, build_entries
from parallelvars.formats._view import CheckpointView
from parallelvars.formats.keras._integrity import _verify_structure
from parallelvars.formats.keras._layout import INFO_ATTR, RESERVED
from parallelvars.formats.keras._store import _H5Store


def _info(h5: h5py.File, file: str) -> dict[str, Any] | None:
    raw = h5.attrs.get(INFO_ATTR)
    if raw is None:
        return None
    try:
        info = json.loads(attr_to_python(raw))
    except (TypeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(
            f"the parallelvars attribute is not valid JSON ({exc})", file=file, variable=INFO_ATTR
        ) from None
    if not isinstance(info, dict):
        raise CorruptCheckpointError(
            "the parallelvars attribute is not a JSON object", file=file, variable=INFO_ATTR
        )
    return info


def _reserved(group: h5py.Group, prefix: str, out: dict[str, h5py.Dataset], file: str) -> None:
    reserved = _h5policy.get(group, RESERVED, file)
    if not isinstance(reserved, h5py.Group):
        return
    for name, obj in _h5policy.walk(reserved, file):
        if isinstance(obj, h5py.Dataset):
            out[f"{prefix}{RESERVED}/{name}"] = obj


def _model_weights(h5: h5py.File, file: str) -> h5py.Group | None:
    """The legacy ``model_weights`` group (of a whole-model file), links checked."""
    group = _h5policy.get(h5, "model_weights", file)
    return group if isinstance(group, h5py.Group) else None


def _is_legacy(h5: h5py.File) -> bool:
    root = _model_weights(h5, h5.filename) or h5
    return "layer_names" in root.attrs or "layer_names0" in root.attrs


def _not_ours(h5: h5py.File, file: str, want: str) -> None:
    if "parallelvars_format" in h5.attrs:
        raise NotACheckpointError(
            f"this is a parallelvars HDF5 checkpoint, not a {want} file",
            file=file,
            hint="open it with format 'hdf5'",
        )


def _open(
    path: str | os.PathLike[str], fmt: str, what: str, scan: Any, layout_entry: Any
) -> CheckpointView:
    """Open either Keras layout: ``scan`` finds the datasets and the layout, which is verified
    against the structure checksum and kept in the metadata (``layout_entry``) for writers."""
    p = os.fspath(path)
    h5 = open_h5(p)
    try:
        with h5_errors(p, "h5py cannot read the file's structure"):
            _not_ours(h5, p, what)
            datasets, layout = scan(h5, p)
            store = _H5Store(p, h5, datasets)
            info = _info(h5, p)
            _verify_structure(h5, p, store, layout, info)
            entries = build_entries(store, info, names="slash")
        metadata = dict((info or {}).get("metadata") or {})
        key, value = layout_entry(layout)
        metadata[key] = value
    except BaseException:
        with contextlib.suppress(*H5_ERRORS):
            h5.close()
        raise
    return StoreView(store, entries, format=fmt, path=p, metadata=metadata)


def _sniff_with(path: str, head: bytes, check: Any) -> bool:
    if not is_hdf5(path, head):
        return False
    try:
        with h5py.File(path, "r") as h5:
            if "parallelvars_format" in h5.attrs:
                return False
            return bool(check(h5))
    except H5_ERRORS:
        return False
