"""A save's records as the native writers see them, and what a file's bytes depend on.

* :class:`RecordList`: save records that keep, once made, their part of the structure key and
  the flat list of their components (a checkpoint hands the same list to every save of an
  unchanged object graph);
* :func:`_structure_key` and :func:`metadata_key`: what a file's bytes depend on besides the
  component values and the header values (a writer's cache key);
* :func:`_index_template`, :func:`crc_mark` and :func:`marked_template`: the index document
  with a ``%d`` for every checksum, so a repeated save formats it instead of dumping it, and
  :func:`index_capacity`, the room a document of a structure gets;
* :class:`PlanCache`: what a checkpoint keeps of the structure it saved last (the generated
  metadata of ``h5raw/native.py``), found again by the structure's key;
* :func:`record_classes`: a first save's records sorted into classes of records that differ
  only by their path, shape and row strings (``name``, ``slot_of``), so that the plan and the
  documents make what a class shares once (``h5raw/generate.py``, ``h5io/columns.py``).
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import itemgetter
from typing import Any

from parallelvars.checkpoint.h5io.layout import _library_version
from parallelvars.errors import InvalidEntryError

__all__ = [
    "PlanCache",
    "RecordList",
    "crc_mark",
    "index_capacity",
    "marked_template",
    "metadata_key",
    "record_classes",
]


class RecordList(list):
    """Save records that keep what writing their structure again needs, made on first use:
    their part of the structure key (and the writer's plan of their replicas).

    A checkpoint hands the same records to every save while its object graph is unchanged
    (``Checkpoint._gather``), so a repeated save does this per-record work once per
    structure. The records must not change once written (what is kept would be stale); their
    components' values may, they are read at every write.
    """

    __slots__ = ("_key", "_like", "replicas", "token")

    def __init__(self, records: Iterable[Any] = (), *, like: RecordList | None = None) -> None:
        """``like``: records of the same structure (a snapshot's copies are like the live
        records): their key and token are these records' too."""
        super().__init__(records)
        self._key: Any = None
        self._like = like
        # The plan the writer compares the records' replicas by (runs of their buffers: set by
        # the checkpoint's writer, read by h5raw.component_bytes): None, False after a first save, then
        # the plan.
        self.replicas: Any = None
        # Stands for the records' structure: records with the same token have the same
        # structure, so a writer's cache can tell a repeated structure without its key.
        self.token: object = object() if like is None else like.token

    @property
    def copied(self) -> bool:
        """Whether these records are copies made like other records (a non-blocking save's
        snapshot: each replica there is its first component's copy, nothing to compare)."""
        return self._like is not None

    def structure(self) -> Any:
        """The records' part of :func:`_structure_key` (None: not all are arrays in memory)."""
        if self._key is None:
            self._key = _records_key(self) if self._like is None else self._like.structure()
        return self._key


def _records_key(items: Sequence[Any]) -> Any:
    """Each entry's path, kind, shape, attributes and components' dtypes and shapes (None for
    entries that are not arrays in memory)."""
    try:
        return tuple(
            (
                e.path,
                e.kind,
                tuple(e.shape),
                dict(e.attrs),
                tuple((c.dtype, c.shape) for c in e.components),
            )
            for e in items
        )
    except AttributeError:
        return None


def metadata_key(metadata: Mapping[str, Any] | None) -> tuple[Any, ...]:
    """What a file's bytes depend on in its metadata: each name, with the type of a number
    (its value is a header value, rewritten in place) and any other value as it is."""
    return tuple(
        (k, type(v).__name__ if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
        for k, v in dict(metadata or {}).items()
        if v is not None
    )


def _structure_key(
    items: Sequence[Any], object_graph: Mapping[str, Any] | None, metadata: Mapping[str, Any] | None
) -> Any:
    """What a file's bytes depend on besides the component values and the header values: the
    library version, the metadata's names and types, the object graph and each entry's path,
    kind, shape, attributes and components' dtypes and shapes. None for entries that are not
    arrays in memory (their structure is never cached)."""
    records = items.structure() if isinstance(items, RecordList) else _records_key(items)
    if records is None:
        return None
    meta = metadata_key(metadata)
    return (_library_version(), meta, object_graph, records)


_CRC_MARK = "\ue000parallelvars-crc32c:{}\ue000"  # stands for a record's checksums


def _index_template(index: Mapping[str, Any]) -> str:
    """The index document with a ``%d`` for every checksum: ``template % crcs`` is
    ``json.dumps(index)`` (the checksums are each record's last field).

    Made with one ``json.dumps`` of the index, each record's checksums replaced by a mark
    (:func:`crc_mark`) then by ``%d``s; a mark found more often than records have it (a value
    of the same text) makes the template record by record instead."""
    marked: dict[str, Any] = {}
    for path, meta in index.items():
        rest = dict(meta)
        rest["crc32c"] = crc_mark(len(rest.pop("crc32c")))
        marked[path] = rest
    template = marked_template(marked)
    return _index_template_by_record(index) if template is None else template


def crc_mark(n: int) -> str:
    """What stands for a record's ``n`` checksums in an index made for :func:`marked_template`."""
    return _CRC_MARK.format(n)


def marked_template(marked: Mapping[str, Any]) -> str | None:
    """The template of :func:`_index_template` from an index whose records' last field,
    ``crc32c``, is its :func:`crc_mark`; None when a mark's text is found elsewhere too."""
    counts: dict[str, int] = {}
    for meta in marked.values():
        mark = meta["crc32c"]
        counts[mark] = counts.get(mark, 0) + 1
    text = json.dumps(marked).replace("%", "%%")
    for mark, count in counts.items():
        quoted = json.dumps(mark)
        if text.count(quoted) != count:
            return None
        n = int(mark.strip("\ue000").rpartition(":")[2])
        text = text.replace(quoted, "[" + ", ".join(["%d"] * n) + "]")
    return text


def _index_template_by_record(index: Mapping[str, Any]) -> str:
    parts = []
    for path, meta in index.items():
        rest = {k: v for k, v in meta.items() if k != "crc32c"}
        body = json.dumps(rest).replace("%", "%%")
        crcs = ", ".join(["%d"] * len(meta["crc32c"]))
        parts.append(f'{json.dumps(path).replace("%", "%%")}: {body[:-1]}, "crc32c": [{crcs}]}}')
    return "{" + ", ".join(parts) + "}"


def index_capacity(length: int, checksums: int) -> int:
    """Room for a document of ``length`` bytes besides its ``checksums`` (each written in at
    most 10 digits), rounded up to 64 bytes: every save of a structure fits the same room, so
    its metadata bytes depend on the structure alone."""
    return int(math.ceil((length + 10 * checksums + 64) / 64) * 64)


class PlanCache:
    """What a checkpoint keeps of the structure it saved last: one object with a ``key``
    attribute (a writer's prepared metadata, or a marker that the generator cannot express the
    structure), handed back while a save's structure has that key."""

    def __init__(self) -> None:
        self._held: Any = None
        self._lock = threading.Lock()

    @property
    def held(self) -> Any:
        """The object held (None: nothing yet)."""
        return self._held

    def get(self, key: Any) -> Any:
        """The held object when ``key`` (the structure) is its key, else None."""
        with self._lock:
            held = self._held
        if held is None:
            return None
        try:
            same = bool(held.key == key)
        except (ValueError, TypeError):  # attributes that do not compare (arrays): a new one
            same = False
        return held if same else None

    def put(self, held: Any) -> None:
        with self._lock:
            self._held = held

    def clear(self) -> None:
        self.put(None)


# The attributes whose string values differ between most records (a variable's name, a slot's
# variable): kept per record, not in a record's class (h5io/layout.py: COLUMNS_ROW_ATTRS; the
# generator keeps ``slot_of`` per group too).
ROW_KEYS = ("name", "slot_of")
_PLAIN_TYPES = (str, int, bool, type(None))


class RecordClasses:
    """Records sorted into classes (:func:`record_classes`): ``ids[k]`` is record ``k``'s
    class, ``first[c]`` the first record of class ``c``. The records of one class have the same
    kind, dtype, rank, number of components, components' sharing, attribute names in order,
    attribute types and attribute values, but the strings of :data:`ROW_KEYS` (those not
    starting with ``"json:"``): what the plan and the documents make of one record of a class
    holds for all of them, with its path, shape and row strings put in."""

    __slots__ = ("first", "ids")

    def __init__(self, ids: list[int], first: list[int]) -> None:
        self.ids = ids
        self.first = first


def _frozen(value: Any) -> Any:
    from parallelvars.checkpoint.h5raw.objects import frozen

    return frozen(value)


def _list_key(value: list[Any]) -> Any:
    """A list's part of a class key: a list of strings as a tuple of them, any other list
    frozen (``1`` and ``True`` compare equal but are written apart)."""
    try:
        "".join(value)  # (only strings join)
    except TypeError:
        return _frozen(value)
    return tuple(value)


def _getter(positions: list[int]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """The values at ``positions``, as a tuple."""
    if len(positions) == 1:
        p = positions[0]
        return lambda vals: (vals[p],)
    return itemgetter(*positions)


_JSON = itertools.repeat("json:")


def _values_key(
    names: tuple[Any, ...], types: tuple[type, ...]
) -> Callable[[tuple[Any, ...]], Any]:
    """For attributes of ``names`` whose values have ``types``: a function of the values to
    their part of a class key (strings, integers, booleans and None as they are; lists of
    strings as tuples; anything else frozen, floats by their bits; the row strings only when
    one is ``"json:"`` text; the common attributes, a few row strings and one list, by a
    function of a few operations)."""
    plain: list[int] = []
    rows: list[int] = []
    lists: list[int] = []
    other: list[int] = []
    for p, (name, t) in enumerate(zip(names, types, strict=True)):
        if name in ROW_KEYS and t is str:
            rows.append(p)
        elif t in _PLAIN_TYPES:
            plain.append(p)
        elif t is list:
            lists.append(p)
        else:
            other.append(p)
    get = _getter(plain) if plain else lambda vals: ()
    if not rows and not lists and not other:
        return get
    if not other and len(rows) <= 2 and len(lists) <= 1:
        # (the common attributes, a few operations: a variable's devices, its name and slot)
        r0, r1 = [*rows, -1, -1][:2]
        at = lists[0] if lists else -1
        json = "json:"

        def fast(vals: tuple[Any, ...]) -> Any:
            # (a list of strings as a tuple of them, any other frozen: its items may be
            # lists or dicts, which do not hash)
            listed = _list_key(vals[at]) if at >= 0 else None
            if (r0 >= 0 and vals[r0].startswith(json)) or (r1 >= 0 and vals[r1].startswith(json)):
                return (get(vals), listed, tuple(vals[p] for p in rows))
            return (get(vals), listed)

        return fast
    row_get = _getter(rows) if rows else None
    list_get = _getter(lists) if lists else None
    other_get = _getter(other) if other else None
    starts = str.startswith
    frozen = _frozen

    def key(vals: tuple[Any, ...]) -> Any:
        return (
            get(vals),
            row_get(vals)
            if row_get is not None and any(map(starts, row_get(vals), _JSON))
            else None,
            None if list_get is None else tuple(map(_list_key, list_get(vals))),
            None if other_get is None else tuple(map(frozen, other_get(vals))),
        )

    return key


def record_classes(
    items: Sequence[Any],
    shared: Sequence[Sequence[int] | None] | None = None,
    file: str | None = None,
) -> RecordClasses:
    """The classes of ``items`` (entries with ``kind``, ``dtype``, ``shape``,
    ``num_components`` and ``attrs``; with ``shared``, each one's sharing of its components'
    datasets, part of its class): see :class:`RecordClasses`. A few Python operations per
    record: its attributes' names, types and values as tuples, a function per combination of
    names and types.

    A list of strings is keyed as a tuple of them, any other list frozen (its items may equal
    others of another type, ``1 == True``, or not hash: lists, dicts).

    Raises:
        InvalidEntryError: an attribute name that is not text (an HDF5 attribute's name is),
            naming ``file`` and the variable."""
    specs: dict[tuple[Any, Any], Callable[[tuple[Any, ...]], Any]] = {}
    classes: dict[Any, int] = {}
    ids: list[int] = []
    first: list[int] = []
    add = ids.append
    find = classes.get
    tuples: dict[int, tuple[int, ...]] = {}  # (by the list's id: every list is alive here)
    for k, e in enumerate(items):
        a = e.attrs
        vals = tuple(a.values())
        sig = (tuple(a), tuple(map(type, vals)))
        spec = specs.get(sig)
        if spec is None:
            for name in sig[0]:  # (once per combination of names and types)
                if type(name) is not str:
                    raise InvalidEntryError(
                        f"attribute name {name!r} is not text",
                        file=file,
                        variable=e.path,
                        expected="text attribute names",
                        found=f"a name of type {type(name).__name__}",
                    )
            spec = specs[sig] = _values_key(*sig)
        held = None if shared is None else shared[k]
        if held is None:
            sh = None
        else:  # (the lists of replicas of the first are shared: one tuple each)
            sh = tuples.get(id(held))
            if sh is None:
                sh = tuples[id(held)] = tuple(held)
        key = (e.kind, e.dtype, len(e.shape), e.num_components, sh, spec, spec(vals))
        c = find(key)
        if c is None:
            c = classes[key] = len(first)
            first.append(k)
        add(c)
    return RecordClasses(ids, first)
