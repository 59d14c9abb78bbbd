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
    InvalidArgumentError,
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
from parallelvars.formats.keras._archive import keras_layer_order
from parallelvars.formats.keras._layout import (
    _OWN_ROOT_ATTRS,
    _SUFFIX_RE,
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

# A Keras 3 layer group: layers/<snake-case class>[_<n>]/vars, <n> counting layers of a class.
_KERAS3_GROUP_RE = re.compile(r"^(?:.*/)?layers/([A-Za-z0-9_]+?)(?:_(\d+))?/vars$")


def _group_rank(parent: str) -> tuple[str, int, str]:
    """Keras 3 groups of one class in the model's order (dense, dense_1, ..., dense_10), which
    their names' alphabetical order is not; other groups keep their order among themselves."""
    m = _KERAS3_GROUP_RE.match(parent)
    if m is None:
        return ("", 0, "")
    return (m.group(1), int(m.group(2) or 0), parent)


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
    entries: Mapping[str, Entry],
    layout: dict[str, Any] | None,
    keras3: dict[str, Any] | None,
    order: list[str] | None = None,
    file: str = "",
) -> tuple[
    str, list[str], dict[str, list[tuple[str, str]]], list[tuple[str, str]] | None, dict[str, Any]
]:
    """(root, layer_names, layer -> [(weight name, path)], optimizer weights, layout) for the
    legacy writer: the recorded layout when it matches the entries, else one made from paths,
    its layers in ``order`` (the model's layer names in the model's order, from a template).

    Keras' legacy loader matches layers by position, so ``layer_names`` must be in the model's
    order. Keras 3 groups (``layers/<class>[_<n>]/vars``) of more than one class carry no such
    order, and without a template they are refused rather than written in an order that
    loads the wrong weights or fails in Keras."""
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

    if order is None:
        classes = {m.group(1) for m in map(_KERAS3_GROUP_RE.match, groups) if m}
        if len(classes) > 1:
            raise InvalidArgumentError(
                f"{file}: Keras 3 weights of {len(classes)} layer classes "
                f"({', '.join(sorted(classes)[:4])}) do not say the model's layer order, which "
                "Keras' legacy loader matches by; pass the model's .keras archive as a template "
                "(like=MODEL.keras, --like)"
            )
        groups = dict(sorted(groups.items(), key=lambda kv: _group_rank(kv[0])))
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
    if order is not None:
        rank = {name: i for i, name in enumerate(order)}
        unplaced = [n for n in layer_names if n not in rank]
        if unplaced:
            raise InvalidEntryError(
                "layers not in the template's model config",
                file=file,
                variable=unplaced[0],
                expected=f"layers of the template ({', '.join(order[:6])})",
                found=f"{', '.join(unplaced[:6])}",
            )
        layer_names.sort(key=rank.__getitem__)
    generic = {"file_attrs": {"keras_version": _GENERIC_KERAS_VERSION}}
    return "", layer_names, layers, None, generic


def write_keras_legacy(
    path: str | os.PathLike[str],
    entries: Mapping[str, Entry],
    *,
    metadata: Mapping[str, Any] | None = None,
    like: str | os.PathLike[str] | None = None,
) -> str:
    """Write ``entries`` as a legacy Keras HDF5 weights file, one tensor at a time.

    Args:
        path: the output file.
        entries: the entries (a view of a legacy Keras file keeps its exact layout, including
            ``model_weights/`` and the model config of a full-model file).
        metadata: file metadata (default: the source view's); ``keras_legacy_layout`` gives
            the layout.
        like: the model's ``.keras`` archive: its config gives the layers' order (Keras'
            legacy loader matches layers by position) and its weights the layers' names.
            Needed for Keras 3 weights of more than one layer class.

    Returns:
        The file written.
    """
    p = os.fspath(path)
    if metadata is None:
        metadata = getattr(entries, "metadata", None) or {}
    keras3 = _layout(metadata, KERAS_LAYOUT)
    order = None
    if like is not None:
        order, template_layout = keras_layer_order(like)
        keras3 = _layout({KERAS_LAYOUT: template_layout}, KERAS_LAYOUT) or keras3
    root_name, layer_names, layers, optimizer, layout = _legacy_plan(
        entries, _layout(metadata, LEGACY_LAYOUT), keras3, order, p
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
