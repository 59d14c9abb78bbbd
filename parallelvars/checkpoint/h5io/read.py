"""Opening a native checkpoint file: :class:`H5Reader` (the index, the object graph, one
:class:`~parallelvars.checkpoint.h5io.stored.StoredVariable` per variable) and
:func:`is_native_checkpoint`.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import json
import math
import operator
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import crc32c as _crc32c
import h5py
import numpy as np

from parallelvars._fileio import value_types
from parallelvars.checkpoint import _h5policy
from parallelvars.checkpoint.entry import AGGREGATIONS, MAX_COMPONENTS, layout_problem
from parallelvars.checkpoint.h5io._global_heap import GlobalHeapCheck
from parallelvars.checkpoint.h5io.attributes import _decode, _read_json
from parallelvars.checkpoint.h5io.layout import (
    _H5_ERRORS,
    COLUMNS_DATASET,
    COLUMNS_VERSION,
    DOCUMENTS_ATTR,
    FORMAT_VERSION,
    GRAPH_DATASET,
    HDF5_SIGNATURE,
    INDEX_DATASET,
    META_GROUP,
    STAGE_COMPONENT,
    STAGE_GAP,
    STAGE_LIMIT,
    STAGE_MIN_COMPONENTS,
)
from parallelvars.checkpoint.h5io.stored import StoredVariable, _dtype_named
from parallelvars.checkpoint.registry import component_name
from parallelvars.errors import (
    CheckpointNotFoundError,
    ClosedCheckpointError,
    CorruptCheckpointError,
    FormatVersionError,
    NotACheckpointError,
    TruncatedFileError,
    UnsupportedDtypeError,
)

# Every type a canonical index field has; anything else sends the whole file down the general
# path (one StoredVariable per entry, made at open, as before).
_NONE = type(None)


class IndexTable:
    """A native file's index as arrays: one row per variable (in the index's order), one slot per
    component, parsed and validated in bulk at open.

    A row holds a variable's kind, dtype, shape, number of components and on-read aggregation;
    the component slots ``first[row]:first[row + 1]`` hold each component's data offset in the
    file, size in bytes and checksum. ``direct[row]`` says whether a restore may read the row's
    components in bulk (see :meth:`H5Reader.read_bulk`): every component non-empty, smaller
    than ``STAGE_COMPONENT``, at an offset and with a checksum the index gives, in a dtype of
    fixed size, not sharded. Rows are plain lists of values the decoded index already holds
    (strings, dtypes, ints) and a few numpy arrays: no object per variable.
    """

    __slots__ = (
        "aggregations",
        "counts",
        "crcs",
        "direct",
        "dtypes",
        "first",
        "kinds",
        "located",
        "lowered",
        "names",
        "nbytes",
        "offsets",
        "row_nbytes",
        "rows",
        "shapes",
    )

    def __init__(
        self,
        names: list[str],
        kinds: list[str],
        dtypes: list[np.dtype],
        shapes: list[tuple[int, ...]],
        counts: list[int],
        aggregations: list[Any],
        lowered: dict[Any, str],
        first: np.ndarray,
        offsets: np.ndarray,
        nbytes: np.ndarray,
        crcs: np.ndarray,
        located: np.ndarray,
        direct: list[bool],
        row_nbytes: list[int],
        rows: dict[str, int] | None = None,
    ) -> None:
        self.names = names
        # (each name's row; made here unless given)
        self.rows = dict(zip(names, range(len(names)), strict=True)) if rows is None else rows
        self.kinds = kinds
        self.dtypes = dtypes
        self.shapes = shapes
        self.counts = counts
        self.aggregations = aggregations  # as the index has them (None: not given)
        self.lowered = lowered  # each of them as spread_plan compares it
        self.first = first
        self.offsets = offsets
        self.nbytes = nbytes
        self.crcs = crcs
        self.located = located
        self.direct = direct
        self.row_nbytes = row_nbytes  # bytes of all of a row's components

    def check_placement(self, file: str, file_size: int) -> bool:
        """Whether the components the index places are each in their own bytes.

        A component placed past the end of the file is refused (the first in path order, as
        :meth:`StoredVariable._location` would name it). Offsets that overlap are no error:
        an index whose offsets went stale (a file rewritten by another HDF5 tool) is read the
        general way, each component from where HDF5 places it when its indexed bytes do not
        match its checksum; False then.

        Raises:
            TruncatedFileError: data placed past the end of the file.
        """
        offsets, nbytes, located = self.offsets, self.nbytes, self.located
        outside = located & (offsets + nbytes > file_size)
        if outside.any():
            rows = {self._row_of(int(k)) for k in np.flatnonzero(outside)}
            first = min(rows, key=self.names.__getitem__)  # the first in path order
            slot = int(self.first[first]) + int(np.argmax(outside[self.first[first] :]))
            row = self._row_of(slot)
            size = math.prod(self.shapes[row]) * self.dtypes[row].itemsize
            raise TruncatedFileError(
                "file ends inside the data",
                file=file,
                variable=self.slot_name(slot),
                expected=f"{int(offsets[slot]) + size} bytes",
                found=f"{file_size} bytes",
            )
        placed = np.flatnonzero(located & (nbytes > 0))
        if placed.size < 2:
            return True
        order = placed[np.argsort(offsets[placed], kind="stable")]
        starts = offsets[order]
        ends = np.maximum.accumulate(starts + nbytes[order])
        return not bool((starts[1:] < ends[:-1]).any())

    def component_slots(self, rows: np.ndarray) -> np.ndarray:
        """The component slots of ``rows``, row by row in component order."""
        starts = self.first[rows]
        counts = self.first[rows + 1] - starts
        if counts.size and int(counts.max()) == 1:
            return starts
        base = np.repeat(starts - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
        return base + np.arange(int(counts.sum()), dtype=np.int64)

    def _row_of(self, slot: int) -> int:
        return int(np.searchsorted(self.first, slot, side="right")) - 1

    def slot_name(self, slot: int) -> str:
        """``<variable path>/<component name>`` of a component slot (for messages)."""
        row = self._row_of(slot)
        return f"{self.names[row]}/{component_name(slot - int(self.first[row]))}"


def _index_table(metas: dict[str, Any], file: str, file_size: int) -> IndexTable | None:
    """The index as an :class:`IndexTable`, or None when any entry is not in the form our
    writers give (a field missing or of another type, a layout :func:`layout_problem`
    refuses, a value out of range): such a file is opened the general way, entry by entry,
    with the general path's errors. Sharded and byte-string variables are rows too, never
    direct (their StoredVariables are made at open).

    Column by column, in C loops (``map``, ``set``, numpy); the few distinct layouts (kind,
    number of components, aggregation, devices) are each checked once.
    """
    # Rows in the index's own order: the decoded entries lie in memory in that order, so each
    # pass over a column reads them front to back (in path order, every pass would jump).
    names = list(metas)
    entries = list(metas.values())
    if value_types(entries) - {dict}:
        return None
    get = operator.itemgetter
    try:
        kinds = list(map(get("kind"), entries))
        dnames = list(map(get("dtype"), entries))
        shapes_json = list(map(get("shape"), entries))
        counts = list(map(get("num_components"), entries))
        offsets_json = list(map(get("offsets"), entries))
        crcs_json = list(map(get("crc32c"), entries))
        attrs: list[Any] = list(map(get("attrs"), entries))
    except KeyError:
        return None
    if (
        value_types(kinds) - {str}
        or value_types(dnames) - {str}
        or value_types(shapes_json) - {list}
        or value_types(counts) - {int}
        or value_types(offsets_json) - {list}
        or value_types(crcs_json) - {list}
        or value_types(attrs) - {dict}
        or list(map(len, offsets_json)) != counts
        or list(map(len, crcs_json)) != counts
    ):
        return None
    for kind, n in set(zip(kinds, counts, strict=True)):
        if kind != "sharded" and layout_problem(kind, (), n, {}) is not None:
            return None  # (a sharded entry's layout is checked by its StoredVariable, at open)
    aggregations = list(map(dict.get, attrs, itertools.repeat("aggregation")))
    if value_types(aggregations) - {str, _NONE}:
        return None
    lowered: dict[Any, str] = {}
    for agg in set(aggregations):
        if agg is not None and agg.lower() not in AGGREGATIONS:
            return None
        lowered[agg] = str(agg).lower()  # as spread_plan compares them (None: "none")
    devices: list[Any] = list(map(dict.get, attrs, itertools.repeat("devices")))
    device_types = value_types(devices)
    if device_types - {list, _NONE}:
        return None
    try:  # (a device that is not a string may be unhashable: no canonical index either way)
        if device_types == {list}:
            if list(map(len, devices)) != counts:
                return None
            distinct = set(map(tuple, devices))
        else:
            listed = [(d, n) for d, n in zip(devices, counts, strict=True) if d is not None]
            if any(len(d) != n for d, n in listed):
                return None
            distinct = {tuple(d) for d, _ in listed}
    except TypeError:
        return None
    if value_types(itertools.chain.from_iterable(distinct)) - {str}:
        return None
    # Shapes, offsets and checksums: integers in range, as numpy arrays.
    dims = list(itertools.chain.from_iterable(shapes_json))
    flat_offsets = list(itertools.chain.from_iterable(offsets_json))
    flat_crcs = list(itertools.chain.from_iterable(crcs_json))
    offset_types = value_types(flat_offsets)
    if value_types(dims) - {int} or offset_types - {int, _NONE} or value_types(flat_crcs) - {int}:
        return None
    if dims and (min(dims) < 0 or max(dims) >= 1 << 62):
        return None
    if flat_crcs and not 0 <= min(flat_crcs) <= max(flat_crcs) < 1 << 32:
        return None
    located = None
    if _NONE in offset_types:
        located = np.array([o is not None for o in flat_offsets], bool)
        flat_offsets = [-1 if o is None else o for o in flat_offsets]
        placed = np.array(flat_offsets, np.int64)[located]
    if flat_offsets and (
        min(flat_offsets if located is None else placed.tolist() or [0]) < 0
        or max(flat_offsets) >= 1 << 62
    ):
        return None  # outside every file: the general path names it
    dname_set = set(dnames)
    try:
        dtype_of = {name: _dtype_named(name) for name in dname_set if name != "bytes"}
    except UnsupportedDtypeError:
        return None  # the general path names the entry
    dtype_of["bytes"] = np.dtype(object)
    ndims = np.array(list(map(len, shapes_json)), np.int64)
    return _assemble(
        names,
        kinds,
        dnames,
        dtype_of,
        list(map(tuple, shapes_json)),
        ndims,
        np.array(dims, np.int64),
        counts,
        aggregations,
        lowered,
        np.array(flat_offsets, np.int64),
        located,
        np.array(flat_crcs, np.int64),
    )


def _assemble(
    names: list[str],
    kinds: list[str],
    dnames: list[str],
    dtype_of: dict[str, np.dtype],
    shapes: list[tuple[int, ...]],
    ndims: np.ndarray,
    dims: np.ndarray,
    counts: list[int],
    aggregations: list[Any],
    lowered: dict[Any, str],
    offsets: np.ndarray,
    located: np.ndarray | None,
    crcs: np.ndarray,
    row_of: dict[str, int] | None = None,
) -> IndexTable | None:
    """The :class:`IndexTable` of validated columns (every dimension, offset and checksum in
    range, every dtype name in ``dtype_of``); None when a variable's size reaches 2**62
    bytes. ``ndims``/``dims``: each row's number of dimensions and all rows' dimensions in
    turn; ``offsets`` (-1 where ``located`` is False) and ``crcs``: each component's."""
    dtypes = list(map(dtype_of.__getitem__, dnames))
    itemsize_of = {name: dt.itemsize for name, dt in dtype_of.items()}
    rows = len(names)
    # Elements per variable: the product of each row's dimensions (a 1 put before each row
    # keeps scalars, which have none, in the product), refused past 2**62 bytes.
    heads = np.zeros(rows, np.int64)
    np.cumsum(ndims[:-1], out=heads[1:])
    ones = np.insert(dims, heads, 1)
    at = heads + np.arange(rows, dtype=np.int64)
    itemsizes = np.array(list(map(itemsize_of.__getitem__, dnames)), np.int64)
    if rows and float(
        (np.multiply.reduceat(ones.astype(np.float64), at) * np.maximum(itemsizes, 1)).max()
    ) >= float(1 << 62):
        return None
    row_nbytes = np.multiply.reduceat(ones, at) * itemsizes if rows else ndims
    counts_arr = np.array(counts, np.int64)
    first = np.zeros(rows + 1, np.int64)
    np.cumsum(counts_arr, out=first[1:])
    nbytes = np.repeat(row_nbytes, counts_arr)
    has = np.ones(offsets.size, bool) if located is None else located
    if "sharded" in kinds or "bytes" in dnames:
        general = np.array(
            [k == "sharded" or d == "bytes" for k, d in zip(kinds, dnames, strict=True)], bool
        )
        has &= ~np.repeat(general, counts_arr)
        nbytes[~has] = 0  # a shard's size is not the variable's: not read from the table
    small = (nbytes > 0) & (nbytes < STAGE_COMPONENT) & has
    per_row = np.add.reduceat(small.astype(np.int64), first[:-1]) if rows else counts_arr
    return IndexTable(
        names,
        kinds,
        dtypes,
        shapes,
        counts,
        aggregations,
        lowered,
        first,
        offsets,
        nbytes,
        crcs,
        has,
        (per_row == counts_arr).tolist(),
        (row_nbytes * counts_arr).tolist(),
        row_of,
    )


