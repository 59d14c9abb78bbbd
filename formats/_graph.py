"""The native object graph carried through the other formats.

A checkpoint written by :meth:`~parallelvars.Checkpoint.write` stores its object graph (which
object holds which variable under which name, which optimizer slot serves which variable).
safetensors, npz and the Keras files carry that graph in their parallel info (key
``object_graph``, see :mod:`._info`); every format carries the slot relations themselves as the
entries' ``slot_of`` / ``slot_name`` attributes (TensorFlow checkpoints as TensorFlow's own
``.OPTIMIZER_SLOT`` keys and ``slot_variables``). Writing our HDF5 layout from any of them stores
the carried graph, or one rebuilt from the paths and slot relations, so a restore of the
converted file finds every slot through its optimizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from parallelvars.checkpoint.graph import (
    GRAPH_VERSION,
    checked_graph_nodes,
    graph_from_paths,
    slot_relations,
)
from parallelvars.errors import InvalidEntryError

__all__ = [
    "carried_graph",
    "check_writable_graph",
    "graph_from_info",
    "object_graph_for",
    "shared_objects",
]


def check_writable_graph(graph: Any, file: str | None) -> None:
    """Refuse, before anything is written, an in-memory object graph that no JSON document can
    hold: one that holds itself (a dict or list inside its own value; one shared by two
    places is fine). A graph read from a file never does; one handed to a writer may.

    The graph is encoded once by json's C encoder, which refuses a container inside its own
    value (and counts a value it cannot encode as null: those are each writer's to refuse), a
    tenth of the walk's cost at 50,000 variables; only a graph it does not encode (a cycle,
    nesting deeper than the recursion limit, a key json cannot write, a mapping that fails)
    is walked to tell which.

    Raises:
        InvalidEntryError: naming ``file`` and ``object_graph``.
    """
    try:
        _CHECKER.encode(graph)
        return
    except Exception:  # (a cycle, or what the encoder cannot take: told apart below)
        pass
    walking: set[int] = set()  # the containers whose values are being walked
    stack: list[tuple[Any, bool]] = [(graph, False)]
    while stack:
        value, done = stack.pop()
        if done:
            walking.discard(id(value))
            continue
        if isinstance(value, Mapping):
            inner: Any = value.values()
        elif isinstance(value, (list, tuple)):
            inner = value
        else:
            continue
        if id(value) in walking:
            raise InvalidEntryError(
                "the object graph cannot be written as JSON",
                file=file,
                variable="object_graph",
                expected="a tree of dicts and lists",
                found="one that holds itself",
            )
        walking.add(id(value))
        stack.append((value, True))
        stack.extend((v, False) for v in inner if isinstance(v, (Mapping, list, tuple)))


def _as_dict(value: Any) -> Any:
    """What the check's encoder takes for a value json does not encode: a mapping's items
    (walked, a cycle through it seen), else null (a leaf)."""
    return dict(value) if isinstance(value, Mapping) else None


# (a key json cannot write is an error, not skipped: skipping it would skip its value, which
# may hold a cycle; the walk then tells)
_CHECKER = json.JSONEncoder(skipkeys=False, check_circular=True, default=_as_dict)


def carried_graph(entries: Mapping[str, Any]) -> dict[str, Any] | None:
    """The source view's native object graph, when it describes exactly these entries.

    TensorFlow views keep graphs of their own shape (a list of objects), and a filtered or
    renamed conversion no longer matches its source's graph: then there is none to carry.
    """
    graph = getattr(entries, "object_graph", None)
    if not isinstance(graph, Mapping) or not isinstance(graph.get("nodes"), list):
        return None
    try:
        paths = {n["path"] for n in graph["nodes"] if n.get("path") is not None}
    except (TypeError, KeyError, AttributeError):
        return None
    return dict(graph) if paths == set(entries) else None


def object_graph_for(entries: Mapping[str, Any]) -> dict[str, Any] | None:
    """The graph an HDF5 file of ``entries`` stores: the carried one, else one rebuilt from the
    paths when some entries are optimizer slots, else None (a restore matches by path)."""
    graph = carried_graph(entries)
    if graph is not None:
        return graph
    summary = getattr(entries, "summary", None)
    if summary is not None and getattr(entries, "summaries_match_entries", False):
        slots = slot_relations(_Summarized(entries, summary))
    else:
        slots = slot_relations(entries)
    if not slots:
        return None
    return {"version": GRAPH_VERSION, "nodes": graph_from_paths(entries, slots)}


class _Summarized(Mapping[str, Any]):
    """A view's variables as :func:`slot_relations` reads them: each one's attributes from
    the view's summary (a view whose summaries and entries cannot differ), no entry made;
    its entry where it has none."""

    def __init__(self, entries: Mapping[str, Any], summary: Any) -> None:
        self._entries, self._summary = entries, summary

    def __getitem__(self, path: str) -> Any:
        known = self._summary(path)
        return self._entries[path] if known is None else _Attrs(known[5])

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class _Attrs:
    __slots__ = ("attrs",)

    def __init__(self, attrs: Any) -> None:
        self.attrs = attrs


def graph_from_info(info: Mapping[str, Any] | None, file: str) -> dict[str, Any] | None:
    """The object graph recorded in a parallel info document, checked node by node.

    Raises:
        CorruptCheckpointError: the recorded graph is malformed.
    """
    if not isinstance(info, Mapping) or info.get("object_graph") is None:
        return None
    graph = info["object_graph"]
    nodes = checked_graph_nodes(graph, file)
    return {"version": graph.get("version", GRAPH_VERSION), "nodes": nodes}


def shared_objects(graph: Mapping[str, Any]) -> int:
    """How many of a native graph's child links reach an object that another link reached
    first: a format that names each object by one path (TensorFlow's, built from the paths)
    keeps only the first of them. A restore is unaffected (the object is matched once)."""
    seen: set[int] = set()
    extra = 0
    for node in graph.get("nodes") or []:
        for _, child in node.get("children") or []:
            if child in seen:
                extra += 1
            seen.add(child)
    return extra
