"""The object graph of a checkpoint: built from the live objects, written into the file, read
back and checked.

Saving walks the graph breadth-first from the checkpoint's roots (:func:`build_object_graph`);
every object with a registered saveable (variables) is a leaf, at the first path that reaches
it (``model/layers/0/kernel``), local names escaped like TensorFlow's keys (``.`` -> ``..``,
``/`` -> ``.S``: :func:`escape_name`). Optimizer slots are leaves at
``<optimizer>/slots/<variable path>/<slot>``. The graph document stored in the file has one
node per object: ``{"children": [[name, id], ...], "path": <leaf path or null>, "slots":
[[variable id, slot name, slot id], ...]}``.

A file that stores no graph (written by a converter) gets one from its paths
(:func:`graph_from_paths`); a stored graph is checked field by field before a restore uses it
(:func:`checked_graph_nodes`). The converters of :mod:`parallelvars.formats` use these too.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import is_, is_not
from typing import Any, cast

from parallelvars._fileio import value_types
from parallelvars._ints import is_index
from parallelvars.checkpoint._gcfreeze import FREEZE_STEP, freeze_made_so_far
from parallelvars.checkpoint.entry import check_name_text
from parallelvars.checkpoint.registry import Saveable, get_saveable, type_saveable
from parallelvars.checkpoint.registry import generation as registry_generation
from parallelvars.errors import CorruptCheckpointError
from parallelvars.tracking import (
    Trackable,
    _as_node,
    node_children,
    same_children,
    type_decides_isinstance,
)

__all__ = [
    "GRAPH_VERSION",
    "ObjectGraph",
    "build_object_graph",
    "checked_graph_nodes",
    "escape_name",
    "graph_from_paths",
    "is_leaf",
    "leaf_saveable",
    "slot_relations",
    "unescape_name",
]

GRAPH_VERSION = 1


def escape_name(name: str) -> str:
    """Escape one local name for a path: ``.`` -> ``..``, ``/`` -> ``.S``."""
    return name.replace(".", "..").replace("/", ".S")


def unescape_name(name: str) -> str:
    """Invert :func:`escape_name`; a ``.`` that starts no valid escape is kept as it is."""
    out, i = [], 0
    while i < len(name):
        if name[i] == "." and i + 1 < len(name):
            out.append(
                "." if name[i + 1] == "." else "/" if name[i + 1] == "S" else name[i : i + 2]
            )
            i += 2
        else:
            out.append(name[i])
            i += 1
    return "".join(out)


def is_leaf(obj: Any) -> bool:
    """Whether ``obj`` is a saved value (a registered saveable that is not a container)."""
    return leaf_saveable(obj) is not None


def leaf_saveable(obj: Any) -> Saveable | None:
    """The saveable of the graph node ``obj`` (what ``tracking._as_node`` made of a value: a
    plain list, tuple or dict is a container by then) when it is a leaf, a saved value: no
    :class:`Trackable`, of a registered saveable; else None. The one rule of a leaf:
    :func:`_leaf_saveable` decides it once per type where the type decides it."""
    return None if isinstance(obj, Trackable) else get_saveable(obj)


@dataclass
class ObjectGraph:
    """The graph of one save: nodes, the live object of each, and variable paths.

    It also keeps what :meth:`unchanged` needs to tell that the live graph is still this one
    (a snapshot of every container's children and of every trackable's slots).
    """

    objects: list[Any] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    ids: dict[int, int] = field(default_factory=dict)  # (the walk's: emptied once it is done)

    def add(self, obj: Any, path: str | None) -> int:
        node_id = len(self.nodes)
        self.ids[id(obj)] = node_id
        self.objects.append(obj)
        saveable = leaf_saveable(obj)  # (kept for the gather)
        self.nodes.append({"children": [], "path": None if saveable is None else path, "slots": []})
        self._paths.append(path or "")
        if saveable is not None:
            self._leaves[node_id] = saveable
        return node_id

    def __post_init__(self) -> None:
        self._paths: list[str] = []
        # node id -> saveable of every leaf, in node order
        self._leaves: dict[int, Saveable] = {}
        # What the walk saw (see unchanged): the registrations it asked, a snapshot of every
        # container's children (tracking.node_children) and every trackable's slots.
        self._generation = registry_generation()
        self._snapshots: list[tuple[Any, ...]] = []
        self._slot_snapshots: list[
            tuple[Any, tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]
        ] = []

    def is_leaf(self, node_id: int) -> bool:
        """Whether the node is a saved value (a variable) rather than a container."""
        return node_id in self._leaves

    def path_of(self, node_id: int) -> str:
        return self._paths[node_id]

    def variables(self) -> Iterator[tuple[int, Any, str]]:
        objects, paths = self.objects, self._paths
        for i in self._leaves:
            yield i, objects[i], paths[i]

    def saveables(self) -> Iterator[tuple[int, Any, str, Saveable]]:
        """``(node id, object, path, saveable)`` of every variable node, in node order."""
        objects, paths = self.objects, self._paths
        for i, saveable in self._leaves.items():
            yield i, objects[i], paths[i], saveable

    def leaf_columns(self) -> tuple[list[int], list[Any], list[str], list[Saveable]]:
        """What :meth:`saveables` yields, as four lists (node ids, objects, paths, saveables)."""
        ids = list(self._leaves)
        return (
            ids,
            list(map(self.objects.__getitem__, ids)),
            list(map(self._paths.__getitem__, ids)),
            list(self._leaves.values()),
        )

    def to_json(self) -> dict[str, Any]:
        return {"version": GRAPH_VERSION, "nodes": self.nodes}

    def unchanged(self) -> bool:
        """Whether a walk of the live objects now would give this graph again.

        The walk is a function of each container's children (names and objects, in order), of
        each trackable's slots and of which types are saveable: when every container has the
        same children as when this graph was built, and every trackable the same slots, the
        walk visits the same objects in the same order, under the same paths. Costs one
        identity comparison per child (containers whose children come from the base classes'
        rules are compared by their contents) instead of a new graph.
        """
        if registry_generation() != self._generation:
            return False
        if not all(map(same_children, self._snapshots)):
            return False
        for obj, variables, names, slots in self._slot_snapshots:
            now = obj._checkpoint_slots()
            if len(now) != len(names):
                return False
            if now:
                v, n, s = zip(*now, strict=True)
                if not (n == names and all(map(is_, v, variables)) and all(map(is_, s, slots))):
                    return False
        return True


def build_object_graph(root: Any) -> ObjectGraph:
    """Walk ``root`` breadth-first; every object once, at the first path that reaches it.

    The children of one container that are all new variables (a layer's weights, a list of
    variables), and one optimizer's slots of saved variables, are added together
    (:func:`_add_leaves`): their ids, names and paths as lists, no per-object call; any
    other child is added as it is found. Both give the same nodes in the same order."""
    graph = ObjectGraph()
    graph.add(root, "")
    ids, objects, nodes, leaves, add = (
        graph.ids,
        graph.objects,
        graph.nodes,
        graph._leaves,
        graph.add,
    )
    paths = graph._paths
    snapshots = graph._snapshots
    leaf_saveable = _leaf_types()
    queue: deque[int] = deque([0])
    trackables: list[int] = []  # the containers walked, in walk order (they may own slots)
    freeze_at = FREEZE_STEP
    while queue:
        if len(nodes) >= freeze_at:
            # (inside a save's older_objects_frozen: the nodes made so far are kept, so the
            # collections the walk triggers need not walk them again and again)
            freeze_made_so_far()
            freeze_at = len(nodes) + FREEZE_STEP
        parent = queue.popleft()
        obj = objects[parent]
        if not isinstance(obj, Trackable):
            continue  # (a root that is neither a container nor a variable: nothing in it)
        trackables.append(parent)
        base = paths[parent]
        prefix = f"{base}/" if base else ""
        children = nodes[parent]["children"]
        found, snapshot = node_children(obj)
        snapshots.append(snapshot)
        names = list(found)
        values = list(found.values())
        escaped = _escaped_names(names)
        if escaped is not None and len(names) > 1:
            saveables = _new_leaves(leaf_saveable, ids, values)
            if saveables is not None:
                new = _add_leaves(graph, values, _prefixed(prefix, escaped), saveables)
                children.extend(map(list, zip(names, new, strict=True)))
                continue
        for name, value in found.items():
            child = _as_node(value)
            child_id = ids.get(id(child))
            if not name.isascii():  # refused before anything is written, as by every writer
                check_name_text(name, variable=prefix + escape_name(name))
            if child_id is None:
                child_id = add(child, prefix + escape_name(name))
                if child_id not in leaves:
                    queue.append(child_id)
            children.append([name, child_id])
    for node_id in sorted(trackables):  # node order, as every node was visited before
        obj = objects[node_id]
        triples = obj._checkpoint_slots()
        v, n, s = zip(*triples, strict=True) if triples else ((), (), ())
        graph._slot_snapshots.append((obj, v, n, s))
        if not triples:
            continue
        freeze_made_so_far()  # (the slot triples of a large optimizer, see above)
        slots = nodes[node_id]["slots"]
        var_ids = list(map(ids.get, map(id, v)))
        if (
            None not in var_ids
            and all(map(is_not, s, repeat(None)))
            and _escaped_names(n) is not None
        ):
            saveables = _new_leaves(leaf_saveable, ids, s)
            if saveables is not None:
                # every slot a new variable of a saved variable: added together
                head = f"{paths[node_id]}/slots/"
                suffix = {name: "/" + escape_name(name) for name in set(n)}
                owners = [paths[i] for i in var_ids if i is not None]  # (none is None here)
                slot_paths = list(map(str.__add__, owners, map(suffix.__getitem__, n)))
                new = _add_leaves(graph, s, _prefixed(head, slot_paths), saveables)
                slots.extend(map(list, zip(var_ids, n, new, strict=True)))
                continue
        for var_id, (_, slot_name, slot_var) in zip(var_ids, triples, strict=True):
            if var_id is None or slot_var is None:
                continue  # a slot of a variable that is not saved is not saved either
            if not slot_name.isascii():
                check_name_text(slot_name, variable=f"{graph.path_of(var_id)} (slot {slot_name!a})")
            slot_id = ids.get(id(slot_var))
            if slot_id is None:
                path = f"{graph.path_of(node_id)}/slots/{graph.path_of(var_id)}/{escape_name(slot_name)}"
                slot_id = add(slot_var, path)
            slots.append([var_id, slot_name, slot_id])
    # (the walk's map of objects to nodes is not needed once it is done: it is kept with the
    # graph for a save's life, ~100 bytes an object)
    ids.clear()
    return graph


# type -> its saveable, for the types whose instances are always leaves: a registered
# saveable, and neither a Trackable nor a plain list, tuple or dict whatever the instance
# (see _leaf_saveable); made again when a registration changes what is saveable.
_LEAF_TYPES: tuple[int, dict[type, Saveable | None]] = (-1, {})


def _leaf_types() -> dict[type, Saveable | None]:
    global _LEAF_TYPES
    now = registry_generation()
    if _LEAF_TYPES[0] != now:
        _LEAF_TYPES = (now, {})
    return _LEAF_TYPES[1]


def _leaf_saveable(cls: type) -> Saveable | None:
    """The saveable of ``cls`` when every instance of it is a leaf of the graph (what
    :func:`leaf_saveable` decides per node, of what ``_as_node`` made of a value, decided once
    per type: a plain list, tuple or dict becomes a container), else None.

    Decided by the type where it decides ``isinstance`` (:func:`type_decides_isinstance`)."""
    saveable = type_saveable(cls)
    if saveable is None or issubclass(cls, (Trackable, list, tuple, dict)):
        return None
    return saveable if type_decides_isinstance(cls) else None


def _new_leaves(
    known: dict[type, Saveable | None], ids: dict[int, int], values: Sequence[Any]
) -> list[Saveable] | None:
    """The saveable of each of ``values`` when all are leaves (:func:`_leaf_saveable`) not yet
    in the graph, each once; else None (the caller adds them one by one)."""
    types = list(map(type, values))
    for cls in set(types):
        if cls not in known:
            known[cls] = _leaf_saveable(cls)
        if known[cls] is None:
            return None
    keys = set(map(id, values))
    if len(keys) != len(values) or not ids.keys().isdisjoint(keys):  # (iterates the smaller)
        return None
    return cast(list[Saveable], list(map(known.__getitem__, types)))  # (none is None)


def _escaped_names(names: Sequence[Any]) -> Sequence[str] | None:
    """``names`` escaped for paths (:func:`escape_name`) when all are ASCII strings, else None
    (the caller checks them one by one)."""
    try:
        joined = "".join(names)
    except TypeError:
        return None
    if not joined.isascii():
        return None
    if "." in joined or "/" in joined:
        return list(map(escape_name, names))
    return names


def _prefixed(prefix: str, names: Sequence[str]) -> Sequence[str]:
    return list(map(prefix.__add__, names)) if prefix else names


def _add_leaves(
    graph: ObjectGraph,
    values: Sequence[Any],
    paths: Sequence[str],
    saveables: list[Saveable],
) -> range:
    """Add the leaves ``values`` (new to the graph, each once) at ``paths``: what
    :meth:`ObjectGraph.add` does for each, for all of them at once; their node ids."""
    start = len(graph.nodes)
    new = range(start, start + len(values))
    graph.ids.update(zip(map(id, values), new, strict=True))
    graph.objects.extend(values)
    # (a leaf never has children or slots: its nodes share one empty list, read by the
    # graph's document and never added to, 112 bytes a leaf less than a list each)
    none: list[Any] = []
    for k in range(0, len(paths), FREEZE_STEP):
        graph.nodes.extend(
            [{"children": none, "path": p, "slots": none} for p in paths[k : k + FREEZE_STEP]]
        )
        freeze_made_so_far()  # (see build_object_graph)
    graph._paths.extend(paths)
    graph._leaves.update(zip(new, saveables, strict=True))
    return new


def graph_from_paths(
    paths: Iterable[str], slots: Mapping[str, tuple[str, str]] | None = None
) -> list[dict[str, Any]]:
    """The object graph of a file that stores none (written by a converter), from its paths.

    One node per path component, children named by the unescaped component. ``slots`` maps the
    path of an optimizer slot (``<optimizer>/slots/<variable>/<slot>``, as :func:`build_object_graph`
    names it) to ``(slot_of, slot_name)``: such a path becomes a slot of the optimizer's node
    for the variable's node, as in a graph saved by :meth:`Checkpoint.write`, so a restore
    finds it through the optimizer (and defers it until the optimizer creates the slot). A slot
    whose optimizer or variable cannot be told from the path stays a plain path.
    """
    paths = list(paths)
    slots = dict(slots or {})
    nodes: list[dict[str, Any]] = [{"children": [], "path": None, "slots": []}]
    index: dict[str, int] = {"": 0}

    def add_path(path: str, leaf: bool) -> int:
        parts = path.split("/") if path else []
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            if prefix in index:
                continue
            index[prefix] = len(nodes)
            nodes.append(
                {
                    "children": [],
                    "path": path if leaf and depth == len(parts) else None,
                    "slots": [],
                }
            )
            parent = index["/".join(parts[: depth - 1])]
            nodes[parent]["children"].append([unescape_name(parts[depth - 1]), index[prefix]])
        return index[path]

    owners: dict[str, tuple[str, str, str]] = {}
    for path in paths:
        slot = slots.get(path)
        owner = None if slot is None else _slot_owner(path, *slot)
        if slot is not None and owner is not None:
            owners[path] = (owner, *slot)
    variables = set(paths) - set(owners)
    for path in paths:
        if path in variables:
            add_path(path, True)
    for path, (owner, slot_of, slot_name) in owners.items():
        var_id = index.get(slot_of)
        opt_id = index.get(owner)
        if (
            var_id is None
            or nodes[var_id]["path"] is None
            or (opt_id is not None and nodes[opt_id]["path"] is not None)
        ):
            add_path(path, True)  # no such variable saved: keep the slot by its path
            continue
        if opt_id is None:
            opt_id = add_path(owner, False)
        slot_id = len(nodes)
        nodes.append({"children": [], "path": path, "slots": []})
        nodes[opt_id]["slots"].append([var_id, slot_name, slot_id])
    return nodes


def _slot_owner(path: str, slot_of: str, slot_name: str) -> str | None:
    """The optimizer's path in a slot's path ``<optimizer>/slots/<slot_of>/<slot_name>``."""
    for name in dict.fromkeys((escape_name(slot_name), slot_name)):
        suffix = f"/slots/{slot_of}/{name}"
        if path.endswith(suffix) and len(path) > len(suffix):
            return path[: -len(suffix)]
        if path == suffix[1:]:
            return ""
    return None


def slot_relations(source: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """``path -> (slot_of, slot_name)`` for the entries of ``source`` marked as optimizer slots."""
    out: dict[str, tuple[str, str]] = {}
    for path in source:
        attrs = getattr(source[path], "attrs", None) or {}
        slot_of, slot_name = attrs.get("slot_of"), attrs.get("slot_name")
        if isinstance(slot_of, str) and isinstance(slot_name, str) and slot_of and slot_name:
            out[path] = (slot_of, slot_name)
    return out


def _canonical_nodes(nodes: list[Any]) -> bool:
    """Whether every node of a saved graph is as our writers make it, checked field by field
    over all nodes at once: a dict with a ``path`` (a string or None), ``children`` of
    ``[name, node id]`` and ``slots`` of ``[variable id, slot name, slot id]``, ids of
    existing nodes. Such nodes need no copy and no check one by one."""
    count = len(nodes)
    if value_types(nodes) != {dict} and nodes:
        return False
    repeat = itertools.repeat
    if not all(map(dict.__contains__, nodes, repeat("path"))):
        return False
    children: list[Any] = list(map(dict.get, nodes, repeat("children")))
    slots: list[Any] = list(map(dict.get, nodes, repeat("slots")))
    if value_types(map(dict.get, nodes, repeat("path"))) - {str, type(None)}:
        return False
    if value_types(children) - {list} or value_types(slots) - {list}:
        return False
    pairs = list(itertools.chain.from_iterable(children))
    triples = list(itertools.chain.from_iterable(slots))
    if value_types(pairs) - {list} or value_types(triples) - {list}:
        return False
    if set(map(len, pairs)) - {2} or set(map(len, triples)) - {3}:
        return False
    item = operator.itemgetter
    ids = [*map(item(1), pairs), *map(item(0), triples), *map(item(2), triples)]
    names = [*map(item(0), pairs), *map(item(1), triples)]
    if value_types(ids) - {int} or value_types(names) - {str}:
        return False
    return not ids or (min(ids) >= 0 and max(ids) < count)


def checked_graph_nodes(graph: Any, path: str) -> list[dict[str, Any]]:
    """The nodes of a saved object graph, every field checked for type and range (a damaged
    or crafted graph is a :class:`~parallelvars.errors.CorruptCheckpointError`, never a
    ``TypeError``/``KeyError`` later in the restore)."""

    def bad(what: str, where: str, found: Any) -> CorruptCheckpointError:
        text = repr(found)
        return CorruptCheckpointError(
            f"object graph is malformed: {what}",
            file=path,
            variable=where,
            found=text if len(text) <= 80 else text[:77] + "...",
        )

    nodes = graph.get("nodes") if isinstance(graph, dict) else None
    if not isinstance(nodes, list):
        raise bad("no list of nodes", "object_graph", type(graph).__name__)
    if _canonical_nodes(nodes):
        return nodes
    n = len(nodes)
    out: list[dict[str, Any]] = []
    for i, node in enumerate(nodes):
        where = f"node {i}"
        if not isinstance(node, dict):
            raise bad("a node is not an object", where, node)
        node = dict(node)
        node.setdefault("slots", [])
        node.setdefault("children", [])
        node.setdefault("path", None)
        if node["path"] is not None and not isinstance(node["path"], str):
            raise bad("a variable path is not a string", where, node["path"])
        children = node["children"]
        if not isinstance(children, list) or (
            children
            and not all(
                isinstance(c, list)
                and len(c) == 2
                and isinstance(c[0], str)
                and is_index(c[1])
                and c[1] < n
                for c in children
            )
        ):
            raise bad("children must be [name, node id] pairs of existing nodes", where, children)
        slots = node["slots"]
        if not isinstance(slots, list) or (
            slots
            and not all(
                isinstance(s, list)
                and len(s) == 3
                and is_index(s[0])
                and s[0] < n
                and isinstance(s[1], str)
                and is_index(s[2])
                and s[2] < n
                for s in slots
            )
        ):
            raise bad(
                "slots must be [variable id, slot name, slot id] of existing nodes", where, slots
            )
        out.append(node)
    return out
