"""Machinery shared by the adapters of formats that hold a flat list of named tensors.

safetensors, ``.npz`` and the Keras weight files know nothing of parallel variables. Our
writers put each variable's primary under the variable's own key (see :mod:`._names`), extra
components next to it, and record what a plain key cannot say in a small JSON document, the
*parallel info*, stored where the format allows metadata (safetensors ``__metadata__``, a
reserved ``.npz`` member, an HDF5 root attribute):

.. code-block:: json

    {"format": "parallelvars", "version": 1, "names": "dotted",
     "variables": {
       "model/w": {"kind": "mirrored", "dtype": "bfloat16", "shape": [3, 2],
                   "num_components": 2, "layout": "components",
                   "keys": ["model.w", "model.w/parallel_component_1"],
                   "attrs": {"devices": ["cpu:0", "cpu:1"]}},
       "model/e": {"kind": "sharded", "dtype": "float32", "shape": [10, 4],
                   "num_components": 4, "layout": "logical", "keys": ["model.e"],
                   "attrs": {"shard_axis": 0, "shard_offsets": [0, 3, 6, 8]}}}}

``layout`` is ``"components"`` (one stored tensor per component, in order) or ``"logical"``
(sharded variables only: the stitched full value is stored once under the variable's key, so a
plain consumer sees the whole tensor, and component ``i`` is read back as the slice
``shard_offsets[i]:shard_offsets[i + 1]`` along ``shard_axis``). Only variables that need it
are listed (a kind other than ``single``, attributes, a dtype the format cannot name, or a key
that does not map back to the path); every other stored tensor is a ``single`` variable whose
path is ``from_key(key, names)``.

Everything here reads lazily: a :class:`TensorStore` knows the stored tensors' dtypes and
shapes from the file's header and reads bytes only when a component is asked for.
"""

from __future__ import annotations

import abc
import itertools
import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import crc32c as _crc32c
import numpy as np

from parallelvars._dtypes import EXTENSION_DTYPES, is_extension_dtype
from parallelvars._dtypes import dtype_name as _core_dtype_name
from parallelvars._fileio import Scratch, atomic_path
from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidEntryError,
    ShapeMismatchError,
    TruncatedFileError,
    UnsupportedDtypeError,
)

from ._names import check_names, from_key, to_key
from ._view import KINDS, DictView, Entry

__all__ = [
    "INFO_FORMAT",
    "INFO_VERSION",
    "ByteStore",
    "PlannedTensor",
    "Scratch",
    "StoredEntry",
    "StoreView",
    "TensorStore",
    "atomic_path",
    "build_entries",
    "carried_metadata",
    "check_entry",
    "dtype_from_name",
    "dtype_name",
    "is_string_dtype",
    "jsonable",
    "parse_size",
    "plan_tensors",
    "little_endian",
    "write_array",
]

INFO_FORMAT = "parallelvars"
INFO_VERSION = 1

# Reads of a strided slice go through a bounce buffer of at most this many bytes.
_BLOCK = 16 << 20

# --------------------------------------------------------------------------------------------
# dtypes and JSON


def is_string_dtype(dtype: np.dtype) -> bool:
    """True for our string tensors (object arrays of ``bytes``)."""
    return np.dtype(dtype).kind == "O"


def is_ml_dtype(dtype: np.dtype) -> bool:
    """True for the ml_dtypes types (bfloat16, the float8 family, int4, ...)."""
    return is_extension_dtype(np.dtype(dtype))


def dtype_name(dtype: np.dtype) -> str:
    """The checkpoint name of ``dtype`` (``float32``, ``bfloat16``; ``bytes`` for strings)."""
    dtype = np.dtype(dtype)
    if not (
        is_string_dtype(dtype)
        or is_ml_dtype(dtype)
        or (dtype.kind in "biufc" and dtype.fields is None)
    ):
        raise UnsupportedDtypeError(f"dtype {dtype} is not a tensor dtype")
    return _core_dtype_name(dtype)


