"""The columns document of a native file (docs/FORMAT.md): the index in columns, written by
:func:`_columns_parts` and parsed into an
:class:`~parallelvars.checkpoint.h5io.index_table.IndexTable` and its entries
(:func:`_columns_table`), every field checked against what the writer writes.
"""

from __future__ import annotations

import bisect
import itertools
import json
import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np

from parallelvars._fileio import value_types
from parallelvars._ints import unique_ints
from parallelvars.checkpoint.entry import AGGREGATIONS, MAX_COMPONENTS, layout_problem
from parallelvars.checkpoint.h5io.index_table import (
    _NONE,
    IndexTable,
    RowIndex,
    _assemble,
    one_each,
)
from parallelvars.checkpoint.h5io.layout import (
    COLUMNS_DATASET,
    COLUMNS_ROW_ATTRS,
    COLUMNS_VERSION,
    INDEX_DATASET,
)
from parallelvars.checkpoint.h5io.stored import _dtype_named
from parallelvars.errors import CorruptCheckpointError, InvalidEntryError, UnsupportedDtypeError

__all__ = ["ColumnEntries"]


def _copied(value: Any) -> Any:
    """A copy of a decoded JSON value (``copy.deepcopy``'s result, without its memo: strings,
    numbers, booleans and None are shared, lists and objects made anew)."""
    t = type(value)
    if t is list:
        types = set(map(type, value))
        if list not in types and dict not in types:  # (of strings and numbers: shared)
            return list(value)
        return list(map(_copied, value))
    if t is dict:
        return {k: _copied(v) for k, v in value.items()}
    return value


def _columns_parts(index: Mapping[str, Any]) -> tuple[str, str]:
    """The columns document of ``index`` (docs/FORMAT.md) without its checksums: the text
    before them and after them (``head + ", ".join(map(str, crcs)) + tail`` is the document).

    Distinct layouts (kind, dtype, number of dimensions and of components, the attributes but
    the per-row ones, each a ``null`` where it stands) are listed once and referenced by
    number; the paths, the per-row attributes, dimensions, data offsets and checksums are flat
    lists, the last three of every row's values in turn (a row's count is its layout's).
    """
    ids: dict[tuple[Any, ...], int] = {}
    layouts: list[dict[str, Any]] = []
    rows: list[int] = []
    row_attrs: dict[str, list[Any]] = {k: [] for k in COLUMNS_ROW_ATTRS}
    columns = list(row_attrs.items())
    dims: list[int] = []
    offsets: list[int | None] = []
    for meta in index.values():
        attrs = meta["attrs"]
        fixed = dict(attrs)
        for key, column in columns:
            column.append(fixed.get(key))
            if key in fixed:
                fixed[key] = None
        shape = meta["shape"]
        layout = (meta["kind"], meta["dtype"], len(shape), meta["num_components"], repr(fixed))
        number = ids.get(layout)
        if number is None:
            number = ids[layout] = len(layouts)
            kind, dtype, ndim, count, _ = layout
            layouts.append(
                {
                    "kind": kind,
                    "dtype": dtype,
                    "ndim": ndim,
                    "num_components": count,
                    "attrs": fixed,
                }
            )
        rows.append(number)
        dims.extend(shape)
        offsets.extend(meta["offsets"])
    doc = {
        "version": COLUMNS_VERSION,
        "layouts": layouts,
        "paths": list(index),
        "layout": rows,
        "row_attrs": row_attrs,
        "shapes": dims,
        "offsets": offsets,
    }
    return json.dumps(doc)[:-1] + ', "crc32c": [', "]}"


_ENCODE = json.encoder.encode_basestring_ascii  # (how json.dumps writes a string)
_META_KEYS = frozenset({"kind", "dtype", "shape", "num_components"})


