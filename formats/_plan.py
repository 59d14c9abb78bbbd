"""Write plans for flat-tensor formats: each variable checked, then laid out as the stored
tensors (keys, dtypes, shapes, sources) and the parallel info that describes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from parallelvars import _spans
from parallelvars._fileio import Scratch, value_types
from parallelvars._geometry import shard_slices
from parallelvars.checkpoint._gcfreeze import FREEZE_STEP, freeze_made_so_far
from parallelvars.checkpoint.entry import ReadAhead, check_entry
from parallelvars.checkpoint.registry import component_name
from parallelvars.errors import (
    InvalidEntryError,
    ShapeMismatchError,
)

from ._dtypes import tensor_dtype_name
from ._graph import carried_graph, check_writable_graph
from ._info import INFO_FORMAT, INFO_VERSION
from ._json import _LEAVES, jsonable
from ._names import check_names, component_keys, from_key, part_key, to_key
from ._view import Entry, aggregates


@dataclass(slots=True)
class PlannedTensor:
    """One tensor a writer will store: component ``component`` of ``entry`` (``None``: the
    logical value of a sharded entry, or an on-read entry's aggregate) under ``key``.

    (Slotted: a plan holds one per stored tensor until the file is written, 300,000 of them
    for 50,000 variables with Adam's slots on 2 devices; no per-object dictionary.)

    A plan made with ``hold_entries=False`` from entries made when asked for (a conversion's:
    ``makes_entries``) does not hold ``entry`` between runs: :func:`read_batches` asks
    ``source`` for it again while the tensor's run is read, so a plan's memory is its own rows,
    not a source entry per variable. ``path`` (the entry's) names the variable meanwhile."""

    key: str
    entry: Entry
    component: int | None
    path: str = field(init=False, repr=False, compare=False)
    # (the mapping ``entry`` is asked for again from, under ``path``; None: ``entry`` is held)
    source: Mapping[str, Entry] | None = field(init=False, repr=False, compare=False)
    # (Each asked for several times per tensor by a writer: worked out once, when planned.)
    dtype: np.dtype = field(init=False, repr=False, compare=False)
    shape: tuple[int, ...] = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)
    string: bool = field(init=False, repr=False, compare=False)  # a string tensor
    # (a let-go tensor of an entry whose tensors are its components, as many as it has: their
    # number, so a run holding them all reads them in bulk without the entry; else 0)
    parts: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.path, self.source, self.parts = self.entry.path, None, 0
        self.dtype = np.dtype(self.entry.dtype)
        self.string = self.dtype.kind == "O"
        if self.component is None:
            self.shape = tuple(int(s) for s in self.entry.shape)
        else:
            self.shape = tuple(int(s) for s in self.entry.component_shape(self.component))
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def _of(
        cls,
        key: str,
        entry: Entry,
        component: int | None,
        dtype: np.dtype,
        shape: tuple[int, ...],
    ) -> PlannedTensor:
        """The planned tensor of ``dtype`` and ``shape`` (those of ``entry``'s component,
        worked out once per entry by the caller): what ``__init__`` makes, without asking the
        entry again."""
        t = cls.__new__(cls)
        t.key, t.entry, t.component = key, entry, component
        t.path, t.source, t.parts = entry.path, None, 0
        t.dtype, t.shape = dtype, shape
        t.nbytes = math.prod(shape) * dtype.itemsize
        t.string = dtype.kind == "O"
        return t

    def read(self) -> np.ndarray:
        """The tensor's value, as a C-contiguous array the caller owns."""
        if self.component is None:
            value = self.entry.value()
        else:
            value = self.entry.component(self.component)
        if not value.flags.c_contiguous:
            value = np.array(value, order="C")
        if value.shape != self.shape or value.dtype != self.dtype:
            raise ShapeMismatchError(
                "a component read back with another shape or dtype than the entry declares",
                variable=self.entry.path,
                expected=f"{self.shape} {self.dtype}",
                found=f"{value.shape} {value.dtype}",
            )
        return value

    def read_into(self, out: np.ndarray) -> np.ndarray:
        """Read the tensor into ``out`` (this tensor's dtype and shape) and return it.

        A sharded entry's shards are read straight into their place in ``out``. String
        tensors cannot live in a reused buffer: for them a new array is returned.
        """
        if self.string:
            return self.read()
        entry = self.entry
        if self.component is not None:
            entry.read_component_into(self.component, out)
            return out
        if entry.kind != "sharded":  # an on-read aggregate: computed from the parts
            out[...] = entry.value()
            return out
        axis = int(entry.attrs["shard_axis"])
        for j, region in enumerate(shard_slices(out.shape, axis, entry.attrs["shard_offsets"])):
            entry.read_component_into(j, out[region])
        return out

    def read_with(self, scratch: Scratch) -> np.ndarray:
        """The tensor read into ``scratch`` (valid until the next read with it)."""
        if self.string:
            return self.read()
        return self.read_into(scratch.array(self.dtype, self.shape))


def _part_key(
    path: str,
    entry: Entry,
    i: int,
    names: str,
    slot: dict[str, Any],
    key_of: Callable[[str, Entry, int], str] | None,
) -> str:
    """The key of part ``i`` of an aggregated on-read entry (``parallel_component_<i>``, 0
    included; a format's ``key_of`` names part 0 like its part 1, ending in ``0``)."""
    if key_of is None:
        return part_key(path, i, names, **slot)
    if i:
        return key_of(path, entry, i)
    first = key_of(path, entry, 1)
    return first[: -len("1")] + "0"


def plan_tensors(
    entries: Mapping[str, Entry],
    *,
    names: str,
    needs_record: Callable[[Entry], bool] = lambda entry: False,
    file: str | None = None,
    key_of: Callable[[str, Entry, int], str] | None = None,
    hold_entries: bool = True,
) -> tuple[list[PlannedTensor], dict[str, Any]]:
    """Which tensors a flat-key writer stores, under which keys, and the parallel info.

    Args:
        entries: the entries to write.
        names: the key style (see :mod:`._names`).
        needs_record: format hook: True when an entry must be listed in the info even if it is
            a plain single variable (for example a dtype the format cannot name).
        file: the file being written, for error messages.
        key_of: format hook replacing the key style: ``key_of(path, entry, i)`` is the key of
            component ``i`` (0: the primary, or the stitched value of a sharded entry).
        hold_entries: False (a writer that reads the plan through :func:`read_batches` only):
            when ``entries`` makes its entries when asked for (``entries.makes_entries``), the
            plan does not hold them; each run's are asked for again while it is read.

    Returns:
        The planned tensors in entry order, and the parallel info document.
    """
    check_names(names)
    planned: list[PlannedTensor] = []
    variables: dict[str, Any] = {}
    owner: dict[str, str] = {}
    of = PlannedTensor._of
    # Worked out once per distinct value, not once per entry (a file names a few dtypes and
    # shapes): a dtype's checkpoint name, a shape's tuple and list.
    dtype_names: dict[np.dtype, str] = {}
    shapes: dict[Any, tuple[tuple[int, ...], list[int]]] = {}
    plain = key_of is None and names == "slash"
    dotted = key_of is None and names == "dotted"
    # "/parallel_component_<i>" by i (entries of few components: most ask for the first few)
    suffixes = ["", *(f"/{component_name(i)}" for i in range(1, 64))]
    let_go = not hold_entries and bool(getattr(entries, "makes_entries", False))
    for n, (path, entry) in enumerate(entries.items(), 1):
        if not n % FREEZE_STEP:
            freeze_made_so_far()  # (the plan is kept until the file is written)
        check_entry(entry, file)
        attrs = entry.attrs or {}
        slot_of, slot_name = attrs.get("slot_of"), attrs.get("slot_name")
        count = int(entry.num_components)
        dtype = np.dtype(entry.dtype)
        raw_shape = entry.shape
        known = shapes.get(raw_shape) if type(raw_shape) is tuple else None
        if known is None:
            shape = tuple(int(s) for s in raw_shape)
            known = (shape, list(shape))
            if type(raw_shape) is tuple and len(shapes) < 4096:
                shapes[raw_shape] = known
        shape = known[0]
        kind = entry.kind
        if plain:  # (the slash style: the path itself, its components beside it; no slot)
            keys = component_keys(path, names, 1 if kind == "sharded" else count)
        elif (
            dotted
            and (kind == "sharded" or 1 <= count < len(suffixes))
            and "//" not in path
            and path[:1] != "/"
            and path[-1:] != "/"
        ):
            # (the dotted style of a path without empty segments: its slashes made dots, as
            # to_key makes them; its components beside it, as component_keys names them)
            key = path.replace("/", ".")
            keys = [key] if kind == "sharded" else [key + suffix for suffix in suffixes[:count]]
        else:
            slot = {
                "slot_of": str(slot_of) if slot_of is not None else None,
                "slot_name": str(slot_name) if slot_name is not None else None,
            }
            if kind == "sharded":
                keys = [
                    key_of(path, entry, 0)
                    if key_of is not None
                    else to_key(path, names, component=0, **slot)
                ]
            elif key_of is not None:
                keys = [key_of(path, entry, i) for i in range(count)]
            else:
                keys = component_keys(path, names, count, **slot)
        primary = keys[0]
        if kind == "sharded":
            tensors = [of(primary, entry, None, dtype, shape)]
            layout = "logical"
        elif aggregates(entry):
            # The aggregate under the plain key, every part (0 included) beside it.
            slot = {
                "slot_of": str(slot_of) if slot_of is not None else None,
                "slot_name": str(slot_name) if slot_name is not None else None,
            }
            tensors = [of(primary, entry, None, dtype, shape)]
            tensors += [
                of(
                    _part_key(path, entry, i, names, slot, key_of),
                    entry,
                    i,
                    dtype,
                    tuple(int(s) for s in entry.component_shape(i)),
                )
                for i in range(count)
            ]
            layout = "aggregate"
        else:
            tensors = []
            for i in range(count):
                part = entry.component_shape(i)
                tensors.append(
                    of(keys[i], entry, i, dtype, shape if part == shape else _ints(part))
                )
            layout = "components"
        for t in tensors:
            if t.key in owner:
                raise InvalidEntryError(
                    f"{file or '<output>'}: variables {owner[t.key]!r} and {path!r} both map to "
                    f"the key {t.key!r} with names={names!r}; choose another name style"
                )
            owner[t.key] = path
        if let_go and entry.path == path:  # (asked for again under its own path)
            parts = count if layout == "components" and not tensors[0].string else 0
            for t in tensors:
                t.entry, t.source, t.parts = _LET_GO, entries, parts
        planned.extend(tensors)
        if (
            kind != "single"
            or attrs
            or (primary != path if plain else from_key(primary, names) != path)
            or needs_record(entry)
        ):
            name = dtype_names.get(dtype)
            if name is None:
                name = dtype_names[dtype] = tensor_dtype_name(dtype, file=file, variable=path)
            variables[path] = {
                "kind": kind,
                "dtype": name,
                "shape": known[1],
                "num_components": count,
                "layout": layout,
                # (the components' keys are those the tensors took, in order: that list itself)
                "keys": keys if layout == "components" else [t.key for t in tensors],
                "attrs": _json_attrs(attrs),
            }
    info = {"format": INFO_FORMAT, "version": INFO_VERSION, "names": names, "variables": variables}
    graph = carried_graph(entries)
    if graph is not None:
        # (the source's own graph when it is plain JSON, not a second copy of every node: a
        # tree, no container met twice, so it cannot hold itself; any other is checked first)
        if _plain_json(graph):
            info["object_graph"] = graph
        else:
            check_writable_graph(graph, file)
            info["object_graph"] = jsonable(graph)
    return planned, info


def _plain_json(value: Any) -> bool:
    """Whether :func:`jsonable` would give back ``value`` unchanged: plain dicts with string
    keys and lists, down to strings, ints, bools, None and finite floats (the document is
    only read, so it may be shared). A container met twice (shared by two places) is not
    plain: :func:`jsonable` copies it (a graph that holds itself is refused before:
    :func:`._graph.check_writable_graph`)."""
    todo = [value]
    seen: set[int] = set()
    while todo:
        v = todo.pop()
        t = type(v)
        if t is dict or t is list:
            if id(v) in seen:
                return False
            seen.add(id(v))
        if t is dict:
            if value_types(v) - {str}:
                return False
            v = list(v.values())
        elif t is not list:
            if t not in _LEAVES and not (t is float and math.isfinite(v)):
                return False
            continue
        kinds = value_types(v)
        if not kinds <= _LEAVES:
            if float in kinds and not all(math.isfinite(x) for x in v if type(x) is float):
                return False
            todo.extend(x for x in v if type(x) in _CONTAINERS)
            if kinds - _LEAVES - _CONTAINERS - {float}:
                return False
    return True


_CONTAINERS = frozenset({dict, list})


def _json_attrs(attrs: Any) -> Any:
    """``jsonable(attrs)`` for the info document: the entry's own dict when it already is
    plain JSON (string keys; strings, ints, bools, None or plain lists of them: what
    :func:`jsonable` would copy unchanged), so the plan holds no second copy of every
    variable's attributes; any other through :func:`jsonable`. (The document is only read.)"""
    if type(attrs) is dict:
        for k, v in attrs.items():
            t = type(v)
            if type(k) is not str or not (
                t in _LEAVES or (t is list and all(type(x) in _LEAVES for x in v))
            ):
                break
        else:
            return attrs
    return jsonable(attrs)


def _ints(shape: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in shape)


def read_batches(
    planned: Sequence[PlannedTensor], limit: int | None = None
) -> Iterator[list[PlannedTensor]]:
    """``planned`` in runs of at most ``limit`` bytes (default :data:`~parallelvars._spans.BULK_BYTES`;
    a larger tensor alone), in order, the
    components each run reads from a file read ahead in bulk first: the variables of a native
    file under every run (through any forwarding entry: a reshard's, a selection's) are read
    by their reader's ``prefetch`` (the index's places in a few large reads, each checked
    against its checksum), so a writer streaming many small tensors pays a few system calls
    per run, not one per component. A let-go tensor's variable whose components are all in
    the run is read by its source's ``bulk_components`` when it has one (the same reads and
    checks), without the entry being made again (:func:`_fetch_entries`). What no reader
    reads ahead is read when asked for, as before; memory stays one run (and what a writer
    holds of it)."""
    sizes = [t.nbytes for t in planned]
    with ReadAhead() as ahead:
        for run in _spans.batches(range(len(planned)), sizes, limit or _spans.BULK_BYTES):
            tensors = [planned[k] for k in run]
            asked = _fetch_entries(tensors)
            ahead(t.entry for t in tensors if type(t.entry) is not _Fetched)
            yield tensors
            for t in asked:  # (the plan holds them no longer than their run)
                t.entry = _LET_GO


# What a planned tensor's ``entry`` is while its plan does not hold it (see PlannedTensor).
_LET_GO = cast(Entry, None)


class _Fetched:
    """A variable's components as its source read them in bulk (checksums checked): what a
    let-go tensor reads instead of its entry made again (see :func:`_fetch_entries`)."""

    __slots__ = ("comps", "path")

    def __init__(self, path: str, comps: Sequence[np.ndarray]) -> None:
        self.path, self.comps = path, comps

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        data = self.comps[i]
        if data.shape != out.shape or data.dtype != out.dtype:
            raise ShapeMismatchError(
                "a component read back with another shape or dtype than the entry declares",
                variable=self.path,
                expected=f"{out.shape} {out.dtype}",
                found=f"{data.shape} {data.dtype}",
            )
        np.copyto(out, data)


def read_whole(
    bulk: Callable[[list[str]], Iterator[tuple[str, Sequence[Any] | None]]],
    in_run: Mapping[str, tuple[int, int]],
) -> Iterator[tuple[str, Sequence[Any]]]:
    """The components a view reads in bulk (``bulk``: its ``bulk_components``) of each
    variable of a run whose every component is in the run (``in_run``: by path, how many of
    its components the run holds and how many it has), for those the bulk read takes (the
    others: their entries are made, whose general read names any damage)."""
    whole = [p for p, (have, parts) in in_run.items() if have == parts]
    if whole:
        for path, comps in bulk(whole):
            if comps is not None and len(comps) == in_run[path][1]:
                yield path, comps


def _fetch_entries(tensors: Sequence[PlannedTensor]) -> list[PlannedTensor]:
    """Give the ``tensors`` whose plan does not hold their entries what they read from: the
    components of a variable read in bulk by the source (``bulk_components``: a native file's
    index places, read in a few large reads and checked against their checksums) when all its
    component tensors are in the run (its bytes are the run's), else its entry asked for again,
    once in the run (a variable the bulk path does not take, too: the general read names any
    damage); those tensors."""
    asked = [t for t in tensors if t.source is not None]
    bulk = getattr(asked[0].source, "bulk_components", None) if asked else None
    if bulk is not None:
        of_path: dict[str, list[PlannedTensor]] = {}
        for t in asked:
            if t.parts:
                of_path.setdefault(t.path, []).append(t)
        in_run = {p: (len(ts), ts[0].parts) for p, ts in of_path.items()}
        for path, comps in read_whole(bulk, in_run):
            fetched = cast(Entry, _Fetched(path, comps))
            for t in of_path[path]:
                t.entry = fetched
    made: dict[str, Entry] = {}
    for t in asked:
        if t.entry is not _LET_GO:
            continue
        entry = made.get(t.path)
        if entry is None:
            entry = made[t.path] = t.source[t.path]  # type: ignore[index]
        t.entry = entry
    return asked


def read_run(tensors: Sequence[PlannedTensor], scratch: Scratch) -> tuple[np.ndarray, list[Any]]:
    """The tensors of one run read into one buffer of ``scratch``, back to back in order (valid
    until the next read with it): the buffer (uint8, their bytes in C order as each tensor's
    dtype holds them) and each tensor's array over it; a string tensor's array is its own
    (not in the buffer, which holds no bytes for it)."""
    total = sum(t.nbytes for t in tensors if not t.string)
    buf = scratch.array(np.dtype(np.uint8), (total,))
    out: list[Any] = []
    pos = 0
    for t in tensors:
        if t.string:
            out.append(t.read())
            continue
        n = t.nbytes
        out.append(t.read_into(buf[pos : pos + n].view(t.dtype).reshape(t.shape)))
        pos += n
    return buf, out
