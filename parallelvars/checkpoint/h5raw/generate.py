"""The native layout's HDF5 metadata, generated from the structure without libhdf5.

:class:`FilePlan` takes a checkpoint's structure (its variables, root attributes and the
names of its JSON documents) and lays out a complete HDF5 file (``libver="latest"``: superblock
version 3, version-2 object headers with checksums) deterministically:

* the superblock, at 0;
* every object header: the root group, the groups on the way to each variable, each
  variable's group (its attributes, links to its component datasets and, when sharded, to the
  virtual ``value``), each component dataset (contiguous, allocated, never filled), the
  ``_parallelvars`` group and its documents (fixed-length strings with a ``crc32c``
  attribute); every group keeps its links in its header (compact storage, the group info
  message's phase change raised past 8 links, at most :data:`MAX_COMPACT_LINKS`) and its
  attributes too (the attribute phase change raised past 8 attributes, as the writer asks
  libhdf5 to), a header too long for one chunk continues in chunks of at most 4 KiB;
* the global heap collections of the variable-length strings (one heap object per string
  element, as libhdf5 writes them) and of the virtual datasets' mappings;
* the data: every component at an 8-byte aligned offset, in the variables' order, then the
  documents.

What h5py and the HDF5 tools see is what the libhdf5 writer (``h5io/write.py``) makes of the same
structure: the same groups, datasets, attributes, types, shapes and values. Components whose
bytes the caller found equal may share one dataset (``Variable.shared``): the other names are
hard links to it (its header then counts its links).

The plan is made in two steps, because the documents (the index) record the components'
offsets: ``FilePlan(...)`` lays out everything but the documents' data and gives
:attr:`FilePlan.offsets`; :meth:`FilePlan.metadata` then takes the documents' capacities and
the header values of this save (``created``, the documents' checksums...) and returns the
metadata pieces to write and the documents' offsets. What it cannot express (bytes variables,
dtypes without an HDF5 type of ours, a group of more than :data:`MAX_COMPACT_LINKS` links,
an attribute message over 64 KiB) raises :class:`~.messages.Unsupported` when the plan is
made: the caller writes that file through libhdf5.

Variable groups and component datasets are written from templates, one per layout (kind,
dtype, rank, components, attributes but the shape and ``slot_of``): the template is encoded
twice, with every per-variable field (shape, string references, link addresses, dimensions,
data offsets) made of 0x00 and then of 0xFF bytes, which finds the fields; each variable is
the template with its fields put in. The headers of one layout are made together, as one
array (:class:`~.templates.Template`: fields laid in column-wise, checksums computed for all
rows at once); the other headers' chunks are checksummed together
(:func:`~.lookup3.lookup3_many`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parallelvars._dtypes import dtype_name, is_extension_dtype
from parallelvars._geometry import shard_bounds
from parallelvars.checkpoint.h5raw import header as hdr
from parallelvars.checkpoint.h5raw import messages as msg
from parallelvars.checkpoint.h5raw.global_heap import build_collections
from parallelvars.checkpoint.h5raw.lookup3 import lookup3, lookup3_many
from parallelvars.checkpoint.h5raw.symbol_table import SYMBOL_TABLE, SymbolTable
from parallelvars.checkpoint.h5raw.templates import Template, place, runs
from parallelvars.checkpoint.h5raw.virtual import mapping
from parallelvars.errors import InvalidEntryError

__all__ = ["FilePlan", "Metadata", "Variable"]

SUPERBLOCK_SIZE = 48
_CHUNK = 4096  # the most bytes of messages in one object header chunk we write
_MAX_MESSAGE = 0xFFFF
_COMPACT_ATTRS = 8  # HDF5's default attribute phase change: 8 in the header ...
_WIDE_ATTRS = 32  # ... the writer's for groups of more (see h5io/write.py)
_DEFAULT_LINKS = 8  # HDF5's default link phase change (8 compact, 6 dense)
# The most links a generated group keeps in its header: HDF5 finds a name among compact links
# by scanning them, so opening each of n children costs n^2 (10,000 children: 10.8 s where
# libhdf5's dense storage takes 1.8 s); up to this many it costs milliseconds.
MAX_COMPACT_LINKS = 1024
# Kept in the index only (h5io/layout.py: _INDEX_ONLY_ATTRS).
_INDEX_ONLY = frozenset({"name", "synchronization", "trainable"})


@dataclass
class Variable:
    """One variable of the structure: what the index records of it (``attrs`` as the index
    has them, the index-only ones included), and ``shared``: for each component, the component
    whose dataset it is (itself, or an earlier one of the same shape whose bytes are equal)."""

    path: str
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...]
    num_components: int
    attrs: Mapping[str, Any]
    shared: Sequence[int] | None = None
    # Components that live in other files (a multi-process checkpoint's index file): each
    # component's (file, dataset path), written as an HDF5 external link.
    external: Sequence[tuple[str, str]] | None = None


@dataclass
class Metadata:
    """A generated file's metadata: the byte ``pieces`` ``(offset, bytes)`` to write (the
    component data and the documents go between them), the file's size, and each document's
    data offset."""

    pieces: list[tuple[int, bytes]]
    file_size: int
    documents: dict[str, int]


# ----------------------------------------------------------------------------- attributes
@dataclass
class _Attr:
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


def encode_attribute(name: str, value: Any) -> _Attr:
    """An attribute as h5py writes ``value`` once the layout writer has converted it
    (``h5io/attributes.py``: ``_attr_value`` / ``_root_attr_value``)."""
    if isinstance(value, str):
        return _Attr(name, _VLEN_UTF8, msg.dataspace(()), strings=[value.encode("utf-8")])
    if isinstance(value, np.bytes_ | bytes):
        raw = bytes(value)
        if not raw:
            raise msg.Unsupported(f"attribute {name!r}: an empty fixed-length string")
        return _Attr(name, msg.datatype(msg.FixedString(len(raw))), msg.dataspace(()), raw)
    if isinstance(value, bool | np.bool_):
        return _Attr(name, msg.datatype(np.dtype(bool)), msg.dataspace(()), bytes((bool(value),)))
    if isinstance(value, np.int64):
        return _Attr(name, _INT64, msg.dataspace(()), value.astype("<i8").tobytes())
    if isinstance(value, np.float64):
        return _Attr(name, _FLOAT64, msg.dataspace(()), value.astype("<f8").tobytes())
    arr = np.asarray(value)
    if arr.dtype.kind == "O":
        if not all(isinstance(v, str) for v in arr.reshape(-1).tolist()):
            raise msg.Unsupported(f"attribute {name!r}: objects that are not strings")
        strings = [v.encode("utf-8") for v in arr.reshape(-1).tolist()]
        return _Attr(name, _VLEN_UTF8, msg.dataspace(arr.shape), strings=strings)
    if arr.dtype.kind == "S":
        if arr.dtype.itemsize == 0:
            raise msg.Unsupported(f"attribute {name!r}: empty fixed-length strings")
        return _Attr(
            name,
            msg.datatype(msg.FixedString(arr.dtype.itemsize)),
            msg.dataspace(arr.shape),
            np.ascontiguousarray(arr).tobytes(),
        )
    if arr.dtype.kind in "biuf":
        dt = arr.dtype
        return _Attr(name, msg.datatype(dt), msg.dataspace(arr.shape), arr.tobytes())
    raise msg.Unsupported(f"attribute {name!r} of type {type(value).__name__}")


_ROW_STRING = "slot_of"  # the one group attribute that differs between most variables


_SCALARS = (str, int, float, bool, type(None))


def _frozen(value: Any) -> Any:
    """``value`` as a hashable key (lists and dicts as tuples, arrays by dtype and bytes)."""
    if type(value) is dict:  # the common case first: scalars and lists of strings
        out: list[tuple[Any, ...]] = []
        for k, v in value.items():
            t = type(v)
            if t in _SCALARS:
                out.append((k, t, v))
            elif t is list and all(type(x) is str for x in v):
                out.append((k, "strs", *v))
            else:
                out.append((k, _frozen(v)))
        return tuple(out)
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return (type(value).__name__, *map(_frozen, value))
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    return (type(value).__name__, value)


def _signature(
    kind: str, dt: np.dtype, shape: tuple[int, ...], n: int, attrs: dict[str, Any]
) -> _Signature:
    """The attributes a variable's group gets (``h5io/write.py``: ``_write_group``)."""
    from parallelvars.checkpoint.h5io.attributes import _attr_value

    values: dict[str, Any] = {
        "kind": kind,
        "dtype": dtype_name(dt),
        "shape": np.zeros(len(shape), np.int64),
        "num_components": np.int64(n),
    }
    for key, value in attrs.items():
        if value is None or key in values or key in _INDEX_ONLY:
            continue
        values[key] = _attr_value(value)
    names = list(values)
    return _Signature(
        [encode_attribute(k, v) for k, v in values.items()],
        names.index("shape"),
        names.index(_ROW_STRING) if _ROW_STRING in values else None,
        len(shape),
    )


