"""The *parallel info* of formats that hold a flat list of named tensors, and the entries and
view built from it when such a file is read.

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

``layout`` is ``"components"`` (one stored tensor per component, in order), ``"logical"``
(sharded variables only: the stitched full value is stored once under the variable's key, so a
plain consumer sees the whole tensor, and component ``i`` is read back as the slice
``shard_offsets[i]:shard_offsets[i + 1]`` along ``shard_axis``) or ``"aggregate"`` (on-read SUM
and MEAN variables of several parts: ``keys[0]``, the variable's own key, holds the aggregate a
plain consumer reads as the value, then ``keys[1 + i]`` part ``i``, under
``parallel_component_<i>``, 0 included). Only variables that need it
are listed (a kind other than ``single``, attributes, a dtype the format cannot name, or a key
that does not map back to the path); every other stored tensor is a ``single`` variable whose
path is ``from_key(key, names)``.

That is version 1, one record per variable. Version 2 holds the same fields as columns (our
safetensors writer writes it; :mod:`._info_columns`); :func:`build_entries` reads both.

Everything here reads lazily: a :class:`TensorStore` knows the stored tensors' dtypes and
shapes from the file's header and reads bytes only when a component is asked for.
"""

from __future__ import annotations

import json
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np

from parallelvars._fileio import value_types
from parallelvars._spans import BULK_BYTES
from parallelvars.checkpoint.entry import layout_problem
from parallelvars.errors import CorruptCheckpointError

from ._dtypes import dtype_from_name, is_string_dtype
from ._graph import graph_from_info
from ._info_columns import COLUMNS_VERSION, AttrRows, _corrupt, records_from_columns
from ._names import from_key
from ._store import ByteStore, TensorStore, _region_shape
from ._view import DictView, Entry

INFO_FORMAT = "parallelvars"
INFO_VERSION = 1
_LAYOUTS = ("components", "logical", "aggregate")


_TEXT_OR_NUMBER = frozenset({str, int, float, bool, type(None)})


def _json_copy(value: Any) -> Any:
    """A copy of a parsed JSON value that shares no list or object with it."""
    if type(value) is list:
        if value_types(value) <= _TEXT_OR_NUMBER:  # (a device list, offsets: a shallow copy)
            return value[:]
        return [_json_copy(v) if type(v) in _CONTAINERS else v for v in value]
    if type(value) is dict:
        return {k: _json_copy(v) if type(v) in _CONTAINERS else v for k, v in value.items()}
    return value


_CONTAINERS = (list, dict)


# Held while an entry's attributes are copied at their first use (StoredEntry.attrs): a
# restore reads entries from several threads, and two first uses of one entry must give one
# dict. Later uses read the copy without it.
_FIRST_COPY = threading.Lock()


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
        shared_attrs: bool = False,
    ) -> None:
        self._store = store
        self.path = path
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.kind = kind
        self.num_components = int(num_components)
        self.keys = tuple(keys)
        self.layout = layout
        # ``shared_attrs``: the values of ``attrs`` may be other entries' too (a version-2
        # info's tables): copied at the first use, so no entry's attributes change through
        # another's, as with version 1's own objects per record.
        self._shared: Mapping[str, Any] | None = attrs if shared_attrs else None
        self._own: dict[str, Any] | None = None if shared_attrs else dict(attrs)

    @classmethod
    def _checked(
        cls,
        store: TensorStore,
        path: str,
        dtype: np.dtype,
        shape: tuple[int, ...],
        kind: str,
        num_components: int,
        keys: Sequence[str],
        layout: str,
        attrs: Mapping[str, Any],
        shared_attrs: bool,
    ) -> StoredEntry:
        """An entry of fields already checked and in their own types (a numpy dtype, a tuple
        of ints, an int), as a reader of the parallel info makes one per stored variable:
        the same entry as the constructor's, without converting each field again."""
        self = cls.__new__(cls)
        self._store = store
        self.path = path
        self.dtype = dtype
        self.shape = shape
        self.kind = kind
        self.num_components = num_components
        self.keys = tuple(keys)
        self.layout = layout
        self._shared = attrs if shared_attrs else None
        self._own = None if shared_attrs else dict(attrs)
        return self

    @property
    def attrs(self) -> dict[str, Any]:
        own = self._own
        if own is None:  # the first use: made once, under the lock, whatever the threads
            with _FIRST_COPY:
                own = self._own
                if own is None:
                    own = {
                        k: _json_copy(v) if type(v) in _CONTAINERS else v
                        for k, v in (self._shared or {}).items()
                    }
                    self._own = own  # published whole, before the table is let go
                    self._shared = None
                    if self._table is not None:  # (its own attributes now: kept by the view)
                        self._table._keep(self)
        return own

    @attrs.setter
    def attrs(self, value: Mapping[str, Any]) -> None:
        own = dict(value)
        with _FIRST_COPY:  # not undone by a first copy under way
            self._own, self._shared = own, None
            if self._table is not None:
                self._table._keep(self)

    def _source(self, i: int) -> tuple[str, tuple[int, int, int] | None]:
        self._check_index(i)
        if self.layout == "components":
            return self.keys[i], None
        if self.layout == "aggregate":  # keys[0] holds the aggregate, then every part
            return self.keys[i + 1], None
        axis = int(self.attrs["shard_axis"])
        start = int(self.attrs["shard_offsets"][i])
        return self.keys[0], (axis, start, start + self.component_shape(i)[axis])

    #: The table that made this entry (:class:`EntryTable`), which keeps it once it has
    #: attributes of its own (changed through it, they stay changed); None: held by its view.
    _table: EntryTable | None = None

    #: The view whose read-ahead holds this entry's components (:meth:`StoreView.prefetch`;
    #: set by the view, None: read one by one).
    _view: StoreView | None = None

    def prefetcher(self) -> StoreView | None:
        """The view that reads this entry's components in bulk with others' (a writer's
        :class:`~parallelvars.checkpoint.entry.ReadAhead`), else None."""
        return self._view

    def component(self, i: int) -> np.ndarray:
        out = np.empty(self.component_shape(i), self.dtype)
        self.read_component_into(i, out)
        return out

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        view = self._view
        if view is not None and view._ahead:
            parts = view._ahead.get(self.path)
            # (read ahead: the whole components of this entry, checked against the file's
            # checksums; any other read, or a dtype asked to change, takes the general way)
            if parts is not None and out.dtype == self.dtype and 0 <= i < len(parts):
                part = parts[i]
                if out.shape == part.shape:
                    np.copyto(out, part)
                    return
        key, region = self._source(i)
        # the bytes land as they are stored: an ``out`` of another dtype would take their bits
        self.check_out(i, out, file=self._store.file)
        self._read(key, region, out)

    def value(self) -> np.ndarray:
        if self.layout in ("logical", "aggregate"):  # stored as it is
            out = np.empty(self.shape, self.dtype)
            self._read(self.keys[0], None, out)
            return out
        return super().value()

    def _read(self, key: str, region: tuple[int, int, int] | None, out: np.ndarray) -> None:
        if is_string_dtype(self.dtype):
            out[...] = self._store.read_objects(key, region)
            return
        stored_dtype, stored_shape = self._store.stored(key)
        # The bytes land as the store gives them (native order): an ``out`` of the other byte
        # order takes the values through a native scratch, converted, never the raw bytes.
        native = out.dtype.newbyteorder("=")
        fits = out.flags.c_contiguous and out.dtype.isnative
        target = out if fits else np.empty(out.shape, native)
        sshape = _region_shape(stored_shape, region)
        if stored_dtype == target.dtype and sshape == target.shape:
            buf = target
        else:  # the format stores the bits under another dtype (bfloat16 as uint16, ...)
            buf = target.reshape(-1).view(np.uint8).view(stored_dtype).reshape(sshape)
        self._store.read_into(key, buf, region)
        if target is not out:
            out[...] = target