class RecordDocuments:
    """The documents of records (:func:`record_documents`) in two steps: the columns
    document's text around its checksums (``head``, in pieces, and ``tail``: see
    :func:`_columns_parts`) and the index document's length without its checksums' digits
    (``index_bare``: :func:`index_bare_length` of its runs) at once, the index's text when
    :meth:`index_runs` is asked. A first save sizes its documents' rooms in the metadata by
    the lengths and makes the index's text only once the metadata is written and the plan has
    let go of what made it (an image kept for repeated saves is still held then: it is the
    plan's objects and their transients that are out of the index text's way)."""

    def __init__(
        self,
        records: Sequence[Any],
        ids: Sequence[int],
        literals: list[list[str]],
        places: list[tuple[int, int, tuple[int, ...]]],
        consts: list[list[str | None]],
        blocks: list[tuple[int, int, str, str]],
        head: list[str],
        index_bare: int,
    ) -> None:
        self._records = records
        self._ids = ids
        self._literals = literals
        self._places = places
        self._consts = consts
        self._blocks = blocks
        self.head = head
        self.tail = "]}"
        self.index_bare = index_bare

    def index_runs(self) -> list[tuple[str, int]]:
        """The index document as a template in runs (see :func:`index_pieces`), made now a
        block of at most ``_RUN`` records at a time: the records' paths and row strings
        encoded again, their dimensions' and offsets' texts those of the columns document
        (split, not made again)."""
        runs: list[tuple[str, int]] = []
        ids = self._ids
        for a, b, dims, offsets in self._blocks:
            block = self._records[a:b]
            block_ids = ids[a:b]
            paths = list(map(_ENCODE, map(_PATH, block)))
            attrs = list(map(_ATTRS, block))
            rows = [
                _row_strings(attrs, block_ids, key, [c[r] for c in self._consts])
                for r, key in enumerate(COLUMNS_ROW_ATTRS)
            ]
            # (the index is itself a format, of the checksums: a "%" of a value doubled)
            for column in (paths, *rows):
                if "%" in "".join(column):
                    column[:] = [v.replace("%", "%%") for v in column]
            runs += _index_texts(
                block_ids,
                self._literals,
                self._places,
                paths,
                rows,
                dims.split(", ") if dims else [],
                offsets.split(", ") if offsets else [],
            )
        return runs


_PATH = operator.attrgetter("path")
_ATTRS = operator.attrgetter("attrs")
_SHAPE = operator.attrgetter("shape")


def record_documents(
    records: Sequence[Any],
    offsets: Mapping[str, Sequence[int | None]],
    classes: Any = None,
) -> RecordDocuments | None:
    """The documents of ``records`` (entries with ``path``, ``kind``, ``dtype``, ``shape``,
    ``num_components``, ``attrs``) whose components lie at ``offsets`` (by path), as
    :class:`RecordDocuments`: ``"".join(index_pieces(d.index_runs(), crcs))`` is
    ``json.dumps(index)`` and ``"".join(d.head) + ... + d.tail`` the columns document
    (:func:`_columns_parts`) of the index a writer records of them, made without building the
    index (no dictionary or list per record) and without joining the runs or the pieces (a
    save writes them a piece at a time: the documents are never held whole besides). An
    attribute name that is not text is refused by ``record_classes`` (``InvalidEntryError``);
    None only for ``classes`` made otherwise, holding such a record (the caller builds the
    index instead).

    The records are taken by class (``classes``: their
    :func:`~parallelvars.checkpoint.h5io.records.record_classes`, made here when not given):
    a class's text is made once from its first record, as a format with a place for each
    record's path, dimensions, row strings and offsets, and each record's text is that format
    with its values put in. The columns' texts are made a block of at most ``_RUN`` records at
    a time (each block's texts pieces of the document: no list of a text per record is held
    for all records at once)."""
    from parallelvars.checkpoint.h5io.records import record_classes

    if classes is None:
        classes = record_classes(records)
    enc = _ENCODE
    caches: tuple[dict[Any, str], dict[str, str], dict[Any, str]] = ({}, {}, {})
    literals: list[list[str]] = []
    # per class: its records' number of dimensions, of components and row strings' columns
    row_places: list[tuple[int, int, tuple[int, ...]]] = []
    row_const: list[list[str | None]] = []  # per class: each row column's text, None: per record
    col_layout: list[int] = []  # per class: its number in the columns' layouts
    class_bare: list[int] = []  # per class: the length of its text without its values
    layouts: dict[tuple[Any, ...], int] = {}
    layout_texts: list[str] = []
    row_keys = COLUMNS_ROW_ATTRS
    for k in classes.first:
        made = _class_texts(records[k], caches)
        if made is None:
            return None
        fmt, at, consts, layout, layout_text = made
        first = records[k]
        n = int(first.num_components)
        literals.append(_literals(fmt))
        class_bare.append(index_bare_length([("".join(literals[-1]), n)]) - 2)
        row_places.append((len(first.shape), n, at))
        row_const.append(consts)
        number = layouts.get(layout)
        if number is None:
            number = layouts[layout] = len(layout_texts)
            layout_texts.append(layout_text)
        col_layout.append(number)
    ids = classes.ids
    count = len(records)
    per_class = np.bincount(np.asarray(ids, np.int64), minlength=len(literals)).tolist()
    # the index's length: each record's class's text without its values, the values (the
    # columns' values but the row strings a record's class gives), the separators
    bare = 2 + 2 * max(count - 1, 0) + sum(map(operator.mul, per_class, class_bare))
    for times, consts in zip(per_class, row_const, strict=True):
        bare -= times * sum(len(text) for text in consts if text is not None)
    paths: list[str] = []
    numbers: list[str] = []
    rows: list[list[str]] = [[] for _ in row_keys]
    dims: list[str] = []
    places: list[str] = []
    blocks: list[tuple[int, int, str, str]] = []
    for a in range(0, count, _RUN):
        b = min(a + _RUN, count)
        block = records[a:b]
        block_ids = ids[a:b]
        raw = list(map(_PATH, block))
        texts = [", ".join(map(enc, raw))]
        numbers.append(", ".join(map(str, map(col_layout.__getitem__, block_ids))))
        attrs = list(map(_ATTRS, block))
        for r, key in enumerate(row_keys):
            column = _row_strings(attrs, block_ids, key, [c[r] for c in row_const])
            texts.append(", ".join(column))
            rows[r].append(texts[-1])
        paths.append(texts[0])
        bare += sum(map(len, texts)) - 2 * (b - a - 1) * len(texts)
        # every dimension's and every offset's text, in turn (None: null, in both documents)
        dim_text = ", ".join(map(str, map(int, itertools.chain.from_iterable(map(_SHAPE, block)))))
        off_text = ", ".join(map(str, itertools.chain.from_iterable(map(offsets.__getitem__, raw))))
        if "None" in off_text:
            off_text = off_text.replace("None", "null")
        for text in (dim_text, off_text):
            bare += len(text) - 2 * text.count(", ")
        dims.append(dim_text)
        places.append(off_text)
        blocks.append((a, b, dim_text, off_text))
    # (the columns' texts as pieces, each made once: never joined into one text here)
    head = [
        f'{{"version": {COLUMNS_VERSION}, "layouts": [{", ".join(layout_texts)}], "paths": [',
        *_listed(paths),
        '], "layout": [',
        *_listed(numbers),
        '], "row_attrs": {',
    ]
    for r, key in enumerate(row_keys):
        head += (f"{', ' if r else ''}{enc(key)}: [", *_listed(rows[r]), "]")
    head += ('}, "shapes": [', *_listed(dims), '], "offsets": [', *_listed(places))
    head.append('], "crc32c": [')
    return RecordDocuments(records, ids, literals, row_places, row_const, blocks, head, bare)


