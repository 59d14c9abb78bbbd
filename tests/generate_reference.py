"""The HDF5 metadata generator as it was before it made its image a chunk at a time
(``parallelvars/checkpoint/h5raw/generate.py`` at the commit before), kept as the oracle of
``test_generate_reference.py``: the generator's bytes must stay exactly these.

The native layout's HDF5 metadata, generated from the structure without libhdf5.

:class:`FilePlan` takes a checkpoint's structure (its variables, root attributes and the
names of its JSON documents) and lays out a complete HDF5 file (``libver="latest"``: superblock
version 3, version-2 object headers with checksums) deterministically:

* the superblock, at 0;
* every object header: the root group, the groups on the way to each variable, each
  variable's group (its attributes, links to its component datasets and, when sharded, to the
  virtual ``value``), each component dataset (contiguous, allocated, never filled), the
  ``_parallelvars`` group and its documents (fixed-length strings with a ``crc32c``
  attribute); every group keeps its links in its header (compact storage, the group info
  message's phase change raised past 8 links, at most :data:`MAX_COMPACT_LINKS`; a group of
  more keeps them in a symbol table laid right after its header, :mod:`.symbol_table`) and its
  attributes too (the attribute phase change raised past 8 attributes, as the writer asks
  libhdf5 to), a header too long for one chunk continues in chunks of at most 4 KiB;
* the global heap collections of the variable-length strings (one heap object per string
  element, as libhdf5 writes them: the attributes' and then the byte-string variables'
  elements, ``Variable.strings``) and of the virtual datasets' mappings;
* the data: every component at an 8-byte aligned offset, in the variables' order (a
  byte-string component's data are its elements' heap references, which the plan lays
  itself: :attr:`Metadata.pieces` after the first), then the documents.

What h5py and the HDF5 tools see is what the libhdf5 writer (``h5io/write.py``) makes of the same
structure: the same groups, datasets, attributes, types, shapes and values. Components whose
bytes the caller found equal may share one dataset (``Variable.shared``): the other names are
hard links to it (its header then counts its links).

The plan is made in two steps, because the documents (the index) record the components'
offsets: ``FilePlan(...)`` lays out everything but the documents' data and gives
:attr:`FilePlan.offsets`; :meth:`FilePlan.metadata` then takes the documents' capacities and
the header values of this save (``created``, the documents' checksums...) and returns the
metadata pieces to write and the documents' offsets. What it cannot express (dtypes without
an HDF5 type of ours, a group of more than :data:`MAX_COMPACT_LINKS` links of which some are
external, an attribute message over 64 KiB: dense attribute storage) raises
:class:`~.messages.Unsupported` when the plan is made: the caller writes that file through
libhdf5.

The plan is kept column-wise, so that a file of many variables costs a few Python operations
per variable and numpy work per layout: component datasets are rows of dataset columns (template
number, shape, bytes; addresses and data offsets computed for all rows at once), and variable
groups are rows of their layout (kind, dtype, rank, components, shared components, attributes
but the shape and ``slot_of``: its attributes are encoded once per layout). Variable groups,
component datasets and groups without attributes whose links have the same names (a variable's
slots' group) are written from templates: a template is encoded twice, with every per-object
field (shape, string references, link addresses, dimensions, data offsets) made of 0x00 and then
of 0xFF bytes, which finds the fields; the headers of one template are made together, as one
array (:class:`~.templates.Template`: fields laid in column-wise, checksums computed for all rows
at once). The other headers are encoded one by one (``_encode_group``: where a group's link
storage is chosen; ``encode_attribute``: where an attribute's encoding is) and their chunks'
checksums computed together (:func:`~.lookup3.lookup3_many`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from parallelvars.checkpoint.h5raw import header as hdr
from parallelvars.checkpoint.h5raw import messages as msg
from parallelvars.checkpoint.h5raw import objects as _objects

# (the generator's helpers, reached through its module: the reference makes no private import)
from parallelvars.checkpoint.h5raw.generate import (
    FREEZE_STEP,
    freeze_made_so_far,
    shard_bounds,
)
from parallelvars.checkpoint.h5raw.global_heap import MIN_COLLECTION, ragged_copy
from parallelvars.checkpoint.h5raw.header import SUPERBLOCK_SIZE
from parallelvars.checkpoint.h5raw.header import encode_chunked as _encode_chunked
from parallelvars.checkpoint.h5raw.lookup3 import lookup3, lookup3_many
from parallelvars.checkpoint.h5raw.messages import superblock as _superblock
from parallelvars.checkpoint.h5raw.objects import ROW_STRING as _ROW_STRING
from parallelvars.checkpoint.h5raw.objects import Attr as _Attr
from parallelvars.checkpoint.h5raw.objects import Dataset as _Dataset
from parallelvars.checkpoint.h5raw.objects import External as _External
from parallelvars.checkpoint.h5raw.objects import Group, Layout, encode_attribute
from parallelvars.checkpoint.h5raw.objects import attrs_key as _attrs_key
from parallelvars.checkpoint.h5raw.objects import signature as _signature
from parallelvars.checkpoint.h5raw.symbol_table import SYMBOL_TABLE, SymbolTable
from parallelvars.checkpoint.h5raw.templates import Template, place_rows, runs
from parallelvars.checkpoint.h5raw.virtual import mapping
from parallelvars.checkpoint.registry import component_name as _component_name
from parallelvars.errors import InvalidEntryError


class _Group(Group):
    """The earlier generator's group: its child groups listed too (``children``)."""

    __slots__ = ("children",)

    def __init__(self) -> None:
        super().__init__()
        self.children: list[_Group] = []

    @classmethod
    def leaf(
        cls, layout: _Layout, shape: tuple[int, ...], row: bytes | None, first_ds: int
    ) -> _Group:
        """A variable's group made from its layout's template: without lists of its own
        (:func:`_adopt` and :meth:`FilePlan._expand` give it lists when it needs them)."""
        g = cls.__new__(cls)
        g.attrs = g.links = g.children = _NOTHING  # type: ignore[assignment]
        g.address = g.first_string = g.table_at = -1
        g.layout, g.shape, g.row, g.first_ds = layout, shape, row, first_ds
        g.comp_at = 0
        g.table = None
        return g