def _malformed(
    file: str, field: str, expected: Any, found: Any, variable: str | None = None
) -> CorruptCheckpointError:
    """The error of a columns document whose ``field`` is not what our writer writes."""
    where = f"{COLUMNS_DATASET}: {field}"
    return CorruptCheckpointError(
        f"the columns document's {field!r} is malformed",
        file=file,
        variable=where if variable is None else f"{variable} ({where})",
        expected=expected,
        found=found,
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int_column(
    values: Any,
    field: str,
    low: int,
    high: int,
    file: str,
    *,
    nulls: bool = False,
    owners: tuple[list[int], list[str]] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """A flat JSON list of integers in ``[low, high)`` (with ``nulls``, also null: -1 there,
    and where they are not, a mask) as an int64 array; else the columns' error, naming the
    variable of the first bad value when ``owners`` (each row's first position in the list,
    then the end, and the rows' paths) are given."""
    if not isinstance(values, list):
        raise _malformed(file, field, "a list", type(values).__name__)

    def bad(expected: str, at: int) -> CorruptCheckpointError:
        variable = None
        if owners is not None:
            variable = owners[1][bisect.bisect_right(owners[0], at) - 1]
        return _malformed(file, field, expected, _short(values[at]), variable)

    types = value_types(values)
    allowed = {int, _NONE} if nulls else {int}
    if types - allowed:
        at = next(k for k, v in enumerate(values) if type(v) not in allowed)
        raise bad("integers or null" if nulls else "integers", at)
    located = None
    ints = values
    if _NONE in types:
        located = np.fromiter(map(operator.is_not, values, itertools.repeat(None)), bool)
        ints = [-1 if v is None else v for v in values]
    try:
        arr = np.array(ints, np.int64)
        placed = arr if located is None else arr[located]
        inside = not placed.size or (int(placed.min()) >= low and int(placed.max()) < high)
    except OverflowError:  # past 64 bits
        inside = False
    if not inside:
        at = next(k for k, v in enumerate(values) if v is not None and not low <= v < high)
        raise bad(f"integers in [{low}, {high})", at)
    return arr, located


_ABSENT = object()


def _same(a: Any, b: Any) -> bool:
    """Whether two decoded JSON values are the same JSON (``True`` is not ``1``, ``1`` is not
    ``1.0``, and mappings keep their order)."""
    if a is _ABSENT or b is _ABSENT:
        return a is b
    return json.dumps(a) == json.dumps(b)


class ColumnEntries(Mapping[str, dict[str, Any]]):
    """The index's entries made from a columns document, one when it is asked for: each equal
    to the entry the index holds for that path (see docs/FORMAT.md)."""

    def __init__(
        self,
        doc: dict[str, Any],
        rows: dict[str, int],
        dim_first: list[int],
        comp_first: list[int],
    ) -> None:
        self._doc = doc
        self._rows = rows
        self._dim_first = dim_first
        self._comp_first = comp_first

    def __getitem__(self, path: str) -> dict[str, Any]:
        row = self._rows[path]
        doc = self._doc
        layout = doc["layouts"][doc["layout"][row]]
        d, c = self._dim_first[row], self._comp_first[row]
        n = layout["num_components"]
        row_attrs = doc["row_attrs"]
        return {
            "kind": layout["kind"],
            "dtype": layout["dtype"],
            "shape": doc["shapes"][d : d + layout["ndim"]],
            "num_components": n,
            "attrs": {
                k: row_attrs[k][row] if v is None else copy.deepcopy(v)
                for k, v in layout["attrs"].items()
            },
            "offsets": doc["offsets"][c : c + n],
            "crc32c": doc["crc32c"][c : c + n],
        }

    def __contains__(self, path: object) -> bool:
        return path in self._rows

    def __iter__(self) -> Iterator[str]:
        return iter(self._doc["paths"])

    def __len__(self) -> int:
        return len(self._rows)


# The row attributes a reader needs per layout (the table checks them once per layout).
_LAYOUT_ONLY_ATTRS = frozenset({"aggregation", "devices"})


def _shape_tuples(
    values: list[int], dims: np.ndarray, ndims: np.ndarray, dim_first: np.ndarray
) -> list[tuple[int, ...]]:
    """Each row's shape as a tuple, from every row's dimensions in turn (``values``, also as
    ``dims``), each row's number of them and where each row's start."""
    rows = ndims.size
    if not rows:
        return []
    low, high = int(ndims.min()), int(ndims.max())
    if low == high:  # one number of dimensions (the common case): tuples made in C
        return list(zip(*[iter(values)] * low, strict=True)) if low else [()] * rows
    # Rows sorted by their number of dimensions: each group's tuples made in C, then put back
    # in row order.
    order = np.argsort(ndims, kind="stable")
    counts = ndims[order]
    starts = dim_first[:-1][order]
    base = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    flat = dims[base + np.arange(int(counts.sum()), dtype=np.int64)].tolist()
    grouped: list[tuple[int, ...]] = []
    at = 0
    for k, n in zip(*np.unique(counts, return_counts=True), strict=True):
        k, n = int(k), int(n)
        grouped.extend(zip(*[iter(flat[at : at + k * n])] * k, strict=True) if k else [()] * n)
        at += k * n
    where = np.empty(rows, np.int64)
    where[order] = np.arange(rows, dtype=np.int64)
    return list(map(grouped.__getitem__, where.tolist()))


def _columns_table(doc: Any, file: str) -> tuple[IndexTable | None, ColumnEntries] | None:
    """The index as an :class:`IndexTable` and its entries, from a columns document.

    None for a document of a later version (the index is read instead). The table is None
    when a layout is not in the form the bulk path takes (as :func:`_index_table` decides
    for the index): every entry then goes the general way, with the general path's errors.

    Raises:
        CorruptCheckpointError: the document is not what our writer writes: a field missing or
            of another type, lists of the wrong lengths, an integer out of range, an unknown
            layout number, a path twice; naming the field, expected and found.
    """
    if not isinstance(doc, dict):
        raise _malformed(file, "document", "a mapping", type(doc).__name__)
    version = doc.get("version")
    if type(version) is not int:
        raise _malformed(file, "version", "an integer", _short(version))
    if version > COLUMNS_VERSION:
        return None
    if version != COLUMNS_VERSION:
        raise _malformed(file, "version", COLUMNS_VERSION, version)
    for field, want in (
        ("layouts", list),
        ("paths", list),
        ("layout", list),
        ("row_attrs", dict),
        ("shapes", list),
        ("offsets", list),
        ("crc32c", list),
    ):
        if not isinstance(doc.get(field), want):
            found = "missing" if field not in doc else type(doc[field]).__name__
            raise _malformed(file, field, f"a {want.__name__}", found)
    row_attrs: dict[str, Any] = doc["row_attrs"]
    # The layouts: few, each checked on its own.
    kind_of, dname_of, ndim_of, count_of, agg_of = [], [], [], [], []
    places: dict[str, list[int]] = {}  # the layouts that take each row attribute from the row
    canonical = True
    for k, layout in enumerate(doc["layouts"]):
        field = f"layouts[{k}]"
        if not isinstance(layout, dict):
            raise _malformed(file, field, "a mapping", type(layout).__name__)
        checks: tuple[tuple[str, type, int], ...] = (
            ("kind", str, 0),
            ("dtype", str, 0),
            ("ndim", int, 65),
            ("num_components", int, MAX_COMPONENTS + 1),
            ("attrs", dict, 0),
        )
        for key, typ, high in checks:
            got: Any = layout.get(key)
            if type(got) is not typ:
                raise _malformed(file, f"{field}.{key}", typ.__name__, _short(got))
            if high and not 0 <= cast(int, got) < high:
                raise _malformed(file, f"{field}.{key}", f"0 to {high - 1}", got)
        attrs = layout["attrs"]
        for key, value in attrs.items():
            if value is None:
                places.setdefault(key, []).append(k)
            if value is None and (key not in row_attrs or key in _LAYOUT_ONLY_ATTRS):
                raise _malformed(
                    file, f"{field}.attrs.{key}", "a value (or a row attribute's place)", None
                )
        kind, n = layout["kind"], layout["num_components"]
        kind_of.append(kind)
        dname_of.append(layout["dtype"])
        ndim_of.append(layout["ndim"])
        count_of.append(n)
        agg = attrs.get("aggregation")
        agg_of.append(agg)
        devices = attrs.get("devices")
        if (
            (kind != "sharded" and layout_problem(kind, (), n, {}) is not None)
            or not (agg is None or (isinstance(agg, str) and agg.lower() in AGGREGATIONS))
            or not (
                devices is None
                or (
                    isinstance(devices, list)
                    and len(devices) == n
                    and all(isinstance(d, str) for d in devices)
                )
            )
        ):
            canonical = False
    # The rows.
    paths: list[Any] = doc["paths"]
    rows = len(paths)
    if value_types(paths) - {str}:
        wrong = next(p for p in paths if not isinstance(p, str))
        raise _malformed(file, "paths", "strings", _short(wrong))
    row_of = dict(zip(paths, range(rows), strict=True))
    if len(row_of) != rows:
        twice = next(p for p, r in zip(paths, range(rows), strict=True) if row_of[p] != r)
        raise _malformed(file, "paths", "each path once", f"{twice!r} twice")
    if rows and not kind_of:
        raise _malformed(file, "layouts", "the layouts the rows name", "none")
    if len(doc["layout"]) != rows:
        raise _malformed(file, "layout", f"{rows} layout numbers", len(doc["layout"]))
    ids, _ = _int_column(doc["layout"], "layout", 0, max(len(kind_of), 1), file)
    ndims = np.array(ndim_of, np.int64)[ids] if rows else np.zeros(0, np.int64)
    counts_arr = np.array(count_of, np.int64)[ids] if rows else np.zeros(0, np.int64)
    for key, values in row_attrs.items():
        field = f"row_attrs.{key}"
        if key in _LAYOUT_ONLY_ATTRS:
            raise _malformed(file, field, "an attribute of the layout", "a row attribute")
        if not isinstance(values, list) or len(values) != rows:
            size = len(values) if isinstance(values, list) else type(values).__name__
            raise _malformed(file, field, f"a list of {rows} values", size)
        has = np.zeros(len(kind_of), bool)
        has[places.get(key, [])] = True
        given = np.fromiter(map(operator.is_not, values, itertools.repeat(None)), bool, rows)
        wrong = np.flatnonzero(given != has[ids]) if rows else ids
        if wrong.size:
            r = int(wrong[0])
            expected = "a value (its layout takes it from the row)" if has[ids[r]] else "null"
            raise _malformed(file, field, expected, _short(values[r]), paths[r])
    dim_first = np.zeros(rows + 1, np.int64)
    np.cumsum(ndims, out=dim_first[1:])
    first = np.zeros(rows + 1, np.int64)
    np.cumsum(counts_arr, out=first[1:])
    for field, total in (("shapes", int(dim_first[-1])), ("offsets", int(first[-1]))):
        if len(doc[field]) != total:
            raise _malformed(file, field, f"{total} values (as the layouts give)", len(doc[field]))
    if len(doc["crc32c"]) != int(first[-1]):
        raise _malformed(
            file, "crc32c", f"{int(first[-1])} values (as the layouts give)", len(doc["crc32c"])
        )
    dim_list, first_list = dim_first.tolist(), first.tolist()
    dims, _ = _int_column(doc["shapes"], "shapes", 0, 1 << 62, file, owners=(dim_list, paths))
    offsets, located = _int_column(
        doc["offsets"], "offsets", 0, 1 << 62, file, nulls=True, owners=(first_list, paths)
    )
    crcs, _ = _int_column(doc["crc32c"], "crc32c", 0, 1 << 32, file, owners=(first_list, paths))
    entries = ColumnEntries(doc, row_of, dim_list, first_list)
    if not canonical:
        return None, entries
    try:
        dtype_of = {name: _dtype_named(name) for name in set(dname_of) if name != "bytes"}
    except UnsupportedDtypeError:
        return None, entries  # the general path names the entry
    dtype_of["bytes"] = np.dtype(object)
    lid: list[int] = doc["layout"]
    kinds = list(map(kind_of.__getitem__, lid))
    aggregations = list(map(agg_of.__getitem__, lid))
    lowered = {agg: str(agg).lower() for agg in set(agg_of)}
    shapes = _shape_tuples(doc["shapes"], dims, ndims, dim_first)
    table = _assemble(
        list(paths),
        kinds,
        list(map(dname_of.__getitem__, lid)),
        dtype_of,
        shapes,
        ndims,
        dims,
        counts_arr.tolist(),
        aggregations,
        lowered,
        offsets,
        located,
        crcs,
        row_of,
    )
    return table, entries  # (None: a size past 2**62 bytes, which the general path names)


def is_native_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is an HDF5 file with our root attribute (any version)."""
    p = os.fspath(path)
    try:
        if not os.path.isfile(p) or not h5py.is_hdf5(p):
            return False
        with h5py.File(p, "r") as f:
            return "parallelvars_format" in f.attrs
    except _H5_ERRORS:
        return False


#: Bytes read per system call when a component's checksum is taken as it is read (1 MiB: the
#: chunk is still in the CPU's cache when its CRC-32C runs).
CHECK_CHUNK = 1 << 20


#: The most bytes of larger components a restore keeps in memory between verifying them and
#: copying them into the variables (docs/checkpoints.md, "A restore lands only checked
#: bytes"); 0 by default. Kept, a file rewritten after its verification cannot change the
#: restore; but the memory is fresh, and its page faults made a restore of 400 MB with the
#: pages evicted 1.1-2.5x slower on the 2-core test machine (huge pages stalled on compaction,
#: 4 KiB pages cost a fault each). Not kept, a component is read again when it is copied,
#: into a reused buffer, and checked there before it lands (a change is then a
#: ConcurrentWriteError naming the variables already restored).
RESTORE_KEEP_LIMIT = 0


class H5Reader(Mapping[str, StoredVariable]):
    """A checkpoint file in the native layout, opened read-only: a Mapping path -> variable.

    Raises:
        FileNotFoundError: no such file.
        NotACheckpointError: not HDF5, or HDF5 without our layout.
        FormatVersionError: written by a newer, incompatible layout version.
        TruncatedFileError / CorruptCheckpointError: damaged file.
    """

    def __init__(self, path: str | os.PathLike[str], *, map_file: bool = False) -> None:
        self.path = os.fspath(path)
        self._file: h5py.File | None = None
        self._raw_fd: int | None = None
        # map_file: accepted for compatibility; the file is never memory-mapped (a mapped file
        # truncated by another process kills the reader with SIGBUS): every read is a pread.
        del map_file
        self._local = threading.local()
        self._lock = threading.RLock()
        self._own_name: bytes | None = None
        # Parts of a multi-process checkpoint (reached by external link), opened by us.
        self._parts: dict[str, h5py.File] = {}
        self._checked_groups: set[str] = set()
        # The index's entries (path -> decoded entry) and, when they are all in our writers'
        # form, the same as arrays; a StoredVariable is made when a path is first asked for.
        self._metas: Mapping[str, Any] = {}
        self._names: list[str] = []
        # Whether the entries come from the columns document (docs/FORMAT.md).
        self._columns = False
        self.table: IndexTable | None = None
        # Small components read ahead in a few large reads (see stage()): the start of each
        # staged span, its end, and its bytes.
        self._staged: tuple[list[int], list[int], list[np.ndarray]] | None = None
        # A restore's larger components, read and verified once and kept until they are copied
        # (file offset -> bytes), and the bytes it may still keep (see stage()).
        self._kept: dict[int, np.ndarray] = {}
        self._slots: dict[int, tuple[int, int]] = {}  # offset -> (place in the arena, bytes)
        self._arena: np.ndarray | None = None
        if not os.path.exists(self.path):
            raise CheckpointNotFoundError("no such checkpoint file", file=self.path)
        if os.path.isdir(self.path):
            raise NotACheckpointError("is a directory, not a checkpoint file", file=self.path)
        self.file_size = _h5policy.check_regular_file(self.path).st_size  # a FIFO would block
        with open(self.path, "rb") as fh:
            head = fh.read(8)
        if not h5py.is_hdf5(self.path):
            raise NotACheckpointError(
                "not an HDF5 file",
                file=self.path,
                expected=f"HDF5 signature {HDF5_SIGNATURE!r}",
                found=f"{head!r}",
            )
        try:
            self._file = h5py.File(self.path, "r")
        except _H5_ERRORS as exc:
            msg = str(exc)
            if "truncated" in msg.lower():
                raise TruncatedFileError("file is truncated", file=self.path, found=msg) from None
            raise CorruptCheckpointError(
                "HDF5 file cannot be opened", file=self.path, found=msg
            ) from None
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    def _load(self) -> None:
        f = self._file
        assert f is not None
        try:
            version = f.attrs.get("parallelvars_format")
        except _H5_ERRORS as exc:
            raise CorruptCheckpointError(
                "root attributes unreadable", file=self.path, found=str(exc)
            ) from None
        if version is None:
            raise NotACheckpointError(
                "an HDF5 file, but not a parallelvars checkpoint",
                file=self.path,
                expected="root attribute 'parallelvars_format'",
                found="none",
            )
        try:
            version = int(version)
        except (TypeError, ValueError):
            raise CorruptCheckpointError(
                "bad format version attribute", file=self.path, found=repr(version)
            ) from None
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                "checkpoint written by a newer layout version",
                file=self.path,
                expected=f"version <= {FORMAT_VERSION}",
                found=f"version {version}",
                hint="upgrade parallelvars to read it",
            )
        self.format_version = version
        try:
            self.metadata: dict[str, Any] = {k: _decode(v) for k, v in f.attrs.items()}
            listed = self.metadata.pop(
                DOCUMENTS_ATTR, None
            )  # layout bookkeeping, not user metadata
            required = set(listed) if isinstance(listed, list) else set()
            # A file that lists its columns is opened from them: the index is not decoded.
            if COLUMNS_DATASET in required and self._open_columns(
                _read_json(f, COLUMNS_DATASET, self.path, required=True)
            ):
                pass
            elif (
                metas := _read_json(f, INDEX_DATASET, self.path, required=INDEX_DATASET in required)
            ) is not None:
                if not isinstance(metas, dict):
                    raise CorruptCheckpointError("index is not a mapping", file=self.path)
                self._open_index(metas)
            else:
                groups = {
                    name: obj
                    for name, obj in _h5policy.walk(f, self.path, own_virtual="value")
                    if isinstance(obj, h5py.Group)
                    and "kind" in obj.attrs
                    and not name.startswith(META_GROUP)
                }
                self._variables = {
                    name: StoredVariable.from_group(self, name, groups[name])
                    for name in sorted(groups)
                }
                self._names = list(self._variables)
            self.object_graph: dict[str, Any] | None = _read_json(
                f, GRAPH_DATASET, self.path, required=GRAPH_DATASET in required
            )
        except (CorruptCheckpointError, UnsupportedDtypeError):
            raise
        except (*_H5_ERRORS, json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise CorruptCheckpointError(
                "damaged file structure", file=self.path, found=str(exc)
            ) from None

    def _open_index(self, metas: dict[str, Any]) -> None:
        """Take the index: in bulk (:class:`IndexTable`) when every entry is in our writers'
        form, its unusual rows (sharded, byte strings) as StoredVariables now; otherwise one
        StoredVariable per entry, each validated as it is made (the first bad one raises)."""
        self._take(metas, _index_table(metas, self.path, self.file_size))

    def _open_columns(self, doc: Any) -> bool:
        """Take the columns document instead of the index (False: a later version of it,
        which this reader does not know; the index is read instead)."""
        built = _columns_table(doc, self.path)
        if built is None:
            return False
        table, entries = built
        self._take(entries, table)
        self._columns = True
        return True

    def _take(self, metas: Mapping[str, Any], table: IndexTable | None) -> None:
        """Take the index's entries (``metas``) and their table (None: entry by entry)."""
        self._metas = metas
        if table is None:
            self._variables = {
                name: StoredVariable(self, name, metas[name]) for name in sorted(metas)
            }
            self._names = list(self._variables)
            return
        self._names = sorted(table.names)
        self._variables = {}
        general = [
            name
            for name, direct, kind, dtype in zip(
                table.names, table.direct, table.kinds, table.dtypes, strict=True
            )
            if not direct and (kind == "sharded" or dtype.kind == "O")
        ]
        for name in sorted(general):  # (the first bad one in path order raises, as before)
            self._variables[name] = StoredVariable(self, name, metas[name])
        if table.check_placement(self.path, self.file_size):
            self.table = table

    def _open_dataset(self, path: str, dtype: np.dtype) -> Any:
        """The dataset id at ``path`` under the indirection policy (see ``_h5policy``), its
        stored type checked for ``dtype``; None when there is no such dataset.

        A component that is an external link into this checkpoint's own ``.parts`` folder (a
        multi-process save) is opened in that part by us, after the link is validated; no
        other link is ever followed.
        """
        f = self._h5()
        link = _h5policy.check_path(
            f.id, path, self.path, checked=self._checked_groups, last_external=True
        )
        if link is None:
            try:  # the low-level open: a fraction of the cost of Group.__getitem__
                dsid = h5py.h5d.open(f.id, path.encode())
            except _H5_ERRORS:
                return None
            _h5policy.check_dataset(dsid, self.path, path.lstrip("/"), dtype=dtype)
            return dsid
        part_path = _h5policy.part_file(self.path, link, path.lstrip("/"))
        with self._lock:
            part = self._parts.get(part_path)
            if part is None:
                try:
                    part = self._parts[part_path] = h5py.File(part_path, "r")
                except _H5_ERRORS as exc:
                    raise CorruptCheckpointError(
                        "a part of the checkpoint cannot be opened",
                        file=self.path,
                        variable=path.lstrip("/"),
                        found=f"{part_path}: {exc}",
                    ) from None
        return _h5policy.open_dataset(part.id, os.fsdecode(link[1]), part_path, dtype=dtype)

    def _holds(self, dsid: Any) -> bool:
        """Whether a dataset lives in this file (not behind an external link: those are read
        through HDF5, not from this file's map)."""
        if self._own_name is None:
            self._own_name = h5py.h5f.get_name(self._h5().id)
        try:
            return bool(h5py.h5f.get_name(dsid) == self._own_name)
        except _H5_ERRORS:
            return False

    def _h5(self) -> h5py.File:
        if self._file is None:
            raise ClosedCheckpointError("the reader is closed", file=self.path)
        return self._file

    # Components may be verified and copied from several threads at once (a restore does):
    # the lazily opened descriptor is made under a lock, the read buffers are per thread.
    def _buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes to read a component into: this thread's reused buffer, or a fresh
        one for a component over 64 MiB (so a reader does not keep that much memory)."""
        if nbytes > 64 << 20:
            return np.empty(nbytes, np.uint8)
        buf: np.ndarray | None = getattr(self._local, "component", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.component = np.empty(max(nbytes, 1 << 16), np.uint8)
        return buf[:nbytes]

    def _chunk(self, nbytes: int) -> np.ndarray:
        """A reusable buffer for streamed checks: the component's size, at most 8 MiB."""
        want = min(nbytes, 8 << 20)
        buf: np.ndarray | None = getattr(self._local, "chunk", None)
        if buf is None or len(buf) < want:
            buf = self._local.chunk = np.empty(want, np.uint8)
        return buf

    def _fd(self) -> int:
        """A read-only descriptor of the file, for the reads with pread."""
        if self._raw_fd is None:
            with self._lock:
                if self._raw_fd is None:
                    fd = os.open(self.path, os.O_RDONLY)
                    if hasattr(os, "posix_fadvise"):  # read front to back: a larger readahead
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    self._raw_fd = fd
        return self._raw_fd

    def _read_fully(
        self, view: memoryview, offset: int, variable: str | None = None, *, crc: bool = False
    ) -> int:
        """Fill ``view`` with the file's bytes from ``offset`` on (a file that ends first, cut
        by someone else since it was opened, is a :class:`TruncatedFileError` naming
        ``variable``, the component read, when given). With ``crc``, the bytes are read in
        chunks of ``CHECK_CHUNK`` and their CRC-32C is taken as each chunk arrives, while it is
        in the CPU's cache, and returned (else 0)."""
        end, fd = offset + len(view), self._fd()
        step = CHECK_CHUNK if crc else len(view)
        value = 0
        while len(view):
            n = os.preadv(fd, [view[:step]], offset)
            if n <= 0:
                raise TruncatedFileError(
                    "file ends inside the data",
                    file=self.path,
                    variable=variable,
                    expected=f"{end} bytes",
                    found=f"{self.file_size} bytes",
                )
            if crc:
                value = _crc32c.crc32c(view[:n], value)
            view, offset = view[n:], offset + n
        return value

    def stage(self, variables: Iterable[StoredVariable]) -> set[tuple[str, int]]:
        """Prepare a restore of ``variables``: read their small components now
        (:meth:`_stage_small`, whose verified components are returned), and set aside the
        memory the larger ones are kept in between their verification and their copy.

        The components whose place the index gives and that are not staged get a slot of one
        buffer (one allocation, so the kernel can back it with huge pages: fresh small
        buffers cost a page fault per 4 KiB), first ones first, at most
        ``RESTORE_KEEP_LIMIT`` bytes; :meth:`StoredVariable.verify` reads each into its slot,
        verifies it there and keeps it, and the copy into the variable takes those bytes.
        """
        variables = list(variables)
        verified = self._stage_small(variables)
        slots: dict[int, tuple[int, int]] = {}
        total = 0
        for var in variables:
            if var.dtype.kind == "O" or var._index_offsets is None:
                continue
            for i in range(var.num_components):
                nbytes = var.component_nbytes(i)
                if nbytes == 0 or total + nbytes > RESTORE_KEEP_LIMIT:
                    continue
                loc = var._location(i)
                if loc is None or self._staged_bytes(loc[0], nbytes) is not None:
                    continue
                slots[loc[0]] = (total, nbytes)
                total += nbytes
        with self._lock:
            self._kept = {}
            self._slots = slots
            self._arena = np.empty(total, np.uint8) if total else None
        return verified

    def _slot(self, offset: int, nbytes: int) -> np.ndarray | None:
        """The memory set aside for the component at ``offset`` (:meth:`stage`), or None."""
        slot = self._slots.get(offset)
        arena = self._arena
        if slot is None or arena is None or slot[1] != nbytes:
            return None
        return arena[slot[0] : slot[0] + nbytes]

    def _keep(self, offset: int, data: np.ndarray) -> None:
        """Keep ``data``, the verified bytes at ``offset``, for the copy."""
        with self._lock:
            self._kept[offset] = data

    def _stage_small(self, variables: list[StoredVariable]) -> set[tuple[str, int]]:
        """Read the small components of ``variables`` now, with a few large reads.

        A restore of many small variables would otherwise pay two system calls per component
        (one to verify it, one to copy it). With at least ``STAGE_MIN_COMPONENTS`` of them
        (fewer save little, and one thread reading them from a cold disk can cost more than the
        restore's threads reading them in place), components under ``STAGE_COMPONENT`` bytes whose
        offsets the index gives are sorted by offset and read in spans (neighbours less than
        ``STAGE_GAP`` apart share one read), at most ``STAGE_LIMIT`` bytes in all; copies then
        work from memory, on the bytes that were read once. Released by :meth:`unstage`.

        The staged components whose checksums the index gives are verified here, in one pass
        over the spans (a component's crc32c over its own bytes inside the span), and marked
        verified; the returned set names them as ``(variable path, component)``, so a restore
        does not check them again. A component whose bytes do not match is left unverified:
        :meth:`StoredVariable.verify` then raises for it (or reads it where HDF5 places it,
        when the index's offset is stale), as without staging.
        """
        ranges: list[tuple[int, int, StoredVariable | None, int]] = []
        total = 0
        for var in variables:
            if var.dtype.kind == "O" or var._index_offsets is None:
                continue
            crcs = var._crcs  # from the index; None: each dataset's attribute (checked later)
            for i in range(var.num_components):
                nbytes = var.component_nbytes(i)
                if 0 < nbytes < STAGE_COMPONENT and total + nbytes <= STAGE_LIMIT:
                    loc = var._location(i)  # checked against the file's size
                    if loc is not None and i in var._from_index:
                        checked = var if crcs is not None and crcs[i] is not None else None
                        ranges.append((loc[0], nbytes, checked, i))
                        total += nbytes
        if len(ranges) < STAGE_MIN_COMPONENTS:  # a few syscalls saved; serial reads would cost more
            return set()
        ranges.sort(key=lambda r: r[0])
        starts: list[int] = []
        ends: list[int] = []
        for offset, nbytes, _, _ in ranges:
            if starts and offset - ends[-1] <= STAGE_GAP and offset >= starts[-1]:
                ends[-1] = max(ends[-1], offset + nbytes)
            else:
                starts.append(offset)
                ends.append(offset + nbytes)
        if hasattr(os, "posix_fadvise"):  # every span asked for at once: the disk reads in parallel
            for start, end in zip(starts, ends, strict=True):
                os.posix_fadvise(self._fd(), start, end - start, os.POSIX_FADV_WILLNEED)
        bufs = []
        for start, end in zip(starts, ends, strict=True):
            buf = np.empty(end - start, np.uint8)
            self._read_fully(memoryview(buf), start)  # type: ignore[arg-type]
            bufs.append(buf)
        self._staged = (starts, ends, bufs)
        # Every staged component against its checksum, span by span (ranges are in file order).
        verified: set[tuple[str, int]] = set()
        k = 0
        for offset, nbytes, owner, i in ranges:
            while offset >= ends[k]:
                k += 1
            if owner is None:
                continue
            at = offset - starts[k]
            if _crc32c.crc32c(bufs[k][at : at + nbytes]) == owner._crcs[i]:  # type: ignore[index, arg-type]
                owner._verified.add(i)
                verified.add((owner.path, i))
        return verified

    def read_bulk(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Read the components at ``slots`` of :attr:`table` (direct rows' components, at most
        ``STAGE_LIMIT`` bytes together) into one buffer and verify each against its checksum.

        The components are read in file order in a few large reads (neighbours less than
        ``STAGE_GAP`` apart share one; the gaps are HDF5's object headers), then each one's
        crc32c is computed over its own bytes in the buffer. Returns the buffer, where each
        slot's bytes start in it, and the positions in ``slots`` of the components whose bytes
        do not match (the caller reads those the general way: a stale offset, or the error
        naming the damage).
        """
        table = self.table
        assert table is not None
        offsets = table.offsets[slots]
        nbytes = table.nbytes[slots]
        order = np.argsort(offsets, kind="stable")
        starts, sizes = offsets[order], nbytes[order]
        ends = np.maximum.accumulate(starts + sizes)
        total = int(sizes.sum())
        for gap in (STAGE_GAP, 0):  # without gaps when they would double what is read
            new = np.empty(starts.size, bool)
            new[:1] = True
            new[1:] = starts[1:] - ends[:-1] > gap
            heads = np.flatnonzero(new)
            span_starts = starts[heads]
            span_ends = ends[np.append(heads[1:], starts.size) - 1]
            spans = span_ends - span_starts
            if int(spans.sum()) <= 2 * total + (1 << 20):
                break
        bases = np.zeros(spans.size, np.int64)
        np.cumsum(spans[:-1], out=bases[1:])
        buf = np.empty(int(spans.sum()), np.uint8)
        fd = self._fd()
        spans_list = list(zip(span_starts.tolist(), spans.tolist(), bases.tolist(), strict=True))
        if len(spans_list) > 1 and hasattr(os, "posix_fadvise"):  # the disk reads them in parallel
            for start, size, _ in spans_list:
                os.posix_fadvise(fd, start, size, os.POSIX_FADV_WILLNEED)
        whole = memoryview(buf)  # type: ignore[arg-type]
        for start, size, base in spans_list:
            self._read_fully(whole[base : base + size], start)
        span_of = np.cumsum(new) - 1
        at_sorted = starts - span_starts[span_of] + bases[span_of]
        crc = _crc32c.crc32c
        bad = [
            k
            for k, p, n, c in zip(
                order.tolist(),
                at_sorted.tolist(),
                sizes.tolist(),
                table.crcs[slots][order].tolist(),
                strict=True,
            )
            if crc(whole[p : p + n]) != c
        ]
        at = np.empty_like(at_sorted)
        at[order] = at_sorted
        return buf, at, bad

    def unstage(self) -> None:
        """Drop what :meth:`stage` read, and what the verification kept."""
        self._staged = None
        with self._lock:
            self._kept, self._slots, self._arena = {}, {}, None

    def _staged_bytes(self, offset: int, nbytes: int) -> np.ndarray | None:
        """The staged bytes ``[offset, offset + nbytes)`` of the file, when staged (or kept
        by a restore's verification)."""
        kept = self._kept.get(offset)
        if kept is not None and kept.size == nbytes:
            return kept
        staged = self._staged
        if staged is None:
            return None
        starts, ends, bufs = staged
        k = bisect.bisect_right(starts, offset) - 1
        if k < 0 or offset + nbytes > ends[k]:
            return None
        return bufs[k][offset - starts[k] : offset - starts[k] + nbytes]

    def __getitem__(self, key: str) -> StoredVariable:
        var = self._variables.get(key)
        if var is not None:
            return var
        meta = self._metas.get(key)
        if meta is None:
            from parallelvars.errors import MissingVariableError

            raise MissingVariableError(
                "no such variable in the checkpoint", file=self.path, variable=key
            )
        # A row of the table, validated at open: made now, once (whichever thread is first).
        return self._variables.setdefault(key, StoredVariable(self, key, meta))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, key: object) -> bool:
        return key in self._variables or key in self._metas

    def verify_all(self) -> list[str]:
        """Check every variable; the problems found (empty when sound).

        Every component's bytes against its checksum, and the file's structure as any HDF5
        reader sees it: each variable's group and attributes (equal to the index; the global
        heap objects of variable-length values validated by our own parser first), each
        component dataset read through HDF5 (its bytes again against the checksum) and a
        sharded variable's ``value`` (equal to its shards), so a file that h5py or ``extract``
        cannot read never passes.
        """
        problems = self._columns_problems() if self._columns else []
        sizes = self._h5().id.get_create_plist().get_sizes()
        heap = GlobalHeapCheck(self._fd(), self.file_size, self.path, *map(int, sizes))
        for var in self.values():
            try:
                var.verify_group(heap)
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
                continue
            sound = True
            for i in range(var.num_components):
                try:
                    var.verify(i)
                    var.verify_through_h5(i)
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
                    sound = False
            if sound and var.kind == "sharded":
                try:
                    var.verify_stitched_value(heap)
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
        return problems

    def _columns_problems(self) -> list[str]:
        """Where the columns document (which the reader took) and the index disagree: each
        variable and field whose values differ, or the index's own damage."""
        try:
            index = _read_json(self._h5(), INDEX_DATASET, self.path, required=True)
        except (CorruptCheckpointError, *_H5_ERRORS) as exc:
            return [str(exc)]
        if not isinstance(index, dict):
            return [f"{self.path}: the index is not a mapping ({type(index).__name__})"]
        problems = []
        columns = self._metas

        def differ(variable: str, field: str, said: Any, says: Any) -> None:
            problems.append(
                str(
                    CorruptCheckpointError(
                        f"the columns and the index disagree on {field!r}",
                        file=self.path,
                        variable=variable,
                        expected=f"the index's {_short(said)}",
                        found=f"the columns' {_short(says)}",
                    )
                )
            )

        if list(index) != list(columns):
            extra = [p for p in columns if p not in index]
            missing = [p for p in index if p not in columns]
            for path in missing:
                differ(path, "paths", "listed", "not listed")
            for path in extra:
                differ(path, "paths", "not listed", "listed")
            if not extra and not missing:
                differ(COLUMNS_DATASET, "paths", "its order", "another order")
        for path, said in index.items():
            if path not in columns:
                continue
            says = columns[path]
            if _same(said, says):
                continue
            if not isinstance(said, dict):
                differ(path, "entry", said, says)
                continue
            for field in dict.fromkeys([*said, *says]):
                mine, theirs = said.get(field, _ABSENT), says.get(field, _ABSENT)
                if field == "attrs" and isinstance(mine, dict) and isinstance(theirs, dict):
                    for key in dict.fromkeys([*mine, *theirs]):
                        if not _same(mine.get(key, _ABSENT), theirs.get(key, _ABSENT)):
                            differ(path, f"attrs.{key}", mine.get(key), theirs.get(key))
                    if list(mine) != list(theirs):
                        differ(path, "attrs (order)", list(mine), list(theirs))
                elif not _same(mine, theirs):
                    differ(path, field, mine, theirs)
            if list(said) != list(says):
                differ(path, "entry (order)", list(said), list(says))
        return problems

    def close(self) -> None:
        # Drop the dataset ids first: those reached through external links keep their own
        # (linked) file open until they are released.
        for var in getattr(self, "_variables", {}).values():
            var._datasets.clear()
        if self._metas:  # made again from the index when asked for after closing
            # (each StoredVariable refers back to this reader: dropping them breaks the cycles,
            # so a closed reader and its index are freed at once, not by the cyclic collector)
            self._variables = {}
        if self._raw_fd is not None:
            os.close(self._raw_fd)
            self._raw_fd = None
        for part in getattr(self, "_parts", {}).values():
            try:
                part.close()
            except _H5_ERRORS:
                pass
        self._parts = {}
        if self._file is not None:
            try:
                self._file.close()
            except _H5_ERRORS:
                pass
            self._file = None

    def __enter__(self) -> H5Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<H5Reader {self.path!r} variables={len(self._names)}>"