def _row_strings(
    attrs: Sequence[Mapping[str, Any]], ids: Sequence[int], key: str, const: list[str | None]
) -> list[str]:
    """A row column's texts for records with ``attrs`` of classes ``ids``: each class's own
    (``const``, by class), or (None there) each record's string."""
    if None not in const:
        return cast(list[str], list(map(const.__getitem__, ids)))
    if const.count(None) == len(const):
        return [_ENCODE(a[key]) for a in attrs]
    return [
        _ENCODE(a[key]) if const[c] is None else cast(str, const[c])
        for a, c in zip(attrs, ids, strict=True)
    ]


def _listed(texts: Sequence[str]) -> list[str]:
    """A JSON list's items' texts, given in blocks (each its items joined), as pieces: a
    ``", "`` between two blocks (an empty block: none)."""
    out: list[str] = []
    for text in texts:
        if text:
            if out:
                out.append(", ")
            out.append(text)
    return out


def index_pieces(runs: Sequence[tuple[str, int]], crcs: Sequence[int]) -> Iterator[str]:
    """The index document's text of the template ``runs`` (:func:`record_documents`: each
    run's text a format of its count of checksums) with the checksums ``crcs`` in turn, a
    piece at a time: ``{``, each run's text with its checksums put in (``", "`` between
    two), ``}``."""
    wanted = sum(count for _, count in runs)
    if wanted != len(crcs):
        raise InvalidEntryError(
            "the index's template does not take the checksums given",
            variable=INDEX_DATASET,
            expected=f"{wanted} checksums",
            found=len(crcs),
        )
    yield "{"
    at = 0
    for r, (text, count) in enumerate(runs):
        if r:
            yield ", "
        yield text % tuple(crcs[at : at + count])
        at += count
    yield "}"


