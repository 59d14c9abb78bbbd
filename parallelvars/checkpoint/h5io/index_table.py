"""A native file's index as a table of columns (:class:`IndexTable`), parsed and validated in
bulk from the decoded index document (:func:`_index_table`): what lets a restore of many
variables read and check them column by column instead of one object per variable.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np

from parallelvars._fileio import value_types
from parallelvars.checkpoint.entry import AGGREGATIONS, layout_problem
from parallelvars.checkpoint.h5io.stored import _dtype_named
from parallelvars.checkpoint.registry import component_name
from parallelvars.errors import TruncatedFileError, UnsupportedDtypeError

__all__ = ["IndexTable"]

# Every type a canonical index field has; anything else sends the whole file down the general
# path (one StoredVariable per entry, made at open, as before).
_NONE = type(None)
_T = TypeVar("_T")


def one_each(values: Iterable[_T]) -> list[_T]:
    """``list(values)`` with equal values one object (the first met): a column of many rows
    holds few distinct shapes, sizes or names, each then held once, not once per row."""
    seen: dict[Any, Any] = {}
    keep = seen.setdefault
    return [keep(v, v) for v in values]


class RowIndex(Mapping[str, int]):
    """Each name's row, from the rows' names (each once: checked by the caller), its
    mapping made when a name is first looked up: a reader that walks every row in order
    (``verify``, ``inspect``) never holds one (at 150,000 rows, 8 MB of dict and ints)."""

    __slots__ = ("_names", "_rows")

    def __init__(self, names: list[str]) -> None:
        self._names = names
        self._rows: dict[str, int] | None = None

    def _mapping(self) -> dict[str, int]:
        rows = self._rows
        if rows is None:  # (two threads may both make it: equal dicts, either kept)
            rows = self._rows = dict(zip(self._names, range(len(self._names)), strict=True))
        return rows

    def __getitem__(self, name: str) -> int:
        return self._mapping()[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self._mapping().get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._mapping()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class IndexTable:
    """A native file's index as arrays: one row per variable (in the index's order), one slot per
    component, parsed and validated in bulk at open.

    A row holds a variable's kind, dtype, shape, number of components and on-read aggregation;
    the component slots ``first[row]:first[row + 1]`` hold each component's data offset in the
    file, size in bytes and checksum. ``direct[row]`` says whether the row's components can be
    read in bulk (:meth:`H5Reader.read_bulk`, for a restore and for the commands alike): every
    component non-empty, at an offset and with a checksum the index gives, in a dtype of
    fixed size, not sharded, whatever its size (a bulk read holds a large one alone). Rows
    are plain lists of values the decoded index already holds
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
        rows: Mapping[str, int] | None = None,
    ) -> None:
        self.names = names
        # (each name's row; made when first looked up unless given)
        self.rows = RowIndex(names) if rows is None else rows
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
        :meth:`StoredVariable._location` would name it). Names of one dataset (the same
        offset, size and checksum: hard links) are one place. Offsets that overlap are no error:
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
        # Names of one dataset (components stored once, hard links): the same offset, size
        # and checksum; each such place counts once.
        same = (
            (offsets[order[1:]] == offsets[order[:-1]])
            & (nbytes[order[1:]] == nbytes[order[:-1]])
            & (self.crcs[order[1:]] == self.crcs[order[:-1]])
        )
        if same.any():
            order = order[np.concatenate(([True], ~same))]
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
        if n < 1 or (kind != "sharded" and layout_problem(kind, (), n, {}) is not None):
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
    row_of: Mapping[str, int] | None = None,
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
    placed = (nbytes > 0) & has
    per_row = np.add.reduceat(placed.astype(np.int64), first[:-1]) if rows else counts_arr
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
        one_each((row_nbytes * counts_arr).tolist()),
        row_of,
    )
