"""The column form of the parallel info (version 2): the same records as version 1, one JSON
array per field instead of one object per variable.

A file of 15,000 mirrored variables spends most of its version-1 info repeating the same
field names, kinds, dtypes, shapes and devices, and (inside a safetensors ``__metadata__``
string) escaping every quote of them; a reader then parses it record by record. Version 2
writes each field once per file:

.. code-block:: json

    {"format": "parallelvars", "version": 2, "names": "dotted", "checksums": "crc32c",
     "columns": {
       "path": ["model/w", "model/e"],
       "kind": {"values": ["mirrored", "sharded"], "index": [0, 1]},
       "dtype": {"values": ["bfloat16", "float32"], "index": [0, 1]},
       "shape": {"values": [[3, 2], [10, 4]], "index": [0, 1]},
       "num_components": {"values": [2, 4], "index": [0, 1]},
       "layout": {"values": ["components", "logical"], "index": [0, 1]},
       "keys": [0, 2, 1],
       "attrs": {
         "devices": {"values": [["cpu:0", "cpu:1"]], "index": [0, -1]},
         "shard_axis": {"values": [0], "index": [-1, 0]},
         "shard_offsets": {"values": [[0, 3, 6, 8]], "index": [-1, 0]}}}}

* Every column holds one value per variable, in ``path`` order: either a plain array of the
  values, or ``{"values": [...distinct values...], "index": [...]}`` where ``index[j]`` is the
  position in ``values`` of variable ``j``'s value; ``"index": 0`` (one integer:
  every variable has ``values[0]``).
* ``attrs`` maps each attribute name to such a column; in the indexed form ``-1`` says that
  variable has no attribute of that name (the plain form: every variable has it). A
  variable's attributes come back in the order the ``attrs`` object lists them; the writer
  uses this form only when that is each variable's own order.
* ``keys`` is flat: each variable's stored tensors in turn (``num_components`` of them for
  the ``components`` layout, 1 for ``logical``, ``num_components + 1`` for ``aggregate``),
  each as its position in the sorted list (by code point) of every tensor name of the file
  (of every shard of a set).

Only variables version 1 would list are listed; the other fields (``names``,
``object_graph``, ``checksums``) are version 1's. A reader checks every column's type and
length, every index against its table and every key position against the file's tensors, and
each distinct layout once, before an entry is made.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from parallelvars._fileio import value_types
from parallelvars.errors import CorruptCheckpointError, LimitExceededError

COLUMNS_VERSION = 2
#: The record fields held as columns, in the order written.
_FIELDS = ("kind", "dtype", "shape", "num_components", "layout")
_ABSENT = -1
_TEXT_OR_INT = frozenset({str, int})
#: The attributes a reader expands, in bytes of version 1's JSON for them, may not exceed what a
#: version-1 header may hold (the safetensors header limit): a column whose index repeats one
#: value (``"index": 0``) stands for that value once per variable, so without a bound a small
#: document could ask for variables x attribute names of work and memory. With it, version 2
#: asks for no more than the largest version-1 record set a reader takes, and the writer keeps
#: version 1 for a model past it (so we never write what we refuse). None: that limit.
ATTRS_LIMIT: int | None = None


def _attrs_limit() -> int:
    """:data:`ATTRS_LIMIT`, or the safetensors header limit (looked up when called: the
    safetensors package imports this module)."""
    if ATTRS_LIMIT is not None:
        return ATTRS_LIMIT
    from parallelvars.formats.safetensors._layout import MAX_HEADER_SIZE

    return MAX_HEADER_SIZE


def _expanded_attrs(raw_attrs: dict[str, Any], n: int) -> int:
    """The JSON bytes version 1 would spend on the attributes ``raw_attrs`` describes for
    ``n`` variables (``"name":value,`` per present cell), counted without expanding them;
    malformed columns count 0 here (:func:`_column` refuses them by name)."""
    total = 0
    for name, col in raw_attrs.items():
        if type(col) is not dict:
            continue  # (a plain array holds each value itself: the document's own bytes)
        values, index = col.get("values"), col.get("index")
        if type(values) is not list:
            continue
        cell = len(json.dumps(name)) + 2
        if type(index) is int and 0 <= index < len(values):
            total += n * (cell + len(json.dumps(values[index], separators=(",", ":"))))
        elif type(index) is list:
            sizes = [cell + len(json.dumps(v, separators=(",", ":"))) for v in values]
            if value_types(index) <= {int}:  # (each distinct code once, counted in C)
                for c, times in Counter(index).items():
                    if 0 <= c < len(sizes):
                        total += sizes[c] * times
            else:  # (bools and floats equal some ints: told apart one by one)
                total += sum(sizes[c] for c in index if type(c) is int and 0 <= c < len(sizes))
    return total


def _hashable(value: Any) -> Any:
    """A dictionary key that tells two JSON values apart exactly as their JSON text does
    (``True`` is not ``1``, ``-0.0`` is not ``0.0``)."""
    t = type(value)
    if t is str or t is int:  # (the common leaves: a string is never an int's equal)
        return value if t is str else (int, value)
    if t is list and value_types(value) <= _TEXT_OR_INT:
        # (a device list, a shape: equal as tuples exactly when equal as JSON text, since no
        # string equals an int and no bool or float is among them)
        return list, tuple(value)
    if t in (list, dict):
        return dict, json.dumps(value, separators=(",", ":"))
    if t is float:  # (-0.0 == 0.0, but they are two values)
        return "float", repr(value)
    return type(value).__name__, value


def _distinct(values: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """``values`` as ``(table, codes)``: the distinct values in first-seen order (told apart
    as their JSON text is) and each value's position in it (``_MISSING``: ``_ABSENT``)."""
    if value_types(values) <= _TEXT_OR_INT:
        # (strings and ints, told apart by their own equality: no string equals an int, and
        # no bool or float is among them; the distinct values in first-seen order, at once)
        positions = {v: k for k, v in enumerate(dict.fromkeys(values))}
        return list(positions), list(map(positions.__getitem__, values))
    table: dict[Any, int] = {}
    distinct: list[Any] = []
    codes: list[int] = []
    for v in values:
        if v is _MISSING:
            codes.append(_ABSENT)
            continue
        k = _hashable(v)
        at = table.get(k)
        if at is None:
            at = table[k] = len(distinct)
            distinct.append(v)
        codes.append(at)
    return distinct, codes