def _storage_type(dt: np.dtype) -> bytes:
    """The HDF5 type of a component of dtype ``dt`` (``h5io/layout.py``: ``_storage_dtype``)."""
    known = _STORAGE.get(dt)
    if known is None:
        known = _STORAGE[dt] = _storage_type_of(dt)
    return known


_STORAGE: dict[np.dtype, bytes] = {}


def _storage_type_of(dt: np.dtype) -> bytes:
    if dt.kind == "O":
        raise msg.Unsupported("byte-string variables (their values live in the global heap)")
    if is_extension_dtype(dt):
        return msg.datatype(msg.Opaque(dt.itemsize, f"NUMPY:|V{dt.itemsize}"))
    return msg.datatype(dt.newbyteorder("<") if dt.byteorder == ">" else dt)


# ----------------------------------------------------------------------------- objects
@dataclass
class _Dataset:
    dtype: bytes
    shape: tuple[int, ...]
    fill: bytes
    nbytes: int = 0  # contiguous data (its offset is assigned with the data)
    mapping: bytes | None = None  # a virtual dataset's mapping (a heap object)
    document: str | None = None  # a metadata document: its data comes last
    attrs: list[_Attr] = field(default_factory=list)
    links: int = 1  # hard links to it
    offset: int = -1  # data offset (-1: none)
    address: int = -1
    heap_ref: tuple[int, int] = (0, 0)


