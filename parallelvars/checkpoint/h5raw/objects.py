"""The objects of a generated native file before they are laid out (:mod:`.generate`).

* :class:`Attr` and :func:`encode_attribute`: an attribute as h5py writes a value the layout
  writer converted, with its data or its variable-length strings (one heap object each);
* :class:`Signature` and :class:`Layout`: what the groups of variables of one kind, dtype,
  rank, components and attributes share, so that their headers are made from one template;
  :func:`attrs_key` is their attributes' hashable key and :func:`signature` their encoding;
* :class:`Group`, :class:`Dataset` and :class:`External`: a group, a dataset encoded on its own
  (a virtual ``value``, a document) and an external link's target;
* :func:`storage_type`: the HDF5 type of a component's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parallelvars._dtypes import dtype_name, is_extension_dtype
from parallelvars.checkpoint.h5raw import messages as msg
from parallelvars.checkpoint.h5raw.symbol_table import SymbolTable
from parallelvars.checkpoint.h5raw.templates import Template
from parallelvars.checkpoint.registry import component_name

__all__ = [
    "INDEX_ONLY",
    "ROW_STRING",
    "Attr",
    "Dataset",
    "External",
    "Group",
    "Layout",
    "Signature",
    "attrs_key",
    "encode_attribute",
    "frozen",
    "signature",
    "storage_type",
]

# Kept in the index only (h5io/layout.py: _INDEX_ONLY_ATTRS).
INDEX_ONLY = frozenset({"name", "synchronization", "trainable"})


@dataclass
class Attr:
    """An attribute as the generator writes it: name, datatype and dataspace bodies, and its
    data (fixed bytes) or its strings (variable-length: one heap object each)."""

    name: str
    dtype: bytes
    space: bytes
    data: bytes = b""
    strings: list[bytes] | None = None

    def size(self) -> int:
        n = 16 * len(self.strings) if self.strings is not None else len(self.data)
        return msg.attribute_data_offset(self.name, self.dtype, self.space) + n


_VLEN_UTF8 = msg.datatype(msg.VlenString(utf8=True))
_INT64 = msg.datatype(np.dtype("<i8"))
_FLOAT64 = msg.datatype(np.dtype("<f8"))


def encode_attribute(name: str, value: Any) -> Attr:
    """An attribute as h5py writes ``value`` once the layout writer has converted it
    (``h5io/attributes.py``: ``_attr_value`` / ``_root_attr_value``)."""
    if isinstance(value, str):
        return Attr(name, _VLEN_UTF8, msg.dataspace(()), strings=[value.encode("utf-8")])
    if isinstance(value, np.bytes_ | bytes):
        raw = bytes(value)
        if not raw:
            raise msg.Unsupported(f"attribute {name!r}: an empty fixed-length string")
        return Attr(name, msg.datatype(msg.FixedString(len(raw))), msg.dataspace(()), raw)
    if isinstance(value, bool | np.bool_):
        return Attr(name, msg.datatype(np.dtype(bool)), msg.dataspace(()), bytes((bool(value),)))
    if isinstance(value, np.int64):
        return Attr(name, _INT64, msg.dataspace(()), value.astype("<i8").tobytes())
    if isinstance(value, np.float64):
        return Attr(name, _FLOAT64, msg.dataspace(()), value.astype("<f8").tobytes())
    arr = np.asarray(value)
    if arr.dtype.kind == "O":
        if not all(isinstance(v, str) for v in arr.reshape(-1).tolist()):
            raise msg.Unsupported(f"attribute {name!r}: objects that are not strings")
        strings = [v.encode("utf-8") for v in arr.reshape(-1).tolist()]
        return Attr(name, _VLEN_UTF8, msg.dataspace(arr.shape), strings=strings)
    if arr.dtype.kind == "S":
        if arr.dtype.itemsize == 0:
            raise msg.Unsupported(f"attribute {name!r}: empty fixed-length strings")
        return Attr(
            name,
            msg.datatype(msg.FixedString(arr.dtype.itemsize)),
            msg.dataspace(arr.shape),
            np.ascontiguousarray(arr).tobytes(),
        )
    if arr.dtype.kind in "biuf":
        dt = arr.dtype
        return Attr(name, msg.datatype(dt), msg.dataspace(arr.shape), arr.tobytes())
    raise msg.Unsupported(f"attribute {name!r} of type {type(value).__name__}")


ROW_STRING = "slot_of"  # the one group attribute that differs between most variables


def frozen(value: Any) -> Any:
    """``value`` as a hashable key (lists and dicts as tuples, arrays by dtype and bytes,
    floats by their exact bits: ``-0.0 == 0.0``; a dict's keys with their types, as its
    values: ``{1: x}``, ``{True: x}`` and ``{1.0: x}`` are written apart)."""
    if isinstance(value, dict):
        return ("dict", *((frozen(k), frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, *map(frozen, value))
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, float | np.floating):
        return (type(value).__name__, float(value).hex())
    return (type(value).__name__, value)


_NOT_IN_KEY = INDEX_ONLY | {ROW_STRING}


def attrs_key(attrs: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a variable group's header holds of its attributes (all but the index-only ones
    and the row string), as a hashable key (:func:`frozen` but for the common values:
    strings, booleans, integers, None, floats by their exact bits, lists of strings)."""
    out: list[tuple[Any, ...]] = []
    append = out.append
    for k, v in attrs.items():
        if k in _NOT_IN_KEY:
            continue
        t = type(v)
        if t is str or t is bool or t is int or v is None:
            append((k, t, v))
        elif t is float:
            append((k, t, v.hex()))
        elif t is list:
            try:
                "".join(v)  # (only strings join)
            except TypeError:
                append((k, frozen(v)))
            else:
                append((k, "strs", *v))
        else:
            append((k, frozen(v)))
    return tuple(out)