def _listed_variables(file: str, info: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The records of a version-1 parallel ``info`` (empty for version 2, whose columns the
    caller reads, and for None), the document's format and version checked."""
    variables: Mapping[str, Any] = {}
    if info is not None:
        if not isinstance(info, Mapping) or info.get("format") != INFO_FORMAT:
            raise _corrupt(file, "the parallelvars metadata is not a parallelvars document")
        version = info.get("version")
        if not isinstance(version, int) or version > COLUMNS_VERSION:
            from parallelvars.errors import FormatVersionError

            raise FormatVersionError(
                "the parallelvars metadata has an unknown version",
                file=file,
                expected=f"<= {COLUMNS_VERSION}",
                found=version,
            )
        if version < COLUMNS_VERSION:
            variables = info.get("variables") or {}
            if not isinstance(variables, Mapping):
                raise _corrupt(file, "the parallelvars metadata 'variables' is not an object")
    return variables


def _no_columns(file: str) -> Exception:
    return _corrupt(
        file,
        "the parallelvars metadata has no columns",
        variable="parallelvars/columns",
        expected="a 'columns' object (version 2)",
        found="none",
    )


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
    variables = _listed_variables(file, info)
    stored_keys = list(store.keys())
    present = set(stored_keys)
    claimed: dict[str, str] = {}
    by_first_key: dict[str, Entry] = {}
    checked: dict[Any, Any] = {}
    if info is not None and info.get("version") == COLUMNS_VERSION:
        if "columns" not in info:
            raise _no_columns(file)
        records: Iterator[StoredEntry] = iter(
            _entries_from_columns(store, info["columns"], stored_keys)
        )
    else:
        records = (
            _entry_from_record(store, str(path), rec, present, checked)
            for path, rec in variables.items()
        )
    for recorded in records:
        path = recorded.path
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
            dtype, shape = store.stored(key)  # a tensor the info does not list: as stored
            entry = _stored_entry(
                store,
                from_key(key, names),
                "single",
                np.dtype(dtype),
                tuple(map(int, shape)),
                1,
                "components",
                [key],
                1,
                {},
                None,
            )
        if entry.path in out:
            raise _corrupt(
                file, "two stored tensors map to the same variable path", variable=entry.path
            )
        out[entry.path] = entry
    return out


def _layout_key(kind: Any, shape: tuple[int, ...], n: int, attrs: dict[str, Any]) -> Any:
    """What :func:`layout_problem` reads of a variable that is not sharded, as a key (None:
    not kept: a sharded variable, or values that are not plain text: a hostile list or object
    is no key, and the full validation names it)."""
    if type(kind) is not str or kind == "sharded":
        return None
    aggregation, devices = attrs.get("aggregation"), attrs.get("devices")
    if aggregation is not None and type(aggregation) is not str:
        return None
    if devices is not None:
        if type(devices) is not list or value_types(devices) - {str}:
            return None
        devices = tuple(devices)
    return kind, n, bool(shape) and min(shape) < 0, aggregation, devices


def _entry_from_record(
    store: TensorStore,
    path: str,
    rec: Any,
    present: set[str] | Mapping[str, Any],
    checked: dict[Any, Any] | None = None,
) -> StoredEntry:
    """The entry a parallel-info record describes, every field checked (``checked``: the
    layouts found sound so far, shared by the records of one file)."""
    file = store.file
    if not isinstance(rec, Mapping):
        raise _corrupt(file, "variable record is not an object", variable=path)
    try:
        kind, dtype_name, raw_shape = rec["kind"], rec["dtype"], rec["shape"]
        n, keys = rec["num_components"], rec["keys"]
        layout = rec.get("layout", "components")
        attrs = dict(rec.get("attrs") or {})
    except (KeyError, TypeError, ValueError) as exc:
        raise _corrupt(file, f"variable record is incomplete ({exc})", variable=path) from None
    if type(keys) is not list or value_types(keys) - {str}:
        raise _corrupt(
            file,
            "variable record is incomplete (keys is not of strings)",
            variable=path,
            expected="a list of strings",
            found=repr(keys)[:120],
        )
    dtype, shape, count = _described(
        file, path, kind, dtype_name, raw_shape, n, layout, attrs, checked
    )
    return _stored_entry(store, path, kind, dtype, shape, n, layout, keys, count, attrs, present)


def _described(
    file: str,
    path: str,
    kind: Any,
    dtype_name: Any,
    raw_shape: Any,
    n: Any,
    layout: Any,
    attrs: dict[str, Any],
    checked: dict[Any, Any] | None,
) -> tuple[np.dtype, tuple[int, ...], int]:
    """A variable's fields as the parallel info gives them (either version), checked: its
    dtype, its shape (a list of integers, as the number of components is an integer: ``2.5``,
    ``"3"`` or ``true`` are refused, not converted) and its layout (:func:`_checked_layout`).
    Returns the dtype, the shape and the number of stored tensors the layout takes."""
    dtype = dtype_from_name(dtype_name, file=file, variable=path)
    for what, bad in (
        ("shape", type(raw_shape) is not list or value_types(raw_shape) - {int}),
        ("num_components", type(n) is not int),
    ):
        if bad:
            raise _corrupt(
                file,
                f"variable record is incomplete ({what} is not of integers)",
                variable=path,
                expected="a list of integers" if what == "shape" else "an integer",
                found=repr(raw_shape if what == "shape" else n)[:120],
            )
    shape = tuple(raw_shape)
    return dtype, shape, _checked_layout(file, path, kind, shape, n, layout, attrs, checked)


def _stored_entry(
    store: TensorStore,
    path: str,
    kind: str,
    dtype: np.dtype,
    shape: tuple[int, ...],
    n: int,
    layout: str,
    keys: list[str],
    count: int,
    attrs: Mapping[str, Any],
    present: set[str] | Mapping[str, Any] | None,
    *,
    shared_attrs: bool = False,
) -> StoredEntry:
    """The entry of one variable of the parallel info (either version), its layout checked
    already (:func:`_checked_layout`, which gives ``count``, the stored tensors it takes):
    ``keys`` must be that many, each in ``present`` (None: known to be stored, as version
    2's positions are) and holding the bytes the variable describes (:func:`_check_stored`)."""
    file = store.file
    if len(keys) != count:
        raise _corrupt(
            file,
            "variable record lists the wrong number of stored tensors",
            variable=path,
            expected=count,
            found=len(keys),
        )
    if present is not None:
        for key in keys:
            if key not in present:
                raise _corrupt(
                    file, f"stored tensor {key!r} listed in the metadata is missing", variable=path
                )
    entry = StoredEntry._checked(
        store, path, dtype, shape, kind, n, keys, layout, attrs, shared_attrs
    )
    described = (entry.dtype, entry.shape)
    if kind == "sharded" or list(map(store.stored, keys)) != [described] * len(keys):
        _check_stored(store, entry)  # (the general check, which names what differs)
    return entry


def _checked_layout(
    file: str,
    path: str,
    kind: Any,
    shape: tuple[int, ...],
    n: int,
    layout: Any,
    attrs: dict[str, Any],
    checked: dict[Any, Any] | None,
) -> int:
    """Check a variable's kind, components, attributes and layout (the core's one entry
    validation); the number of stored tensors the layout takes."""
    key = _layout_key(kind, shape, n, attrs) if checked is not None else None
    if key is None or key not in checked:  # type: ignore[operator]
        problem = layout_problem(kind, shape, n, attrs)  # the core's one entry validation
        if problem is not None:
            what, expected, found = problem
            raise _corrupt(file, what, variable=path, expected=expected, found=found)
        if key is not None and len(checked) < 4096:  # type: ignore[arg-type]
            checked[key] = True  # type: ignore[index]
    if layout not in _LAYOUTS:
        raise _corrupt(
            file,
            "variable record has a bad layout",
            variable=path,
            expected="|".join(_LAYOUTS),
            found=repr(layout),
        )
    expected_keys: int = {"components": n, "logical": 1, "aggregate": n + 1}[layout]
    if (layout == "logical" and kind != "sharded") or (layout == "aggregate" and kind != "on_read"):
        raise _corrupt(
            file,
            "variable record lists the wrong number of stored tensors",
            variable=path,
            expected=f"the layout of a {kind} variable",
            found=repr(layout),
        )
    return expected_keys


def _check_stored(store: TensorStore, entry: StoredEntry) -> None:
    """The stored tensors of ``entry`` must hold exactly the bytes its record describes."""
    dtype, shape, kind, layout = entry.dtype, entry.shape, entry.kind, entry.layout
    string = is_string_dtype(dtype)
    stored = store.stored
    for i, key in enumerate(entry.keys):
        sdtype, sshape = stored(key)
        if sdtype == dtype and sshape == shape and kind != "sharded":
            continue  # (stored as described: every layout's tensor has this shape then)
        if layout == "components":
            want = entry.component_shape(i)
        elif layout == "aggregate" and i > 0:
            want = entry.component_shape(i - 1)
        else:
            want = entry.shape
        if string:
            ok = tuple(sshape) == tuple(want)
        else:
            ok = math.prod(sshape) * sdtype.itemsize == math.prod(want) * dtype.itemsize and (
                tuple(sshape[: len(want)]) == tuple(want)
            )
        if not ok:
            raise _corrupt(
                store.file,
                f"stored tensor {key!r} does not match the variable",
                variable=entry.path,
                expected=f"{tuple(want)} {dtype}",
                found=f"{tuple(sshape)} {sdtype}",
            )


#: The attributes :func:`layout_problem` reads: variables alike in these and in the layout
#: columns are checked once.
_LAYOUT_ATTRS = ("aggregation", "devices", "shard_axis", "shard_offsets")


def _entries_from_columns(
    store: TensorStore, columns: Any, stored_keys: list[str]
) -> list[StoredEntry]:
    """The entries a version-2 (column) info describes, in its order, every field checked:
    each distinct layout once, every stored tensor against its variable."""
    file = store.file
    paths, layouts, tables, flat, attrs = records_from_columns(
        file, columns, stored_keys, _LAYOUT_ATTRS
    )
    kinds, dtypes, shapes, counts, layout_names = tables
    groups: dict[Any, tuple[Any, np.dtype, tuple[int, ...], int, str, int]] = {}
    checked: dict[Any, Any] = {}
    out: list[StoredEntry] = []
    pos = 0
    for j, path in enumerate(paths):
        a = attrs[j]
        code = group = layouts[j]  # (equal codes: the same layout and watched attributes)
        known = groups.get(group)
        if known is None:
            kind, n, layout = kinds[code[0]], counts[code[3]], layout_names[code[4]]
            dtype, shape, count = _described(
                file, path, kind, dtypes[code[1]], shapes[code[2]], n, layout, dict(a), checked
            )
            known = groups[group] = (kind, dtype, shape, n, layout, count)
        kind, dtype, shape, n, layout, count = known
        keys = flat[pos : pos + count]
        pos += count
        out.append(
            _stored_entry(
                store, path, kind, dtype, shape, n, layout, keys, count, a, None, shared_attrs=True
            )
        )
    if pos != len(flat):
        raise _corrupt(
            file,
            "the parallel info lists more stored tensors than its variables take",
            variable="parallelvars/columns/keys",
            expected=pos,
            found=len(flat),
        )
    return out


#: A variable's fields as a table row of :class:`EntryTable` shares them with its group: kind,
#: dtype, shape, number of components, layout, stored tensors taken.
_Group = tuple[str, np.dtype, tuple[int, ...], int, str, int]


class EntryTable(Mapping[str, Entry]):
    """The entries of a store as columns, each :class:`StoredEntry` made when asked for.

    Every field was checked when the table was built (:func:`entry_table`); a row holds its
    path, the code of its group (the variables alike in kind, dtype, shape, components and
    layout), where its stored tensors' names begin in one flat list, and its attributes (a
    dict shared by the rows alike in them: each made entry copies it at its first use). An
    entry made is the one object of its variable while someone holds it or once its
    attributes are its own.
    """

    def __init__(
        self,
        store: TensorStore,
        paths: list[str],
        rows: list[int],
        groups: list[_Group],
        group_of: list[int],
        key_at: list[int],
        keys: list[str],
        key_pos: np.ndarray,
        attrs: Sequence[Mapping[str, Any]],
    ) -> None:
        self._store = store
        self._paths = paths  # in the view's order
        self._row = dict(zip(paths, rows, strict=True))
        self._groups = groups
        self._group_of = group_of
        self._key_at = key_at
        self._keys = keys
        self._key_pos = key_pos  # each of ``keys``' position in the store's columns
        self._attrs = attrs  # of the rows the info lists (the others have none)
        # Entries made: while someone holds them (one object per variable), and for good
        # once their attributes are their own (``StoredEntry.attrs``: a change stays).
        self._made: weakref.WeakValueDictionary[str, StoredEntry] = weakref.WeakValueDictionary()
        self._kept: dict[str, StoredEntry] = {}
        self._kept_at: dict[int, StoredEntry] = {}  # (the same, by row)
        self._making = threading.Lock()
        self.view: StoreView | None = None  # (set by the view over it: its entries read ahead)

    def __len__(self) -> int:
        return len(self._paths)

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __contains__(self, key: object) -> bool:
        return key in self._row

    def __getitem__(self, path: str) -> Entry:
        entry = self._found(path)
        if entry is not None:
            return entry
        row = self._row[path]  # (KeyError for a path the table does not list)
        with self._making:  # one entry per variable, whichever threads look it up at once
            entry = self._found(path)
            if entry is None:
                kind, dtype, shape, n, layout, count = self._groups[self._group_of[row]]
                at = self._key_at[row]
                entry = StoredEntry._checked(
                    self._store,
                    path,
                    dtype,
                    shape,
                    kind,
                    n,
                    self._keys[at : at + count],
                    layout,
                    _RowAttrs(self, row),
                    True,
                )
                entry._view = self.view
                entry._table = self
                self._made[path] = entry
        return entry

    def _found(self, path: str) -> StoredEntry | None:
        """The entry made for ``path``: the one kept for good, else one someone holds."""
        entry = self._kept.get(path)
        return self._made.get(path) if entry is None else entry

    def _keep(self, entry: StoredEntry) -> None:
        """Keeps ``entry``, whose attributes are now its own, for good: the table's answers
        for its variable are its from now on."""
        self._kept[entry.path] = entry
        self._kept_at[self._row[entry.path]] = entry

    def summary(self, path: str) -> tuple[str, np.dtype, tuple[int, ...], int, int, Any] | None:
        """The variable at ``path``: kind, dtype, shape, number of components, bytes of all
        its components and attributes (:meth:`attrs_of`: read them, do not change them),
        without an entry made; None when the table has no such variable."""
        row = self._row.get(path)
        if row is None:
            return None
        kind, dtype, shape, n, _, _ = self._groups[self._group_of[row]]
        size = math.prod(shape) * dtype.itemsize
        return kind, dtype, shape, n, size if kind == "sharded" else size * n, self.attrs_of(row)

    def described(self, paths: Sequence[str], names: Sequence[str]) -> list[tuple[Any, ...] | None]:
        """For each of ``paths``: ``(kind, dtype, shape, n, *values)``, ``values`` its
        attributes ``names`` (None where it has none; shared values: read, do not change),
        without an entry or a dict of attributes made; None for a path the table does not
        list."""
        columns = self._columns_of(names)
        row_of, groups, group_of, kept = self._row, self._groups, self._group_of, self._kept_at
        listed = len(self._attrs)
        out: list[tuple[Any, ...] | None] = []
        for path in paths:
            row = row_of.get(path)
            if row is None:
                out.append(None)
                continue
            kind, dtype, shape, n, _, _ = groups[group_of[row]]
            own = kept.get(row) if kept else None
            if own is not None:  # (attributes of its own, maybe changed: the entry's)
                attrs = own.attrs
                out.append((kind, dtype, shape, n, *[attrs.get(name) for name in names]))
            elif row < listed:
                out.append((kind, dtype, shape, n, *[col[row] for col in columns]))
            else:
                out.append((kind, dtype, shape, n, *[None] * len(columns)))
        return out

    def _columns_of(self, names: Sequence[str]) -> list[list[Any]]:
        """Every listed row's attribute ``name`` for each of ``names`` (kept for the next
        ask)."""
        cache = self.__dict__.setdefault("_attr_columns", {})
        out = []
        for name in names:
            col = cache.get(name)
            if col is None:
                attrs = self._attrs
                if isinstance(attrs, AttrRows):
                    col = attrs.column(name)
                else:
                    col = [a.get(name) for a in attrs]
                cache[name] = col
            out.append(col)
        return out

    def attrs_of(self, row: int) -> Mapping[str, Any]:
        """Row ``row``'s attributes: those of its kept entry (:meth:`_keep`, changed through
        it maybe), else as stored (shared with other rows); read them, do not change them."""
        kept = self._kept_at.get(row) if self._kept_at else None
        if kept is not None:
            return kept.attrs
        return self._attrs[row] if row < len(self._attrs) else _NO_ATTRS

    def bulk_rows(self, paths: Sequence[str]) -> list[tuple[int, np.dtype, tuple[int, ...], int]]:
        """For each of ``paths``: ``(first, dtype, shape, n)`` where the variable's components
        are its ``n`` stored tensors (the components layout, not sharded, not strings) at
        ``positions()[first : first + n]``, each of the variable's dtype and shape; ``first``
        is -1 for one read the general way."""
        out: list[tuple[int, np.dtype, tuple[int, ...], int]] = []
        row_of, groups, group_of, key_at = self._row, self._groups, self._group_of, self._key_at
        for path in paths:
            row = row_of.get(path)
            if row is None:
                out.append((-1, _NO_DTYPE, (), 0))
                continue
            kind, dtype, shape, n, layout, _ = groups[group_of[row]]
            if layout != "components" or kind == "sharded" or is_string_dtype(dtype):
                out.append((-1, _NO_DTYPE, (), 0))
            else:
                out.append((key_at[row], dtype, shape, n))
        return out

    def positions(self) -> np.ndarray:
        """Each stored tensor name the rows list (flat, row by row), as its position in the
        store."""
        return self._key_pos


_NO_DTYPE = np.dtype(np.uint8)


class _RowAttrs(Mapping[str, Any]):
    """A table row's attributes, looked up when first read (an entry whose attributes are
    never asked for makes none)."""

    __slots__ = ("_row", "_table")

    def __init__(self, table: EntryTable, row: int) -> None:
        self._table, self._row = table, row

    def _attrs(self) -> Mapping[str, Any]:
        return self._table.attrs_of(self._row)

    def __getitem__(self, key: str) -> Any:
        return self._attrs()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._attrs())

    def __len__(self) -> int:
        return len(self._attrs())

    def items(self) -> Any:
        return self._attrs().items()