@dataclass
class _External:
    """An external link's target."""

    file: bytes
    path: bytes
    address: int = -1


@dataclass
class _Group:
    attrs: list[_Attr] = field(default_factory=list)
    links: list[tuple[bytes, Any]] = field(default_factory=list)  # (name, _Group | _Dataset)
    children: dict[str, _Group] = field(default_factory=dict)
    address: int = -1
    # A variable's group: its signature (what its header has in common with other variables'),
    # its shape and its per-row string (``slot_of``); its attributes are made only when the
    # group is written the general way (it has child groups too).
    sig: _Signature | None = None
    shape: tuple[int, ...] = ()
    row_string: bytes | None = None
    first_string: int = -1  # its first string's number among the heap objects
    # A group of more than MAX_COMPACT_LINKS links: its symbol table, laid right after its
    # header (see symbol_table.py)
    table: SymbolTable | None = None
    table_at: int = -1


@dataclass
class _Signature:
    """What the variables of one layout share: their attributes but the shape and the row
    string, in order (``row_at``: the row string's attribute, ``shape_at``: the shape's)."""

    attrs: list[_Attr]
    shape_at: int
    row_at: int | None
    ndim: int
    template: Template | None = None

    def materialize(self, shape: tuple[int, ...], row: bytes | None) -> list[_Attr]:
        out = list(self.attrs)
        a = out[self.shape_at]
        out[self.shape_at] = _Attr(
            a.name, a.dtype, a.space, np.asarray(shape, "<i8").tobytes() if shape else b""
        )
        if self.row_at is not None:
            b = out[self.row_at]
            out[self.row_at] = _Attr(b.name, b.dtype, b.space, strings=[row or b""])
        return out

    def strings(self, row: bytes | None) -> list[bytes]:
        out: list[bytes] = []
        for k, a in enumerate(self.attrs):
            if k == self.row_at:
                out.append(row or b"")
            elif a.strings is not None:
                out.extend(a.strings)
        return out