def dtype_from_name(name: Any, *, file: str | None = None, variable: str | None = None) -> np.dtype:
    """The numpy dtype named ``name`` by :func:`dtype_name`; UnsupportedDtypeError otherwise."""
    if name == "bytes":
        return np.dtype(object)
    if isinstance(name, str) and name in EXTENSION_DTYPES:
        return EXTENSION_DTYPES[name]
    try:
        dtype = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biufc" or dtype.name != name:
        raise UnsupportedDtypeError(
            "unknown dtype",
            file=file,
            variable=variable,
            expected="a numpy or ml_dtypes dtype name",
            found=repr(name),
        )
    return dtype


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data (numpy scalars and arrays, tuples and bytes converted)."""
    if isinstance(value, np.ndarray):
        return [jsonable(v) for v in value.tolist()] if value.ndim else jsonable(value.item())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# Root attributes of our HDF5 layout that describe that file (who wrote it, when), not the data:
# a converted file does not inherit them.
FILE_ATTRS = frozenset({"parallelvars_format", "parallelvars_version", "created"})


def carried_metadata(metadata: Mapping[str, Any] | None, *drop: str) -> dict[str, Any]:
    """The file metadata a writer carries over: ``metadata`` without :data:`FILE_ATTRS`
    and without the keys in ``drop``."""
    return {
        str(k): v for k, v in dict(metadata or {}).items() if k not in FILE_ATTRS and k not in drop
    }


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or ``"500MB"``, ``"2GiB"``, ``"1e9"`` (Hugging Face units)."""
    if isinstance(size, int):
        value = size
    else:
        text = str(size).strip().upper().replace(" ", "")
        units = {
            "KIB": 1 << 10,
            "MIB": 1 << 20,
            "GIB": 1 << 30,
            "TIB": 1 << 40,
            "KB": 10**3,
            "MB": 10**6,
            "GB": 10**9,
            "TB": 10**12,
            "B": 1,
        }
        for suffix, factor in units.items():
            if text.endswith(suffix):
                try:
                    value = int(float(text[: -len(suffix)]) * factor)
                except ValueError:
                    raise InvalidArgumentError(
                        f"cannot read size {size!r} (expected e.g. 500MB or 2GiB)"
                    ) from None
                break
        else:
            try:
                value = int(float(text))
            except ValueError:
                raise InvalidArgumentError(
                    f"cannot read size {size!r} (expected e.g. 500MB or 2GiB)"
                ) from None
    if value <= 0:
        raise InvalidArgumentError(f"size must be positive, got {size!r}")
    return value


# --------------------------------------------------------------------------------------------
# entries: checks and write plans


def check_entry(entry: Entry, file: str | None = None) -> None:
    """Raise a clear error when ``entry``'s kind, components or shard offsets do not agree."""
    if entry.kind not in KINDS:
        raise InvalidEntryError(
            "unknown kind", variable=entry.path, expected=f"one of {KINDS}", found=repr(entry.kind)
        )
    if entry.num_components < 1:
        raise InvalidEntryError("an entry needs at least one component", variable=entry.path)
    if entry.kind == "single" and entry.num_components != 1:
        raise ShapeMismatchError(
            "a single variable has exactly one component",
            file=file,
            variable=entry.path,
            expected=1,
            found=entry.num_components,
        )
    if entry.kind == "sharded":
        shape = tuple(int(s) for s in entry.shape)
        try:
            axis = int(entry.attrs["shard_axis"])
            offsets = [int(o) for o in entry.attrs["shard_offsets"]]
        except (KeyError, TypeError, ValueError):
            raise ShapeMismatchError(
                "a sharded variable needs integer attrs shard_axis and shard_offsets",
                file=file,
                variable=entry.path,
                expected="shard_axis and shard_offsets",
                found=f"attrs {sorted(entry.attrs)}",
            ) from None
        if not 0 <= axis < len(shape):
            raise ShapeMismatchError(
                "shard axis out of range",
                file=file,
                variable=entry.path,
                expected=f"0 <= axis < {len(shape)}",
                found=axis,
            )
        if (
            len(offsets) != entry.num_components
            or (offsets and offsets[0] != 0)
            or any(b < a for a, b in itertools.pairwise(offsets))
            or (offsets and offsets[-1] > shape[axis])
        ):
            raise ShapeMismatchError(
                "shard offsets do not tile the sharded axis",
                file=file,
                variable=entry.path,
                expected=f"{entry.num_components} ascending offsets from 0 within {shape[axis]}",
                found=offsets,
            )