def entry_table(
    store: TensorStore,
    info: Mapping[str, Any] | None,
    *,
    names: str,
    hidden: Callable[[str], bool] = lambda key: False,
) -> Mapping[str, Entry]:
    """:func:`build_entries`' entries, every check the same, held as an :class:`EntryTable`
    (no entry made per variable until asked for) where ``info`` is version 2 or None; a
    version-1 info's entries are made as :func:`build_entries` makes them."""
    file = store.file
    if _listed_variables(file, info):
        return build_entries(store, info, names=names, hidden=hidden)
    stored_keys = list(store.keys())
    count_stored = len(stored_keys)
    position = getattr(store, "positions", None)
    if position is None:
        where = {key: i for i, key in enumerate(stored_keys)}

        def position(keys: Sequence[str]) -> np.ndarray:
            return np.fromiter(map(where.__getitem__, keys), np.int64, len(keys))

    columns = getattr(store, "stored_columns", None)
    if columns is None:
        stored_pairs = list(map(store.stored, stored_keys))
    else:
        stored_pairs = list(zip(*columns(), strict=True))
    paths: list[str] = []
    groups: list[_Group] = []
    group_of: list[int] = []
    attrs: Sequence[Mapping[str, Any]] = []
    flat: list[str] = []
    counts: list[int] = []
    if info is not None and info.get("version") == COLUMNS_VERSION:
        if "columns" not in info:
            raise _no_columns(file)
        paths, layouts, tables, flat, attrs = records_from_columns(
            file, info["columns"], stored_keys, _LAYOUT_ATTRS
        )
        kinds, dtypes, shapes, nums, layout_names = tables
        code_of: dict[Any, int] = {}
        checked: dict[Any, Any] = {}
        for j, code in enumerate(layouts):  # (equal codes: the same layout and watched attrs)
            g = code_of.get(code)
            if g is None:
                kind, n, layout = kinds[code[0]], nums[code[3]], layout_names[code[4]]
                dtype, shape, count = _described(
                    file, paths[j], kind, dtypes[code[1]], shapes[code[2]], n, layout,
                    dict(attrs[j]), checked,
                )  # fmt: skip
                g = code_of[code] = len(groups)
                groups.append((kind, dtype, shape, n, layout, count))
            group_of.append(g)
        group_counts = [g[5] for g in groups]
        counts = list(map(group_counts.__getitem__, group_of))
    key_at = np.zeros(len(paths) + 1, np.int64)
    np.cumsum(counts, out=key_at[1:])
    if int(key_at[-1]) > len(flat):  # (the first variable whose tensors run past the list)
        j = int(np.searchsorted(key_at[1:], len(flat), side="right"))
        raise _corrupt(
            file,
            "variable record lists the wrong number of stored tensors",
            variable=paths[j],
            expected=counts[j],
            found=max(0, len(flat) - int(key_at[j])),
        )
    if int(key_at[-1]) != len(flat):
        raise _corrupt(
            file,
            "the parallel info lists more stored tensors than its variables take",
            variable="parallelvars/columns/keys",
            expected=int(key_at[-1]),
            found=len(flat),
        )
    key_pos = position(flat)
    # Every stored tensor must hold what its variable describes: compared in bulk (each
    # tensor against its group's dtype and shape); a sharded variable, or one whose tensors
    # differ (the bits under another dtype, or damage), through the general check that
    # names what differs.
    table = EntryTable(store, paths, list(range(len(paths))), groups, group_of,
                       key_at[:-1].tolist(), flat, key_pos, attrs)  # fmt: skip
    expected = [[(g[1], g[2])] * g[5] for g in groups]
    want = list(chain.from_iterable(map(expected.__getitem__, group_of)))
    got = list(map(stored_pairs.__getitem__, key_pos.tolist()))
    suspects = {j for j in range(len(paths)) if groups[group_of[j]][0] == "sharded"}
    if got != want:
        row_of_key = np.repeat(np.arange(len(paths)), counts)
        suspects.update(
            int(row_of_key[k]) for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b
        )
    for j in sorted(suspects):
        entry = table[paths[j]]
        assert isinstance(entry, StoredEntry)
        _check_stored(store, entry)
    # The view's order: each variable at its first stored tensor, and the tensors no
    # variable lists as variables of their own, in the store's order.
    owner = np.full(count_stored, -1, np.int64)
    owner[key_pos] = -2
    owner[key_pos[key_at[:-1][: len(paths)]]] = np.arange(len(paths))
    kept = owner[owner != -2]
    if (kept >= 0).all():
        order = kept.tolist()
    else:
        single: dict[tuple[np.dtype, tuple[int, ...]], int] = {}
        order = []
        taken = set(paths)
        extra: list[int] = []  # (the stored positions of the tensors made variables here)
        for i in np.flatnonzero(owner != -2).tolist():
            j = int(owner[i])
            if j >= 0:
                order.append(j)
                continue
            key = stored_keys[i]
            if hidden(key):
                continue
            path = from_key(key, names)
            if path in taken:
                raise _corrupt(
                    file, "two stored tensors map to the same variable path", variable=path
                )
            taken.add(path)
            dtype, shape = stored_pairs[i]
            pair = (np.dtype(dtype), tuple(map(int, shape)))
            g = single.get(pair)
            if g is None:
                g = single[pair] = len(groups)
                groups.append(("single", pair[0], pair[1], 1, "components", 1))
            order.append(len(paths))
            paths.append(path)
            group_of.append(g)
            table._key_at.append(len(flat))
            flat.append(key)
            extra.append(i)
        # (joined once: appending to the array for each tensor copied it each time, a
        # million-tensor header's open went quadratic)
        table._key_pos = np.concatenate([key_pos, np.asarray(extra, key_pos.dtype)])
    table._paths = list(map(paths.__getitem__, order))
    table._row = dict(zip(table._paths, order, strict=True))
    return table