def signature(
    kind: str, dt: np.dtype, shape: tuple[int, ...], n: int, attrs: dict[str, Any]
) -> Signature:
    """The attributes a variable's group gets (``h5io/write.py``: ``_write_group``)."""
    from parallelvars.checkpoint.h5io.attributes import _attr_value

    values: dict[str, Any] = {
        "kind": kind,
        "dtype": dtype_name(dt),
        "shape": np.zeros(len(shape), np.int64),
        "num_components": np.int64(n),
    }
    for key, value in attrs.items():
        if value is None or key in values or key in INDEX_ONLY:
            continue
        values[key] = _attr_value(value)
    names = list(values)
    return Signature(
        [encode_attribute(k, v) for k, v in values.items()],
        names.index("shape"),
        names.index(ROW_STRING) if ROW_STRING in values else None,
        len(shape),
    )


def storage_type(dt: np.dtype) -> bytes:
    """The HDF5 type of a component of dtype ``dt`` (``h5io/layout.py``: ``_storage_dtype``)."""
    known = _STORAGE.get(dt)
    if known is None:
        known = _STORAGE[dt] = _storage_type_of(dt)
    return known


_STORAGE: dict[np.dtype, bytes] = {}


def _storage_type_of(dt: np.dtype) -> bytes:
    if dt.kind == "O":  # byte strings: h5py's variable-length ASCII strings
        return msg.datatype(msg.VlenString(utf8=False))
    if is_extension_dtype(dt):
        return msg.datatype(msg.Opaque(dt.itemsize, f"NUMPY:|V{dt.itemsize}"))
    return msg.datatype(dt.newbyteorder("<") if dt.byteorder == ">" else dt)


# ----------------------------------------------------------------------------- objects
@dataclass
class Dataset:
    """A dataset encoded on its own (a virtual ``value``, a document); component datasets are
    rows of the plan's dataset columns instead (see :class:`FilePlan`)."""

    dtype: bytes
    shape: tuple[int, ...]
    fill: bytes
    nbytes: int = 0  # contiguous data (its offset is assigned with the data)
    mapping: bytes | None = None  # a virtual dataset's mapping (a heap object)
    document: str | None = None  # a metadata document: its data comes last
    attrs: list[Attr] = field(default_factory=list)
    links: int = 1  # hard links to it
    offset: int = -1  # data offset (-1: none)
    address: int = -1
    heap_ref: tuple[int, int] = (0, 0)


@dataclass
class External:
    """An external link's target."""

    file: bytes
    path: bytes
    address: int = -1