def template_runs(template: str, count: int) -> list[tuple[str, int]]:
    """A whole index template (``json.dumps(index)`` with a ``%d`` for each of its ``count``
    checksums, :func:`~parallelvars.checkpoint.h5io.records.marked_template`) as the runs
    :func:`index_pieces` takes: one run, the text between its braces."""
    if not (template.startswith("{") and template.endswith("}")):
        raise InvalidEntryError(
            "an index template is not one JSON object",
            variable=INDEX_DATASET,
            expected="{...}",
            found=template[:32],
        )
    return [(template[1:-1], count)]


def index_bare_length(runs: Sequence[tuple[str, int]]) -> int:
    """The length of the index document of the template ``runs`` without its checksums'
    digits (each ``%%`` of a run one ``%``, each ``%d`` none)."""
    texts = sum(len(text) - text.count("%%") - 2 * count for text, count in runs)
    return texts + 2 + 2 * max(len(runs) - 1, 0)


def _class_texts(
    e: Any, caches: tuple[dict[Any, str], dict[str, str], dict[Any, str]]
) -> tuple[str, tuple[int, ...], list[str | None], tuple[Any, ...], str] | None:
    """The texts of the class of record ``e`` (see :func:`record_documents`): the format of
    its records' index text (a ``%s`` for the path, a ``%d`` for each dimension, a ``%s`` for
    each row string and each offset, a ``%%d`` for each checksum; the class's own text with
    each ``%`` made ``%%%%``), the row columns whose strings each record gives (their numbers
    in ``COLUMNS_ROW_ATTRS``, in the attributes' order), each row column's text when the class gives it (None: the record's
    string), and its columns layout's key and text. None for an attribute key that is not a
    string."""
    from parallelvars._dtypes import dtype_name
    from parallelvars.checkpoint.h5io.attributes import _attr_value, _decode

    enc = _ENCODE
    dtypes, keys, texts = caches
    dt = e.dtype
    dtype = dtypes.get(dt)
    if dtype is None:
        dtype = dtypes[dt] = enc(dtype_name(np.dtype(dt)))
    kind = enc(e.kind)
    n = int(e.num_components)
    ndim = len(e.shape)
    row_keys = COLUMNS_ROW_ATTRS
    consts: list[str | None] = ["null"] * len(row_keys)
    places: list[int] = []
    items: list[str] = []  # (each a piece of the format)
    fixed: list[str] = []
    for key, val in e.attrs.items():
        if val is None or key in _META_KEYS:
            continue
        if type(key) is not str:
            return None
        name = keys.get(key)
        if name is None:
            name = keys[key] = enc(key)
        t = type(val)
        # what the file's attribute decodes to is the value itself for these (strings that are
        # not "json:" text, booleans, integers of int64)
        if t is str and not val.startswith("json:"):
            if key in row_keys:  # (a name, a slot's variable: each record's own)
                places.append(row_keys.index(key))
                items.append(_doubled(name + ": ") + "%s")
                consts[row_keys.index(key)] = None
                fixed.append(name + ": null")
                continue
            known = texts.get(val)
            text = known if known is not None else texts.setdefault(val, enc(val))
        elif t is bool:
            text = "true" if val else "false"
        elif t is int and -(1 << 63) <= val < 1 << 63:
            text = int.__repr__(val)
        elif t is list and all(type(x) is str and not x.startswith("json:") for x in val):
            text = "[" + ", ".join(map(enc, val)) + "]"
        else:
            vkey = _value_key(val)
            known = texts.get(vkey) if vkey is not None else None
            if known is not None:
                text = known
            else:
                text = json.dumps(_decode(_attr_value(val)))
                if vkey is not None:
                    texts[vkey] = text
        item = name + ": " + text
        items.append(_doubled(item))
        if key in row_keys:
            consts[row_keys.index(key)] = text
            fixed.append(name + ": null")
        else:
            fixed.append(item)
    dims = ", ".join(["%d"] * ndim)
    marks = ", ".join(["%%d"] * n)
    fmt = (
        "%s: "
        + _doubled(f'{{"kind": {kind}, "dtype": {dtype}, "shape": [')
        + dims
        + _doubled(f'], "num_components": {n}, "attrs": {{')
        + ", ".join(items)
        + '}, "offsets": ['
        + ", ".join(["%s"] * n)
        + '], "crc32c": ['
        + marks
        + "]}"
    )
    fixed_text = ", ".join(fixed)
    layout = (kind, dtype, ndim, n, fixed_text)
    layout_text = (
        f'{{"kind": {kind}, "dtype": {dtype}, "ndim": {ndim}, "num_components": {n}, '
        f'"attrs": {{{fixed_text}}}}}'
    )
    return fmt, tuple(places), consts, layout, layout_text


