"""Keras 3 ``.weights.h5`` files: scan, open, write and detection (``.keras`` archives, which
hold one, and the ``keras`` format's entry points are in :mod:`._archive`, above this module).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import IO, Any

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
)
from parallelvars.formats._json import dumps, jsonable
from parallelvars.formats._plan import plan_tensors
from parallelvars.formats._view import CheckpointView, Entry
from parallelvars.formats.keras._layout import (
    _OWN_ROOT_ATTRS,
    _SUFFIX_RE,
    KERAS_LAYOUT,
    LEGACY_LAYOUT,
    RESERVED,
)
from parallelvars.formats.keras._read import _is_legacy, _open, _reserved, _sniff_with
from parallelvars.formats.keras._write import (
    _check_dtypes,
    _layout,
    _seal,
    _set_keras_attr,
    _user_metadata,
    _write_dataset,
    _write_info,
)

_VARS_RE = re.compile(r"^(?:.+/)?vars/(0|[1-9][0-9]*)$")


def _scan_keras(h5: h5py.File, p: str) -> tuple[dict[str, h5py.Dataset], dict[str, dict[str, Any]]]:
    """The datasets of a Keras 3 file in reading order, and the groups' attributes."""
    if _is_legacy(h5):
        raise NotACheckpointError(
            "this is a legacy Keras HDF5 file, not Keras 3 .weights.h5",
            file=p,
            hint="open it with format 'keras-legacy'",
        )
    datasets: dict[str, h5py.Dataset] = {}
    groups: dict[str, dict[str, Any]] = {}
    root_attrs = {k: attr_to_python(v) for k, v in h5.attrs.items() if k not in _OWN_ROOT_ATTRS}
    if root_attrs:
        groups["/"] = root_attrs
    found_vars = False

    for name, obj in _h5policy.walk(h5, p):  # iterative, links refused, depth capped
        if name == RESERVED or name.startswith(f"{RESERVED}/"):
            continue
        if isinstance(obj, h5py.Group):
            found_vars = found_vars or name.rpartition("/")[2] == "vars"
            if obj.attrs:
                groups[name] = {k: attr_to_python(v) for k, v in obj.attrs.items()}
            continue
        datasets[name] = obj
    if not found_vars:
        raise NotACheckpointError(
            "no Keras 'vars' group in the HDF5 file",
            file=p,
            expected="a Keras 3 .weights.h5 layout",
            found=f"top-level {sorted(h5)}",
        )
    for name in datasets:
        if not _VARS_RE.match(name):
            raise CorruptCheckpointError(
                "dataset outside a Keras vars group (expected <path>/vars/<index>)",
                file=p,
                variable=name,
            )
    order = sorted(datasets, key=lambda k: (k.rpartition("/")[0], int(k.rpartition("/")[2])))
    _reserved(h5, "", datasets, p)
    keys = order + [k for k in datasets if k.startswith(f"{RESERVED}/")]
    return {k: datasets[k] for k in keys}, groups


def open_weights(
    path: str | os.PathLike[str],
    *,
    h5: h5py.File | None = None,
    size: int | None = None,
    owned: IO[bytes] | None = None,
) -> CheckpointView:
    """Open a Keras 3 ``.weights.h5`` file lazily (entry paths: ``layers/<name>/vars/<i>``).

    Files we wrote carry CRC-32Cs (per dataset and of the structure), checked on read; a file
    from Keras has none and is read as it is. ``h5``, ``size`` and ``owned``: the weights of a
    ``.keras`` archive already open (see :mod:`._archive`, which also opens archives by name).
    """
    return _open(
        os.fspath(path),
        "keras",
        "Keras weights",
        _scan_keras,
        lambda groups: (KERAS_LAYOUT, dumps({"groups": jsonable(groups)})),
        h5=h5,
        size=size,
        owned=owned,
    )