def _encode(values: Sequence[Any], *, optional: bool = False) -> Any:
    """A column of ``values`` (``optional``: ``_MISSING`` marks a variable without one): the
    indexed form when values repeat or some are missing, else the plain array."""
    distinct, index = _distinct(values)
    if not optional and 2 * len(distinct) > len(values):
        return list(values)
    if len(distinct) == 1 and _ABSENT not in index:
        return {"values": distinct, "index": 0}  # one value for every variable
    return {"values": distinct, "index": index}


_MISSING: Any = object()


def to_columns(info: Mapping[str, Any], tensor_names: Iterable[str]) -> dict[str, Any] | None:
    """The version-2 form of the version-1 ``info`` whose keys are among ``tensor_names``;
    None when a variable's attributes are in another order than the columns would give
    back (the caller keeps version 1 then)."""
    variables: Mapping[str, Any] = info["variables"]
    records = list(variables.values())
    position = {name: i for i, name in enumerate(sorted(tensor_names))}
    attr_names: dict[str, int] = {}
    for rec in records:
        for name in rec["attrs"]:
            attr_names.setdefault(name, len(attr_names))
    for rec in records:  # each record's own order must be the columns' order
        ranks = [attr_names[name] for name in rec["attrs"]]
        if ranks != sorted(ranks):
            return None
    columns: dict[str, Any] = {"path": list(variables)}
    for field in _FIELDS:
        columns[field] = _encode([rec[field] for rec in records])
    columns["keys"] = [position[key] for rec in records for key in rec["keys"]]
    columns["attrs"] = {
        name: _encode([rec["attrs"].get(name, _MISSING) for rec in records], optional=True)
        for name in attr_names
    }
    if _expanded_attrs(columns["attrs"], len(records)) > _attrs_limit():
        return None  # (a reader would refuse the expansion: version 1 says the same)
    out = {k: v for k, v in info.items() if k != "variables"}
    out["version"] = COLUMNS_VERSION
    out["columns"] = columns
    return out