@dataclass
class PlannedTensor:
    """One tensor a writer will store: component ``component`` of ``entry`` (``None``: the
    logical value of a sharded entry) under ``key``."""

    key: str
    entry: Entry
    component: int | None

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.entry.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.component is None:
            return tuple(int(s) for s in self.entry.shape)
        return tuple(int(s) for s in self.entry.component_shape(self.component))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def read(self) -> np.ndarray:
        """The tensor's value, as a C-contiguous array the caller owns."""
        if self.component is None:
            value = self.entry.value()
        else:
            value = self.entry.component(self.component)
        if not value.flags.c_contiguous:
            value = np.array(value, order="C")
        if value.shape != self.shape or value.dtype != self.dtype:
            raise ShapeMismatchError(
                "a component read back with another shape or dtype than the entry declares",
                variable=self.entry.path,
                expected=f"{self.shape} {self.dtype}",
                found=f"{value.shape} {value.dtype}",
            )
        return value

    def read_into(self, out: np.ndarray) -> np.ndarray:
        """Read the tensor into ``out`` (this tensor's dtype and shape) and return it.

        A sharded entry's shards are read straight into their place in ``out``. String
        tensors cannot live in a reused buffer: for them a new array is returned.
        """
        if is_string_dtype(self.dtype):
            return self.read()
        entry = self.entry
        if self.component is not None:
            entry.read_component_into(self.component, out)
            return out
        axis = int(entry.attrs["shard_axis"])
        for j, start in enumerate(entry.attrs["shard_offsets"]):
            size = int(entry.component_shape(j)[axis])
            region = (slice(None),) * axis + (slice(int(start), int(start) + size),)
            entry.read_component_into(j, out[region])
        return out

    def read_with(self, scratch: Scratch) -> np.ndarray:
        """The tensor read into ``scratch`` (valid until the next read with it)."""
        if is_string_dtype(self.dtype):
            return self.read()
        return self.read_into(scratch.array(self.dtype, self.shape))


def plan_tensors(
    entries: Mapping[str, Entry],
    *,
    names: str,
    needs_record: Callable[[Entry], bool] = lambda entry: False,
    file: str | None = None,
    key_of: Callable[[str, Entry, int], str] | None = None,
) -> tuple[list[PlannedTensor], dict[str, Any]]:
    """Which tensors a flat-key writer stores, under which keys, and the parallel info.

    Args:
        entries: the entries to write.
        names: the key style (see :mod:`._names`).
        needs_record: format hook: True when an entry must be listed in the info even if it is
            a plain single variable (for example a dtype the format cannot name).
        file: the file being written, for error messages.
        key_of: format hook replacing the key style: ``key_of(path, entry, i)`` is the key of
            component ``i`` (0: the primary, or the stitched value of a sharded entry).

    Returns:
        The planned tensors in entry order, and the parallel info document.
    """
    check_names(names)
    planned: list[PlannedTensor] = []
    variables: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for path, entry in entries.items():
        check_entry(entry, file)
        attrs = entry.attrs or {}
        slot = {"slot_of": attrs.get("slot_of"), "slot_name": attrs.get("slot_name")}
        slot = {k: (str(v) if v is not None else None) for k, v in slot.items()}

        def key(i: int, path: str = path, entry: Entry = entry, slot: dict = slot) -> str:
            if key_of is not None:
                return key_of(path, entry, i)
            return to_key(path, names, component=i, **slot)

        primary = key(0)
        if entry.kind == "sharded":
            tensors = [PlannedTensor(primary, entry, None)]
            layout = "logical"
        else:
            tensors = [PlannedTensor(key(i), entry, i) for i in range(entry.num_components)]
            layout = "components"
        for t in tensors:
            if t.key in owner:
                raise InvalidEntryError(
                    f"{file or '<output>'}: variables {owner[t.key]!r} and {path!r} both map to "
                    f"the key {t.key!r} with names={names!r}; choose another name style"
                )
            owner[t.key] = path
        planned.extend(tensors)
        if (
            entry.kind != "single"
            or attrs
            or from_key(primary, names) != path
            or needs_record(entry)
        ):
            variables[path] = {
                "kind": entry.kind,
                "dtype": dtype_name(entry.dtype),
                "shape": [int(s) for s in entry.shape],
                "num_components": int(entry.num_components),
                "layout": layout,
                "keys": [t.key for t in tensors],
                "attrs": jsonable(dict(attrs)),
            }
    info = {"format": INFO_FORMAT, "version": INFO_VERSION, "names": names, "variables": variables}
    return planned, info