def _keras3_keys(entries: Mapping[str, Entry], file: str) -> dict[str, str]:
    primary: dict[str, str] = {}
    used: set[str] = set()
    for path in entries:
        if path.startswith(f"{RESERVED}/"):
            raise InvalidEntryError(
                f"paths under {RESERVED}/ are reserved", file=file, variable=path
            )
        if _VARS_RE.match(path):
            primary[path] = path
            used.add(path)
    next_index: dict[str, int] = {}
    for path in entries:
        if path in primary:
            continue
        parent = path.rpartition("/")[0]
        group = f"{parent}/vars" if parent else "vars"
        i = next_index.get(group, 0)
        while f"{group}/{i}" in used:
            i += 1
        next_index[group] = i + 1
        primary[path] = f"{group}/{i}"
        used.add(primary[path])
    return primary


_MODEL_CLASSES = ("Sequential", "Functional", "Model")


def _snake_case(name: str) -> str:
    """Keras' ``naming.to_snake_case``: ``BatchNormalization`` -> ``batch_normalization``."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def _keras3_from_legacy(
    entries: Mapping[str, Entry], legacy: dict[str, Any], file: str
) -> tuple[dict[str, str], dict[str, dict[str, Any]]] | None:
    """Keras 3 keys and groups for the weights of a legacy Keras file, or None when the entries
    are not that file's weights (renamed or from elsewhere: the generic mapping applies).

    Keras 3 names a layer's group after its *class* (``layers/dense_1/vars``, made unique in
    layer order) and records the layer's name in ``@name``; the legacy layout has the layer
    names and their order, and the model config of a full-model file has the classes.
    """
    layers = {
        str(layer): [_SUFFIX_RE.sub("", str(w)) for w in names]
        for layer, names in (legacy.get("layers") or {}).items()
    }
    covered = [path for paths in layers.values() for path in paths]
    optimizer = [
        "optimizer_weights/" + _SUFFIX_RE.sub("", str(w))
        for w in legacy.get("optimizer_weights") or []
    ]
    if set(entries) != set(covered) | set(optimizer) or len(covered) != len(set(covered)):
        return None
    if optimizer:
        raise InvalidEntryError(
            f"{file}: the legacy file's optimizer weights ({len(optimizer)}) have no place in a "
            "Keras 3 .weights.h5 made from it (Keras 3 orders optimizer variables by its own "
            "optimizer objects); convert to another format to keep them"
        )
    raw = (legacy.get("file_attrs") or {}).get("model_config")
    try:
        config = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        config = None
    model = config.get("config") if isinstance(config, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("layers"), list):
        raise InvalidEntryError(
            f"{file}: a Keras 3 .weights.h5 names each layer's weights by the layer's class, and "
            "this legacy file has no model config saying which class each layer is (a "
            "save_weights file); convert the full-model file (model.save), or load it in Keras "
            "and call save_weights there"
        )
    classes: dict[str, str] = {}
    for layer in model["layers"]:
        if isinstance(layer, dict):
            cfg = layer.get("config")
            name = cfg.get("name") if isinstance(cfg, dict) else None
            name = name if isinstance(name, str) else layer.get("name")
            if isinstance(name, str) and isinstance(layer.get("class_name"), str):
                classes[name] = layer["class_name"]
    keys: dict[str, str] = {}
    groups: dict[str, dict[str, Any]] = {}
    if isinstance(model.get("name"), str):
        groups["vars"] = {"name": model["name"]}
    used: dict[str, int] = {}
    for layer in [str(n) for n in legacy.get("layer_names") or []]:
        cls = classes.get(layer)
        if cls is None:
            raise InvalidEntryError(
                f"{file}: layer {layer!r} is not in the file's model config; cannot "
                "tell its Keras 3 group"
            )
        if cls in _MODEL_CLASSES:
            raise InvalidEntryError(
                f"{file}: layer {layer!r} is a nested model ({cls}); its Keras 3 "
                "layout cannot be derived from the legacy file"
            )
        group = _snake_case(cls)
        if group in used:
            used[group] += 1
            group = f"{group}_{used[group]}"
        else:
            used[group] = 0
        groups[f"layers/{group}/vars"] = {"name": layer}
        for i, path in enumerate(layers.get(layer, [])):
            keys[path] = f"layers/{group}/vars/{i}"
    for i, path in enumerate(layers.get("top_level_model_weights", [])):
        keys[path] = f"vars/{i}"
    if set(keys) != set(covered):
        missing = sorted(set(covered) - set(keys))
        raise InvalidEntryError(
            f"{file}: weights of layers not in layer_names cannot be placed: {missing[:3]}"
        )
    return keys, groups


def keras3_mapping(
    entries: Mapping[str, Entry], metadata: Mapping[str, Any], file: str
) -> tuple[dict[str, str], dict[str, Any]]:
    """(entry path -> Keras 3 key, layout) for ``entries``: a legacy Keras file's weights get
    Keras 3's own names for its layers (from its model config), other entries the generic
    mapping (``layers/.../vars/<i>`` kept, other paths numbered in their parent's ``vars``)."""
    layout = _layout(metadata, KERAS_LAYOUT) or {}
    legacy = None if layout else _layout(metadata, LEGACY_LAYOUT)
    mapped = _keras3_from_legacy(entries, legacy, file) if legacy else None
    if mapped is not None:  # a legacy Keras file: Keras 3's own names for its layers
        keys, groups = mapped
        return keys, {"groups": groups}
    return _keras3_keys(entries, file), layout


def write_weights(
    path: str | os.PathLike[str],
    entries: Mapping[str, Entry],
    *,
    metadata: Mapping[str, Any] | None = None,
    keys: Mapping[str, str] | None = None,
) -> str:
    """Write ``entries`` as a Keras 3 ``.weights.h5`` file, one tensor at a time (see
    :func:`._archive.write_keras` for the arguments; a ``.keras`` archive goes there).
    ``keys``: the Keras 3 key of each entry, already mapped (:func:`keras3_mapping`).

    Returns:
        The file written.
    """
    p = os.fspath(path)
    if metadata is None:
        metadata = getattr(entries, "metadata", None) or {}
    if keys is None:
        keys, layout = keras3_mapping(entries, metadata, p)
    else:
        layout = _layout(metadata, KERAS_LAYOUT) or {}
    planned, info = plan_tensors(
        entries,
        names="slash",
        needs_record=lambda e: False,
        file=p,
        key_of=lambda path, e, i: (
            keys[path] if i == 0 else f"{RESERVED}/{keys[path]}/{component_name(i)}"
        ),
    )
    _check_dtypes(planned, p)
    user = _user_metadata(metadata, KERAS_LAYOUT)
    scratch = Scratch()
    with atomic_path(p) as tmp, h5py.File(tmp, "w", libver="latest") as h5:
        for gpath, attrs in (layout.get("groups") or {}).items():
            group = h5 if gpath == "/" else h5.require_group(gpath)
            for name, value in (attrs or {}).items():
                _set_keras_attr(group, name, value)
        for t in planned:
            parent = t.key.rpartition("/")[0]
            group = h5.require_group(parent)
            if (
                parent.endswith("vars")
                and "name" not in group.attrs
                and not parent.startswith(RESERVED)
            ):
                owner = parent[: -len("vars")].rstrip("/").rpartition("/")[2]
                if owner:
                    _set_keras_attr(group, "name", owner)
            _write_dataset(h5, t.key, t, p, scratch)
        _write_info(h5, info, user)
        _seal(h5, tmp, _scan_keras)
    return p


def _has_vars_group(h5: h5py.File) -> bool:
    if _is_legacy(h5):
        return False

    return any(
        isinstance(obj, h5py.Group) and name.rpartition("/")[2] == "vars"
        for name, obj in _h5policy.walk(h5, h5.filename, skip_links=True)
    )


def sniff_weights(path: str, head: bytes) -> bool:
    """True for an HDF5 file with Keras 3 ``vars`` groups and no legacy attributes."""
    return _sniff_with(path, head, _has_vars_group)