_NOTHING: tuple[()] = ()  # (the links, children and attributes of a leaf group: none)


def _adopt(parent: _Group, name: bytes, child: _Group) -> None:
    """Link ``child`` into ``parent`` under ``name`` (a leaf variable group that becomes a
    parent gets lists of its own first)."""
    if parent.links is _NOTHING:
        parent.links, parent.children = [], []
    parent.links.append((name, child))
    parent.children.append(child)


class _Layout(Layout):
    """The earlier generator's layout: the groups made from its template listed too."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.groups: list[_Group] = []  # the groups made from the template, in file order


_NO_LINKS = vars(_objects)["_NOTHING"]

__all__ = ["MAX_COMPACT_LINKS", "FilePlan", "Metadata", "Variable", "encode_attribute"]

_MAX_MESSAGE = 0xFFFF
_COMPACT_ATTRS = 8  # HDF5's default attribute phase change: 8 in the header ...
_WIDE_ATTRS = 32  # ... the writer's for groups of more (see h5io/write.py)
_DEFAULT_LINKS = 8  # HDF5's default link phase change (8 compact, 6 dense)
# The most links a generated group keeps in its header: HDF5 finds a name among compact links
# by scanning them, so opening each of n children costs n^2 (10,000 children: 10.8 s where
# libhdf5's dense storage takes 1.8 s); up to this many it costs milliseconds.
MAX_COMPACT_LINKS = 1024


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
    # A byte-string variable's values: each component's elements in C order (each one a
    # global heap object, the component dataset's data their references).
    strings: Sequence[Sequence[bytes]] | None = None


@dataclass
class Metadata:
    """A generated file's metadata: the byte ``pieces`` ``(offset, bytes)`` to write (the
    component data and the documents go between them), the file's size, and each document's
    data offset."""

    pieces: list[tuple[int, bytes | memoryview]]  # (the image's own bytes, not copied)
    file_size: int
    documents: dict[str, int]


class FilePlan:
    """The layout of one native file (see the module docstring).

    The structure is kept column-wise: every component dataset is a row of the dataset
    columns (its template, shape, bytes; its address and data offset are computed for all
    rows at once), and every variable group made from its layout's template is a row of that
    layout (shape, first string, first dataset). Python objects are made per group and per
    variable only for what the file needs on its own."""

    def __init__(
        self,
        variables: Sequence[Variable],
        *,
        root_attrs: Mapping[str, Any],
        documents: Sequence[str] = (),
        align: int = 8,
        shared: Sequence[Sequence[int] | None] | None = None,
        classes: Any = None,
    ) -> None:
        """``variables``: :class:`Variable` records, or any entries with their fields but
        ``shared`` and ``external`` (a save's records, passed as they are: no object is made
        per variable to hold them) with each one's ``shared`` given in ``shared``, and then
        optionally their ``classes`` (``h5io.records.record_classes`` of them with ``shared``:
        the layout of a class's first record is every record's of the class)."""
        self._root = _Group()
        self._root.attrs = [encode_attribute(k, v) for k, v in root_attrs.items()]
        self._root_values = {a.name: i for i, a in enumerate(self._root.attrs)}
        self._by_path: dict[str, _Group] = {"": self._root}
        # the dataset columns: per dataset, its template's number (-1: encoded on its own,
        # see _special), shape and bytes of data
        self._ds_key: list[int] = []
        self._ds_shape: list[tuple[int, ...]] = []
        self._ds_nbytes: list[int] = []
        self._special: dict[int, _Dataset] = {}
        self._keys: dict[tuple[Any, ...], int] = {}  # a dataset template's key -> its number
        self._key_list: list[tuple[Any, ...]] = []
        self._dataset_templates: dict[int, Template] = {}
        self._layouts: dict[Any, _Layout] = {}
        self._documents: dict[str, int] = {}  # a document -> its dataset number
        # per variable, in order: its path, layout (None: external links), first dataset
        self._rows: list[tuple[str, _Layout | None, int, int]] = []
        self._fill: int | None = None  # encoding a template: the byte every field is made of
        # byte-string components: (dataset number, its elements) and, once laid out, the
        # (data offset, references) of each
        self._vlen: list[tuple[int, Sequence[bytes]]] = []
        self._vlen_data: list[tuple[int, bytes]] = []
        self._ds_address: np.ndarray = np.zeros(0, np.int64)
        self._linking_out: set[int] = set()  # the groups holding external links (by id)
        add = self._add_variable
        if shared is None:
            for var in variables:
                add(var, var.shared, var.external, var.strings)
        elif classes is None:
            for var, sh in zip(variables, shared, strict=True):
                add(var, sh, None, None)
        else:
            self._add_classes(variables, shared, classes.ids, len(classes.first))
        for name in documents:
            path = name.split("/")
            group = self._group_of("/".join(path[:-1]))
            ds = _Dataset(msg.datatype(msg.FixedString(1)), (), msg.FILL_LATE_IFSET, document=name)
            ds.attrs = [encode_attribute("crc32c", np.int64(0))]
            number = self._add_special(ds)
            group.links.append((path[-1].encode("utf-8"), number))
            self._documents[name] = number
        self._layout(align)

    # ------------------------------------------------------------------ structure
    def _group_of(self, path: str) -> _Group:
        """The group at ``path`` ("": the root), made with the groups on the way to it."""
        group = self._by_path.get(path)
        if group is not None:
            return group
        parent_path, _, name = path.rpartition("/")
        parent = self._group_of(parent_path)
        group = self._by_path[path] = _Group()
        _adopt(parent, name.encode("utf-8"), group)
        return group

    def _add_special(self, ds: _Dataset) -> int:
        number = len(self._ds_key)
        self._ds_key.append(-1)
        self._ds_shape.append(ds.shape)
        self._ds_nbytes.append(0)
        self._special[number] = ds
        return number

    def _key_number(self, key: tuple[Any, ...]) -> int:
        number = self._keys.get(key)
        if number is None:
            number = self._keys[key] = len(self._key_list)
            self._key_list.append(key)
        return number

    def _make_layout(
        self,
        key: Any,
        var: Variable,
        dt: np.dtype,
        shape: tuple[int, ...],
        var_shared: Sequence[int] | None,
    ) -> _Layout:
        n = int(var.num_components)
        shared = list(var_shared) if var_shared is not None else list(range(n))
        for i, j in enumerate(shared):
            if j != i and (not 0 <= j < i or shared[j] != j):
                raise InvalidEntryError(
                    f"component {i} cannot share another component's dataset",
                    variable=var.path,
                    expected="an earlier component of the same shape that is stored",
                    found=f"component {j}",
                )
        sig = _signature(var.kind, dt, shape, n, dict(var.attrs))
        layout = _Layout(var.kind, dt, n, shared, sig)
        self._layouts[key] = layout
        return layout

    def _add_variable(
        self,
        var: Variable,
        shared: Sequence[int] | None,
        external: Sequence[tuple[str, str]] | None,
        strings: Sequence[Sequence[bytes]] | None,
        layout: _Layout | None = None,
    ) -> _Layout:
        """Add ``var`` (its ``layout`` when known: that of a variable of its class); returns
        its layout."""
        path = var.path
        dt = var.dtype if isinstance(var.dtype, np.dtype) else np.dtype(var.dtype)
        shape = tuple(map(int, var.shape))
        attrs = var.attrs
        row = attrs.get(_ROW_STRING)
        if row is not None and not isinstance(row, str):
            raise msg.Unsupported(f"attribute {_ROW_STRING!r} that is not a string")
        by_path = self._by_path
        group = by_path.get(path)  # (made already as the parent of an earlier variable)
        if group is not None and (group.attrs or group.layout is not None):
            raise InvalidEntryError("is written twice", variable=path)
        if layout is None:
            key = (
                var.kind,
                dt,
                len(shape),
                var.num_components,
                None if shared is None else tuple(shared),
                row is None,
                # what the group's header does not hold (the index-only attributes) is not in
                # the key
                _attrs_key(attrs),
            )
            layout = self._layouts.get(key)
            if layout is None:
                layout = self._make_layout(key, var, dt, shape, shared)
        row_bytes = None if row is None else row.encode("utf-8")
        first = len(self._ds_key)
        if external is not None:
            if group is None:
                group = self._group_of(path)
            n = layout.n
            if len(external) != n:
                raise InvalidEntryError(
                    "external links", variable=path, expected=n, found=len(external)
                )
            for i, (file, dataset) in enumerate(external):
                target = _External(file.encode("utf-8"), dataset.encode("utf-8"))
                group.links.append((_component_name(i).encode(), target))
            self._linking_out.add(id(group))
            if layout.sharded:  # the stitched value, over the shards in the other files
                axis = int(attrs["shard_axis"])
                bounds = shard_bounds(attrs["shard_offsets"], shape[axis])
                sources = [dataset for _, dataset in external]
                files = [file for file, _ in external]
                vds = _Dataset(
                    layout.storage,
                    shape,
                    msg.FILL_INCREMENTAL_IFSET,
                    mapping=mapping(sources, shape, axis, bounds, files=files),
                )
                group.links.append((b"value", self._add_special(vds)))
            group.attrs = layout.sig.materialize(shape, row_bytes)  # links vary: no template
            self._rows.append((path, None, first, n))
            return layout
        if group is None:  # (the common case: a group without lists of its own)
            parent_path, _, name = path.rpartition("/")
            parent = by_path.get(parent_path) or self._group_of(parent_path)
            group = by_path[path] = _Group.leaf(layout, shape, row_bytes, first)
            _adopt(parent, name.encode("utf-8"), group)
        else:
            group.layout = layout
            group.shape = shape
            group.row = row_bytes
            group.first_ds = first
            group.comp_at = len(group.links)
        layout.groups.append(group)
        if layout.sharded:
            axis = int(attrs["shard_axis"])
            bounds = shard_bounds(attrs["shard_offsets"], shape[axis])
            shapes = [
                tuple(bounds[i + 1] - bounds[i] if k == axis else d for k, d in enumerate(shape))
                for i in range(layout.n)
            ]
            for i, j in enumerate(layout.shared):
                if shapes[j] != shapes[i]:
                    raise InvalidEntryError(
                        f"component {i} cannot share another component's dataset",
                        variable=path,
                        expected="an earlier component of the same shape that is stored",
                        found=f"component {j}",
                    )
            for c, links in zip(layout.stored, layout.links, strict=True):
                nbytes = math.prod(shapes[c]) * layout.itemsize
                self._add_component(layout, shapes[c], nbytes, links)
            sources = [f"/{path}/{_component_name(i)}" for i in range(layout.n)]
            vds = _Dataset(
                layout.storage,
                shape,
                msg.FILL_INCREMENTAL_IFSET,
                mapping=mapping(sources, shape, axis, bounds),
            )
            self._add_special(vds)
        else:
            nbytes = math.prod(shape) * layout.itemsize
            keys = layout.ds_keys[nbytes > 0]
            if keys is None:
                keys = layout.ds_keys[nbytes > 0] = [
                    self._component_key(layout, len(shape), nbytes, links) for links in layout.links
                ]
            self._ds_key += keys
            count = len(keys)
            self._ds_shape += [shape] * count
            self._ds_nbytes += [nbytes] * count
        if layout.vlen:
            if strings is None or len(strings) != layout.n:
                raise InvalidEntryError(
                    "a byte-string variable's values",
                    variable=path,
                    expected=f"the elements of {layout.n} components",
                    found=None if strings is None else len(strings),
                )
            for k, c in enumerate(layout.stored):
                elements = strings[c]
                if len(elements) * 16 != self._ds_nbytes[first + k]:
                    raise InvalidEntryError(
                        "a byte-string component's elements",
                        variable=f"{path}[{c}]",
                        expected=self._ds_nbytes[first + k] // 16,
                        found=len(elements),
                    )
                self._vlen.append((first + k, elements))
        self._rows.append((path, layout, first, layout.n))
        return layout

    def _add_classes(
        self,
        variables: Sequence[Any],
        shared: Sequence[Sequence[int] | None],
        ids: Sequence[int],
        count: int,
    ) -> None:
        """:meth:`_add_variable` of records sorted into ``count`` classes (``ids``: each
        one's class): a class's first record is added in full (its layout made or found, its
        row string's type checked), then every record of a class whose layout is neither
        sharded nor of byte strings, and whose group is not made yet (as a parent), is added
        in a few operations: its group made from the layout, its datasets' rows of the
        layout's datasets."""
        add = self._add_variable
        of_class: list[_Layout | None] = [None] * count
        by_path = self._by_path
        leaf = _Group.leaf
        ds_key, ds_shape, ds_nbytes = self._ds_key, self._ds_shape, self._ds_nbytes
        rows = self._rows
        prod = math.prod
        # shapes recur: each one's tuple of ints made once (and shared by its records' rows)
        shapes: dict[Any, tuple[int, ...]] = {}
        # the records of a group come one after another: its parent's path and lists kept
        parent_path: str | None = None
        plinks: list[tuple[bytes, Any]] = []
        pchildren: list[_Group] = []
        for k, (var, sh, c) in enumerate(zip(variables, shared, ids, strict=True)):
            if not k % FREEZE_STEP:
                freeze_made_so_far()  # (the plan's objects live until its image is made)
            layout = of_class[c]
            path = var.path
            if layout is None or layout.sharded or layout.vlen or path in by_path:
                of_class[c] = add(var, sh, None, None, layout)
                parent_path = None  # (it may have given a leaf group lists of its own)
                continue
            raw = var.shape
            try:
                shape = shapes[raw]
            except (KeyError, TypeError):
                shape = tuple(map(int, raw))
                if type(raw) is tuple:
                    shapes[raw] = shape
            row = var.attrs.get(_ROW_STRING)  # (a string or None: its class's first record's)
            first = len(ds_key)
            at, _, name = path.rpartition("/")
            if at != parent_path:
                parent = by_path.get(at) or self._group_of(at)
                if parent.links is _NO_LINKS:  # (a leaf variable's group becomes a parent)
                    parent.links, parent.children = [], []
                parent_path, plinks, pchildren = at, parent.links, parent.children
            group = by_path[path] = leaf(
                layout, shape, None if row is None else row.encode("utf-8"), first
            )
            plinks.append((name.encode("utf-8"), group))  # (adopt, the parent's lists at hand)
            pchildren.append(group)
            layout.groups.append(group)
            nbytes = prod(shape) * layout.itemsize
            keys = layout.ds_keys[nbytes > 0]
            if keys is None:
                keys = layout.ds_keys[nbytes > 0] = [
                    self._component_key(layout, len(shape), nbytes, links) for links in layout.links
                ]
            ds_key += keys
            n = len(keys)
            ds_shape += [shape] * n
            ds_nbytes += [nbytes] * n
            rows.append((path, layout, first, layout.n))

    def _component_key(self, layout: _Layout, ndim: int, nbytes: int, links: int) -> int:
        """The template number of a component dataset."""
        return self._key_number((layout.storage, ndim, nbytes > 0, links, layout.fill))

    def _add_component(
        self, layout: _Layout, shape: tuple[int, ...], nbytes: int, links: int
    ) -> None:
        self._ds_key.append(self._component_key(layout, len(shape), nbytes, links))
        self._ds_shape.append(shape)
        self._ds_nbytes.append(nbytes)

    def _expand(self, g: _Group) -> None:
        """Make ``g`` a group encoded on its own: its attributes and component links made
        from its layout."""
        layout = g.layout
        assert layout is not None
        g.attrs = layout.sig.materialize(g.shape, g.row)
        g.links = list(g.links)  # (a leaf group's are shared: see _Group.leaf)
        g.links[g.comp_at : g.comp_at] = [
            (name, g.first_ds + d) for name, d in zip(layout.names, layout.link_ds, strict=True)
        ]
        g.layout = None

    # ------------------------------------------------------------------ layout
    def _layout(self, align: int) -> None:
        # 1. the groups in file order (depth first, each before its children); a variable that
        # is also a parent, or whose header continues in further chunks (their continuation
        # messages hold addresses), is encoded on its own
        root = self._root
        groups: list[_Group] = [root]
        add_group = groups.append
        # (a stack of the children still to visit of each group on the way: a variable's
        # group, a leaf, is added without a visit of its own)
        stack = [iter(root.children)]
        while stack:
            for g in stack[-1]:
                add_group(g)
                if g.children:
                    if g.layout is not None:  # a variable that is also a parent
                        self._expand(g)
                    stack.append(iter(g.children))
                    break
            else:
                stack.pop()
        self._groups = groups
        freeze_made_so_far()
        for layout in self._layouts.values():
            # a variable's group whose header continues in further chunks (their continuation
            # messages hold addresses), or of more links than a header keeps (a symbol
            # table): encoded on its own
            if layout.groups and (
                len(self._group_template(layout).chunks) > 1
                or len(layout.names) > MAX_COMPACT_LINKS
            ):
                for g in layout.groups:
                    if g.layout is not None:
                        self._expand(g)
            layout.groups = [g for g in layout.groups if g.layout is not None]
        # groups without attributes whose links have the same names (the groups of a
        # variable's slots...) are made from one template
        others = [g for g in groups if g.layout is None]  # (groups not made from a layout)
        plain: dict[tuple[bytes, ...], list[_Group]] = {}
        linking_out = self._linking_out
        for g in others:
            if len(g.links) > MAX_COMPACT_LINKS:
                g.table = SymbolTable([name for name, _ in g.links])
            elif not g.attrs and g is not root and g.links and id(g) not in linking_out:
                plain.setdefault(tuple([name for name, _ in g.links]), []).append(g)
        self._plain: list[tuple[Template, list[_Group]]] = []
        templated: set[int] = set()
        for members in plain.values():
            if len(members) < 2:
                continue
            tmpl = self._plain_template(members[0])
            if len(tmpl.chunks) > 1:
                continue
            self._plain.append((tmpl, members))
            templated.update(map(id, members))
        self._individual = [g for g in others if id(g) not in templated]
        plain_of = {id(g): tmpl.size for tmpl, members in self._plain for g in members}
        # each group's header and table: a list, then one array (a layout's groups: its
        # template's size)
        size_of: list[int] = [-1 if g.layout is None else g.layout.size for g in groups]
        tables: list[_Group] = []
        for k in [k for k, size in enumerate(size_of) if size < 0]:
            g = groups[k]
            size = plain_of.get(id(g))
            if size is None:
                size = len(self._encode_group(g)[0])
            if g.table is not None:  # the header, then its symbol table
                g.table_at = size
                size += g.table.size
                tables.append(g)
            size_of[k] = size
        sizes = np.array(size_of, np.int64)
        del size_of
        starts = SUPERBLOCK_SIZE + np.cumsum(sizes) - sizes
        at = SUPERBLOCK_SIZE + int(sizes.sum())
        for g, a in zip(groups, starts.tolist(), strict=True):
            g.address = a
        for g in tables:
            g.table_at += g.address
        # 2. the datasets, in order
        keys = np.asarray(self._ds_key, np.int64)
        key_sizes = np.array(
            [self._dataset_template(k).size for k in range(len(self._key_list))] + [0], np.int64
        )
        ds_sizes = key_sizes[keys]  # (-1: the special datasets, sized below)
        for number, ds in self._special.items():
            ds_sizes[number] = len(self._encode_dataset(ds)[0])
        ds_address = at + np.cumsum(ds_sizes) - ds_sizes
        at += int(ds_sizes.sum())
        self._ds_address = ds_address
        for number, ds in self._special.items():
            ds.address = int(ds_address[number])
        # 3. the global heap: every string of every attribute, then the mappings
        strings: list[bytes] = []
        add_string = strings.append
        for g in groups:
            lay = g.layout
            if lay is not None:
                g.first_string = len(strings)
                before, after = lay.strings
                if lay.sig.row_at is None:
                    strings += before
                elif before or after:
                    strings += before
                    add_string(g.row or b"")
                    strings += after
                else:
                    add_string(g.row or b"")
        owners: list[tuple[_Attr, int]] = []
        holders: list[_Group | _Dataset] = [*self._individual, *self._special.values()]
        for obj in holders:
            for a in obj.attrs:
                if a.strings is not None:
                    owners.append((a, len(strings)))
                    strings.extend(a.strings)
        vlen_at = []  # each byte-string component's first element among the heap objects
        for _, elements in self._vlen:
            vlen_at.append(len(strings))
            strings.extend(elements)
        maps = [ds for ds in self._special.values() if ds.mapping is not None]
        objects = strings + [ds.mapping or b"" for ds in maps]
        lengths = np.fromiter(map(len, objects), np.int64, len(objects))
        heap, addrs, index = build_collections(b"".join(objects), lengths, at)
        self._heap = (at, heap)
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
        # 4. the data: each stored component with bytes at an aligned offset, in order
        nbytes = np.asarray(self._ds_nbytes, np.int64)
        room = -(-nbytes // align) * align
        first = -(-at // align) * align
        ds_offset = np.where(nbytes > 0, first + np.cumsum(room) - room, -1)
        self._ds_offset = ds_offset
        stored = np.flatnonzero(nbytes)
        self.data_end = int(ds_offset[stored[-1]] + nbytes[stored[-1]]) if stored.size else at
        # each variable's components' offsets (None: no data)
        offs: list[int | None] = [None if o < 0 else o for o in ds_offset.tolist()]
        # each layout's way: 0 (its components each of its own dataset, in order: a slice), 1
        # (all one dataset, a mirrored variable's stored once: one offset repeated), 2
        # (picked), 3 (no offsets: external links, and byte strings, read through HDF5: none in
        # the index, as the libhdf5 writer's)
        ways: dict[_Layout | None, int] = {None: 3}
        for lay in self._layouts.values():
            cd = lay.comp_ds
            ways[lay] = (
                3 if lay.vlen else 0 if cd == list(range(lay.n)) else 1 if not any(cd) else 2
            )
        self.offsets: dict[str, list[int | None]] = {
            path: offs[start : start + n]
            if way == 0
            else [offs[start]] * n
            if way == 1
            else [None] * n
            if way == 3
            else [offs[start + d] for d in cast(_Layout, lay).comp_ds]
            for path, lay, start, n in self._rows
            for way in (ways[lay],)
        }
        self._vlen_data = [
            (int(ds_offset[number]), refs[at : at + len(elements)].tobytes())
            for (number, elements), at in zip(self._vlen, vlen_at, strict=True)
            if elements
        ]
        self._vlen = []

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

    def _address(self, target: Any) -> int:
        """A link target's address (a group or a dataset by number)."""
        if isinstance(target, int):
            return int(self._ds_address[target]) if target < len(self._ds_address) else 0
        return max(target.address, 0)

    # ------------------------------------------------------------------ templates
    def _group_template(self, layout: _Layout) -> Template:
        """A variable group's header with its fields (string references and the shape, in
        attribute order, then the link addresses) zero: found by encoding it with every
        field's bytes 0x00 and then 0xFF (once per layout)."""
        sig = layout.sig
        if layout.template is None:
            made = []
            links = [(name, 0) for name in layout.names]
            for fill in (0x00, 0xFF):
                self._fill = fill
                try:
                    attrs = sig.materialize((), b"")
                    a = attrs[sig.shape_at]
                    attrs[sig.shape_at] = _Attr(
                        a.name, a.dtype, a.space, bytes((fill,)) * (8 * sig.ndim)
                    )
                    g = _Group()
                    g.attrs, g.links = attrs, links
                    made.append(self._encode_group(g))
                finally:
                    self._fill = None
            layout.template = Template(made[0][0], made[0][1], runs(made[0][0], made[1][0]))
            layout.size = layout.template.size
        return layout.template

    def _plain_template(self, g: _Group) -> Template:
        """A group without attributes: its header with the link addresses zero."""
        made = []
        for fill in (0x00, 0xFF):
            self._fill = fill
            try:
                made.append(self._encode_group(g))
            finally:
                self._fill = None
        return Template(made[0][0], made[0][1], runs(made[0][0], made[1][0]))

    def _place_groups(self, image: np.ndarray, layout: _Layout) -> None:
        """The headers of the variable groups of one layout, written into ``image``: the
        template's rows with every group's fields put in column-wise."""
        groups = layout.groups
        sig = layout.sig
        tmpl = self._group_template(layout)
        count = len(groups)
        per = [len(a.strings or ()) if k != sig.shape_at else 0 for k, a in enumerate(sig.attrs)]
        before = sum(per[: sig.shape_at])  # string references before the shape
        first = np.fromiter((g.first_string for g in groups), np.int64, count)
        refs = self._ref_rows[first[:, None] + np.arange(sum(per))].reshape(count, -1)
        shapes = np.array([g.shape for g in groups], "<i8").reshape(count, sig.ndim)
        first_ds = np.fromiter((g.first_ds for g in groups), np.int64, count)
        links = self._ds_address[first_ds[:, None] + np.asarray(layout.link_ds, np.int64)]
        fields = np.hstack(
            (
                refs[:, : 16 * before],
                shapes.view(np.uint8).reshape(count, -1),
                refs[:, 16 * before :],
                links.astype("<u8").reshape(count, -1).view(np.uint8).reshape(count, -1),
            )
        )
        addresses = np.fromiter((g.address for g in groups), np.int64, count)
        place_rows(image, addresses, tmpl, fields)

    def _place_plain(self, image: np.ndarray, tmpl: Template, groups: list[_Group]) -> None:
        count = len(groups)
        ds = self._ds_address.tolist()
        links = np.array(
            [[t.address if type(t) is _Group else ds[t] for _, t in g.links] for g in groups], "<u8"
        )
        fields = links.reshape(count, -1).view(np.uint8).reshape(count, -1)
        addresses = np.fromiter((g.address for g in groups), np.int64, count)
        place_rows(image, addresses, tmpl, fields)

    def _dataset_template(self, number: int) -> Template:
        """A component dataset's header with its fields (dimensions, maximum dimensions and,
        when it has data, its offset and size) zero (once per key)."""
        tmpl = self._dataset_templates.get(number)
        if tmpl is None:
            storage, ndim, has_data, links, fill_flags = self._key_list[number]
            made = []
            for fill in (0, (1 << 64) - 1):
                proto = _Dataset(storage, (fill,) * ndim, fill_flags, links=links)
                proto.nbytes, proto.offset = (fill or 1, fill) if has_data else (0, -1)
                made.append(self._encode_dataset(proto, size=fill if has_data else None))
            tmpl = Template(made[0][0], made[0][1], runs(made[0][0], made[1][0]))
            self._dataset_templates[number] = tmpl
        return tmpl

    def _place_datasets(self, image: np.ndarray, number: int, rows: np.ndarray) -> None:
        """The headers of the component datasets ``rows`` of one template, written into
        ``image``."""
        tmpl = self._dataset_template(number)
        ndim = self._key_list[number][1]
        count = rows.size
        shapes = self._ds_shape
        dims = np.array([shapes[i] for i in rows.tolist()], "<u8").reshape(count, ndim)
        columns = [dims, dims]
        if self._key_list[number][2]:  # stored data: its offset and size
            columns.append(np.maximum(self._ds_offset[rows], 0).reshape(count, 1))
            columns.append(np.asarray(self._ds_nbytes, np.int64)[rows].reshape(count, 1))
        fields = np.hstack(columns).astype("<u8").view(np.uint8).reshape(count, -1)
        place_rows(image, self._ds_address[rows], tmpl, fields)

    def _encode_group(self, g: _Group) -> tuple[bytes, list[tuple[int, int]]]:
        messages: list[tuple[int, int, bytes]] = []
        nlinks = len(g.links)
        # Where a group's link storage is chosen: compact (in its header) up to
        # MAX_COMPACT_LINKS links.
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
                    name, self._address(t) if fill is None else fill * 0x0101010101010101
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
        assert self._groups is not None, "the plan was released: its image was made already"
        self._capacities = dict(capacities or {})
        self._set_root_values(values)
        at = self.data_end
        documents: dict[str, int] = {}
        for name, number in self._documents.items():
            ds = self._special[number]
            ds.offset = at
            documents[name] = at
            at += self._capacities.get(name, 1)
            crc = int((document_checksums or {}).get(name, 0))
            ds.attrs = [encode_attribute("crc32c", np.int64(crc))]
        file_size = max(at, self.metadata_size)
        self._ref_start = {id(a): first for a, first in self._owners}
        # The metadata is one image: the superblock, the headers and the heap, laid one after
        # another from 0. Headers made from templates are written a template at a time; the
        # others are encoded one by one and their chunks' checksums computed together.
        image = np.zeros(self.metadata_size, np.uint8)
        spans: list[tuple[int, int]] = []

        def put(at: int, data: bytes, chunks: list[tuple[int, int]]) -> None:
            image[at : at + len(data)] = np.frombuffer(data, np.uint8)
            spans.extend((at + start, at + end) for start, end in chunks)

        put(0, _superblock(file_size, self._root.address), [])
        for g in self._individual:
            put(g.address, *self._encode_group(g))
            if g.table is not None:
                addresses = [self._address(t) for _, t in g.links]
                put(g.table_at, g.table.encode(g.table_at, addresses), [])
        for layout in self._layouts.values():
            if layout.groups:
                self._place_groups(image, layout)
        for tmpl, groups in self._plain:
            self._place_plain(image, tmpl, groups)
        keys = np.asarray(self._ds_key, np.int64)
        if keys.size:
            order = np.argsort(keys, kind="stable")
            bounds = np.searchsorted(keys[order], np.arange(len(self._key_list) + 1))
            for number in range(len(self._key_list)):
                rows = order[bounds[number] : bounds[number + 1]]
                if rows.size:
                    self._place_datasets(image, number, rows)
        for ds in self._special.values():
            put(ds.address, *self._encode_dataset(ds))
        at, heap = self._heap
        image[at : at + heap.size] = heap
        sums = lookup3_many(image, spans)
        where = np.array([e for _, e in spans], np.int64).reshape(-1, 1) + np.arange(4)
        image[where.reshape(-1)] = sums.astype("<u4").view(np.uint8)
        self.checksum_spans = spans  # (each header chunk encoded on its own: start, checksum)
        return Metadata([(0, image.data), *self._vlen_data], file_size, documents)

    def relink(self, old: bytes, new: bytes) -> int:
        """Give every external link whose file starts with ``old`` the folder ``new`` instead
        (of the same length: the layout stays); the next :meth:`metadata` encodes them so.
        Returns how many links changed."""
        assert len(old) == len(new) and self._groups is not None
        count = 0
        for g in self._groups:
            for _, target in g.links:
                if isinstance(target, _External) and target.file.startswith(old):
                    target.file = new + target.file[len(old) :]
                    count += 1
        return count

    def release(self) -> None:
        """After :meth:`metadata`: drop what only making the image needed (the groups, the
        layouts, the dataset columns, the heap), keeping :attr:`offsets` and what
        :meth:`refresh` re-encodes (the root group, the documents). A plan kept for repeated
        saves then holds tens of bytes per variable instead of its whole structure."""
        documents = set(self._documents.values())
        self._special = {k: ds for k, ds in self._special.items() if k in documents}
        root_links = [t for _, t in self._root.links if isinstance(t, int)]
        if root_links:  # (a root linking to datasets: their addresses stay)
            keep = max(root_links) + 1
            self._ds_address = self._ds_address[:keep].copy()
        else:
            self._ds_address = np.zeros(0, np.int64)
        for g in self._root.children:
            g.links, g.children, g.attrs = [], [], []  # (only its address is read)
        self._root.children = []
        for layout in self._layouts.values():
            # (a layout and its groups refer to each other: emptied, the plan's objects are
            # freed as it drops them, not left to a full collection of the cyclic collector)
            layout.groups = []
        for name in ("_by_path", "_groups", "_layouts", "_plain", "_individual", "_rows"):
            setattr(self, name, None)
        self._ds_key, self._ds_shape, self._ds_nbytes = [], [], []
        self._ds_offset = np.zeros(0, np.int64)
        self._ref_rows = np.zeros((0, 16), np.uint8)
        self._heap = (0, np.zeros(0, np.uint8))

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
        for name, number in self._documents.items():
            ds = self._special[number]
            crc = int(document_checksums.get(name, 0))
            ds.attrs = [encode_attribute("crc32c", np.int64(crc))]
            objects.append((ds.address, self._encode_dataset(ds)))
        out = []
        for address, (data, chunks) in objects:
            buf = bytearray(data)
            for start, end in chunks:
                buf[end : end + 4] = lookup3(buf[start:end]).to_bytes(4, "little")
            out.append((address, bytes(buf)))
        return out


# ----------------------------------------------------------------------------- the global heap
_HEAP_OBJECT_HEADER = 16  # index (2), reference count (2), reserved (4), size (8)
_HEAP_COLLECTION_HEADER = 16  # signature, version, reserved (3), size (8)
_HEAP_PER = 4096  # objects per collection
_HEAP_BATCH = 1 << 16


def _heap_align8(n: Any) -> Any:
    return (n + 7) & ~7


def build_collections(
    data: bytes | np.ndarray, lengths: np.ndarray, base: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(The library's heap builder before it made collections a range at a time, kept as an
    oracle apart from ``global_heap.Collections``.) Global heap collections at file offset ``base`` holding one object per entry of
    ``lengths`` (the objects' bytes are ``data``, concatenated).

    Returns the collections' bytes (uint8), and each object's collection address and index
    (its reference is ``length, address, index``). Each collection holds up to 4096 objects
    and is at least 4096 bytes long (a free-space object fills the rest); objects keep their
    order.
    """
    lengths = np.asarray(lengths, np.int64)
    n = lengths.size
    if n == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)
    per = _HEAP_PER
    which = np.arange(n) // per
    index = np.arange(n) % per + 1
    slot = _HEAP_OBJECT_HEADER + _heap_align8(lengths)  # each object's bytes in its collection
    count = int(which[-1]) + 1
    used = np.bincount(which, weights=slot, minlength=count).astype(np.int64)
    used += _HEAP_COLLECTION_HEADER
    size = np.maximum(_heap_align8(used), MIN_COLLECTION)
    starts = base + np.concatenate(([0], np.cumsum(size)[:-1]))
    out = np.zeros(int(size.sum()), np.uint8)
    local = starts - base
    # the collection heads
    head = np.zeros((count, _HEAP_COLLECTION_HEADER), np.uint8)
    head[:, :5] = np.frombuffer(b"GCOL\x01", np.uint8)
    head[:, 8:16] = size.astype("<u8").view(np.uint8).reshape(count, 8)
    out[(local[:, None] + np.arange(_HEAP_COLLECTION_HEADER)).reshape(-1)] = head.reshape(-1)
    # each object's place: after the head and the objects before it in its collection
    before = np.cumsum(slot) - slot
    at = local[which] + _HEAP_COLLECTION_HEADER + before - before[which * per]
    src = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    first = np.cumsum(lengths) - lengths  # each object's bytes in ``src``
    # the objects' heads and bytes, a batch of objects at a time (the index arrays of a
    # scatter take 8 bytes per byte scattered: bounded by the batch, not the heap)
    for lo in range(0, n, _HEAP_BATCH):
        hi = min(n, lo + _HEAP_BATCH)
        m = hi - lo
        objhead = np.zeros((m, _HEAP_OBJECT_HEADER), np.uint8)
        objhead[:, 0:2] = index[lo:hi].astype("<u2").view(np.uint8).reshape(m, 2)
        objhead[:, 8:16] = lengths[lo:hi].astype("<u8").view(np.uint8).reshape(m, 8)
        out[(at[lo:hi, None] + np.arange(_HEAP_OBJECT_HEADER)).reshape(-1)] = objhead.reshape(-1)
        ragged_copy(out, at[lo:hi] + _HEAP_OBJECT_HEADER, src, first[lo:hi], lengths[lo:hi])
    # the free space of each collection: an object of index 0 (when there is room for one)
    free = size - used
    for c in np.flatnonzero(free >= _HEAP_OBJECT_HEADER).tolist():
        p = int(local[c] + used[c])
        out[p + 8 : p + 16] = np.frombuffer(int(free[c]).to_bytes(8, "little"), np.uint8)
    return out, starts[which], index
