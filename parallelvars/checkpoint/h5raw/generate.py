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
groups are rows of the variable columns (path, layout, first dataset, shape, ``slot_of``; their
addresses and first heap strings computed for all rows at once), linked from their parents as
``~row``: no Python object per variable (a layout: kind, dtype, rank, components, shared
components, attributes but the shape and ``slot_of``, its attributes encoded once). Only the
groups on the way to the variables, and a variable's group that is also a parent or whose header
a template cannot make, are objects. :attr:`FilePlan.offsets` reads the variable columns when
asked (``bench/bench_generate.py`` measures the plan's memory and time per entry). Variable groups,
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

import errno
import math
import operator
import os
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, cast

import numpy as np

from parallelvars._geometry import shard_bounds
from parallelvars._ints import unique_ints
from parallelvars.checkpoint._gcfreeze import FREEZE_STEP, freeze_made_so_far
from parallelvars.checkpoint.h5raw import header as hdr
from parallelvars.checkpoint.h5raw import messages as msg
from parallelvars.checkpoint.h5raw.global_heap import Collections, ObjectBytes
from parallelvars.checkpoint.h5raw.header import SUPERBLOCK_SIZE
from parallelvars.checkpoint.h5raw.header import encode_chunked as _encode_chunked
from parallelvars.checkpoint.h5raw.lookup3 import lookup3, lookup3_many
from parallelvars.checkpoint.h5raw.messages import superblock as _superblock
from parallelvars.checkpoint.h5raw.objects import ROW_STRING as _ROW_STRING
from parallelvars.checkpoint.h5raw.objects import Attr as _Attr
from parallelvars.checkpoint.h5raw.objects import Dataset as _Dataset
from parallelvars.checkpoint.h5raw.objects import External as _External
from parallelvars.checkpoint.h5raw.objects import Group as _Group
from parallelvars.checkpoint.h5raw.objects import Layout as _Layout
from parallelvars.checkpoint.h5raw.objects import attrs_key as _attrs_key
from parallelvars.checkpoint.h5raw.objects import encode_attribute
from parallelvars.checkpoint.h5raw.objects import signature as _signature
from parallelvars.checkpoint.h5raw.symbol_table import SYMBOL_TABLE, SymbolTable
from parallelvars.checkpoint.h5raw.templates import Template, place_rows, runs
from parallelvars.checkpoint.h5raw.virtual import mapping
from parallelvars.checkpoint.registry import component_name as _component_name
from parallelvars.errors import CheckpointWriteError, InvalidEntryError

__all__ = [
    "CHUNK_BYTES",
    "KEPT_IMAGE_BYTES",
    "MAX_COMPACT_LINKS",
    "Chunks",
    "FilePlan",
    "Metadata",
    "SpilledImage",
    "Variable",
    "encode_attribute",
]

_MAX_MESSAGE = 0xFFFF
_GROUP_MARK = 1 << 62  # (a plain group's link to a group: its address plus this, see _Columns)
_COMPACT_ATTRS = 8  # HDF5's default attribute phase change: 8 in the header ...
_WIDE_ATTRS = 32  # ... the writer's for groups of more (see h5io/write.py)
_DEFAULT_LINKS = 8  # HDF5's default link phase change (8 compact, 6 dense)
# The most links a generated group keeps in its header: HDF5 finds a name among compact links
# by scanning them, so opening each of n children costs n^2 (10,000 children: 10.8 s where
# libhdf5's dense storage takes 1.8 s); up to this many it costs milliseconds.
MAX_COMPACT_LINKS = 1024
#: The most bytes of metadata :meth:`FilePlan.chunks` makes at once (one object header of more
#: is a chunk of its own: a header is at most a few KiB, a symbol table's group 40 bytes a link).
CHUNK_BYTES = 4 << 20
#: A structure whose metadata image is at most this many bytes keeps the image in memory for
#: its repeated saves (``h5raw/native.py``: written again as it is, its changing headers
#: re-encoded); one of more keeps it in an unnamed file beside the checkpoint
#: (:class:`SpilledImage`), written there a chunk at a time and copied by the kernel.
KEPT_IMAGE_BYTES = 64 << 20


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


class Chunks:
    """A generated file's metadata a chunk at a time (:meth:`FilePlan.chunks`): iterating
    gives the ``(offset, bytes)`` chunks of the metadata image in file order, each made when
    reached (once: the iteration is the plan's); ``file_size``, ``documents`` (each
    document's data offset) and ``data`` (the data the plan lays itself, ``(offset, bytes)``:
    byte-string components' heap references) are known at once."""

    def __init__(
        self,
        windows: Iterator[tuple[int, bytes | memoryview]],
        file_size: int,
        documents: dict[str, int],
        data: list[tuple[int, bytes | memoryview]],
    ) -> None:
        self._windows = windows
        self.file_size = file_size
        self.documents = documents
        self.data = data

    def __iter__(self) -> Iterator[tuple[int, bytes | memoryview]]:
        return self._windows


class SpilledImage:
    """A metadata image kept for repeated saves outside memory: an unnamed temporary file in
    ``folder`` (the checkpoint's own; ``tempfile.TemporaryFile``: opened ``O_TMPFILE``, never
    linked, where the folder's file system has it, else created and unlinked at once), gone
    when the image is dropped or the process ends, and copied into each later file by the
    kernel (``copy_file_range``; read and written a chunk at a time where that is refused).
    Made by :meth:`write`, as the first file's metadata is written."""

    def __init__(self, size: int, folder: str) -> None:
        import tempfile

        self.size = size
        self._file = tempfile.TemporaryFile(dir=folder)  # noqa: SIM115 (kept open)

    @classmethod
    def write(cls, chunks: Chunks, size: int, fd: int, folder: str | None) -> SpilledImage | None:
        """Write the image of ``size`` bytes that ``chunks`` lay into ``fd``, a chunk at a
        time as each is made, and (given a ``folder``) into a spilled image there too: that
        image, or None when none was asked for or it could not be written (an ``OSError``:
        its disk full, the folder refusing a temporary file): the file is written all the
        same, its image made again by the next save."""
        from parallelvars._fileio import pwrite_all

        spilled: SpilledImage | None = None
        if folder is not None:
            try:
                spilled = cls(size, folder)
            except OSError:
                spilled = None
        try:
            for at, data in chunks:
                view = memoryview(data)
                pwrite_all(fd, view, at)
                if spilled is not None:
                    try:
                        pwrite_all(spilled._file.fileno(), view, at)
                    except OSError:
                        spilled._file.close()
                        spilled = None
        except BaseException:
            if spilled is not None:
                spilled._file.close()
            raise
        return spilled

    def write_to(self, fd: int) -> None:
        """Copy the image to ``fd`` at offset 0."""
        from parallelvars._fileio import pwrite_all

        src = self._file.fileno()
        at = 0
        copy = getattr(os, "copy_file_range", None)
        while at < self.size and copy is not None:
            try:
                done = copy(src, fd, self.size - at, at, at)
            except OSError:
                break
            if done <= 0:
                break
            at += done
        while at < self.size:
            data = os.pread(src, min(CHUNK_BYTES, self.size - at), at)
            if not data:
                err = CheckpointWriteError(
                    "the metadata image kept for repeated saves is cut short",
                    expected=f"{self.size} bytes",
                    found=f"{at} bytes",
                    hint="the last good file at this path is unchanged",
                )
                err.errno, err.strerror = errno.EIO, os.strerror(errno.EIO)
                raise err
            pwrite_all(fd, memoryview(data), at)
            at += len(data)

    def __del__(self) -> None:  # (dropped from the cache: the file goes with it)
        file = getattr(self, "_file", None)
        if file is not None:
            file.close()


class _Offsets(Mapping[str, list[int | None]]):
    """:attr:`FilePlan.offsets`: each variable's components' data offsets (None: no data), by
    path, made when asked from the plan's columns (each variable's way number and first
    dataset, the datasets' offsets), not held as a list per variable. Asked in the variables'
    order (as every caller does), a path is found without a table; the first path asked out of
    order makes one.

    A way (one per layout, and per count of components linked to other files) is all that is
    kept of a layout: ``(code, n, picks)``, code 0 (its components each of its own dataset, in
    order: a slice), 1 (all one dataset, a mirrored variable's stored once: one offset
    repeated), 2 (``picks``: each component's dataset), 3 (no offsets: byte strings, read
    through HDF5, none in the index as the libhdf5 writer's; or linked to other files)."""

    def __init__(
        self,
        paths: list[str],
        way_of: array[int],
        ways: list[tuple[int, int, list[int]]],
        first: array[int],
        ds_offset: np.ndarray,
    ) -> None:
        self._paths = paths
        self._way_of = way_of
        self._ways = ways
        self._first = first
        self._off = array("q", np.ascontiguousarray(ds_offset, np.int64).tobytes())
        self._next = 0
        self._index: dict[str, int] | None = None

    @staticmethod
    def way(lay: _Layout | int) -> tuple[int, int, list[int]]:
        """The way of a layout (or of a count of components linked to other files)."""
        if isinstance(lay, int):
            return (3, lay, [])
        cd = lay.comp_ds
        code = 3 if lay.vlen else 0 if cd == list(range(lay.n)) else 1 if not any(cd) else 2
        return (code, lay.n, list(cd))

    def __getitem__(self, path: str) -> list[int | None]:
        k = self._next
        paths = self._paths
        if k >= len(paths) or paths[k] != path:
            if self._index is None:
                self._index = {p: i for i, p in enumerate(paths)}
            k = self._index[path]  # (KeyError: not a variable of the plan)
        self._next = k + 1
        code, n, picks = self._ways[self._way_of[k]]
        start = self._first[k]
        if code == 0:
            out: list[Any] = self._off[start : start + n].tolist()
        elif code == 1:
            return [None if (o := self._off[start]) < 0 else o] * n
        elif code == 2:
            off = self._off
            out = [off[start + d] for d in picks]
        else:
            return [None] * n
        if -1 in out:
            return [None if o < 0 else o for o in out]
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


def _leaves_only(links: list[Any]) -> bool:
    """Whether a group's ``links`` (at least one) are all leaves (``~row``, see
    :meth:`FilePlan._named`)."""
    return type(links[0]) is int and _JUST_INT.issuperset(map(type, links)) and max(links) < 0


_JUST_INT = frozenset({int})


def _dims(shapes: list[tuple[int, ...]], ndim: int, dtype: type) -> np.ndarray:
    """Shapes of ``ndim`` dimensions each as a ``(len(shapes), ndim)`` array (read as one run
    of ints: a few times faster than numpy's conversion of a list of tuples)."""
    count = len(shapes)
    flat: np.ndarray = np.fromiter(chain.from_iterable(shapes), dtype, count * ndim)
    return flat.reshape(count, ndim)


class _Columns:
    """What :meth:`FilePlan._window` reads of the plan, made once per :meth:`FilePlan.chunks`:
    per kind of header, the objects' addresses (increasing) and their fields' sources."""

    def __init__(self) -> None:
        self.individual: list[_Group] = []
        self.individual_at = np.zeros(0, np.int64)
        # per layout: (layout, addresses, first strings, shapes, first datasets)
        self.layouts: list[tuple[_Layout, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.plain: list[tuple[Template, np.ndarray, np.ndarray]] = []  # (template, at, links)
        self.datasets: list[tuple[int, np.ndarray, np.ndarray]] = []  # (template, rows, at)
        self.special: list[_Dataset] = []
        self.special_at = np.zeros(0, np.int64)
        self.starts = np.zeros(0, np.int64)  # every object's address


class FilePlan:
    """The layout of one native file (see the module docstring).

    The structure is kept column-wise: every component dataset is a row of the dataset
    columns (its template, shape, bytes; its address and data offset are computed for all
    rows at once), and every variable is a row of the variable columns (path, layout, first
    dataset, shape, row string; a variable whose group is made from its layout's template is
    linked from its parent by its row number, ``~row``). Python objects are made per group and
    per variable only for what the file needs on its own."""

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
        self._ds_key = array("q")
        self._ds_shape: list[tuple[int, ...]] = []
        self._ds_nbytes = array("q")
        self._special: dict[int, _Dataset] = {}
        self._keys: dict[tuple[Any, ...], int] = {}  # a dataset template's key -> its number
        self._key_list: list[tuple[Any, ...]] = []
        self._dataset_templates: dict[int, Template] = {}
        self._layouts: dict[Any, _Layout] = {}
        self._documents: dict[str, int] = {}  # a document -> its dataset number
        # the variables' columns, in order: each one's path (the caller's string), layout (or,
        # linked to other files, its number of components) and first dataset
        self._paths: list[str] = []
        self._row_layout: list[_Layout | int] = []
        self._row_number = array("q")  # (its layout's number; -1: linked to other files)
        self._row_first = array("q")
        # ... and of a variable whose group is made from its layout's template (a leaf: linked
        # from its parent as ``~row``, no object of its own), its shape and row string
        self._row_shape: list[tuple[int, ...]] = []
        self._row_str: list[str | None] = []
        self._row_address: np.ndarray = np.zeros(0, np.int64)  # (-1: not a leaf)
        # the rows whose group is made, or became a parent, after the row was linked as a leaf:
        # ``~row`` -> its group (encoded on its own)
        self._row_group: dict[int, _Group] = {}
        self._group_starts: np.ndarray = np.zeros(0, np.int64)  # every group's, in file order
        self._fill: int | None = None  # encoding a template: the byte every field is made of
        # byte-string components: (dataset number, its elements) and, once laid out, the
        # (data offset, references) of each
        self._vlen: list[tuple[int, Sequence[bytes]]] = []
        self._vlen_data: list[tuple[int, bytes]] = []
        self._ds_address: np.ndarray = np.zeros(0, np.int64)
        # the global heap: its address, its collections (laid out by _layout) and the objects'
        # bytes joined; after release() only the root's strings' references are kept
        self._heap_at = 0
        self._heap: Collections | None = None
        self._heap_data = b""
        self._kept_refs: np.ndarray | None = None
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
        group = self._by_path[path] = _Group.inner()
        parent.links.append((name.encode("utf-8"), group))
        return group

    def _named(self, links: list[Any]) -> list[tuple[bytes, Any]]:
        """A group's ``links`` as ``(name, target)``: a leaf's link is held as its row alone
        (``~row``: its name is the last part of its path), every other one as the pair."""
        paths = self._paths
        return [
            (paths[~k].rpartition("/")[2].encode("utf-8"), k) if type(k) is int else k
            for k in links
        ]

    def _names(self, links: list[Any]) -> tuple[str | bytes, ...]:
        """What tells a group's ``links``' names apart from another's (see :meth:`_named`): a
        leaf's name as its path's string, every other one as its bytes (groups whose links
        are named the same but linked otherwise are only told apart)."""
        paths = self._paths
        return tuple([paths[~k].rpartition("/")[2] if type(k) is int else k[0] for k in links])

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
        layout.number = len(self._layouts)
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
            self._add_row(path, n, first, shape, None)
            return layout
        if group is None:  # (the common case: a leaf, linked from its parent by its row)
            parent_path = path.rpartition("/")[0]
            parent = by_path.get(parent_path) or self._group_of(parent_path)
            parent.links.append(~len(self._paths))  # (a leaf: its row alone, see _named)
        else:  # (made already as the parent of an earlier variable: encoded on its own)
            group.layout = layout
            group.shape = shape
            group.row = row_bytes
            group.first_ds = first
            group.comp_at = len(group.links)
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
            self._ds_key.extend(keys)
            count = len(keys)
            self._ds_shape += [shape] * count
            self._ds_nbytes.extend([nbytes] * count)
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
        self._add_row(path, layout, first, shape, row)
        return layout

    def _add_row(
        self,
        path: str,
        layout: _Layout | int,
        first: int,
        shape: tuple[int, ...],
        row: str | None,
    ) -> None:
        self._paths.append(path)
        self._row_layout.append(layout)
        self._row_number.append(-1 if isinstance(layout, int) else layout.number)
        self._row_first.append(first)
        self._row_shape.append(shape)
        self._row_str.append(row)

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
        # per class whose records take the few operations: its layout, the layout's number and
        # per shape (as the records give it) the columns a record of it adds (see _columns),
        # None until its first record
        fast: list[tuple[_Layout, int, dict[Any, Any]] | None] = [None] * count
        by_path = self._by_path
        ds_key, ds_shape, ds_nbytes = self._ds_key, self._ds_shape, self._ds_nbytes
        paths = self._paths
        add_path, add_layout, add_lid, add_first, add_shape, add_str = (
            paths.append,
            self._row_layout.append,
            self._row_number.append,
            self._row_first.append,
            self._row_shape.append,
            self._row_str.append,
        )
        # the records of a group come one after another: its parent's path and links kept
        parent_path: str | None = None
        plink = cast(Any, None)  # (its links' append)
        for k, (var, sh, c) in enumerate(zip(variables, shared, ids, strict=True)):
            if not k % FREEZE_STEP:
                freeze_made_so_far()  # (the plan's objects live until its image is made)
            f = fast[c]
            path = var.path
            if f is None or path in by_path:
                layout = of_class[c] = add(var, sh, None, None, of_class[c])
                if f is None and not (layout.sharded or layout.vlen):
                    fast[c] = (layout, layout.number, {})
                parent_path = None  # (it may have given a leaf group lists of its own)
                continue
            layout, number, of_shape = f
            raw = var.shape
            try:
                shape, keys, shapes, nbytes = of_shape[raw]
            except (KeyError, TypeError):
                shape, keys, shapes, nbytes = made = self._columns(layout, raw)
                if type(raw) is tuple:
                    of_shape[raw] = made
            at = path.rpartition("/")[0]
            if at != parent_path:
                parent = by_path.get(at) or self._group_of(at)
                parent_path, plink = at, parent.links.append
            plink(~len(paths))  # (a leaf: its row alone)
            add_first(len(ds_key))
            ds_key.extend(keys)
            ds_shape += shapes
            ds_nbytes.extend(nbytes)
            add_path(path)
            add_layout(layout)
            add_lid(number)
            add_shape(shape)
            add_str(var.attrs.get(_ROW_STRING))  # (a string or None: its class's first's)

    def _columns(
        self, layout: _Layout, raw: Any
    ) -> tuple[tuple[int, ...], array[int], list[tuple[int, ...]], array[int]]:
        """What a record of ``layout`` (neither sharded nor of byte strings) and of shape
        ``raw`` adds to the columns: its shape, and its datasets' template numbers, shapes and
        bytes of data (its datasets' template numbers made when first asked)."""
        shape = tuple(map(int, raw))
        nbytes = math.prod(shape) * layout.itemsize
        keys = layout.ds_keys[nbytes > 0]
        if keys is None:
            keys = layout.ds_keys[nbytes > 0] = [
                self._component_key(layout, len(shape), nbytes, links) for links in layout.links
            ]
        n = len(keys)
        return shape, array("q", keys), [shape] * n, array("q", [nbytes] * n)

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
        g.links = list(g.links)
        g.links[g.comp_at : g.comp_at] = [
            (name, g.first_ds + d) for name, d in zip(layout.names, layout.link_ds, strict=True)
        ]
        g.layout = None

    def _row_group_of(self, r: int, group: _Group | None = None) -> _Group:
        """Variable ``r``'s group as an object (``group``: the one made there as the parent of
        a later variable), encoded on its own: linked from its parent as ``~r`` still."""
        g = _Group() if group is None else group
        lay = self._row_layout[r]
        assert not isinstance(lay, int)
        row = self._row_str[r]
        g.layout, g.shape, g.first_ds, g.comp_at = lay, self._row_shape[r], self._row_first[r], 0
        g.row = None if row is None else row.encode("utf-8")
        if group is None:
            self._expand(g)
        self._row_group[~r] = g
        return g

    def _leaves(self) -> np.ndarray:
        """Check that no path is written twice, give the variables linked as leaves that became
        parents (a later variable's path goes through theirs) or whose header a template cannot
        make their own group, and return which rows are leaves (a bool per row)."""
        paths = self._paths
        unique = set(paths)
        made = unique.intersection(self._by_path)  # (variables whose path is a group's too)
        if len(unique) != len(paths):
            seen: set[str] = set()
            for path in paths:
                if path in seen:
                    raise InvalidEntryError("is written twice", variable=path)
                seen.add(path)
        leaf = np.ones(len(paths), bool)
        by_path = self._by_path
        promoted: dict[int, set[int]] = {}  # a parent (by id) -> the groups it links twice
        parents: dict[int, _Group] = {}
        row_layout = self._row_layout
        del unique
        for r in [r for r, path in enumerate(paths) if path in made] if made else []:
            path, lay = paths[r], row_layout[r]
            g = by_path[path]
            leaf[r] = False
            if g.layout is None and type(lay) is not int:  # (a leaf made a parent after)
                self._row_group_of(r, g)
                parent = self._by_path[path.rpartition("/")[0]]
                parents[id(parent)] = parent
                promoted.setdefault(id(parent), set()).add(id(g))
        for key, twice in promoted.items():  # (each linked where its variable was, once)
            parent = parents[key]
            if parent.layout is not None:  # (a variable too: its components stay where they were)
                before = parent.links[: parent.comp_at]
                parent.comp_at -= sum(type(k) is not int and id(k[1]) in twice for k in before)
            parent.links = [k for k in parent.links if type(k) is int or id(k[1]) not in twice]
        self._by_path = {}  # (the groups by path: read while the variables are added only)
        # each row's layout's number (-1: linked to other files)
        layouts = list(self._layouts.values())
        self._row_lid = lid = np.frombuffer(self._row_number, np.int64).copy()
        self._row_number = array("q")
        for k in unique_ints(lid[leaf])[0].tolist():
            lay = layouts[k]
            # a variable's group whose header continues in further chunks (their continuation
            # messages hold addresses), or of more links than a header keeps (a symbol
            # table): encoded on its own
            if len(self._group_template(lay).chunks) > 1 or len(lay.names) > MAX_COMPACT_LINKS:
                for r in np.flatnonzero(leaf & (lid == k)).tolist():
                    self._row_group_of(r)
                    leaf[r] = False
        return leaf

    # ------------------------------------------------------------------ layout
    def _layout(self, align: int) -> None:
        # 1. the groups in file order (depth first, each before its children): a variable's
        # group made from its layout's template (a leaf) as ``~row``, every other group as an
        # object; a variable that is also a parent, or whose header continues in further
        # chunks (their continuation messages hold addresses), is encoded on its own
        leaf = self._leaves()
        root = self._root
        # the groups made as objects (``made``), in file order, and each one's place among
        # all the groups; the leaves, in file order
        made: list[_Group] = [root]
        places = [0]
        leaves: list[int] = []
        add_leaf = leaves.append
        row_group = self._row_group
        # (a stack of the links still to visit of each group on the way: a leaf is added
        # without a visit of its own, the links of a group that links to leaves only at once)
        stack = [iter(root.links)]
        while stack:
            for link in stack[-1]:
                t: Any = link if type(link) is int else link[1]
                kind = type(t)
                if kind is int:
                    if t >= 0:  # (a dataset)
                        continue
                    own = row_group.get(t) if row_group else None
                    if own is None:
                        add_leaf(t)
                        continue
                    t = own
                elif kind is not _Group:  # (an external link)
                    continue
                places.append(len(made) + len(leaves))
                made.append(t)
                if t.layout is not None:  # a variable that is also a parent
                    self._expand(t)
                links = t.links
                if not links:
                    continue
                if not row_group and _leaves_only(links):
                    leaves += links
                    continue
                stack.append(iter(links))
                break
            else:
                stack.pop()
        self._groups = made
        freeze_made_so_far()
        # groups without attributes whose links have the same names (the groups of a
        # variable's slots...) are made from one template (by their numbers in ``made``)
        plain: dict[tuple[str | bytes, ...], list[int]] = {}
        linking_out = self._linking_out
        leaf_name = [path.rpartition("/")[2] for path in self._paths].__getitem__
        for k, g in enumerate(made):
            links = g.links
            if len(links) > MAX_COMPACT_LINKS:
                g.table = SymbolTable([name for name, _ in self._named(links)])
            elif not g.attrs and g is not root and links and id(g) not in linking_out:
                names = (
                    tuple(map(leaf_name, map(operator.invert, links)))
                    if _leaves_only(links)
                    else self._names(links)
                )
                plain.setdefault(names, []).append(k)
        del leaf_name
        templated: list[tuple[Template, list[int]]] = []
        object_sizes = np.full(len(made), -1, np.int64)  # (-1: encoded on its own)
        for members in plain.values():
            if len(members) < 2:
                continue
            tmpl = self._plain_template(made[members[0]])
            if len(tmpl.chunks) > 1:
                continue
            templated.append((tmpl, members))
            object_sizes[members] = tmpl.size
        apart = np.flatnonzero(object_sizes < 0).tolist()  # (encoded on their own)
        self._individual = [made[k] for k in apart]
        # each group's header and table (a leaf: its layout's template's size)
        objects_at = np.array(places, np.int64)
        is_leaf = np.ones(len(made) + len(leaves), bool)
        is_leaf[objects_at] = False
        leaf_at = np.flatnonzero(is_leaf)  # the leaves' places in file order ...
        leaf_rows = ~np.array(leaves, np.int64)  # ... and rows
        del places, leaves, is_leaf
        lid = self._row_lid
        layouts = list(self._layouts.values())
        lay_size = np.array([lay.size for lay in layouts] + [0], np.int64)
        sizes = np.zeros(len(made) + leaf_rows.size, np.int64)
        sizes[leaf_at] = lay_size[lid[leaf_rows]]
        tables: list[_Group] = []
        for k in apart:
            g = made[k]
            size = len(self._encode_group(g)[0])
            if g.table is not None:  # the header, then its symbol table
                g.table_at = size
                size += g.table.size
                tables.append(g)
            object_sizes[k] = size
        sizes[objects_at] = object_sizes
        starts = SUPERBLOCK_SIZE + np.cumsum(sizes) - sizes
        at = SUPERBLOCK_SIZE + int(sizes.sum())
        del sizes, object_sizes
        object_address = starts[objects_at]
        for g, a in zip(made, object_address.tolist(), strict=True):
            g.address = a
        for g in tables:
            g.table_at += g.address
        # (per template: the groups and their addresses)
        self._plain: list[tuple[Template, list[_Group], np.ndarray]] = [
            (tmpl, [made[k] for k in members], object_address[members])
            for tmpl, members in templated
        ]
        row_address = np.full(len(self._paths), -1, np.int64)
        row_address[leaf_rows] = starts[leaf_at]
        for t, g in row_group.items():
            row_address[~t] = g.address
        self._row_address = row_address
        self._group_starts = starts
        self._leaf_rows = leaf_rows  # (in file order)
        assert leaf_rows.size == int(np.count_nonzero(leaf))
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
        # (each leaf's strings: its layout's before its row string, the row string, its
        # layout's after it)
        per = np.array(
            [
                len(lay.strings[0]) + len(lay.strings[1]) + (lay.sig.row_at is not None)
                for lay in layouts
            ]
            + [0],
            np.int64,
        )
        count = per[lid[leaf_rows]]
        row_fs = np.full(len(self._paths), -1, np.int64)
        row_fs[leaf_rows] = np.cumsum(count) - count
        self._row_fs = row_fs
        del count
        objects = ObjectBytes()
        self._leaf_strings(objects, layouts, per[:-1], leaf_rows)
        strings = objects.pending  # (joined a batch at a time)
        full = objects.JOIN_BATCH
        owners: list[tuple[_Attr, int]] = []
        holders: list[_Group | _Dataset] = [*self._individual, *self._special.values()]
        for obj in holders:
            for a in obj.attrs:
                if a.strings is not None:
                    owners.append((a, len(objects)))
                    strings.extend(a.strings)
                    if len(strings) >= full:
                        objects.spill()
        vlen_at = []  # each byte-string component's first element among the heap objects
        for _, elements in self._vlen:
            vlen_at.append(len(objects))
            strings.extend(elements)
            objects.spill()
        maps = [ds for ds in self._special.values() if ds.mapping is not None]
        first_map = len(objects)
        strings.extend(ds.mapping or b"" for ds in maps)
        lengths, data = objects.joined()
        # (laid out now, each object's reference made when asked: the collections' bytes are
        # made a window at a time, :meth:`_windows`, from the objects' bytes kept joined)
        heap = Collections(lengths, at)
        del lengths
        self._heap_at, self._heap, self._heap_data = at, heap, data
        del objects, strings, data
        self._owners = owners
        for k, ds in enumerate(maps):
            ref = heap.refs(np.array([first_map + k]))[0].tobytes()
            ds.heap_ref = (int.from_bytes(ref[4:12], "little"), int.from_bytes(ref[12:], "little"))
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
        # each variable's components' offsets (None: no data), read from the columns when asked
        # (of the layouts, only their ways are kept: see _Offsets)
        ways = [_Offsets.way(lay) for lay in self._layouts.values()]
        way_of = self._row_lid.copy()
        linked = np.flatnonzero(way_of < 0)  # (linked to other files: a way per count)
        if linked.size:
            by_count: dict[int, int] = {}
            for r in linked.tolist():
                n = self._row_layout[r]
                assert isinstance(n, int)
                if n not in by_count:
                    by_count[n] = len(ways)
                    ways.append(_Offsets.way(n))
                way_of[r] = by_count[n]
        self.offsets: Mapping[str, list[int | None]] = _Offsets(
            self._paths, array("q", way_of.tobytes()), ways, self._row_first, ds_offset
        )
        self._vlen_data = [
            (int(ds_offset[number]), heap.refs(np.arange(at, at + len(elements))).tobytes())
            for (number, elements), at in zip(self._vlen, vlen_at, strict=True)
            if elements
        ]
        self._vlen = []

    def _leaf_strings(
        self, objects: ObjectBytes, layouts: list[_Layout], per: np.ndarray, leaf_rows: np.ndarray
    ) -> None:
        """Add the heap strings of the leaves ``leaf_rows`` (in file order) to ``objects``:
        each leaf's its layout's before its row string, the row string, its layout's after it
        (all before it when it has none; ``per``: how many, per layout), a batch of leaves at
        a time: a batch's bytes joined from each layout's strings joined once and the leaves'
        row strings, their lengths laid from each layout's in numpy."""
        has_row = [lay.sig.row_at is not None for lay in layouts]
        before = [b"".join(lay.strings[0]) for lay in layouts]
        after = [b"".join(lay.strings[1]) for lay in layouts]
        # each layout's strings' lengths one after another (its row string's as 0: put in per
        # leaf), where each layout's start, and where its row string is among them (-1: none)
        flat = np.array(
            [
                n
                for lay, row in zip(layouts, has_row, strict=True)
                for n in [*map(len, lay.strings[0]), *([0, *map(len, lay.strings[1])] * row)]
            ],
            np.int64,
        )
        lay_first = np.cumsum(per) - per
        row_pos = np.array(
            [len(lay.strings[0]) if row else -1 for lay, row in zip(layouts, has_row, strict=True)],
            np.int64,
        )
        row_str, lid = self._row_str, self._row_lid
        # (every leaf has a layout: its number indexes the lists above)
        assert not leaf_rows.size or int(lid[leaf_rows].min()) >= 0
        step = max(1, objects.JOIN_BATCH // 3)  # (three pieces a leaf joined)
        for lo in range(0, leaf_rows.size, step):
            rows = leaf_rows[lo : lo + step]
            lids = lid[rows]
            lid_list = lids.tolist()
            texts = [
                (b"" if (t := row_str[r]) is None else t.encode("utf-8")) if has_row[k] else b""
                for r, k in zip(rows.tolist(), lid_list, strict=True)
            ]
            parts: list[bytes] = [b""] * (3 * len(texts))
            parts[0::3] = map(before.__getitem__, lid_list)
            parts[1::3] = texts
            parts[2::3] = map(after.__getitem__, lid_list)
            count = per[lids]
            starts = np.cumsum(count) - count
            within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(starts, count)
            lengths = flat[np.repeat(lay_first[lids], count) + within]
            pos = row_pos[lids]
            row = pos >= 0
            text_lengths = np.fromiter(map(len, texts), np.int64, len(texts))
            lengths[(starts + pos)[row]] = text_lengths[row]
            objects.add_joined(lengths, b"".join(parts))

    # ------------------------------------------------------------------ encoding
    def _attr_message(self, a: _Attr) -> bytes:
        data = a.data if a.strings is None else self._string_refs(a)
        body = msg.attribute(a.name, a.dtype, a.space, data)
        if len(body) > _MAX_MESSAGE:
            raise msg.Unsupported(f"attribute {a.name!r} of {len(body)} bytes (64 KiB at most)")
        return body

    def _string_refs(self, a: _Attr) -> bytes:
        assert a.strings is not None
        if self._fill is not None or (self._heap is None and self._kept_refs is None):
            return bytes((self._fill or 0,)) * (16 * len(a.strings))
        first = self._ref_start[id(a)]
        return self._refs(np.arange(first, first + len(a.strings))).tobytes()

    def _refs(self, objects: np.ndarray) -> np.ndarray:
        """The heap references of ``objects`` (numbers among the heap objects, any shape): of
        the collections laid out, or after :meth:`release` of the root's strings kept."""
        heap, kept = self._heap, self._kept_refs
        if heap is None:
            assert kept is not None
            return kept[objects]
        return heap.refs(objects)

    def _address(self, target: Any) -> int:
        """A link target's address (a group or a dataset by number)."""
        if isinstance(target, int):
            if target < 0:  # (a leaf, by its row)
                ra = self._row_address
                return max(int(ra[~target]), 0) if ~target < len(ra) else 0
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

    def _place_groups(
        self,
        image: np.ndarray,
        layout: _Layout,
        addresses: np.ndarray,
        first: np.ndarray,
        shapes: np.ndarray,
        first_ds: np.ndarray,
    ) -> None:
        """The headers of variable groups of one layout, written into ``image`` at
        ``addresses``: the template's rows with every group's fields (its first string's
        number, its shape, its first dataset's number) put in column-wise."""
        sig = layout.sig
        tmpl = self._group_template(layout)
        count = addresses.size
        per = [len(a.strings or ()) if k != sig.shape_at else 0 for k, a in enumerate(sig.attrs)]
        before = sum(per[: sig.shape_at])  # string references before the shape
        refs = self._refs(first[:, None] + np.arange(sum(per))).reshape(count, -1)
        links = self._ds_address[first_ds[:, None] + np.asarray(layout.link_ds, np.int64)]
        fields = np.hstack(
            (
                refs[:, : 16 * before],
                shapes.view(np.uint8).reshape(count, -1),
                refs[:, 16 * before :],
                links.astype("<u8").reshape(count, -1).view(np.uint8).reshape(count, -1),
            )
        )
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

    def _place_datasets(
        self, image: np.ndarray, number: int, rows: np.ndarray, addresses: np.ndarray
    ) -> None:
        """The headers of the component datasets ``rows`` of one template, written into
        ``image`` at ``addresses``."""
        tmpl = self._dataset_template(number)
        ndim = self._key_list[number][1]
        count = rows.size
        shapes = self._ds_shape
        dims = _dims([shapes[i] for i in rows.tolist()], ndim, np.uint64)
        columns = [dims, dims]
        if self._key_list[number][2]:  # stored data: its offset and size
            columns.append(np.maximum(self._ds_offset[rows], 0).reshape(count, 1))
            columns.append(np.asarray(self._ds_nbytes, np.int64)[rows].reshape(count, 1))
        fields = np.hstack(columns).astype("<u8").view(np.uint8).reshape(count, -1)
        place_rows(image, addresses, tmpl, fields)

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
            for name, t in self._named(g.links)
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
        links = self._named(g.links)
        if any(isinstance(t, _External) for _, t in links):
            raise msg.Unsupported(
                f"a group of {len(g.links)} links with external links (a symbol table holds "
                "hard links only)"
            )
        table = g.table if g.table is not None else SymbolTable([n for n, _ in links])
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
        documents' ``crc32c`` attributes, as one image (the chunks of :meth:`chunks` laid
        one after another)."""
        chunked = self.chunks(capacities, values, document_checksums)
        image = np.empty(self.metadata_size, np.uint8)
        for at, data in chunked:
            image[at : at + len(data)] = np.frombuffer(data, np.uint8)
        return Metadata([(0, image.data), *self._vlen_data], chunked.file_size, chunked.documents)

    def chunks(
        self,
        capacities: Mapping[str, int] | None = None,
        values: Mapping[str, Any] | None = None,
        document_checksums: Mapping[str, int] | None = None,
    ) -> Chunks:
        """:meth:`metadata` a few MiB at a time: an iterable of ``(offset, bytes)`` pieces of
        the metadata image, in file order, each at most :data:`CHUNK_BYTES` long (but one
        object header larger than that, alone) and each made when the iteration reaches it,
        so that a writer or a check holds one chunk and the plan's columns, never the whole
        image. The file's size and the documents' offsets are known at once; the data the
        plan lays itself (byte-string components' references) are :attr:`Chunks.data`."""
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
        self._file_size = file_size
        self.checksum_spans: list[
            tuple[int, int]
        ] = []  # (each header chunk encoded on its own: start, checksum)
        return Chunks(self._windows(), file_size, documents, list(self._vlen_data))

    def _windows(self) -> Iterator[tuple[int, bytes | memoryview]]:
        """The metadata image in windows (see :meth:`chunks`): every object header starting
        in a window is made into that window's buffer (a window ends where an object starts),
        the headers made from templates a slice of rows at a time, the others encoded one by
        one and their chunks' checksums computed together; then the global heap, in slices of
        the collections already made."""
        kinds = self._window_columns()
        heap_at, heap, data = self._heap_at, self._heap, self._heap_data
        assert heap is not None
        bounds = np.append(kinds.starts, heap_at)  # (every object's start, the heap's)
        lo = 0
        while lo < heap_at:
            # the window: up to the last object start within CHUNK_BYTES (one object at least)
            hi = int(bounds[np.searchsorted(bounds, lo + CHUNK_BYTES, "right") - 1])
            if hi <= lo:
                hi = int(bounds[np.searchsorted(bounds, lo, "right")])
            yield lo, self._window(kinds, lo, hi)
            lo = hi
        # the heap: collections made a few MiB at a time (one collection at least), each
        # buffer given in pieces of at most CHUNK_BYTES
        ends = np.cumsum(heap.sizes)
        lo = 0
        while lo < heap.count:
            made = int(ends[lo - 1]) if lo else 0
            hi = max(lo + 1, int(np.searchsorted(ends, made + CHUNK_BYTES, "right")))
            view = memoryview(heap.image(data, lo, hi))  # type: ignore[arg-type]
            for k in range(0, len(view), CHUNK_BYTES):
                yield heap_at + made + k, view[k : k + CHUNK_BYTES]
            lo = hi

    def _window_columns(self) -> _Columns:
        """What making a window needs of the plan, as columns: each object's address, and
        per layout, plain template and dataset template the rows' fields' sources."""
        cols = _Columns()
        individual = self._individual
        cols.individual = individual
        cols.individual_at = np.fromiter((g.address for g in individual), np.int64, len(individual))
        rows = self._leaf_rows  # (in file order)
        lids = self._row_lid[rows]
        order = np.argsort(lids, kind="stable")  # (each layout's leaves in file order)
        layouts = list(self._layouts.values())
        bounds = np.searchsorted(lids[order], np.arange(len(layouts) + 1))
        shapes, row_first = self._row_shape, np.asarray(self._row_first, np.int64)
        for k, layout in enumerate(layouts):
            sel = rows[order[bounds[k] : bounds[k + 1]]]
            count = sel.size
            if not count:
                continue
            dims = _dims([shapes[r] for r in sel.tolist()], layout.sig.ndim, np.int64)
            cols.layouts.append(
                (layout, self._row_address[sel], self._row_fs[sel], dims, row_first[sel])
            )
        ds, ra = self._ds_address, self._row_address
        for tmpl, groups, addresses in self._plain:
            count = len(groups)
            width = len(groups[0].links)
            if _leaves_only(groups[0].links):  # (then every group's: their names are the same)
                rows = np.fromiter(chain.from_iterable(g.links for g in groups), np.int64)
                cols.plain.append((tmpl, addresses, ra[~rows].astype("<u8").reshape(count, width)))
                continue
            # each link's target: a dataset by number, a leaf by ~row (their addresses
            # gathered at once), a group by its address (marked by _GROUP_MARK)
            code = np.array(
                [
                    k
                    if type(k) is int
                    else t
                    if type(t := k[1]) is int
                    else _GROUP_MARK + t.address
                    for g in groups
                    for k in g.links
                ],
                np.int64,
            )
            leaf, group = code < 0, code >= _GROUP_MARK
            dataset = ~(leaf | group)
            code[leaf] = ra[~code[leaf]]
            code[dataset] = ds[code[dataset]]
            code[group] -= _GROUP_MARK
            links = code.astype("<u8").reshape(count, -1)
            cols.plain.append((tmpl, addresses, links))
        keys = np.asarray(self._ds_key, np.int64)
        if keys.size:
            order = np.argsort(keys, kind="stable")
            bounds = np.searchsorted(keys[order], np.arange(len(self._key_list) + 1))
            for number in range(len(self._key_list)):
                rows = order[bounds[number] : bounds[number + 1]]
                if rows.size:
                    cols.datasets.append((number, rows, self._ds_address[rows]))
        specials = sorted(self._special.values(), key=lambda d: d.address)
        cols.special = specials
        cols.special_at = np.array([d.address for d in specials], np.int64)
        every = [np.zeros(1, np.int64), self._group_starts, self._ds_address]
        cols.starts = np.concatenate(every)  # (in file order: increasing)
        return cols

    def _window(self, cols: _Columns, lo: int, hi: int) -> memoryview:
        """The metadata image's bytes ``lo`` to ``hi`` (both where an object starts)."""
        image = np.zeros(hi - lo, np.uint8)
        spans: list[tuple[int, int]] = []

        def put(at: int, data: bytes, chunks: list[tuple[int, int]]) -> None:
            image[at - lo : at - lo + len(data)] = np.frombuffer(data, np.uint8)
            spans.extend((at - lo + start, at - lo + end) for start, end in chunks)

        if lo == 0:
            put(0, _superblock(self._file_size, self._root.address), [])
        a, b = np.searchsorted(cols.individual_at, (lo, hi))
        for g in cols.individual[a:b]:
            put(g.address, *self._encode_group(g))
            if g.table is not None:
                targets = [self._address(t if type(t) is int else t[1]) for t in g.links]
                put(g.table_at, g.table.encode(g.table_at, targets), [])
        for layout, addresses, first, shapes, first_ds in cols.layouts:
            if addresses[0] >= hi or addresses[-1] < lo:
                continue
            a, b = np.searchsorted(addresses, (lo, hi))
            if a < b:
                self._place_groups(
                    image, layout, addresses[a:b] - lo, first[a:b], shapes[a:b], first_ds[a:b]
                )
        for tmpl, addresses, links in cols.plain:
            a, b = np.searchsorted(addresses, (lo, hi))
            if a < b:
                fields = links[a:b].view(np.uint8).reshape(b - a, -1)
                place_rows(image, addresses[a:b] - lo, tmpl, fields)
        for number, rows, addresses in cols.datasets:
            a, b = np.searchsorted(addresses, (lo, hi))
            if a < b:
                self._place_datasets(image, number, rows[a:b], addresses[a:b] - lo)
        a, b = np.searchsorted(cols.special_at, (lo, hi))
        for ds in cols.special[a:b]:
            put(ds.address, *self._encode_dataset(ds))
        if spans:
            sums = lookup3_many(image, spans)
            where = np.array([e for _, e in spans], np.int64).reshape(-1, 1) + np.arange(4)
            image[where.reshape(-1)] = sums.astype("<u4").view(np.uint8)
            self.checksum_spans.extend((lo + s, lo + e) for s, e in spans)
        return image.data

    def relink(self, old: bytes, new: bytes) -> int:
        """Give every external link whose file starts with ``old`` the folder ``new`` instead
        (of the same length: the layout stays); the next :meth:`metadata` encodes them so.
        Returns how many links changed."""
        assert len(old) == len(new) and self._groups is not None
        count = 0
        for g in self._groups:  # (the groups made as objects: a leaf links to components only)
            for _, target in self._named(g.links):
                if isinstance(target, _External) and target.file.startswith(old):
                    target.file = new + target.file[len(old) :]
                    count += 1
        return count

    def release(self) -> None:
        """After :meth:`metadata`: drop what only making the image needed (the groups, the
        layouts, the dataset columns, the heap, the header chunks' :attr:`checksum_spans`),
        keeping :attr:`offsets` and what
        :meth:`refresh` re-encodes (the root group, the documents). A plan kept for repeated
        saves then holds tens of bytes per variable instead of its whole structure."""
        documents = set(self._documents.values())
        self._root.links = self._named(self._root.links)  # (its leaves' names: of the paths)
        self._special = {k: ds for k, ds in self._special.items() if k in documents}
        root_links = [t for _, t in self._root.links if isinstance(t, int)]
        # (a root linking to datasets, or to variables' groups made from their templates:
        # their addresses stay)
        keep = max([t + 1 for t in root_links if t >= 0], default=0)
        self._ds_address = self._ds_address[:keep].copy()
        keep = max([~t + 1 for t in root_links if t < 0], default=0)
        row_address = self._row_address[:keep].copy()
        for _, g in self._root.links:
            if isinstance(g, _Group):
                g.links, g.attrs = [], []  # (only its address is read)
        for name in ("_by_path", "_groups", "_layouts", "_plain", "_individual"):
            setattr(self, name, None)
        self._row_shape, self._row_str, self._row_group = [], [], {}
        empty = np.zeros(0, np.int64)
        self._row_fs = self._row_lid = self._leaf_rows = self._group_starts = empty
        self._row_address = row_address
        self._paths, self._row_layout, self._row_first = [], [], array("q")  # (the offsets')
        self._ds_key, self._ds_shape, self._ds_nbytes = array("q"), [], array("q")
        self._ds_offset = np.zeros(0, np.int64)
        self._keep_root_refs()
        self._heap, self._heap_data = None, b""
        self.checksum_spans = []  # (read after :meth:`metadata`, before the release)

    def _keep_root_refs(self) -> None:
        """Keep of the heap references only the root attributes' strings' (what
        :meth:`refresh` encodes again)."""
        start = getattr(self, "_ref_start", None) or {id(a): f for a, f in self._owners}
        rows, owners, at = [], [], 0
        for a in self._root.attrs:
            if a.strings is not None:
                first = start[id(a)]
                rows.append(self._refs(np.arange(first, first + len(a.strings))))
                owners.append((a, at))
                at += len(a.strings)
        self._kept_refs = np.concatenate(rows) if rows else np.zeros((0, 16), np.uint8)
        self._owners = owners
        self._ref_start = {id(a): f for a, f in owners}

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
            if new.strings is None:  # (the same strings: the laid out attribute stays)
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
