"""Legacy Keras HDF5 weights (``keras-legacy``): scan, open, write and detection."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import h5py

from parallelvars._fileio import Scratch, atomic_path
from parallelvars.checkpoint import _h5policy
from parallelvars.checkpoint.registry import component_name
from parallelvars.errors import (
    CorruptCheckpointError,
    InvalidEntryError,
    NotACheckpointError,
)
from parallelvars.formats._h5 import (
    attr_to_python,
    read_split_attr,
)
from parallelvars.formats._json import dumps, jsonable
from parallelvars.formats._plan import plan_tensors
from parallelvars.formats._view import CheckpointView, Entry
from parallelvars.formats.keras._layout import (
    _OWN_ROOT_ATTRS,
    KERAS_LAYOUT,
    LEGACY_LAYOUT,
    RESERVED,
)
from parallelvars.formats.keras._read import (
    _is_legacy,
    _model_weights,
    _open,
    _reserved,
    _sniff_with,
)
from parallelvars.formats.keras._write import (
    _check_dtypes,
    _layout,
    _seal,
    _set_keras_attr,
    _set_name_list,
    _user_metadata,
    _write_dataset,
    _write_info,
)

_SUFFIX_RE = re.compile(r":\d+$")
# Any version but "1" tells Keras' legacy loader that no Keras 1 conversion is needed.
_GENERIC_KERAS_VERSION = "3.0.0"


def _scan_legacy(h5: h5py.File, p: str) -> tuple[dict[str, h5py.Dataset], dict[str, Any]]:
    """The datasets of a legacy Keras file in reading order, and its layout."""
    model_weights = _model_weights(h5, p)
    in_model = model_weights is not None
    root = model_weights or h5
    if "layer_names" not in root.attrs and "layer_names0" not in root.attrs:
        raise NotACheckpointError(
            "no layer_names attribute: not a legacy Keras weights file",
            file=p,
            expected="attribute layer_names",
            found=f"attributes {sorted(root.attrs)}",
        )
    layer_names = read_split_attr(root, "layer_names", p)
    datasets: dict[str, h5py.Dataset] = {}
    layers: dict[str, list[str]] = {}

    def add(group: h5py.Group, prefix: str) -> list[str]:
        names = read_split_attr(group, "weight_names", p)
        for w in names:
            ds = _h5policy.get(group, w, p)
            if not isinstance(ds, h5py.Dataset):
                raise CorruptCheckpointError(
                    "weight listed in weight_names has no dataset",
                    file=p,
                    variable=f"{group.name}/{w}",
                )
            key = prefix + _SUFFIX_RE.sub("", w)
            if key in datasets:
                raise CorruptCheckpointError("two weights have the same name", file=p, variable=key)
            datasets[key] = ds
        return names

    for layer in [*layer_names, "top_level_model_weights"]:
        group = _h5policy.get(root, layer, p)
        if not isinstance(group, h5py.Group):
            if layer == "top_level_model_weights":
                continue
            raise CorruptCheckpointError(
                "layer listed in layer_names has no group", file=p, variable=layer
            )
        layers[layer] = add(group, "")
    layout: dict[str, Any] = {
        "root": "model_weights" if in_model else "",
        "layer_names": layer_names,
        "layers": layers,
        "file_attrs": {
            k: attr_to_python(v)
            for k, v in h5.attrs.items()
            if k not in _OWN_ROOT_ATTRS and not (in_model is False and k.startswith("layer_names"))
        },
    }
    if in_model:
        layout["root_attrs"] = {
            k: attr_to_python(v) for k, v in root.attrs.items() if not k.startswith("layer_names")
        }
    optimizer = _h5policy.get(h5, "optimizer_weights", p)
    if isinstance(optimizer, h5py.Group):
        layout["optimizer_weights"] = add(optimizer, "optimizer_weights/")
    _reserved(root, "", datasets, p)
    return datasets, layout


def open_keras_legacy(path: str | os.PathLike[str]) -> CheckpointView:
    """Open a legacy Keras HDF5 file lazily (entry paths: weight names without ``:0``).

    Files we wrote carry CRC-32Cs (per dataset and of the structure), checked on read; a file
    from Keras has none and is read as it is.
    """
    return _open(
        path,
        "keras-legacy",
        "Keras",
        _scan_legacy,
        lambda layout: (LEGACY_LAYOUT, dumps(jsonable(layout))),
    )


def _legacy_plan(
    entries: Mapping[str, Entry], layout: dict[str, Any] | None, keras3: dict[str, Any] | None
) -> tuple[
    str, list[str], dict[str, list[tuple[str, str]]], list[tuple[str, str]] | None, dict[str, Any]
]:
    """(root, layer_names, layer -> [(weight name, path)], optimizer weights, layout) for the
    legacy writer: the recorded layout when it matches the entries, else one made from paths."""
    paths = set(entries)
    if layout:
        layers = {
            str(layer): [(str(w), _SUFFIX_RE.sub("", str(w))) for w in names]
            for layer, names in (layout.get("layers") or {}).items()
        }
        opt = layout.get("optimizer_weights")
        optimizer = (
            [(str(w), "optimizer_weights/" + _SUFFIX_RE.sub("", str(w))) for w in opt]
            if opt is not None
            else None
        )
        covered = [p for ws in layers.values() for _, p in ws] + [p for _, p in optimizer or []]
        if set(covered) == paths and len(covered) == len(paths):
            root = str(layout.get("root") or "")
            return (
                root,
                [str(n) for n in layout.get("layer_names") or []],
                layers,
                optimizer,
                layout,
            )
    groups: dict[str, list[tuple[str, str]]] = {}
    for path in entries:
        if path.startswith(f"{RESERVED}/"):
            raise InvalidEntryError(f"paths under {RESERVED}/ are reserved", variable=path)
        groups.setdefault(path.rpartition("/")[0], []).append((path, path))
    keras3_groups = (keras3 or {}).get("groups") or {}

    def layer_name(parent: str) -> str:
        named = (keras3_groups.get(parent) or {}).get("name")
        if isinstance(named, str) and named:
            return named  # a Keras 3 vars group: its layer's own name
        if parent == "vars" or parent.endswith("/vars"):
            parent = parent[: -len("vars")].rstrip("/")
        return parent.rpartition("/")[2] or "model"

    wanted = {parent: layer_name(parent) for parent in groups if parent}
    counts: dict[str, int] = {}
    for name in wanted.values():
        counts[name] = counts.get(name, 0) + 1
    layers = {}
    layer_names = []
    for parent, weights in groups.items():
        if not parent:
            layers["top_level_model_weights"] = weights
            continue
        name = wanted[parent]
        if counts[name] > 1 or name in ("top_level_model_weights", RESERVED):
            name = parent.replace("/", "_")
        layers[name] = weights
        layer_names.append(name)
    generic = {"file_attrs": {"keras_version": _GENERIC_KERAS_VERSION}}
    return "", layer_names, layers, None, generic


def write_keras_legacy(
    path: str | os.PathLike[str],
    entries: Mapping[str, Entry],
    *,
    metadata: Mapping[str, Any] | None = None,
) -> str:
    """Write ``entries`` as a legacy Keras HDF5 weights file, one tensor at a time.

    Args:
        path: the output file.
        entries: the entries (a view of a legacy Keras file keeps its exact layout, including
            ``model_weights/`` and the model config of a full-model file).
        metadata: file metadata (default: the source view's); ``keras_legacy_layout`` gives
            the layout.

    Returns:
        The file written.
    """
    p = os.fspath(path)
    if metadata is None:
        metadata = getattr(entries, "metadata", None) or {}
    root_name, layer_names, layers, optimizer, layout = _legacy_plan(
        entries, _layout(metadata, LEGACY_LAYOUT), _layout(metadata, KERAS_LAYOUT)
    )
    planned, info = plan_tensors(
        entries,
        names="slash",
        file=p,
        key_of=lambda path, e, i: path if i == 0 else f"{RESERVED}/{path}/{component_name(i)}",
    )
    _check_dtypes(planned, p)
    by_key = {t.key: t for t in planned}
    user = _user_metadata(metadata, LEGACY_LAYOUT)
    scratch = Scratch()
    with atomic_path(p) as tmp, h5py.File(tmp, "w", libver="latest") as h5:
        for name, value in (layout.get("file_attrs") or {}).items():
            _set_keras_attr(h5, name, value)
        root = h5.require_group(root_name) if root_name else h5
        for name, value in (layout.get("root_attrs") or {}).items():
            _set_keras_attr(root, name, value)
        _set_name_list(root, "layer_names", layer_names)
        for layer, weights in layers.items():
            group = root.require_group(layer)
            _set_name_list(group, "weight_names", [w for w, _ in weights])
            for weight, wpath in weights:
                _write_dataset(group, weight, by_key[wpath], p, scratch)
        if optimizer is not None:
            group = h5.require_group("optimizer_weights")
            _set_name_list(group, "weight_names", [w for w, _ in optimizer])
            for weight, wpath in optimizer:
                _write_dataset(group, weight, by_key[wpath], p, scratch)
        for t in planned:
            if t.key.startswith(f"{RESERVED}/"):
                _write_dataset(root, t.key, t, p, scratch)
        _write_info(h5, info, user)
        _seal(h5, tmp, _scan_legacy)
    return p


def sniff_keras_legacy(path: str, head: bytes) -> bool:
    """True for an HDF5 file with a ``layer_names`` attribute (at the root or in model_weights)."""
    return _sniff_with(path, head, _is_legacy)