_PLACE = re.compile(r"%(.)", re.S)


def _literals(fmt: str) -> list[str]:
    """The texts of a class's format (see :func:`_class_texts`) around its places, as one
    ``%`` operation leaves them (each ``%%`` one ``%``): ``fmt % values`` is these texts with
    the values between them."""
    pieces = [""]
    at = 0
    for m in _PLACE.finditer(fmt):
        pieces[-1] += fmt[at : m.start()]
        if m.group(1) == "%":
            pieces[-1] += "%"
        else:
            pieces.append("")
        at = m.end()
    pieces[-1] += fmt[at:]
    return pieces


_RUN = 4096  # records a block of the documents' texts holds at most (see record_documents)


def _index_texts(
    ids: Sequence[int],
    literals: Sequence[list[str]],
    places: Sequence[tuple[int, int, tuple[int, ...]]],
    paths: list[str],
    row_columns: list[list[str]],
    dims: list[str],
    offsets: list[str],
) -> list[tuple[str, int]]:
    """The index texts of a block of records, a run of records of one class at a time, each
    run's by one join of its columns (no text or tuple made per record): class ``c``'s
    ``literals[c]`` with, between them, each record's path, dimensions (``dims``: every
    record's in turn), row strings (of the row columns its ``places[c]`` names) and offsets
    (``offsets``, in turn); ``places[c]``: the class's number of dimensions, of components
    and its row columns. The texts joined with ``", "`` are the records' texts so joined;
    each comes with its count of checksums (a ``%d`` for each)."""
    ids_arr = np.asarray(ids, np.int64)
    cuts = np.flatnonzero(ids_arr[1:] != ids_arr[:-1]) + 1
    bounds = [0, *cuts.tolist(), len(ids)]
    texts: list[tuple[str, int]] = []
    d = o = 0  # (the run's first dimension and first offset)
    for a, b in itertools.pairwise(bounds):
        if a == b:
            continue
        c = ids[a]
        lit = literals[c]
        ndim, n, at = places[c]
        assert len(lit) == 2 + ndim + len(at) + n
        sep = lit[-1] + ", " + lit[0]
        count = b - a
        cols: list[Any] = [paths[a:b]]
        k = 1
        for j in range(ndim):
            cols += (itertools.repeat(lit[k]), dims[d + j : d + ndim * count : ndim])
            k += 1
        for r in at:
            cols += (itertools.repeat(lit[k]), row_columns[r][a:b])
            k += 1
        for j in range(n):
            cols += (itertools.repeat(lit[k]), offsets[o + j : o + n * count : n])
            k += 1
        cols.append(itertools.repeat(sep))
        joined = "".join(itertools.chain.from_iterable(zip(*cols, strict=False)))
        # (the last record's text ends at its class's last text, not at the separator)
        texts.append((lit[0] + joined[: len(joined) - len(sep) + len(lit[-1])], n * count))
        d += ndim * count
        o += n * count
    return texts


def _doubled(text: str) -> str:
    """``text`` as a literal of a format whose result is itself a format (each ``%`` four
    times: once for each of the two ``%`` operations)."""
    return text.replace("%", "%%%%") if "%" in text else text