_NO_ATTRS: Mapping[str, Any] = {}


def graph_text(info: Mapping[str, Any] | None, file: str) -> str | None:
    """The object graph of a parallel ``info`` read from ``file``, checked
    (:func:`~._graph.graph_from_info`), as compact JSON text (None: the info carries none).
    A view holds this text, not the graph's objects: at 50,000 variables with Adam's slots the
    graph's 13 MB of text took 78 MB parsed, held for the view's life by every command that
    never asks for it (diff, inspect).

    Raises:
        CorruptCheckpointError: the recorded graph is malformed.
    """
    graph = graph_from_info(info, file)
    return None if graph is None else json.dumps(graph, separators=(",", ":"))


def take_graph(info: dict[str, Any] | None, file: str) -> str | None:
    """Take the object graph out of a parallel ``info`` as :func:`graph_text` (None: it carries
    none), so that its objects are let go before the entries are built from the rest. A graph
    that does not check is left in ``info`` (None): :class:`StoreView` refuses it where it
    always has, after the entries (a file damaged in both places names the same damage)."""
    try:
        text = graph_text(info, file)
    except CorruptCheckpointError:
        return None
    if text is not None and info is not None:  # (info is not None: graph_text found one)
        del info["object_graph"]
    return text


#: Paths whose table rows :meth:`StoreView.bulk_components` looks up at a time.
_ROWS = 4096