def _corrupt(
    file: str, what: str, variable: str | None = None, **kw: Any
) -> CorruptCheckpointError:
    """The error of a damaged parallel info (both versions), naming the file and variable."""
    return CorruptCheckpointError(what, file=file, variable=variable, **kw)


def _ints_below(values: Any, low: int, high: int) -> bool:
    """Whether ``values`` is a list of ints (not bools) in ``[low, high)``, checked in bulk."""
    if type(values) is not list:
        return False
    if not values:
        return True
    return value_types(values) <= {int} and min(values) >= low and max(values) < high


def _first_bad(values: list[Any], low: int, high: int) -> int:
    for j, v in enumerate(values):
        if type(v) is not int or not low <= v < high:
            return j
    return len(values)


def _column(
    file: str, name: str, col: Any, paths: list[str], *, optional: bool = False
) -> tuple[list[Any], list[int]]:
    """A column as ``(table, codes)``: variable ``j``'s value is ``table[codes[j]]`` (-1:
    absent, only where ``optional``), every code checked against the table."""
    n = len(paths)
    where = f"parallelvars/columns/{name}"
    if type(col) is list:
        if len(col) != n:
            raise _corrupt(
                file,
                f"the parallel info column {name!r} has the wrong length",
                where,
                expected=f"{n} values (one per path)",
                found=len(col),
            )
        return _distinct(col)
    if type(col) is not dict or set(col) != {"values", "index"}:
        raise _corrupt(
            file,
            f"the parallel info column {name!r} is not a column",
            where,
            expected='an array or {"values": [...], "index": [...]}',
            found=type(col).__name__ if type(col) is not dict else sorted(col),
        )
    values, index = col["values"], col["index"]
    if type(values) is list and type(index) is int and 0 <= index < len(values):
        index = [index] * n  # (one value for every variable)
    if type(values) is not list or type(index) is not list or len(index) != n:
        raise _corrupt(
            file,
            f"the parallel info column {name!r} is malformed",
            where,
            expected=f"a values array and {n} indices",
            found=f"{type(values).__name__} values, "
            f"{len(index) if type(index) is list else type(index).__name__} indices",
        )
    low = _ABSENT if optional else 0
    if not _ints_below(index, low, len(values)):
        j = _first_bad(index, low, len(values))
        raise _corrupt(
            file,
            f"the parallel info column {name!r} points outside its values",
            paths[j] if j < n else where,
            expected=f"an index in [{low}, {len(values)})",
            found=repr(index[j]) if j < n else type(index).__name__,
        )
    return values, index


class AttrRows(Sequence[dict[str, Any]]):
    """Each variable's attributes, as the ``attrs`` columns give them: ``self[j]`` is the dict
    of variable ``j``'s (in the columns' order, the absent left out), one dict shared by the
    variables alike in every attribute code, its values the columns' own: read it, copy
    before changing one (as an entry does at its first use)."""

    def __init__(
        self, names: list[str], columns: list[tuple[list[Any], list[int]]], count: int
    ) -> None:
        self._names = names
        self._columns = columns
        self._count = count
        # One dict per distinct combination of codes (made when first asked for).
        self._made: dict[tuple[int, ...], dict[str, Any]] = {}

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, j: Any) -> Any:
        if not isinstance(j, int):
            return [self[i] for i in range(self._count)[j]]
        j = range(self._count)[j]  # (IndexError past either end, as a list's)
        combo = tuple([codes[j] for _, codes in self._columns])
        out = self._made.get(combo)
        if out is None:
            out = {
                name: table[c]
                for name, (table, _), c in zip(self._names, self._columns, combo, strict=True)
                if c >= 0
            }
            out = self._made.setdefault(combo, out)  # (one dict, whichever thread made it)
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[j] for j in range(self._count))

    def column(self, name: str) -> list[Any]:
        """Every variable's attribute ``name`` (None where a variable has none), the values
        shared: read them, do not change them."""
        for own, (table, codes) in zip(self._names, self._columns, strict=True):
            if own == name:
                if _ABSENT in codes:
                    return [None if c < 0 else table[c] for c in codes]
                return list(map(table.__getitem__, codes))
        return [None] * self._count