def _value_key(value: Any) -> Any:
    """A key for an attribute value whose text is worth keeping (None: none)."""
    t = type(value)
    if t is str:
        return (t, value)
    if t is list and all(type(x) is str for x in value):
        return ("strs", *value)
    return None


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
        rows: Mapping[str, int],
        dim_first: np.ndarray,
        comp_first: np.ndarray,
        offsets: np.ndarray | None = None,
        crcs: np.ndarray | None = None,
    ) -> None:
        """``offsets``/``crcs``: the document's offsets (-1 for null) and checksums as
        arrays, its lists of them then left out of ``doc`` (None there: a file's components
        are most of a columns document's values, and as Python ints they would be most of
        its memory). ``dim_first``/``comp_first``: where each row's dimensions and components
        start in the document's lists, as arrays (not an int object per row)."""
        self._doc = doc
        self._rows = rows
        self._dim_first = dim_first
        self._comp_first = comp_first
        self.offsets = offsets
        self.crcs = crcs

    def __getitem__(self, path: str) -> dict[str, Any]:
        return self.entry(self._rows[path])

    def entry(self, row: int) -> dict[str, Any]:
        """Row ``row``'s entry (as ``self[path]`` of its path)."""
        doc = self._doc
        layout = doc["layouts"][doc["layout"][row]]
        d, c = int(self._dim_first[row]), int(self._comp_first[row])
        n = layout["num_components"]
        row_attrs = doc["row_attrs"]
        return {
            "kind": layout["kind"],
            "dtype": layout["dtype"],
            "shape": doc["shapes"][d : d + layout["ndim"]],
            "num_components": n,
            "attrs": {
                k: row_attrs[k][row] if v is None else _copied(v)
                for k, v in layout["attrs"].items()
            },
            "offsets": self._offsets_of(c, n),
            "crc32c": doc["crc32c"][c : c + n]
            if self.crcs is None
            else self.crcs[c : c + n].tolist(),
        }

    def _offsets_of(self, c: int, n: int) -> list[int | None]:
        if self.offsets is None:
            return list(self._doc["offsets"][c : c + n])
        return [None if o < 0 else o for o in self.offsets[c : c + n].tolist()]

    def attrs_of(self, row: int, *, shared: bool = False) -> dict[str, Any]:
        """Row ``row``'s attributes (as ``self[path]["attrs"]``, without the rest of the
        entry). With ``shared``, values that are lists are the document's own (to read, not
        to change), not copies."""
        doc = self._doc
        row_attrs = doc["row_attrs"]
        layout_attrs = doc["layouts"][doc["layout"][row]]["attrs"]
        if shared:
            return {k: row_attrs[k][row] if v is None else v for k, v in layout_attrs.items()}
        return {
            k: row_attrs[k][row]
            if v is None
            else (_copied(v) if type(v) is list or type(v) is dict else v)
            for k, v in layout_attrs.items()
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
        return one_each(zip(*[iter(values)] * low, strict=True)) if low else [()] * rows
    # Rows sorted by their number of dimensions: each group's tuples made in C, then put back
    # in row order.
    order = np.argsort(ndims, kind="stable")
    counts = ndims[order]
    starts = dim_first[:-1][order]
    base = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    flat = dims[base + np.arange(int(counts.sum()), dtype=np.int64)].tolist()
    grouped: list[tuple[int, ...]] = []
    at = 0
    distinct, _, times = unique_ints(counts)
    for k, n in zip(distinct, times, strict=True):
        k, n = int(k), int(n)
        grouped.extend(
            one_each(zip(*[iter(flat[at : at + k * n])] * k, strict=True)) if k else [()] * n
        )
        at += k * n
    where = np.empty(rows, np.int64)
    where[order] = np.arange(rows, dtype=np.int64)
    return list(map(grouped.__getitem__, where.tolist()))


def _shared_strings(
    values: list[str | None], paths: list[str], row_of: dict[str, int]
) -> list[str | None]:
    """A row attribute's strings (or nulls), each that is a path (a slot's variable) the
    path's own string, equal others one string: a column of 100,000 rows then holds its
    distinct strings once, not one decoded string per row."""
    seen: dict[str, str] = {}
    keep, row = seen.setdefault, row_of.get
    out: list[str | None] = []
    add = out.append
    for v in values:
        if v is None:
            add(None)
        else:
            r = row(v)
            add(keep(v, v) if r is None else paths[r])
    return out


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
    shardless = [
        k
        for k, (kind, n) in enumerate(zip(kind_of, count_of, strict=True))
        if kind == "sharded" and n < 1
    ]
    if shardless and rows and np.isin(ids, shardless).any():
        r = int(np.flatnonzero(np.isin(ids, shardless))[0])
        field = f"layouts[{int(ids[r])}].num_components"
        raise _malformed(file, field, "at least 1 (a sharded variable's shards)", 0, paths[r])
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
    for key, values in row_attrs.items():
        if not value_types(values) - {str, _NONE}:
            row_attrs[key] = _shared_strings(values, paths, row_of)
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
    # (the lists' values are the arrays' now: the lists are let go)
    doc["offsets"] = doc["crc32c"] = None
    del dim_list, first_list
    # (each path's row looked up from here on: its mapping made when first asked for)
    del row_of
    index = RowIndex(paths)
    entries = ColumnEntries(doc, index, dim_first, first, offsets, crcs)
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
        paths,  # (the document's list: not copied)
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
        index,
    )
    return table, entries  # (None: a size past 2**62 bytes, which the general path names)