# --------------------------------------------------------------------------------------------
# reading: stores and entries


class TensorStore(abc.ABC):
    """Stored tensors of one file (or shard set): names, dtypes and shapes known, bytes lazy."""

    file: str

    @abc.abstractmethod
    def keys(self) -> Sequence[str]:
        """Stored tensor keys in file order."""

    @abc.abstractmethod
    def stored(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape the tensor ``key`` is stored with."""

    @abc.abstractmethod
    def read_into(
        self, key: str, out: np.ndarray, region: tuple[int, int, int] | None = None
    ) -> None:
        """Read tensor ``key`` (or the slice ``region = (axis, start, stop)``) into ``out``.

        ``out`` is C-contiguous with the stored dtype and the shape of what is read.
        """

    def read_objects(self, key: str, region: tuple[int, int, int] | None = None) -> np.ndarray:
        """Read a string tensor as an object array of ``bytes``."""
        raise UnsupportedDtypeError(
            "string tensors are not supported by this format", file=self.file, variable=key
        )

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release open files."""


def _region_shape(shape: tuple[int, ...], region: tuple[int, int, int] | None) -> tuple[int, ...]:
    if region is None:
        return shape
    axis, start, stop = region
    return (*shape[:axis], stop - start, *shape[axis + 1 :])


class ByteStore(TensorStore):
    """A store whose tensors are raw little-endian C-order bytes reached by ``_read_bytes``.

    A store that knows a checksum of a tensor's bytes (``_expected_crc``) has every read
    verified: a whole-tensor read checks the bytes it read; the first partial read of a tensor
    checks the whole tensor once, streamed through a bounded buffer.
    """

    @abc.abstractmethod
    def _read_bytes(self, key: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with bytes ``offset:offset + len(buf)`` of tensor ``key``'s data."""

    def _expected_crc(self, key: str) -> int | None:
        """The stored checksum of tensor ``key``'s bytes, or None when the file has none."""
        return None

    def _crc_start(self, key: str) -> int:
        """The checksum's running value before the tensor's first byte."""
        return 0

    def _crc_update(self, data: Any, crc: int) -> int:
        """The running checksum ``crc`` continued over ``data`` (CRC-32C by default)."""
        return int(_crc32c.crc32c(data, crc))

    def _crc_name(self) -> str:
        return "crc32c"

    def _verified_keys(self) -> set[str]:
        verified: set[str] | None = self.__dict__.get("_verified")
        if verified is None:
            verified = self.__dict__["_verified"] = set()
        return verified

    def _check_crc(self, key: str, crc: int) -> None:
        expected = self._expected_crc(key)
        if expected is not None and crc != expected:
            raise ChecksumMismatchError(
                "the tensor's bytes do not match their stored checksum",
                file=self.file,
                variable=key,
                expected=f"{self._crc_name()} {expected:#010x}",
                found=f"{self._crc_name()} {crc:#010x}",
            )
        self._verified_keys().add(key)

    def verify(self, key: str) -> None:
        """Check tensor ``key``'s bytes against its stored checksum (once per store)."""
        if self._expected_crc(key) is None or key in self._verified_keys():
            return
        dtype, shape = self.stored(key)
        total = math.prod(shape) * dtype.itemsize
        bounce = np.empty(min(total, _BLOCK), np.uint8)
        crc = self._crc_start(key)
        for start in range(0, total, _BLOCK):
            block = bounce[: min(_BLOCK, total - start)]
            self._read_bytes(key, start, block.data)
            crc = self._crc_update(block, crc)
        self._check_crc(key, crc)

    def read_into(
        self, key: str, out: np.ndarray, region: tuple[int, int, int] | None = None
    ) -> None:
        dtype, shape = self.stored(key)
        flat = out.reshape(-1).view(np.uint8)
        if region is None or flat.size == 0:
            if region is None and self._expected_crc(key) is not None:
                if flat.size:
                    self._read_bytes(key, 0, flat.data)
                self._check_crc(key, self._crc_update(flat, self._crc_start(key)))
                return
            if flat.size:
                self._read_bytes(key, 0, flat.data)
            return
        self.verify(key)
        axis, start, stop = region
        outer = math.prod(shape[:axis])
        inner = math.prod(shape[axis + 1 :]) * dtype.itemsize
        run = (stop - start) * inner  # bytes of the slice in one outer row
        stride = shape[axis] * inner  # bytes of one outer row
        if outer == 1 or run == stride:
            self._read_bytes(key, start * inner, flat.data)
            return
        if run >= (64 << 10):  # long runs: read each straight into place
            for o in range(outer):
                self._read_bytes(
                    key, o * stride + start * inner, flat[o * run : (o + 1) * run].data
                )
            return
        rows = max(1, _BLOCK // stride)
        bounce = np.empty(min(rows, outer) * stride, np.uint8)
        for o0 in range(0, outer, rows):
            o1 = min(outer, o0 + rows)
            block = bounce[: (o1 - o0) * stride]
            self._read_bytes(key, o0 * stride, block.data)
            flat[o0 * run : o1 * run] = block.reshape(o1 - o0, stride)[
                :, start * inner : start * inner + run
            ].reshape(-1)


class StoredEntry(Entry):
    """An :class:`Entry` whose components live in a :class:`TensorStore`."""

    def __init__(
        self,
        store: TensorStore,
        path: str,
        *,
        dtype: np.dtype,
        shape: Sequence[int],
        kind: str,
        num_components: int,
        keys: Sequence[str],
        layout: str,
        attrs: Mapping[str, Any],
    ) -> None:
        self._store = store
        self.path = path
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.kind = kind
        self.num_components = int(num_components)
        self.keys = tuple(keys)
        self.layout = layout
        self.attrs = dict(attrs)

    def _source(self, i: int) -> tuple[str, tuple[int, int, int] | None]:
        self._check_index(i)
        if self.layout == "components":
            return self.keys[i], None
        axis = int(self.attrs["shard_axis"])
        start = int(self.attrs["shard_offsets"][i])
        return self.keys[0], (axis, start, start + self.component_shape(i)[axis])

    def component(self, i: int) -> np.ndarray:
        out = np.empty(self.component_shape(i), self.dtype)
        self.read_component_into(i, out)
        return out

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        key, region = self._source(i)
        self._read(key, region, out)

    def value(self) -> np.ndarray:
        if self.layout == "logical":  # the stitched value is stored as it is
            out = np.empty(self.shape, self.dtype)
            self._read(self.keys[0], None, out)
            return out
        return super().value()

    def _read(self, key: str, region: tuple[int, int, int] | None, out: np.ndarray) -> None:
        if is_string_dtype(self.dtype):
            out[...] = self._store.read_objects(key, region)
            return
        stored_dtype, stored_shape = self._store.stored(key)
        target = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
        sshape = _region_shape(stored_shape, region)
        if stored_dtype == target.dtype and sshape == target.shape:
            buf = target
        else:  # the format stores the bits under another dtype (bfloat16 as uint16, ...)
            buf = target.reshape(-1).view(np.uint8).view(stored_dtype).reshape(sshape)
        self._store.read_into(key, buf, region)
        if target is not out:
            out[...] = target


def _corrupt(
    file: str, what: str, variable: str | None = None, **kw: Any
) -> CorruptCheckpointError:
    return CorruptCheckpointError(what, file=file, variable=variable, **kw)


def build_entries(
    store: TensorStore,
    info: Mapping[str, Any] | None,
    *,
    names: str,
    hidden: Callable[[str], bool] = lambda key: False,
) -> dict[str, Entry]:
    """The entries of ``store``, grouped and typed by the parallel ``info`` (may be None).

    Args:
        store: the stored tensors.
        info: the parallel info document, or None for a plain file.
        names: the key style used to map unlisted keys to paths.
        hidden: keys that are not tensors of the checkpoint (skipped when unlisted).
    """
    file = store.file
    variables: Mapping[str, Any] = {}
    if info is not None:
        if not isinstance(info, Mapping) or info.get("format") != INFO_FORMAT:
            raise _corrupt(file, "the parallelvars metadata is not a parallelvars document")
        version = info.get("version")
        if not isinstance(version, int) or version > INFO_VERSION:
            from parallelvars.errors import FormatVersionError

            raise FormatVersionError(
                "the parallelvars metadata has an unknown version",
                file=file,
                expected=f"<= {INFO_VERSION}",
                found=version,
            )
        variables = info.get("variables") or {}
        if not isinstance(variables, Mapping):
            raise _corrupt(file, "the parallelvars metadata 'variables' is not an object")
    stored_keys = list(store.keys())
    present = set(stored_keys)
    claimed: dict[str, str] = {}
    by_first_key: dict[str, Entry] = {}
    for path, rec in variables.items():
        recorded = _entry_from_record(store, str(path), rec, present)
        for key in recorded.keys:
            if key in claimed:
                raise _corrupt(
                    file,
                    f"stored tensor {key!r} is claimed by two variables",
                    variable=str(path),
                    expected="one owner",
                    found=f"also {claimed[key]!r}",
                )
            claimed[key] = str(path)
        by_first_key[recorded.keys[0]] = recorded
    out: dict[str, Entry] = {}
    for key in stored_keys:
        entry: Entry
        if key in by_first_key:
            entry = by_first_key[key]
        elif key in claimed or hidden(key):
            continue
        else:
            dtype, shape = store.stored(key)
            entry = StoredEntry(
                store,
                from_key(key, names),
                dtype=dtype,
                shape=shape,
                kind="single",
                num_components=1,
                keys=[key],
                layout="components",
                attrs={},
            )
        if entry.path in out:
            raise _corrupt(
                file, "two stored tensors map to the same variable path", variable=entry.path
            )
        out[entry.path] = entry
    return out


def _entry_from_record(store: TensorStore, path: str, rec: Any, present: set[str]) -> StoredEntry:
    file = store.file
    if not isinstance(rec, Mapping):
        raise _corrupt(file, "variable record is not an object", variable=path)
    try:
        kind = rec["kind"]
        dtype = dtype_from_name(rec["dtype"], file=file, variable=path)
        shape = tuple(int(s) for s in rec["shape"])
        n = int(rec["num_components"])
        keys = [str(k) for k in rec["keys"]]
        layout = rec.get("layout", "components")
        attrs = dict(rec.get("attrs") or {})
    except (KeyError, TypeError, ValueError) as exc:
        raise _corrupt(file, f"variable record is incomplete ({exc})", variable=path) from None
    if kind not in KINDS or layout not in ("components", "logical") or any(s < 0 for s in shape):
        raise _corrupt(
            file,
            "variable record has a bad kind, layout or shape",
            variable=path,
            expected=f"kind in {KINDS}, layout components|logical, shape >= 0",
            found=f"kind={kind!r} layout={layout!r} shape={shape}",
        )
    expected_keys = n if layout == "components" else 1
    if len(keys) != expected_keys or (layout == "logical" and kind != "sharded"):
        raise _corrupt(
            file,
            "variable record lists the wrong number of stored tensors",
            variable=path,
            expected=expected_keys,
            found=len(keys),
        )
    for key in keys:
        if key not in present:
            raise _corrupt(
                file, f"stored tensor {key!r} listed in the metadata is missing", variable=path
            )
    entry = StoredEntry(
        store,
        path,
        dtype=dtype,
        shape=shape,
        kind=kind,
        num_components=n,
        keys=keys,
        layout=layout,
        attrs=attrs,
    )
    try:
        check_entry(entry, file)
    except ShapeMismatchError as exc:
        raise _corrupt(
            file, exc.what, variable=path, expected=exc.expected, found=exc.found
        ) from None
    # The stored tensors must hold exactly the bytes the record describes.
    for i, key in enumerate(keys):
        sdtype, sshape = store.stored(key)
        want = entry.shape if layout == "logical" else entry.component_shape(i)
        if is_string_dtype(dtype):
            ok = tuple(sshape) == tuple(want)
        else:
            ok = math.prod(sshape) * sdtype.itemsize == math.prod(want) * dtype.itemsize and (
                tuple(sshape[: len(want)]) == tuple(want)
            )
        if not ok:
            raise _corrupt(
                file,
                f"stored tensor {key!r} does not match the variable",
                variable=path,
                expected=f"{tuple(want)} {dtype}",
                found=f"{tuple(sshape)} {sdtype}",
            )
    return entry


class StoreView(DictView):  # the Mapping over ._entries comes from DictView
    """A :class:`CheckpointView` over a dict of entries backed by a :class:`TensorStore`."""

    def __init__(
        self,
        store: TensorStore,
        entries: Mapping[str, Entry],
        *,
        format: str,
        path: str,
        metadata: Mapping[str, Any],
    ) -> None:
        self._store = store
        self._entries = dict(entries)
        self.format = format
        self.path = path
        self.metadata = dict(metadata)

    def close(self) -> None:
        self._store.close()


# --------------------------------------------------------------------------------------------
# writing helpers


def little_endian(array: np.ndarray) -> np.ndarray:
    """``array`` as C-ordered little-endian values (itself when it already is)."""
    a = np.ascontiguousarray(array)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not _LITTLE):
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


def write_array(f: IO[bytes], array: np.ndarray) -> int:
    """Write the raw C-order bytes of ``array`` to ``f`` without an extra copy; the byte count."""
    view = little_endian(array).reshape(-1).view(np.uint8).data
    f.write(view)
    return view.nbytes


_LITTLE = np.little_endian


def read_exact_into(
    f: IO[bytes], lock: threading.Lock, offset: int, buf: memoryview, *, file: str, key: str
) -> None:
    """Fill ``buf`` from ``f`` at ``offset``; TruncatedFileError when the file ends early."""
    with lock:
        f.seek(offset)
        done = 0
        while done < len(buf):
            n = f.readinto(buf[done:])  # type: ignore[attr-defined]
            if not n:
                raise TruncatedFileError(
                    "the file ends inside the tensor's data",
                    file=file,
                    variable=key,
                    expected=f"{len(buf)} bytes at offset {offset}",
                    found=f"{done} bytes",
                )
            done += n


def dumps(doc: Any) -> str:
    """Compact JSON for metadata documents."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