def records_from_columns(
    file: str, columns: Any, tensor_names: Iterable[str], group_by: Sequence[str] = ()
) -> tuple[list[str], list[tuple[int, ...]], list[list[Any]], list[str], AttrRows]:
    """The columns of a version-2 info, checked and decoded.

    Returns:
        ``(paths, layouts, tables, keys, attrs)``: ``layouts[j]`` is variable ``j``'s codes of
        the fields ``kind, dtype, shape, num_components, layout`` into ``tables`` (one per
        field), then its codes of the attributes named in ``group_by`` that the file lists
        (equal codes: equal values; -1: absent); ``keys`` every variable's stored tensors'
        names in turn (flat: the caller splits them by layout); ``attrs[j]`` variable ``j``'s
        attributes (:class:`AttrRows`, made when asked for).

    Raises:
        CorruptCheckpointError: naming the file, the column or variable, expected and found.
    """
    where = "parallelvars/columns"
    if type(columns) is not dict:
        raise _corrupt(
            file, "the parallel info columns are not an object", where, found=type(columns).__name__
        )
    paths = columns.get("path")
    if type(paths) is not list or value_types(paths) - {str}:
        raise _corrupt(
            file,
            "the parallel info has no list of variable paths",
            f"{where}/path",
            expected="an array of strings",
            found=type(paths).__name__,
        )
    if len(set(paths)) != len(paths):
        seen: set[str] = set()
        dup = next(p for p in paths if p in seen or seen.add(p))  # type: ignore[func-returns-value]
        raise _corrupt(file, "a variable is listed twice in the parallel info", dup)
    tables: list[list[Any]] = []
    codes: list[list[int]] = []
    for field in _FIELDS:
        table, code = _column(file, field, columns.get(field), paths)
        tables.append(table)
        codes.append(code)
    layouts = list(zip(*codes, strict=True)) if paths else []
    raw_attrs = columns.get("attrs", {})
    if type(raw_attrs) is not dict:
        raise _corrupt(
            file,
            "the parallel info attributes are not an object",
            f"{where}/attrs",
            found=type(raw_attrs).__name__,
        )
    expanded, limit = _expanded_attrs(raw_attrs, len(paths)), _attrs_limit()
    if expanded > limit:
        raise LimitExceededError(
            "the parallel info's attribute columns expand beyond what a header may hold",
            file=file,
            variable=f"{where}/attrs",
            expected=f"at most {limit} bytes of attributes (as version 1's records)",
            found=f"{expanded} bytes for {len(paths)} variables x {len(raw_attrs)} names",
        )
    attr_names = list(raw_attrs)
    attr_cols = [
        _column(file, f"attrs/{name}", col, paths, optional=True) for name, col in raw_attrs.items()
    ]
    # Each variable's attributes made when asked for, from the columns (no dict per
    # variable held).
    attrs = AttrRows(attr_names, attr_cols, len(paths))
    names = sorted(tensor_names)
    flat: Any = columns.get("keys")
    if not _ints_below(flat, 0, len(names)):
        j = _first_bad(flat, 0, len(names)) if type(flat) is list else 0
        raise _corrupt(
            file,
            "the parallel info names a stored tensor the file does not hold",
            f"{where}/keys",
            expected=f"positions in [0, {len(names)})",
            found=repr(flat[j]) if type(flat) is list and j < len(flat) else type(flat).__name__,
        )
    if len(set(flat)) != len(flat):
        seen_k: set[int] = set()
        dup_k = next(k for k in flat if k in seen_k or seen_k.add(k))  # type: ignore[func-returns-value]
        raise _corrupt(
            file,
            f"stored tensor {names[dup_k]!r} is claimed twice in the parallel info",
            f"{where}/keys",
            expected="one owner",
            found="two",
        )
    keys = list(map(names.__getitem__, flat))
    watched = [
        code for name, (_, code) in zip(attr_names, attr_cols, strict=True) if name in group_by
    ]
    if watched:  # the codes of the attributes the caller groups by, beside the layout's
        layouts = [
            (*lay, *more) for lay, more in zip(layouts, zip(*watched, strict=True), strict=True)
        ]
    return paths, layouts, tables, keys, attrs
