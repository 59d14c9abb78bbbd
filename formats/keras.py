"""Keras weight files: Keras 3 ``.weights.h5`` (``keras``) and legacy Keras HDF5 (``keras-legacy``).

Both are read and written with h5py; datasets are read only when a component is asked for.

``keras`` (Keras 3 ``save_weights`` / ``H5IOStore``, FORMATS.md 3.2)::

    /vars                       @name="sequential"   (the model's own variables)
    /layers/dense/vars          @name="hidden"       0: kernel, 1: bias
    /layers/batch_normalization/vars @name="bn"      0..3
    /optimizer/vars             @name="adam"         0: iterations, 1: learning_rate, ...

  Entry paths are the dataset paths (``layers/dense/vars/0``): Keras itself records no variable
  names, only their order. The groups' attributes are kept in the view's metadata
  (``keras_weights_layout``), so a file read and written back has the same groups, datasets,
  attributes and values, and Keras loads it into the same architecture. Entries from other
  formats whose paths are not of that form go to ``<parent>/vars/<i>`` in order
  (``model/dense/kernel`` -> ``model/dense/vars/0``), with their path kept in the parallel info.

``keras-legacy`` (Keras 2 ``save_weights("x.h5")`` and the ``model_weights/`` group of
``model.save("x.h5")``, FORMATS.md 3.1)::

    @layer_names = ["hidden", "bn", ...]        (split into layer_names0, 1, ... when large)
    /hidden  @weight_names = ["sequential/hidden/kernel", ...]
    /hidden/sequential/hidden/kernel           (Keras 2 names end in ":0")

  Entry paths are the weight names without the ``:0`` suffix (``sequential/hidden/kernel``);
  ``optimizer_weights/`` of a full-model file is read under ``optimizer_weights/<name>``. Layer
  order, the exact weight names and the string attributes are kept in the view's metadata
  (``keras_legacy_layout``). Entries from other formats are grouped into layers by their parent
  path (``model/dense/kernel`` -> layer ``dense``), top-level paths into
  ``top_level_model_weights``, as Keras does.

Parallel variables: Keras counts the datasets of a layer, so only primaries (and the stitched
value of a sharded variable) go where Keras looks; extra components go under the reserved group
``/_parallel_components/<primary's path>/parallel_component_<i>`` and the parallel info (see
:mod:`._info`) into the root attribute ``parallelvars``, written only when there is something
to record. Keras ignores both.

Integrity (files we write; Keras ignores all of it): the file is written with
``libver="latest"``, so HDF5 checksums its own metadata (superblock, object headers, B-trees);
every dataset has a ``crc32c`` attribute (CRC-32C of its bytes), checked when it is read; the
root attribute ``parallelvars_crc32c`` is a CRC-32C of a canonical description of everything
the reader takes from the structure (dataset keys and order, dtypes, shapes and CRCs, layer and
weight names, the groups' attributes, the parallel info), checked on opening. String attributes
are written fixed-length, as Keras 2 writes its name lists, so no string lives in HDF5's global
heap (which has no checksum, and whose parser can loop on a damaged file); the one exception is
the ``dtype`` attribute of bfloat16 and other ml_dtypes datasets, which Keras compares with a
``str``. Every h5py error on a damaged file is raised as a
:class:`~parallelvars.errors.CorruptCheckpointError` naming the file (and dataset). Files from
Keras carry none of this and are read as they are.

dtypes: numpy dtypes are stored natively; bfloat16 (and the other ml_dtypes types) as HDF5
OPAQUE data (``|V2``) with a dataset attribute ``dtype="bfloat16"``, as Keras writes it. String
tensors are refused.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import crc32c as _crc32c
import h5py
import numpy as np

from parallelvars._fileio import Scratch, atomic_path
from parallelvars.checkpoint import _h5policy
from parallelvars.checkpoint.h5io import checksum
from parallelvars.errors import (
    ChecksumMismatchError,
    ClosedCheckpointError,
    CorruptCheckpointError,
    InvalidEntryError,
    NotACheckpointError,
    TruncatedFileError,
    UnsupportedDtypeError,
)

from ._dtypes import dtype_name, is_ml_dtype, is_string_dtype
from ._h5 import H5_ERRORS, attr_to_python, h5_errors, is_hdf5, open_h5, read_split_attr
from ._info import StoreView, build_entries
from ._json import carried_metadata, dumps, jsonable
from ._plan import PlannedTensor, plan_tensors
from ._registry import FormatSpec
from ._store import TensorStore
from ._view import CheckpointView, Entry

__all__ = ["FORMATS", "open_keras", "open_keras_legacy", "write_keras", "write_keras_legacy"]

RESERVED = "_parallel_components"
INFO_ATTR = "parallelvars"
#: Dataset attribute: CRC-32C of the dataset's bytes (Keras ignores attributes it does not know).
CRC_ATTR = "crc32c"
#: Root attribute: CRC-32C of a canonical description of everything the reader takes from the
#: file besides tensor bytes (dataset keys, order, dtypes, shapes and CRCs, layer and weight
#: names, the groups' attributes, the parallel info).
STRUCTURE_ATTR = "parallelvars_crc32c"
_OWN_ROOT_ATTRS = (INFO_ATTR, STRUCTURE_ATTR)
# deflate's best case is about 1032:1: no compressed dataset can expand more than this.
_MAX_COMPRESSION = 1100
KERAS_LAYOUT = "keras_weights_layout"
LEGACY_LAYOUT = "keras_legacy_layout"
# Keras splits string-list attributes above the HDF5 object header limit.
_HEADER_LIMIT = 64512
_VARS_RE = re.compile(r"^(?:.+/)?vars/(0|[1-9][0-9]*)$")
_SUFFIX_RE = re.compile(r":\d+$")
# Any version but "1" tells Keras' legacy loader that no Keras 1 conversion is needed.
_GENERIC_KERAS_VERSION = "3.0.0"


# --------------------------------------------------------------------------------------------
# reading


def _dataset_dtype(ds: h5py.Dataset, file: str, key: str) -> np.dtype:
    dt = ds.dtype
    if h5py.check_string_dtype(dt) is not None or h5py.check_vlen_dtype(dt) is not None:
        return np.dtype(object)
    if dt.kind == "V" and dt.fields is None:
        tag = attr_to_python(ds.attrs.get("dtype", ""))
        from ._dtypes import dtype_from_name

        real = dtype_from_name(tag, file=file, variable=key) if tag else None
        if real is None or real.itemsize != dt.itemsize:
            raise UnsupportedDtypeError(
                "opaque dataset without a matching dtype attribute",
                file=file,
                variable=key,
                expected='attribute dtype="bfloat16"',
                found=f"{dt} with dtype={tag!r}",
            )
        return real
    if dt.kind not in "biufc" or dt.fields is not None:
        raise UnsupportedDtypeError(
            "unsupported HDF5 dataset type",
            file=file,
            variable=key,
            expected="a numeric dtype",
            found=str(dt),
        )
    return dt.newbyteorder("=")


class _H5Store(TensorStore):
    """Datasets of an open h5py file, addressed by our keys."""

    def __init__(self, file: str, h5: h5py.File, datasets: Mapping[str, h5py.Dataset]) -> None:
        self.file = file
        self._h5: h5py.File | None = h5
        self._ds = dict(datasets)
        self._meta = {
            k: (_dataset_dtype(d, file, k), tuple(int(s) for s in d.shape))
            for k, d in self._ds.items()
        }
        self.crcs: dict[str, int | None] = {
            k: _dataset_crc(d, file, k) for k, d in self._ds.items()
        }
        self._verified: set[str] = set()
        size = os.path.getsize(file)
        for k, d in self._ds.items():
            dtype, shape = self._meta[k]
            # No bytes from outside the file; variable-length strings contiguous and unfiltered
            # (their count bounded by the file's size).
            _h5policy.check_dataset(d.id, file, k, dtype=dtype if d.dtype.kind == "O" else None)
            # (the stored size: a fixed-length string's elements may be larger than an object)
            nbytes = math.prod(shape) * max(dtype.itemsize, d.dtype.itemsize)
            limit = size * (_MAX_COMPRESSION if d.chunks is not None else 1)
            if nbytes > limit:  # refused before anything is allocated for it
                raise TruncatedFileError(
                    "the dataset claims more bytes than the file holds",
                    file=file,
                    variable=k,
                    expected=f"<= {limit} bytes",
                    found=f"{nbytes} bytes",
                )

    def keys(self) -> list[str]:
        return list(self._ds)

    def stored(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        return self._meta[key]

    def _dataset(self, key: str) -> h5py.Dataset:
        if self._h5 is None:
            raise ClosedCheckpointError("the checkpoint view is closed", file=self.file)
        return self._ds[key]

    @staticmethod
    def _selection(region: tuple[int, int, int] | None) -> Any:
        if region is None:
            return ()
        axis, start, stop = region
        return (slice(None),) * axis + (slice(start, stop),)

    def read_into(
        self, key: str, out: np.ndarray, region: tuple[int, int, int] | None = None
    ) -> None:
        ds = self._dataset(key)
        with h5_errors(self.file, "h5py cannot read the dataset", key):
            if region is not None:
                self._verify(key)
            if out.size == 0:
                if region is None:
                    self._check(key, out)
                return
            target = out.view(ds.dtype) if ds.dtype.kind == "V" else out
            sel = self._selection(region)
            if ds.shape == ():
                target[()] = ds[()]
            else:
                ds.read_direct(target, source_sel=sel if sel else None)
            if region is None:
                self._check(key, out)

    def _check(self, key: str, value: np.ndarray) -> None:
        expected = self.crcs[key]
        if expected is not None and key not in self._verified:
            found = checksum(value)
            if found != expected:
                raise ChecksumMismatchError(
                    "the dataset's bytes do not match their crc32c attribute",
                    file=self.file,
                    variable=key,
                    expected=f"crc32c {expected:#010x}",
                    found=f"crc32c {found:#010x}",
                )
        self._verified.add(key)

    def _verify(self, key: str) -> None:
        """Check a whole dataset before the first partial read of it (once)."""
        if self.crcs[key] is None or key in self._verified:
            return
        dtype, shape = self._meta[key]
        whole = np.empty(shape, dtype)
        self.read_into(key, whole)

    def read_objects(self, key: str, region: tuple[int, int, int] | None = None) -> np.ndarray:
        ds = self._dataset(key)
        with h5_errors(self.file, "h5py cannot read the dataset", key):
            values = np.asarray(ds[self._selection(region)] if region else ds[()], dtype=object)
        out = np.empty(values.shape, object)
        for idx, v in np.ndenumerate(values):
            out[idx] = v.encode("utf-8") if isinstance(v, str) else bytes(v)
        return out

    def close(self) -> None:
        h5, self._h5 = self._h5, None
        if h5 is not None:
            with h5_errors(self.file, "h5py cannot close the file"):
                h5.close()


def _dataset_crc(ds: h5py.Dataset, file: str, key: str) -> int | None:
    raw = ds.attrs.get(CRC_ATTR)
    if raw is None:
        return None
    value = np.asarray(raw)
    if value.shape != () or value.dtype.kind not in "iu" or not 0 <= int(value) < (1 << 32):
        raise CorruptCheckpointError(
            "the crc32c attribute is damaged",
            file=file,
            variable=key,
            expected="an integer in [0, 2**32)",
            found=repr(raw)[:80],
        )
    return int(value)


def _structure_crc(store: _H5Store, layout: Any, info: Any) -> int:
    """CRC-32C of a canonical description of what the reader takes from the file's structure."""
    keys = store.keys()
    doc = {
        "layout": jsonable(layout),
        "info": jsonable(info),
        "datasets": [
            [k, str(store.stored(k)[0]), list(store.stored(k)[1]), store.crcs[k]] for k in keys
        ],
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return int(_crc32c.crc32c(text.encode("ascii")))


def _verify_structure(h5: h5py.File, file: str, store: _H5Store, layout: Any, info: Any) -> None:
    raw = h5.attrs.get(STRUCTURE_ATTR)
    if raw is None:
        if isinstance(info, dict) and info.get("checksums"):
            raise CorruptCheckpointError(
                "the structure checksum is missing",
                file=file,
                variable=STRUCTURE_ATTR,
                expected=f"root attribute {STRUCTURE_ATTR}",
                found="none",
            )
        return  # a file from Keras or another tool
    value = np.asarray(raw)
    if value.shape != () or value.dtype.kind not in "iu":
        raise CorruptCheckpointError(
            "the structure checksum attribute is damaged",
            file=file,
            variable=STRUCTURE_ATTR,
            expected="an integer",
            found=repr(raw)[:80],
        )
    found = _structure_crc(store, layout, info)
    if int(value) != found:
        raise ChecksumMismatchError(
            "the file's structure (names, order, attributes, dtypes, shapes) does "
            "not match its checksum",
            file=file,
            variable=STRUCTURE_ATTR,
            expected=f"crc32c {int(value):#010x}",
            found=f"crc32c {found:#010x}",
        )


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


def open_keras(path: str | os.PathLike[str]) -> CheckpointView:
    """Open a Keras 3 ``.weights.h5`` file lazily (entry paths: ``layers/<name>/vars/<i>``).

    Files we wrote carry CRC-32Cs (per dataset and of the structure), checked on read; a file
    from Keras has none and is read as it is.
    """
    return _open(
        path,
        "keras",
        "Keras weights",
        _scan_keras,
        lambda groups: (KERAS_LAYOUT, dumps({"groups": jsonable(groups)})),
    )


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
    layer_names = read_split_attr(root, "layer_names")
    datasets: dict[str, h5py.Dataset] = {}
    layers: dict[str, list[str]] = {}

    def add(group: h5py.Group, prefix: str) -> list[str]:
        names = read_split_attr(group, "weight_names")
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


def _seal(h5: h5py.File, tmp: str, scan: Any) -> None:
    """Store the structure checksum of the file being written (read back as the reader will)."""
    datasets, layout = scan(h5, tmp)
    store = _H5Store(tmp, h5, datasets)
    h5.attrs[STRUCTURE_ATTR] = np.int64(_structure_crc(store, layout, _info(h5, tmp)))


# --------------------------------------------------------------------------------------------
# writing


def _to_h5(array: np.ndarray, file: str, variable: str) -> np.ndarray:
    if is_string_dtype(array.dtype):
        raise UnsupportedDtypeError(
            "Keras weight files cannot hold string tensors",
            file=file,
            variable=variable,
            expected="a numeric dtype",
            found="bytes",
        )
    if is_ml_dtype(array.dtype):
        return array.view(f"V{array.dtype.itemsize}")  # HDF5 OPAQUE, as Keras stores bfloat16
    return array


def _check_dtypes(planned: list[PlannedTensor], file: str) -> None:
    for t in planned:
        if is_string_dtype(t.dtype):
            raise UnsupportedDtypeError(
                "Keras weight files cannot hold string tensors",
                file=file,
                variable=t.entry.path,
                expected="a numeric dtype",
                found="bytes",
            )
        if t.dtype.kind not in "biufc" and not is_ml_dtype(t.dtype):
            raise UnsupportedDtypeError(
                "Keras weight files cannot hold this dtype",
                file=file,
                variable=t.entry.path,
                expected="a numeric dtype",
                found=str(t.dtype),
            )


def _write_dataset(
    h5: h5py.File | h5py.Group, name: str, t: PlannedTensor, file: str, scratch: Scratch
) -> None:
    value = _to_h5(t.read_with(scratch), file, t.entry.path)
    ds = h5.create_dataset(name, data=value)
    if is_ml_dtype(t.dtype):
        ds.attrs["dtype"] = dtype_name(t.dtype)  # a str: Keras compares it with "bfloat16"
    ds.attrs[CRC_ATTR] = np.int64(checksum(value))


def _fixed_strings(values: str | list[str]) -> np.ndarray:
    """Strings as fixed-length UTF-8 bytes (``|S``), as Keras 2 writes its name lists.

    Variable-length strings would live in HDF5's global heap, which has no checksum and whose
    parser can loop forever on a damaged file; fixed-length values stay in the (checksummed)
    object header. Readers get the same strings back (:func:`._h5.attr_to_python`).
    """
    if isinstance(values, str):
        raw = values.encode("utf-8", "surrogateescape")
        return np.array(raw, dtype=f"S{max(1, len(raw))}")
    encoded = [v.encode("utf-8", "surrogateescape") for v in values]
    return np.array(encoded, dtype=f"S{max((len(b) for b in encoded), default=1) or 1}")


def _set_attr(obj: h5py.Group | h5py.File, name: str, value: Any) -> None:
    if isinstance(value, list):
        if not value:
            obj.attrs[name] = np.zeros(0, np.float64)  # what Keras writes for an empty list
        elif all(isinstance(v, str) for v in value):
            obj.attrs[name] = _fixed_strings(value)
        else:
            obj.attrs[name] = np.asarray(value)
    elif value is None:
        return
    elif isinstance(value, str):
        obj.attrs[name] = _fixed_strings(value)
    else:
        obj.attrs[name] = value


def _set_name_list(obj: h5py.Group | h5py.File, name: str, values: list[str]) -> None:
    """Write a string-list attribute, split into ``name0``, ``name1``... as Keras does when
    the list would overflow the object header."""
    per_chunk = max(
        1,
        _HEADER_LIMIT // max((len(v.encode("utf-8", "surrogateescape")) for v in values), default=1)
        or 1,
    )
    if len(values) <= per_chunk:
        _set_attr(obj, name, list(values))
        return
    for i in range(0, len(values), per_chunk):
        _set_attr(obj, f"{name}{i // per_chunk}", list(values[i : i + per_chunk]))


def _user_metadata(metadata: Mapping[str, Any], own: str) -> dict[str, Any]:
    return jsonable(carried_metadata(metadata, own))


def _layout(metadata: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    raw = metadata.get(key)
    if raw is None:
        return None
    try:
        layout = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return None
    return layout if isinstance(layout, dict) else None


def _write_info(h5: h5py.File, info: dict[str, Any], user: dict[str, Any]) -> None:
    if info["variables"] or user:
        _set_attr(h5, INFO_ATTR, dumps({**info, "checksums": "crc32c", "metadata": user}))


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


def write_keras(
    path: str | os.PathLike[str],
    entries: Mapping[str, Entry],
    *,
    metadata: Mapping[str, Any] | None = None,
) -> str:
    """Write ``entries`` as a Keras 3 ``.weights.h5`` file, one tensor at a time.

    Args:
        path: the output file.
        entries: the entries (a view of a Keras file keeps its exact layout).
        metadata: file metadata (default: the source view's); ``keras_weights_layout`` gives
            the groups' attributes. The weights of a legacy Keras file (``keras_legacy_layout``)
            go where Keras 3 looks for them (``layers/<class>/vars/<i>``), which needs the
            model config of a full-model file; a mapping that cannot be made is a ValueError.

    Returns:
        The file written.
    """
    p = os.fspath(path)
    if metadata is None:
        metadata = getattr(entries, "metadata", None) or {}
    layout = _layout(metadata, KERAS_LAYOUT) or {}
    legacy = None if layout else _layout(metadata, LEGACY_LAYOUT)
    mapped = _keras3_from_legacy(entries, legacy, p) if legacy else None
    if mapped is not None:  # a legacy Keras file: Keras 3's own names for its layers
        keys, groups = mapped
        layout = {"groups": groups}
    else:
        keys = _keras3_keys(entries, p)
    planned, info = plan_tensors(
        entries,
        names="slash",
        needs_record=lambda e: False,
        file=p,
        key_of=lambda path, e, i: (
            keys[path] if i == 0 else f"{RESERVED}/{keys[path]}/parallel_component_{i}"
        ),
    )
    _check_dtypes(planned, p)
    user = _user_metadata(metadata, KERAS_LAYOUT)
    scratch = Scratch()
    with atomic_path(p) as tmp, h5py.File(tmp, "w", libver="latest") as h5:
        for gpath, attrs in (layout.get("groups") or {}).items():
            group = h5 if gpath == "/" else h5.require_group(gpath)
            for name, value in (attrs or {}).items():
                _set_attr(group, name, value)
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
                    _set_attr(group, "name", owner)
            _write_dataset(h5, t.key, t, p, scratch)
        _write_info(h5, info, user)
        _seal(h5, tmp, _scan_keras)
    return p


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
        key_of=lambda path, e, i: path if i == 0 else f"{RESERVED}/{path}/parallel_component_{i}",
    )
    _check_dtypes(planned, p)
    by_key = {t.key: t for t in planned}
    user = _user_metadata(metadata, LEGACY_LAYOUT)
    scratch = Scratch()
    with atomic_path(p) as tmp, h5py.File(tmp, "w", libver="latest") as h5:
        for name, value in (layout.get("file_attrs") or {}).items():
            _set_attr(h5, name, value)
        root = h5.require_group(root_name) if root_name else h5
        for name, value in (layout.get("root_attrs") or {}).items():
            _set_attr(root, name, value)
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


# --------------------------------------------------------------------------------------------
# detection


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


def _has_vars_group(h5: h5py.File) -> bool:
    if _is_legacy(h5):
        return False

    return any(
        isinstance(obj, h5py.Group) and name.rpartition("/")[2] == "vars"
        for name, obj in _h5policy.walk(h5, h5.filename, skip_links=True)
    )


def sniff_keras(path: str, head: bytes) -> bool:
    """True for an HDF5 file with Keras 3 ``vars`` groups and no legacy attributes."""
    return _sniff_with(path, head, _has_vars_group)


def sniff_keras_legacy(path: str, head: bytes) -> bool:
    """True for an HDF5 file with a ``layer_names`` attribute (at the root or in model_weights)."""
    return _sniff_with(path, head, _is_legacy)


FORMATS = (
    FormatSpec(
        name="keras",
        description="Keras 3 .weights.h5 (layers/<name>/vars/<i>)",
        suffixes=(".weights.h5",),
        sniff=sniff_keras,
        open=open_keras,
        write=write_keras,
    ),
    FormatSpec(
        name="keras-legacy",
        description="legacy Keras HDF5 weights (layer_names / weight_names, model_weights/)",
        suffixes=(),
        sniff=sniff_keras_legacy,
        open=open_keras_legacy,
        write=write_keras_legacy,
    ),
)