class Group:
    """A group of the file. Its links' targets are groups, external links, or component or
    special datasets by number (the plan's dataset columns). A variable's group made from its
    layout's template keeps only ``layout``, ``shape``, ``row`` and ``first_ds`` (its first
    dataset's number): its component links are made from the layout only when the group is
    encoded on its own (it has child groups too), at ``comp_at`` among its links."""

    __slots__ = (
        "address",
        "attrs",
        "comp_at",
        "first_ds",
        "first_string",
        "layout",
        "links",
        "row",
        "shape",
        "table",
        "table_at",
    )

    def __init__(self) -> None:
        self.attrs: list[Attr] = []
        # (name, Group | External | dataset number), or a variable's group made from its
        # layout's template (a leaf) as its row alone, ``~row`` (its name is its path's last part)
        self.links: list[Any] = []
        self.address = -1
        self.layout: Layout | None = None
        self.shape: tuple[int, ...] = ()
        self.row: bytes | None = None
        self.first_ds = -1
        self.comp_at = 0
        self.first_string = -1  # its first string's number among the heap objects
        # a group of more than MAX_COMPACT_LINKS links: its symbol table, laid right after
        # its header (symbol_table.py)
        self.table: SymbolTable | None = None
        self.table_at = -1

    @classmethod
    def inner(cls) -> Group:
        """A group on the way to variables, made by the generator (:mod:`.generate`): links
        of its own, its attributes none (they are given, not added to)."""
        g = cls.__new__(cls)
        g.links = []
        g.attrs = _NOTHING  # type: ignore[assignment]
        g.address = g.first_string = g.table_at = g.first_ds = -1
        g.layout, g.shape, g.row, g.table = None, (), None, None
        g.comp_at = 0
        return g


_NOTHING: tuple[()] = ()  # (the attributes of an inner group: none)


@dataclass
class Signature:
    """What the variables of one layout share: their attributes but the shape and the row
    string, in order (``row_at``: the row string's attribute, ``shape_at``: the shape's)."""

    attrs: list[Attr]
    shape_at: int
    row_at: int | None
    ndim: int

    def materialize(self, shape: tuple[int, ...], row: bytes | None) -> list[Attr]:
        out = list(self.attrs)
        a = out[self.shape_at]
        out[self.shape_at] = Attr(
            a.name, a.dtype, a.space, np.asarray(shape, "<i8").tobytes() if shape else b""
        )
        if self.row_at is not None:
            b = out[self.row_at]
            out[self.row_at] = Attr(b.name, b.dtype, b.space, strings=[row or b""])
        return out

    def strings_around_row(self) -> tuple[list[bytes], list[bytes]]:
        """The strings of the attributes before the row string's and after it (all of them
        before it when there is none)."""
        before: list[bytes] = []
        after: list[bytes] = []
        for k, a in enumerate(self.attrs):
            if a.strings is not None and k != self.row_at:
                (before if self.row_at is None or k < self.row_at else after).extend(a.strings)
        return before, after


class Layout:
    """What the variables of one signature share: their group's attributes (``sig``), their
    component datasets' type, which component each name's dataset is (``shared``), and where
    each link of their group points among their datasets (``link_ds``: offsets from the
    variable's first dataset; a sharded variable's ``value`` comes after its components)."""

    def __init__(self, kind: str, dt: np.dtype, n: int, shared: list[int], sig: Signature):
        self.sig = sig
        self.kind = kind
        # byte strings: each element a global heap object, the dataset's data their 16-byte
        # references (length, collection address, index), as libhdf5 stores them
        self.vlen = dt.kind == "O"
        self.itemsize = 16 if self.vlen else dt.itemsize
        self.fill = msg.FILL_LATE_ON_ALLOC if self.vlen else msg.FILL_EARLY_NEVER
        self.storage = storage_type(dt)
        self.n = n
        self.shared = shared
        self.stored = [i for i in range(n) if shared[i] == i]
        where = {c: k for k, c in enumerate(self.stored)}
        self.comp_ds = [where[shared[i]] for i in range(n)]  # each name's dataset
        self.links = [shared.count(c) for c in self.stored]  # each stored dataset's links
        self.sharded = kind == "sharded" and n > 0
        self.names = [component_name(i).encode() for i in range(n)]
        self.link_ds = list(self.comp_ds)
        if self.sharded:
            self.names.append(b"value")
            self.link_ds.append(len(self.stored))
        self.strings = sig.strings_around_row()
        self.template: Template | None = None
        self.size = -1  # (the template's size, once made)
        self.number = -1  # (its number among the plan's layouts, in the order they are made)
        # the template numbers of a variable's component datasets: [without data, with data]
        # (a layout that is not sharded: every component has the variable's shape)
        self.ds_keys: list[list[int] | None] = [None, None]