class StoreView(DictView):  # the Mapping over ._entries comes from DictView
    """A :class:`CheckpointView` over a dict of entries backed by a :class:`TensorStore`."""

    #: Its summaries and entries are made from its table's rows (:meth:`summary`).
    summaries_match_entries = True

    def __init__(
        self,
        store: TensorStore,
        entries: Mapping[str, Entry],
        *,
        format: str,
        path: str,
        metadata: Mapping[str, Any],
        info: Mapping[str, Any] | None = None,
        graph: str | None = None,
    ) -> None:
        """``graph``: the object graph a reader already took out of ``info``
        (:func:`take_graph`); else the one ``info`` carries is checked here."""
        self._store = store
        # (an EntryTable is kept as it is: its entries are made when asked for)
        self._entries = entries if isinstance(entries, EntryTable) else dict(entries)  # type: ignore[assignment]
        self.format = format
        self.path = path
        self.metadata = dict(metadata)
        # The native object graph the parallel info carries, checked (see ._graph), as its
        # JSON text (:attr:`object_graph` parses it when asked).
        self._graph = graph if graph is not None else graph_text(info, path)
        # The components :meth:`prefetch` read last, by path.
        self._ahead: dict[str, list[Any]] = {}
        if getattr(type(store), "_place", ByteStore._place) is not ByteStore._place:
            # (a store of plain byte ranges: its entries read ahead through this view)
            if isinstance(entries, EntryTable):
                entries.view = self
                return
            for entry in self._entries.values():
                if type(entry) is StoredEntry and entry._store is store:
                    entry._view = self

    @property
    def object_graph(self) -> dict[str, Any] | None:
        """The native object graph the file carries (None: it carries none), checked at open,
        parsed again from its text at each call (each caller gets its own copy)."""
        return None if self._graph is None else json.loads(self._graph)

    def prefetch(self, paths: Sequence[str]) -> None:
        """Read the components of the entries at ``paths`` now, in bulk
        (:meth:`bulk_components`), for the reads of those entries that follow: a writer
        streaming the file's tensors in runs (through
        :class:`~parallelvars.checkpoint.entry.ReadAhead`) pays a few ``pread`` calls per run,
        not a seek and a read per tensor. Each call replaces what the previous one read;
        ``prefetch(())`` drops it. An entry the bulk path does not take (another layout,
        strings, bytes that do not match their checksum) is read the general way, which
        names any damage."""
        self._ahead = {}
        got: dict[str, list[Any]] = {}
        for path, comps in self.bulk_components(list(paths)):
            if comps is not None:
                got[path] = comps
        self._ahead = got

    def bulk_components(self, paths: Sequence[str]) -> Iterator[tuple[str, list[Any] | None]]:
        """Each of ``paths`` with its components read in bulk (:meth:`ByteStore.read_many`:
        a few large reads, every checksum the file carries checked), at most ``BULK_BYTES`` at a time;
        None for an entry read the general way (``self[path]``): another layout, strings, a
        store that is not byte ranges, or bytes that do not check."""
        store = self._store
        table = self._entries
        if isinstance(table, EntryTable) and hasattr(store, "read_positions"):
            yield from self._bulk_rows(table, paths)
            return
        read_many = getattr(store, "read_many", None)
        batch: list[tuple[str, Entry | None]] = []
        size = 0
        for path in paths:
            entry = self._entries.get(path)
            if (
                read_many is None
                or not isinstance(entry, StoredEntry)
                or entry.layout != "components"
                or entry.kind == "sharded"
                or is_string_dtype(entry.dtype)
            ):
                entry = None
            batch.append((path, entry))
            if entry is not None:  # (not sharded: every component of the entry's shape)
                size += math.prod(entry.shape) * entry.dtype.itemsize * entry.num_components
            if size >= BULK_BYTES:
                yield from self._read_batch(batch)
                batch, size = [], 0
        yield from self._read_batch(batch)

    def summary(self, path: str) -> tuple[str, np.dtype, tuple[int, ...], int, int, Any] | None:
        """The variable at ``path`` as its table lists it, without an entry made
        (:meth:`EntryTable.summary`); None for a view whose entries are not a table."""
        table = self._entries
        return table.summary(path) if isinstance(table, EntryTable) else None

    def described(self, paths: Sequence[str], names: Sequence[str]) -> list[tuple[Any, ...] | None]:
        """:meth:`EntryTable.described` (each None for a view whose entries are not a
        table)."""
        table = self._entries
        if isinstance(table, EntryTable):
            return table.described(paths, names)
        return [None] * len(paths)

    def _bulk_rows(
        self, table: EntryTable, paths: Sequence[str]
    ) -> Iterator[tuple[str, list[Any] | None]]:
        """:meth:`bulk_components` over the table's columns: each batch's stored tensors
        found by position and read at once (the store's ``read_positions``); the rows
        looked up :data:`_ROWS` paths at a time (a batch ends at the end of each), so that
        what is held for them stays bounded whatever the number of paths."""
        for at in range(0, len(paths), _ROWS):
            chunk = paths[at : at + _ROWS]
            rows = table.bulk_rows(chunk)
            start = 0
            size = 0
            for k, (first, dtype, shape, n) in enumerate(rows):
                if first >= 0:
                    size += math.prod(shape) * dtype.itemsize * n
                if size >= BULK_BYTES:
                    yield from self._read_rows(table, chunk[start : k + 1], rows[start : k + 1])
                    start, size = k + 1, 0
            yield from self._read_rows(table, chunk[start:], rows[start:])

    def _read_rows(
        self,
        table: EntryTable,
        paths: Sequence[str],
        rows: list[tuple[int, np.dtype, tuple[int, ...], int]],
    ) -> Iterator[tuple[str, list[Any] | None]]:
        firsts = np.array([r[0] for r in rows], np.int64)
        counts = np.array([r[3] for r in rows], np.int64)
        counts[firsts < 0] = 0
        total = int(counts.sum())
        buf, places, good = np.empty(0, np.uint8), [], []
        if total:
            heads = np.repeat(np.cumsum(counts) - counts, counts)
            flat = np.repeat(firsts, counts) + (np.arange(total) - heads)
            buf, at, ok = self._store.read_positions(table.positions()[flat])  # type: ignore[attr-defined]
            places = at.tolist()
            good = ok.tolist()
        k = 0
        for path, (first, dtype, shape, n) in zip(paths, rows, strict=True):
            if first < 0:
                yield path, None
                continue
            if not all(good[k : k + n]):
                yield path, None
            else:
                # (each a read-only array over the batch's buffer, made in one call)
                yield path, [np.ndarray(shape, dtype, buf, a) for a in places[k : k + n]]
            k += n

    def _read_batch(
        self, batch: list[tuple[str, Entry | None]]
    ) -> Iterator[tuple[str, list[Any] | None]]:
        keys: list[str] = []
        sizes: list[int] = []
        for _, entry in batch:
            if entry is not None:  # (not sharded: each component has the entry's shape)
                n = entry.num_components
                keys.extend(entry.keys[:n])  # type: ignore[attr-defined]
                sizes.extend([math.prod(entry.shape) * entry.dtype.itemsize] * n)
        got = self._store.read_many(keys, sizes) if keys else []  # type: ignore[attr-defined]
        k = 0
        for path, entry in batch:
            if entry is None:
                yield path, None
                continue
            n = entry.num_components
            parts = got[k : k + n]
            k += n
            if any(p is None for p in parts):
                yield path, None
                continue
            dtype, shape = entry.dtype, entry.shape
            yield path, [p.view(dtype).reshape(shape) for p in parts]

    def close(self) -> None:
        self._store.close()