class FilePlan:
    """The layout of one native file (see the module docstring)."""

    def __init__(
        self,
        variables: Sequence[Variable],
        *,
        root_attrs: Mapping[str, Any],
        documents: Sequence[str] = (),
        align: int = 8,
    ) -> None:
        self._root = _Group()
        self._root.attrs = [encode_attribute(k, v) for k, v in root_attrs.items()]
        self._root_values = {a.name: i for i, a in enumerate(self._root.attrs)}
        self._datasets: list[_Dataset] = []
        self._documents: dict[str, _Dataset] = {}
        self._doc_groups: dict[str, _Group] = {}
        # the offsets of each variable's components, in order (None: no data)
        self.offsets: dict[str, list[int | None]] = {}
        self._components: list[tuple[str, list[_Dataset]]] = []
        self._signatures: dict[Any, _Signature] = {}
        self._dataset_templates: dict[Any, Template] = {}
        self._fill: int | None = None  # encoding a template: the byte every field is made of
        for var in variables:
            self._add_variable(var)
        for name in documents:
            path = name.split("/")
            group = self._group_of(path[:-1])
            ds = _Dataset(msg.datatype(msg.FixedString(1)), (), msg.FILL_LATE_IFSET, document=name)
            ds.attrs = [encode_attribute("crc32c", np.int64(0))]
            group.links.append((path[-1].encode("utf-8"), ds))
            self._documents[name] = ds
            self._datasets.append(ds)
        self._layout(align)

    # ------------------------------------------------------------------ structure
    def _group_of(self, parts: Sequence[str]) -> _Group:
        group = self._root
        for part in parts:
            child = group.children.get(part)
            if child is None:
                child = group.children[part] = _Group()
                group.links.append((part.encode("utf-8"), child))
            group = child
        return group

    def _add_variable(self, var: Variable) -> None:
        dt = np.dtype(var.dtype)
        storage = _storage_type(dt)
        shape = tuple(int(d) for d in var.shape)
        n = int(var.num_components)
        group = self._group_of(var.path.split("/"))
        if group.attrs or group.sig is not None:
            raise InvalidEntryError("is written twice", variable=var.path)
        attrs = dict(var.attrs)
        row = attrs.get(_ROW_STRING)
        if row is not None and not isinstance(row, str):
            raise msg.Unsupported(f"attribute {_ROW_STRING!r} that is not a string")
        key = (
            var.kind,
            dt,
            len(shape),
            n,
            None if var.shared is None else tuple(var.shared),
            row is None,
            # what the group's header does not hold (the index-only attributes) is not in the key
            _frozen({k: v for k, v in attrs.items() if k != _ROW_STRING and k not in _INDEX_ONLY}),
        )
        sig = self._signatures.get(key)
        if sig is None:
            sig = self._signatures[key] = _signature(var.kind, dt, shape, n, attrs)
        group.sig = sig
        group.shape = shape
        group.row_string = None if row is None else row.encode("utf-8")
        if var.kind == "sharded" and n:
            axis = int(var.attrs["shard_axis"])
            bounds = shard_bounds(var.attrs["shard_offsets"], shape[axis])
            shapes = [
                tuple(bounds[i + 1] - bounds[i] if k == axis else d for k, d in enumerate(shape))
                for i in range(n)
            ]
        else:
            shapes = [shape] * n
        if var.external is not None:
            if len(var.external) != n:
                raise InvalidEntryError(
                    "external links", variable=var.path, expected=n, found=len(var.external)
                )
            for i, (file, dataset) in enumerate(var.external):
                target = _External(file.encode("utf-8"), dataset.encode("utf-8"))
                group.links.append((_component_name(i).encode(), target))
            group.attrs = group.sig.materialize(shape, group.row_string)  # links vary: no template
            group.sig = None
            self._components.append((var.path, []))
            self.offsets[var.path] = [None] * n
            return
        shared = list(var.shared) if var.shared is not None else list(range(n))
        made: list[_Dataset] = []
        offsets: list[_Dataset] = []
        for i in range(n):
            j = shared[i]
            if j == i:
                nbytes = math.prod(shapes[i]) * dt.itemsize
                ds = _Dataset(storage, shapes[i], msg.FILL_EARLY_NEVER, nbytes=nbytes)
                self._datasets.append(ds)
            else:
                if not 0 <= j < i or shared[j] != j or shapes[j] != shapes[i]:
                    raise InvalidEntryError(
                        f"component {i} cannot share another component's dataset",
                        variable=var.path,
                        expected="an earlier component of the same shape that is stored",
                        found=f"component {j}",
                    )
                ds = made[j]
                ds.links += 1
            made.append(ds)
            offsets.append(ds)
            group.links.append((_component_name(i).encode(), ds))
        if var.kind == "sharded" and n:
            sources = [f"/{var.path}/{_component_name(i)}" for i in range(n)]
            vds = _Dataset(
                storage,
                shape,
                msg.FILL_INCREMENTAL_IFSET,
                mapping=mapping(sources, shape, axis, bounds),
            )
            self._datasets.append(vds)
            group.links.append((b"value", vds))
        self._components.append((var.path, offsets))

    # ------------------------------------------------------------------ layout
    def _layout(self, align: int) -> None:
        # 1. every header's size (addresses and offsets have fixed widths)
        groups: list[_Group] = []
        stack = [self._root]
        while stack:
            g = stack.pop()
            groups.append(g)
            stack.extend(reversed(list(g.children.values())))
        self._groups = groups
        at = SUPERBLOCK_SIZE
        for g in groups:
            # a variable that is also a parent, or of many links (a symbol table), or whose
            # header continues in further chunks (their continuation messages hold
            # addresses): encoded on its own
            wide = len(g.links) > MAX_COMPACT_LINKS
            if g.sig is not None and (
                g.children or wide or len(self._group_template(g).chunks) > 1
            ):
                g.attrs = g.sig.materialize(g.shape, g.row_string)
                g.sig = None
            g.address = at
            if wide:
                g.table = SymbolTable([name for name, _ in g.links])
            at += (
                self._group_template(g).size if g.sig is not None else len(self._encode_group(g)[0])
            )
            if g.table is not None:
                g.table_at = at
                at += g.table.size
        for ds in self._datasets:
            ds.address = at
            at += self._dataset_size(ds)
        # 2. the global heap: every string of every attribute, then the mappings
        strings: list[bytes] = []
        owners: list[tuple[_Attr, int]] = []
        for g in groups:
            if g.sig is not None:
                g.first_string = len(strings)
                strings += g.sig.strings(g.row_string)
        holders: list[_Group | _Dataset] = [*groups, *self._datasets]
        for obj in holders:
            for a in obj.attrs:
                if a.strings is not None:
                    owners.append((a, len(strings)))
                    strings.extend(a.strings)
        maps = [ds for ds in self._datasets if ds.mapping is not None]
        objects = strings + [ds.mapping or b"" for ds in maps]
        lengths = np.fromiter(map(len, objects), np.int64, len(objects))
        heap, addrs, index = build_collections(b"".join(objects), lengths, at)
        self._heap = (at, heap.tobytes())
        refs = np.zeros((len(objects), 16), np.uint8)
        refs[:, 0:4] = lengths.astype("<u4").view(np.uint8).reshape(-1, 4)
        refs[:, 4:12] = addrs.astype("<u8").view(np.uint8).reshape(-1, 8)
        refs[:, 12:16] = index.astype("<u4").view(np.uint8).reshape(-1, 4)
        self._refs = refs.tobytes()
        self._ref_rows = refs
        self._owners = owners
        for k, ds in enumerate(maps):
            ds.heap_ref = (int(addrs[len(strings) + k]), int(index[len(strings) + k]))
        at += heap.size
        self.metadata_size = at
        # 3. the data
        data = at
        for path, comps in self._components:
            if not comps and path in self.offsets:  # external components: no data here
                continue
            offs: list[int | None] = []
            for ds in comps:
                if ds.offset < 0 and ds.nbytes:
                    data = -(-data // align) * align
                    ds.offset = data
                    data += ds.nbytes
                offs.append(ds.offset if ds.offset >= 0 else None)
            self.offsets[path] = offs
        self.data_end = data

    # ------------------------------------------------------------------ encoding
    def _attr_message(self, a: _Attr) -> bytes:
        data = a.data if a.strings is None else self._string_refs(a)
        body = msg.attribute(a.name, a.dtype, a.space, data)
        if len(body) > _MAX_MESSAGE:
            raise msg.Unsupported(f"attribute {a.name!r} of {len(body)} bytes (64 KiB at most)")
        return body

    def _string_refs(self, a: _Attr) -> bytes:
        assert a.strings is not None
        refs: bytes | None = getattr(self, "_refs", None)
        if self._fill is not None or refs is None:
            return bytes((self._fill or 0,)) * (16 * len(a.strings))
        first = self._ref_start[id(a)]
        return refs[16 * first : 16 * (first + len(a.strings))]

    # ------------------------------------------------------------------ templates
    def _group_template(self, g: _Group) -> Template:
        """A variable group's header with its fields (string references and the shape, in
        attribute order, then the link addresses) zero: found by encoding it with every
        field's bytes 0x00 and then 0xFF (once per signature)."""
        sig = g.sig
        assert sig is not None
        if sig.template is None:
            made = []
            for fill in (0x00, 0xFF):
                self._fill = fill
                try:
                    attrs = sig.materialize((), b"")
                    a = attrs[sig.shape_at]
                    attrs[sig.shape_at] = _Attr(
                        a.name, a.dtype, a.space, bytes((fill,)) * (8 * sig.ndim)
                    )
                    made.append(self._encode_group(_Group(attrs=attrs, links=g.links)))
                finally:
                    self._fill = None
            sig.template = Template(made[0][0], made[0][1], runs(made[0][0], made[1][0]))
        return sig.template

    def _place_groups(self, image: np.ndarray, groups: list[_Group]) -> None:
        """The headers of variable groups of one signature, written into ``image``: the
        template's rows with every group's fields put in column-wise."""
        sig = groups[0].sig
        assert sig is not None
        tmpl = self._group_template(groups[0])
        count = len(groups)
        per = [len(a.strings or ()) if k != sig.shape_at else 0 for k, a in enumerate(sig.attrs)]
        before = sum(per[: sig.shape_at])  # string references before the shape
        first = np.fromiter((g.first_string for g in groups), np.int64, count)
        refs = self._ref_rows[first[:, None] + np.arange(sum(per))].reshape(count, -1)
        shapes = np.array([g.shape for g in groups], "<i8").reshape(count, sig.ndim)
        nlinks = len(groups[0].links)
        links = np.array([[t.address for _, t in g.links] for g in groups], "<u8")
        fields = np.hstack(
            (
                refs[:, : 16 * before],
                shapes.view(np.uint8).reshape(count, -1),
                refs[:, 16 * before :],
                links.reshape(count, nlinks).view(np.uint8).reshape(count, -1),
            )
        )
        addresses = np.fromiter((g.address for g in groups), np.int64, count)
        place(image, addresses, tmpl.rows(fields))

    @staticmethod
    def _dataset_key(ds: _Dataset) -> tuple[Any, ...] | None:
        """The template a dataset's header is made from (None: it is encoded on its own)."""
        if ds.mapping is not None or ds.document is not None or ds.attrs:
            return None
        return (ds.dtype, len(ds.shape), ds.nbytes > 0, ds.links, ds.fill)

    def _dataset_template(self, key: tuple[Any, ...], ds: _Dataset) -> Template:
        """A component dataset's header with its fields (dimensions, maximum dimensions and,
        when it has data, its offset and size) zero (once per key)."""
        tmpl = self._dataset_templates.get(key)
        if tmpl is None:
            made = []
            for fill in (0, (1 << 64) - 1):
                proto = _Dataset(ds.dtype, (fill,) * len(ds.shape), ds.fill, links=ds.links)
                proto.nbytes, proto.offset = (fill or 1, fill) if ds.nbytes else (0, -1)
                made.append(self._encode_dataset(proto, size=fill if ds.nbytes else None))
            tmpl = Template(made[0][0], made[0][1], runs(made[0][0], made[1][0]))
            self._dataset_templates[key] = tmpl
        return tmpl

    def _dataset_size(self, ds: _Dataset) -> int:
        key = self._dataset_key(ds)
        if key is None:
            return len(self._encode_dataset(ds)[0])
        return self._dataset_template(key, ds).size

    def _place_datasets(
        self, image: np.ndarray, key: tuple[Any, ...], sets: list[_Dataset]
    ) -> None:
        """The headers of component datasets of one template, written into ``image``."""
        tmpl = self._dataset_template(key, sets[0])
        count = len(sets)
        dims = np.array([ds.shape for ds in sets], "<u8").reshape(count, key[1])
        columns = [dims, dims]
        if key[2]:  # stored data: its offset and size
            columns.append(np.array([(max(ds.offset, 0), ds.nbytes) for ds in sets], "<u8"))
        fields = np.hstack(columns).astype("<u8").view(np.uint8).reshape(count, -1)
        addresses = np.fromiter((ds.address for ds in sets), np.int64, count)
        place(image, addresses, tmpl.rows(fields))

    def _encode_group(self, g: _Group) -> tuple[bytes, list[tuple[int, int]]]:
        messages: list[tuple[int, int, bytes]] = []
        nlinks = len(g.links)
        if nlinks > MAX_COMPACT_LINKS:
            return self._encode_wide_group(g)
        phase = None if nlinks <= _DEFAULT_LINKS else (nlinks, max(nlinks - 2, 0))
        messages.append((hdr.LINK_INFO, 0, msg.link_info()))
        messages.append((hdr.GROUP_INFO, 1, msg.group_info(phase)))
        if g.attrs:
            messages.append((hdr.ATTRIBUTE_INFO, 4, msg.attribute_info()))
        messages += [(hdr.ATTRIBUTE, 0, self._attr_message(a)) for a in g.attrs]
        fill = self._fill
        messages += [
            (
                hdr.LINK,
                0,
                msg.external_link(name, t.file, t.path)
                if isinstance(t, _External)
                else msg.hard_link(
                    name, max(t.address, 0) if fill is None else fill * 0x0101010101010101
                ),
            )
            for name, t in g.links
        ]
        attr_phase = (
            None
            if len(g.attrs) <= _COMPACT_ATTRS
            else (max(_WIDE_ATTRS, len(g.attrs)), max(_WIDE_ATTRS, len(g.attrs)) - 2)
        )
        return _encode_chunked(messages, attr_phase, g.address)

    def _encode_wide_group(self, g: _Group) -> tuple[bytes, list[tuple[int, int]]]:
        """A group of more than :data:`MAX_COMPACT_LINKS` links: its header holds a symbol
        table message (the links are in the symbol table laid after it) and its attributes."""
        if any(isinstance(t, _External) for _, t in g.links):
            raise msg.Unsupported(
                f"a group of {len(g.links)} links with external links (a symbol table holds "
                "hard links only)"
            )
        table = g.table if g.table is not None else SymbolTable([n for n, _ in g.links])
        messages = [(SYMBOL_TABLE, 0, table.message(max(g.table_at, 0)))]
        if g.attrs:
            messages.append((hdr.ATTRIBUTE_INFO, 4, msg.attribute_info()))
        messages += [(hdr.ATTRIBUTE, 0, self._attr_message(a)) for a in g.attrs]
        attr_phase = (
            None
            if len(g.attrs) <= _COMPACT_ATTRS
            else (max(_WIDE_ATTRS, len(g.attrs)), max(_WIDE_ATTRS, len(g.attrs)) - 2)
        )
        return _encode_chunked(messages, attr_phase, g.address)

    def _encode_dataset(
        self, ds: _Dataset, *, size: int | None = None
    ) -> tuple[bytes, list[tuple[int, int]]]:
        messages: list[tuple[int, int, bytes]] = [
            (hdr.DATASPACE, 0, msg.dataspace(ds.shape)),
            (hdr.DATATYPE, 1, ds.dtype),
            (hdr.FILL_VALUE, 1, ds.fill),
        ]
        if ds.mapping is not None:
            messages.append((hdr.LAYOUT, 0, msg.virtual_layout(*ds.heap_ref)))
        elif ds.document is not None:
            capacity = self._capacities.get(ds.document, 1) if hasattr(self, "_capacities") else 1
            messages[1] = (hdr.DATATYPE, 1, msg.datatype(msg.FixedString(capacity)))
            messages.append((hdr.LAYOUT, 0, msg.contiguous_layout(max(ds.offset, 0), capacity)))
        elif ds.nbytes:
            nbytes = ds.nbytes if size is None else size
            messages.append((hdr.LAYOUT, 1, msg.contiguous_layout(max(ds.offset, 0), nbytes)))
        else:
            messages.append((hdr.LAYOUT, 0, msg.contiguous_layout(msg.UNDEF, 0)))
        if ds.links > 1:
            messages.append((hdr.REFCOUNT, 0, msg.refcount(ds.links)))
        if ds.attrs:
            messages.append((hdr.ATTRIBUTE_INFO, 4, msg.attribute_info()))
            messages += [(hdr.ATTRIBUTE, 0, self._attr_message(a)) for a in ds.attrs]
        return _encode_chunked(messages, None, ds.address)

    def metadata(
        self,
        capacities: Mapping[str, int] | None = None,
        values: Mapping[str, Any] | None = None,
        document_checksums: Mapping[str, int] | None = None,
    ) -> Metadata:
        """The file's metadata with the documents' ``capacities`` (bytes), the root
        attributes ``values`` (those given at construction, of the same types) and the
        documents' ``crc32c`` attributes."""
        self._capacities = dict(capacities or {})
        self._set_root_values(values)
        at = self.data_end
        documents: dict[str, int] = {}
        for name, ds in self._documents.items():
            ds.offset = at
            documents[name] = at
            at += self._capacities.get(name, 1)
            crc = int((document_checksums or {}).get(name, 0))
            ds.attrs = [encode_attribute("crc32c", np.int64(crc))]
        file_size = max(at, self.metadata_size)
        self._ref_start = {id(a): first for a, first in self._owners}
        # The metadata is one image: the superblock, the headers and the heap, laid one after
        # another from 0. Headers made from templates are written a layout at a time; the
        # others are encoded one by one and their chunks' checksums computed together.
        image = np.zeros(self.metadata_size, np.uint8)
        spans: list[tuple[int, int]] = []

        def put(at: int, data: bytes, chunks: list[tuple[int, int]]) -> None:
            image[at : at + len(data)] = np.frombuffer(data, np.uint8)
            spans.extend((at + start, at + end) for start, end in chunks)

        put(0, _superblock(file_size, self._root.address), [])
        by_signature: dict[int, list[_Group]] = {}
        for g in self._groups:
            if g.sig is not None:
                by_signature.setdefault(id(g.sig), []).append(g)
            else:
                put(g.address, *self._encode_group(g))
            if g.table is not None:
                put(g.table_at, g.table.encode(g.table_at, [t.address for _, t in g.links]), [])
        for groups in by_signature.values():
            self._place_groups(image, groups)
        by_key: dict[tuple[Any, ...], list[_Dataset]] = {}
        for ds in self._datasets:
            key = self._dataset_key(ds)
            if key is None:
                put(ds.address, *self._encode_dataset(ds))
            else:
                by_key.setdefault(key, []).append(ds)
        for key, sets in by_key.items():
            self._place_datasets(image, key, sets)
        put(*self._heap, [])
        sums = lookup3_many(image, spans)
        where = np.array([e for _, e in spans], np.int64).reshape(-1, 1) + np.arange(4)
        image[where.reshape(-1)] = sums.astype("<u4").view(np.uint8)
        return Metadata([(0, image.tobytes())], file_size, documents)

    def _set_root_values(self, values: Mapping[str, Any] | None) -> None:
        for name, value in dict(values or {}).items():
            i = self._root_values[name]
            new = encode_attribute(name, value)
            old = self._root.attrs[i]
            if (new.dtype, new.space, new.size()) != (old.dtype, old.space, old.size()):
                raise InvalidEntryError(
                    "a root attribute's value has another HDF5 type or size than the plan's",
                    variable=name,
                )
            if new.strings != old.strings:
                raise InvalidEntryError(
                    "a root attribute's string differs from the plan's (its heap object is laid out)",
                    variable=name,
                )
            self._root.attrs[i] = new

    def refresh(
        self, values: Mapping[str, Any], document_checksums: Mapping[str, int]
    ) -> list[tuple[int, bytes]]:
        """After :meth:`metadata`: the headers a later save of the same structure changes,
        as ``(offset, bytes)`` pieces with their checksums: the root group's (the root
        attribute ``values``, of the plan's types and strings) and each document's (its
        ``crc32c`` attribute). Everything else in the image :meth:`metadata` returned stays."""
        self._set_root_values(values)
        objects: list[tuple[int, tuple[bytes, list[tuple[int, int]]]]] = [
            (self._root.address, self._encode_group(self._root))
        ]
        for name, ds in self._documents.items():
            crc = int(document_checksums.get(name, 0))
            ds.attrs = [encode_attribute("crc32c", np.int64(crc))]
            objects.append((ds.address, self._encode_dataset(ds)))
        out = []
        for address, (data, chunks) in objects:
            buf = bytearray(data)
            for start, end in chunks:
                buf[end : end + 4] = lookup3(bytes(buf[start:end])).to_bytes(4, "little")
            out.append((address, bytes(buf)))
        return out


def _component_name(i: int) -> str:
    return "primary" if i == 0 else f"parallel_component_{i}"


def _superblock(eof: int, root: int) -> bytes:
    """Superblock version 3: 8-byte addresses and lengths, no extension, closed."""
    body = (
        b"\x89HDF\r\n\x1a\n\x03\x08\x08\x00"
        + (0).to_bytes(8, "little")
        + msg.UNDEF.to_bytes(8, "little")
        + eof.to_bytes(8, "little")
        + root.to_bytes(8, "little")
    )
    return body + lookup3(body).to_bytes(4, "little")


_PENDING = b"\x00\x00\x00\x00"  # a checksum still to compute (see _with_checksums)


def _encode_chunked(
    messages: list[tuple[int, int, bytes]], phase: tuple[int, int] | None, address: int
) -> tuple[bytes, list[tuple[int, int]]]:
    """A version-2 object header at ``address`` holding ``messages``: one chunk, or for a
    long header chunk 0 with continuation messages to further chunks (each at most
    ``_CHUNK`` bytes of messages) laid right after it, and each chunk's (start, checksum
    offset) in the header. Checksums are left zero: every chunk's is computed at the end, for
    all headers at once."""
    bodies = [hdr.message_head(t, len(b), f) + b for t, f, b in messages]
    total = sum(map(len, bodies))
    if total <= _CHUNK:
        head = hdr.prefix_v2(total, phase_change=phase)
        return head + b"".join(bodies) + _PENDING, [(0, len(head) + total)]
    # group the messages into chunks; chunk 0 holds the continuation messages
    chunks: list[list[bytes]] = [[]]
    size = 0
    for b in bodies:
        if size + len(b) > _CHUNK and chunks[-1]:
            chunks.append([])
            size = 0
        chunks[-1].append(b)
        size += len(b)
    cont = 4 + 16  # a continuation message with its head
    first = chunks[0]
    rest = chunks[1:]
    # chunk 0: its own messages plus one continuation message per further chunk
    size0 = sum(map(len, first)) + cont * len(rest)
    head = hdr.prefix_v2(size0, phase_change=phase)
    at = address + len(head) + size0 + 4
    conts = []
    tails = []
    spans = [(0, len(head) + size0)]
    for chunk in rest:
        length = 4 + sum(map(len, chunk)) + 4  # signature, messages, checksum
        conts.append(
            hdr.message_head(hdr.CONTINUATION, 16)
            + at.to_bytes(8, "little")
            + length.to_bytes(8, "little")
        )
        tails.append(hdr.CONTINUATION_SIGNATURE + b"".join(chunk) + _PENDING)
        spans.append((at - address, at - address + length - 4))
        at += length
    data = head + b"".join(first) + b"".join(conts) + _PENDING + b"".join(tails)
    return data, spans
