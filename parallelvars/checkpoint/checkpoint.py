"""``Checkpoint``: save and restore an object graph in the native HDF5 layout (a restore also
reads every other format :mod:`parallelvars.formats` reads; see ``_sources``).

Saving walks the graph breadth-first from the checkpoint's roots; every object with a
registered saveable (variables) is written at the first path that reaches it
(``model/layers/0/kernel``), local names escaped like TensorFlow's keys (``.`` -> ``..``,
``/`` -> ``.S``). Optimizer slots are written at ``<optimizer>/slots/<variable path>/<slot>``.
The graph itself (children, slot relations) goes into the file.

Restoring matches the saved graph against the live one by local names, starting at the root.
Everything is checked first (shapes, dtypes, device counts, checksums) and applied only when
all of it is sound, so a failed restore leaves every variable as it was. Saved objects that do
not exist yet are remembered on their parent and restored the moment they are attached
(deferred restoration): lazily built layers, optimizer slots created by the first step.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import itertools
import operator
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import is_
from typing import Any

import numpy as np

from parallelvars._fileio import byte_view, value_types
from parallelvars._ints import is_index
from parallelvars._threads import run_partitioned
from parallelvars.checkpoint import _restore  # noqa: F401 - registers the variable saveable
from parallelvars.checkpoint._foreign import with_foreign_hint
from parallelvars.checkpoint._h5policy import PARTS_SUFFIX  # noqa: F401 - <file>.parts/: a multi-process save's files
from parallelvars.checkpoint._restore import plan_direct
from parallelvars.checkpoint._skeleton import SkeletonCache
from parallelvars.checkpoint._sources import by_live_names, open_source, reasons_of
from parallelvars.checkpoint.h5io import write_h5
from parallelvars.checkpoint.h5io.write import RecordList
from parallelvars.checkpoint.registry import Saveable, SaveRecord, get_saveable
from parallelvars.checkpoint.registry import generation as registry_generation
from parallelvars.devices import ParallelDevice
from parallelvars.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConcurrentWriteError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    RestoreMismatchError,
)
from parallelvars.tracking import (
    Trackable,
    _as_node,
    _wrap,
    children_of,
    is_trackable,
    node_children,
    same_children,
)

__all__ = [
    "Checkpoint",
    "CheckpointLoadStatus",
    "build_object_graph",
    "checked_graph_nodes",
    "escape_name",
    "graph_from_paths",
    "slot_relations",
    "unescape_name",
]

GRAPH_VERSION = 1

# A multi-process strategy registers itself here: each process then writes its own components
# and the processes commit one logical checkpoint together, through the writer the strategy's
# ``checkpoint_writer()`` hands out (under MPI: h5io.collective.write_collective). Held for the
# process's life: a dropped strategy must not turn the next save into every rank writing the
# same file.
_PROCESS_STRATEGY: list[Any] = []


def use_process_strategy(strategy: Any) -> None:
    """Write checkpoints through ``strategy.checkpoint_writer()`` (``None``: the plain
    single-file writer). ``strategy.cluster_rank`` is this process's rank; rank 0 keeps the
    books (a ``CheckpointManager``'s state, lock and deletions)."""
    _PROCESS_STRATEGY[:] = [] if strategy is None else [strategy]


def _process_strategy() -> Any:
    return _PROCESS_STRATEGY[0] if _PROCESS_STRATEGY else None


def _checkpoint_writer() -> Callable[..., str]:
    """``writer(path, records, *, object_graph, metadata, skeletons)`` for this process's saves."""
    strategy = _process_strategy()
    writer = None if strategy is None else strategy.checkpoint_writer()
    return writer or write_h5


def collective_rank() -> int | None:
    """This process's rank when checkpoints are written collectively (MPI), else None."""
    strategy = _process_strategy()
    return None if strategy is None else int(strategy.cluster_rank)


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_resume = False


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (the collector is resumed after, if it was on).

    A save or restore of many variables builds a few objects per variable that all stay alive
    until it ends (graph nodes, records, plans, the file's index). Each full collection walks
    every live object, so with the collector on these operations cost more per variable the
    more variables there are (twice as much at 20,000 as at 2,000). What garbage they leave is
    collected once the collector runs again. Counted, so that overlapping operations in
    several threads resume it once, after the last one.
    """
    global _gc_depth, _gc_resume
    with _gc_lock:
        if _gc_depth == 0:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_resume:
                gc.enable()


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


def _is_leaf(obj: Any) -> bool:
    return not isinstance(obj, Trackable) and get_saveable(obj) is not None


@dataclass
class ObjectGraph:
    """The graph of one save: nodes, the live object of each, and variable paths.

    It also keeps what :meth:`unchanged` needs to tell that the live graph is still this one
    (a snapshot of every container's children and of every trackable's slots).
    """

    objects: list[Any] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    ids: dict[int, int] = field(default_factory=dict)

    def add(self, obj: Any, path: str | None) -> int:
        node_id = len(self.nodes)
        self.ids[id(obj)] = node_id
        self.objects.append(obj)
        # A leaf is a saved value: no Trackable, a registered saveable (kept for the gather).
        saveable = None if isinstance(obj, Trackable) else get_saveable(obj)
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
    """Walk ``root`` breadth-first; every object once, at the first path that reaches it."""
    graph = ObjectGraph()
    graph.add(root, "")
    ids, objects, nodes, leaves, add = (
        graph.ids,
        graph.objects,
        graph.nodes,
        graph._leaves,
        graph.add,
    )
    snapshots = graph._snapshots
    queue: deque[int] = deque([0])
    trackables: list[int] = []  # the containers walked, in walk order (they may own slots)
    while queue:
        parent = queue.popleft()
        obj = objects[parent]
        if not isinstance(obj, Trackable):
            continue  # (a root that is neither a container nor a variable: nothing in it)
        trackables.append(parent)
        base = graph.path_of(parent)
        prefix = f"{base}/" if base else ""
        children = nodes[parent]["children"]
        found, snapshot = node_children(obj)
        snapshots.append(snapshot)
        for name, value in found.items():
            child = _as_node(value)
            child_id = ids.get(id(child))
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
        for var, slot_name, slot_var in triples:
            var_id = ids.get(id(var))
            if var_id is None or slot_var is None:
                continue  # a slot of a variable that is not saved is not saved either
            slot_id = ids.get(id(slot_var))
            if slot_id is None:
                path = f"{graph.path_of(node_id)}/slots/{graph.path_of(var_id)}/{escape_name(slot_name)}"
                slot_id = add(slot_var, path)
            nodes[node_id]["slots"].append([var_id, slot_name, slot_id])
    return graph


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


class _Session:
    """One ``restore()`` call: the file, its graph, and what has been matched so far."""

    def __init__(self, path: str, allow_cast: bool, root: Any = None) -> None:
        self.path = path
        self.allow_cast = allow_cast
        # Our HDF5 layout, or a view of another format we read (see _sources); a name-based
        # TensorFlow checkpoint seen through the live names of ``root``'s objects.
        self._reader: Any = open_source(path)
        if root is not None:
            try:
                self._reader = by_live_names(self._reader, root)
            except BaseException:
                self._reader.close()
                raise
        self._names = self._reader if hasattr(self._reader, "over") else None
        # Saved path -> why no live object can take it (reported by the load status).
        self.reasons: dict[str, str] = reasons_of(self._reader)
        graph = self._reader.object_graph
        if graph is None:
            self.nodes = graph_from_paths(self._reader, slot_relations(self._reader))
        else:
            self.nodes = checked_graph_nodes(graph, path)
        self.matched: dict[int, Any] = {}
        self.restored: set[int] = set()
        # Saved components a restore left out (an independent variable's components 1.. read
        # into a plain variable), reported by assert_consumed().
        self.unmatched_parts: list[str] = []
        self.pending = 0
        # Variable node id -> the slot relations naming it (built on first use).
        self._slots_of: dict[int, list[tuple[int, int, str, int]]] | None = None
        # Each node's saved path, once the graph is dropped (see release()).
        self._paths: list[str | None] | None = None

    def reader(self) -> Any:
        if self._reader is None:
            source = open_source(self.path)
            self._reader = source if self._names is None else self._names.over(source)
        return self._reader

    def release(self) -> None:
        """Close the file once nothing waits for a live object (no note is pending); the saved
        graph is then dropped too, keeping only each node's path for the load status.

        (Dropped here, while the restore still pauses the cyclic collector: its nodes, a few
        containers per saved object, are otherwise all alive and young when the collector
        resumes, and its first collection walks every one of them.)
        """
        if self.pending != 0:
            return
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._paths is None:
            self._paths = list(map(dict.get, self.nodes, itertools.repeat("path")))
            self.nodes = []
            self._slots_of = None

    def variable_nodes(self) -> dict[int, str]:
        """``node id -> saved path`` of the graph's variables."""
        paths: list[Any] | None = self._paths
        if paths is None:
            paths = list(map(dict.get, self.nodes, itertools.repeat("path")))
        has = map(operator.is_not, paths, itertools.repeat(None))
        return dict(itertools.compress(enumerate(paths), has))

    def restore_into(self, node_id: int, obj: Any) -> None:
        """Match the saved subgraph at ``node_id`` with ``obj`` and restore it, all or nothing."""
        self.plan_into(node_id, obj)()

    def plan_into(self, node_id: int, obj: Any) -> Callable[[], None]:
        """Match the saved subgraph at ``node_id`` with ``obj`` and check everything (shapes,
        dtypes, device counts, checksums) without writing; the callable returned writes it.

        An object that can make now what the file holds for it (an optimizer, its slots and
        step counters for variables matched here: ``_checkpoint_stage``) makes them unattached;
        they are attached when the callable runs, so a failed check leaves it as it was.
        """
        matched: dict[int, Any] = {}
        deferred: list[tuple[Any, str, int]] = []
        deferred_slots: list[tuple[Any, Any, str, int]] = []
        nodes = self.nodes
        self._match([(node_id, obj)], matched, deferred)
        # Per live object: its slots the file has and it has not made, its missing children.
        wanted: dict[int, tuple[Any, list[tuple[Any, str, int]], list[str]]] = {}
        for parent, name, _ in deferred:
            wanted.setdefault(id(parent), (parent, [], []))[2].append(name)
        for owner_id, var_id, slot_name, slot_id in self._slot_relations(matched):
            live = matched.get(owner_id, self.matched.get(owner_id))
            var = matched.get(var_id, self.matched.get(var_id))
            if live is None or var is None or not isinstance(live, Trackable):
                continue
            slot = live._lookup_slot(var, slot_name)
            if slot is None:
                wanted.setdefault(id(live), (live, [], []))[1].append((var, slot_name, slot_id))
            elif slot_id not in matched and slot_id not in self.matched:
                matched[slot_id] = slot
        attach: list[Callable[[], None]] = []
        for live, slots, names in wanted.values():
            # Children this restore noted earlier (a model attached after the optimizer).
            notes = live.__dict__.get("_pv_deferred") or {}
            earlier = {
                name: note.node_id
                for name, note in notes.items()
                if isinstance(note, _Pending) and note.session is self
            }
            made_slots, made_children, done = live._checkpoint_stage(
                [(v, n) for v, n, _ in slots], [*names, *earlier]
            )
            if done is not None:
                attach.append(done)
            for var, slot_name, slot_id in slots:
                slot = made_slots.get((id(var), slot_name))
                if slot is None:
                    deferred_slots.append((live, var, slot_name, slot_id))
                elif slot_id not in matched and slot_id not in self.matched:
                    matched[slot_id] = slot
            if made_children:
                # Attaching them closes the earlier notes (the owner's _checkpoint_stage).
                found = [
                    (child_id, made_children[name])
                    for name, child_id in earlier.items()
                    if name in made_children
                ]
                found += [
                    (child_id, made_children[name])
                    for parent, name, child_id in deferred
                    if parent is live and name in made_children
                ]
                deferred = [d for d in deferred if not (d[0] is live and d[1] in made_children)]
                self._match(found, matched, deferred)

        reader = self.reader()
        plans, sizes, checks, check_sizes = [], [], [], []
        left_out: list[str] = []
        staged: list[Any] = []
        # The variables matched: (node id, live object, saved path), in matched order.
        nids = list(matched)
        paths: list[Any] = list(
            map(dict.get, map(nodes.__getitem__, nids), itertools.repeat("path"))
        )
        is_variable = list(map(operator.is_not, paths, itertools.repeat(None)))
        variable_ids = list(itertools.compress(nids, is_variable))
        items = list(
            itertools.compress(zip(nids, matched.values(), paths, strict=True), is_variable)
        )
        # The common case (a variable taking its saved components one for one) in bulk; the
        # rest each through its saveable's plan.
        table = getattr(reader, "table", None)
        direct = None
        if table is not None:
            direct, rest = plan_direct(table, [it[1] for it in items], [it[2] for it in items])
            taken_items, items = items, [items[k] for k in rest]

        def plan_each(items: list[tuple[int, Any, str]]) -> None:
            for _, live, path in items:
                stored = reader[path]
                staged.append(stored)
                saveable = get_saveable(live)
                assert saveable is not None
                plan = saveable.plan_restore(
                    live, stored, file=self.path, path=path, allow_cast=self.allow_cast
                )
                plans.append(plan)
                left_out.extend(getattr(plan, "unmatched", ()))

        plan_each(items)
        # All or nothing: every checksum is verified before the first value is written. The
        # common case's components are read in a few large reads and verified there (those
        # whose bytes do not match go the general way, which names the damage). Of the others,
        # a native file's small components are read ahead in a few large reads that both
        # passes then use, and verified as they are read (stage() names those); the rest are
        # verified here; checksums and copies in C, spread over the cores.
        try:
            if direct is not None:
                plan_each([taken_items[k] for k in direct.read(reader)])
            verified = reader.stage(staged)
            for stored in staged:
                size = 0
                for i in range(stored.num_components):
                    nbytes = stored.component_nbytes(i)
                    size += nbytes
                    if (stored.path, i) not in verified:
                        checks.append(functools.partial(stored.verify, i))
                        check_sizes.append(nbytes)
                sizes.append(size)
            run_partitioned(checks, check_sizes)
        except BaseException:
            reader.unstage()
            if direct is not None:
                direct.release()
            raise

        def commit() -> None:
            try:
                if direct is not None:
                    direct.commit()
                run_partitioned(plans, sizes)
            finally:
                reader.unstage()
                if direct is not None:
                    direct.release()
            for done in attach:
                done()
            self.matched.update(matched)
            self.unmatched_parts.extend(left_out)
            self.restored.update(variable_ids)
            for parent, name, child_id in deferred:
                parent._pv_deferred_map()[name] = _Pending(self, child_id)
                self.pending += 1
            for opt, var, slot_name, slot_id in deferred_slots:
                opt._pv_deferred_slots()[(id(var), slot_name)] = _Pending(self, slot_id)
                self.pending += 1

        return commit

    def _slot_relations(self, matched: dict[int, Any]) -> list[tuple[int, int, str, int]]:
        """``(owner, variable, slot name, slot)`` node ids of the saved slot relations that
        ``matched`` (newly matched nodes) completes: of owners matched now, and of variables
        matched now whose owner was matched by an earlier part of this restore."""
        nodes = self.nodes
        if self._slots_of is None:
            self._slots_of = {}
            # (only the owners of slots: a model without an optimizer has none)
            for owner_id in itertools.compress(range(len(nodes)), map(_SLOTS, nodes)):
                for var_id, slot_name, slot_id in nodes[owner_id]["slots"]:
                    self._slots_of.setdefault(int(var_id), []).append(
                        (owner_id, int(var_id), slot_name, int(slot_id))
                    )
        out: list[tuple[int, int, str, int]] = []
        if not self._slots_of:  # no slot relation in the file
            return out
        slots_of = self._slots_of
        for nid in matched:
            for var_id, slot_name, slot_id in nodes[nid]["slots"]:
                out.append((nid, int(var_id), slot_name, int(slot_id)))
            for rel in slots_of.get(nid, ()):
                if rel[0] not in matched:  # an owner matched now is listed above
                    out.append(rel)
        return out

    def _match(
        self,
        starts: list[tuple[int, Any]],
        matched: dict[int, Any],
        deferred: list[tuple[Any, str, int]],
    ) -> None:
        """Match saved nodes with live objects breadth-first from ``starts``; a saved child
        with no live object yet goes to ``deferred``.

        Each node is checked and matched when it is reached (in breadth-first order, so the
        first mismatch raised is the one a walk node by node meets first); only containers with
        children wait in the queue. The children of a container are matched together (C loops
        over their ids, names and types); anything unusual among them (a node reached twice, an
        id out of range, a mismatch) goes through :meth:`_match_one`, child by child.
        """
        queue: deque[tuple[int, Any]] = deque()
        leafy: dict[type, bool] = {}  # per type: a saved value, not a container
        for nid, live in starts:
            self._match_one(nid, live, matched, queue, leafy)
        nodes = self.nodes
        earlier = self.matched
        count = len(nodes)
        while queue:
            parent_id, parent = queue.popleft()
            children = nodes[parent_id]["children"]
            names = list(map(_FIRST, children))
            ids = list(map(int, map(_SECOND, children)))
            have = children_of(parent)
            # (the structure saved: the live children in the saved order, no lookup by name)
            same = list(have) == names
            lives = list(have.values()) if same else list(map(have.get, names))
            if any(map(is_, lives, itertools.repeat(None))):
                for name, child_id, live in zip(names, ids, lives, strict=True):
                    if live is None:
                        deferred.append((parent, name, child_id))
                found = [k for k, live in enumerate(lives) if live is not None]
                ids = list(map(ids.__getitem__, found))
                lives = list(map(lives.__getitem__, found))
            types = list(map(type, lives))
            for cls in set(types).difference(leafy):
                leafy[cls] = _is_leaf(lives[types.index(cls)])
            leaf = list(map(leafy.__getitem__, types))
            fresh = (
                len(set(ids)) == len(ids)
                and matched.keys().isdisjoint(ids)
                and earlier.keys().isdisjoint(ids)
                and (not ids or (min(ids) >= 0 and max(ids) < count))
            )
            kids = list(map(nodes.__getitem__, ids)) if fresh else []
            if not fresh or leaf != list(
                map(
                    operator.is_not,
                    map(dict.get, kids, itertools.repeat("path")),
                    itertools.repeat(None),
                )
            ):
                for nid, live in zip(ids, lives, strict=True):
                    self._match_one(nid, live, matched, queue, leafy)
                continue
            matched.update(zip(ids, lives, strict=True))
            if False in leaf:  # containers: their children next
                queue.extend(
                    (nid, live)
                    for nid, live, is_leaf, node in zip(ids, lives, leaf, kids, strict=True)
                    if not is_leaf and node["children"]
                )

    def _match_one(
        self,
        nid: int,
        live: Any,
        matched: dict[int, Any],
        queue: deque[tuple[int, Any]],
        leafy: dict[type, bool],
    ) -> None:
        """Check and match one saved node with ``live`` (nothing when already matched); a
        container with children goes to ``queue``."""
        if nid in matched or nid in self.matched:
            return
        if not 0 <= nid < len(self.nodes):
            raise CheckpointError(
                "object graph refers to a missing node", file=self.path, found=nid
            )
        node = self.nodes[nid]
        path = node.get("path")
        leaf = leafy.get(type(live))
        if leaf is None:
            leaf = leafy[type(live)] = _is_leaf(live)
        if (path is not None) != leaf:
            raise RestoreMismatchError(
                "object kinds differ",
                file=self.path,
                variable=path or f"node {nid}",
                expected="a variable" if path is not None else "a container of variables",
                found=type(live).__name__,
            )
        matched[nid] = live
        if not leaf and node["children"]:
            queue.append((nid, live))


_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_SLOTS = operator.itemgetter("slots")


class _Pending:
    """A saved object waiting for its live counterpart to be attached."""

    def __init__(self, session: _Session, node_id: int) -> None:
        self.session = session
        self.node_id = node_id

    def plan(self, obj: Any) -> Callable[[], None]:
        """Check the restore into ``obj`` (raising leaves this note as it was); the callable
        returned writes it and closes the note."""
        commit = self.session.plan_into(self.node_id, obj)

        def done() -> None:
            self.session.pending -= 1
            try:
                commit()
            finally:
                self.session.release()

        return done

    def apply(self, obj: Any) -> None:
        self.plan(obj)()

    def discard(self) -> None:
        """Drop this note (a later restore gave the object its value)."""
        self.session.pending -= 1
        self.session.release()


class SaveCount:
    """One save's step of a checkpoint's ``save_counter``: incremented when made, taken back
    by :meth:`undo`, or by leaving a ``with`` block on an error, when the save fails.

    A failed save leaves the counter where it was, so the next save reuses the number. Used
    by :meth:`Checkpoint.save` and by the manager, whose write may finish in another thread.
    """

    def __init__(self, counter: Any) -> None:
        self._counter = counter
        self.previous = int(counter)
        self.number = self.previous + 1
        counter.assign(self.number)

    def undo(self) -> None:
        """Put the counter back to its value before this save."""
        self._counter.assign(self.previous)

    def __enter__(self) -> SaveCount:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            self.undo()


_NOT_TAKEN = "no live object took it (so far)"


class CheckpointLoadStatus:
    """What a restore matched; assertions for tests and careful callers."""

    def __init__(self, session: _Session, root: Any) -> None:
        self._session = session
        self._root = root

    def _unmatched_live(self) -> list[str]:
        with _gc_paused():
            graph = build_object_graph(self._root)
            matched = {id(o) for o in self._session.matched.values()}
            return [path for _, obj, path in graph.variables() if id(obj) not in matched]

    @property
    def unrestored_paths(self) -> list[str]:
        """Saved values not restored so far, sorted: no live object matched them yet (a slot
        waiting for its optimizer to create it, a name another model does not have), and the
        components 1.. of an independent variable read into a plain one."""
        with _gc_paused():
            missing = [
                p
                for i, p in self._session.variable_nodes().items()
                if i not in self._session.restored
            ]
        return sorted(missing + self._session.unmatched_parts)

    @property
    def unrestored_reasons(self) -> dict[str, str]:
        """Each of :attr:`unrestored_paths` with why it was not restored: what the restore
        found it cannot map (a TF1 slot whose optimizer cannot be told, a Keras 3 optimizer
        variable saved by position), else that no live object took it so far."""
        reasons = self._session.reasons
        return {p: reasons.get(p, _NOT_TAKEN) for p in self.unrestored_paths}

    @property
    def unmatched_live_paths(self) -> list[str]:
        """Variables reachable from the root now that no saved value was matched with, sorted."""
        return sorted(self._unmatched_live())

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Every saved value was restored and every live variable was matched."""
        missing = self.unrestored_paths
        if missing:
            reasons = self._session.reasons
            raise RestoreMismatchError(
                "saved values were not restored (no matching live object yet)",
                file=self._session.path,
                expected="every saved variable restored",
                found=", ".join(
                    f"{p} ({reasons[p]})" if p in reasons else p for p in sorted(missing)[:20]
                ),
            )
        self.assert_existing_objects_matched()
        return self

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Every variable reachable from the root now was matched with a saved value."""
        unmatched = self._unmatched_live()
        if unmatched:
            raise RestoreMismatchError(
                "live variables have no value in the checkpoint",
                file=self._session.path,
                expected="every live variable matched",
                found=", ".join(sorted(unmatched)[:20]),
            )
        return self

    def assert_nontrivial_match(self) -> CheckpointLoadStatus:
        if not self._session.restored:
            raise RestoreMismatchError("nothing was restored", file=self._session.path)
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Declare that a partial restore is intended (nothing is reported either way)."""
        return self

    @property
    def restored_paths(self) -> list[str]:
        nodes = self._session.variable_nodes()
        return sorted(nodes[i] for i in self._session.restored)


SNAPSHOT_ATTEMPTS = 4
_COMPARE_CHUNK = 4 << 20  # bytes compared at a time: bounded temporary memory
# Two components of one base buffer are copied in one span when at most this many bytes lie
# between them (padding, variables this checkpoint does not save): a span is one copy and one
# comparison, and copying a few KiB more costs less than another span does. Wider gaps (an
# arena row's unused end, large variables not saved) start a new span: never copied.
_SPAN_GAP = 4096
# A span ends before a component that would take it past this many bytes (a larger component
# is a span of its own): buffers of a few MiB at most are reused by the allocator from one save
# to the next, larger ones are mapped anew and their pages faulted in at every copy (8 MiB
# spans, a whole arena row, made the copy of 400 MB 1.5-2x slower than copying by component).
_SPAN_MAX = 1 << 20
_SPAN_ALIGN = 64  # a span's copy keeps its address modulo this: copies aligned like the live
# A structure's copies (at most this many bytes in all) are kept from one non-blocking save to
# the next and copied into again: the next save then reuses the records made over them, so its
# background write costs what a blocking save of the live variables costs, and the copy faults
# in no new pages. Larger snapshots are freed when their write ends.
SNAPSHOT_KEEP_BYTES = 1 << 30


def _unchanged(live: np.ndarray, copied: np.ndarray) -> bool:
    """Whether ``live`` still holds exactly the bytes of ``copied`` (NaNs included)."""
    if live.dtype.kind == "O" or not live.flags.c_contiguous:
        return bool(np.array_equal(live, copied))
    a, b = byte_view(live), byte_view(copied)
    for start in range(0, a.size, _COMPARE_CHUNK):
        if not np.array_equal(a[start : start + _COMPARE_CHUNK], b[start : start + _COMPARE_CHUNK]):
            return False
    return True


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _root(a: np.ndarray) -> np.ndarray:
    """The array at the end of ``a``'s chain of bases (the one that holds its memory)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class _SnapshotPlan:
    """How :func:`_snapshot` copies the components of a list of records, made once per
    structure (the records of an unchanged object graph are the same, their component views
    too).

    Variables live side by side in arenas (``parallelvars._storage``): the C-contiguous
    components that share a base buffer are sorted by address and grouped into spans (see
    ``_SPAN_GAP``), each copied by one memcpy into a buffer of its own and compared in one
    pass; the copied components are views into it (one buffer per span, of at most
    ``_SPAN_MAX`` bytes unless one component is larger). Every other component (strided shards, object
    arrays, empty ones, buffers whose base is not a C-contiguous array) is copied by itself.

    Attributes:
        flat: every record's components in write order.
        spans: ``(live, address, components)``: a flat uint8 view of a span of a live base
            buffer, its address, and the numbers of the components in it.
        span_of: per component, the number of its span (-1: copied by itself).
        offsets: per component of a span, where it starts in the span.
        singles: the numbers of the components copied by themselves.
        starts: the number of each record's first component (then the total).
    """

    __slots__ = (
        "_kept",
        "_lock",
        "flat",
        "nbytes",
        "offsets",
        "singles",
        "span_of",
        "spans",
        "starts",
    )

    def __init__(self, records: Sequence[SaveRecord]) -> None:
        self.flat: list[np.ndarray] = [c for r in records for c in r.components]
        self.starts = list(itertools.accumulate((len(r.components) for r in records), initial=0))
        self.span_of = [-1] * len(self.flat)
        self.offsets = [0] * len(self.flat)
        self.singles: list[int] = []
        roots: dict[int, tuple[np.ndarray, int, list[tuple[int, int, int]]]] = {}
        for i, c in enumerate(self.flat):
            if (
                not isinstance(c, np.ndarray)
                or c.dtype.kind == "O"
                or not c.flags.c_contiguous
                or c.nbytes == 0
            ):
                self.singles.append(i)
                continue
            root = _root(c)
            group = roots.get(id(root))
            if group is None:
                if root.dtype.kind == "O" or not root.flags.c_contiguous:
                    self.singles.append(i)
                    continue
                group = roots[id(root)] = (root, _address(root), [])
            addr = _address(c)
            if not group[1] <= addr <= addr + c.nbytes <= group[1] + root.nbytes:
                self.singles.append(i)  # not inside its base's bytes: never seen, but no span
                continue
            group[2].append((addr, addr + c.nbytes, i))
        self.spans: list[tuple[np.ndarray, int, list[int]]] = []
        for root, base, members in roots.values():
            members.sort()
            whole = byte_view(root)
            run: list[tuple[int, int, int]] = []
            hi = 0
            for m in [*members, None]:
                if run and (m is None or m[0] - hi > _SPAN_GAP or m[1] - run[0][0] > _SPAN_MAX):
                    lo = run[0][0]
                    for addr, _, i in run:
                        self.span_of[i], self.offsets[i] = len(self.spans), addr - lo
                    self.spans.append((whole[lo - base : hi - base], lo, [e[2] for e in run]))
                    run = []
                if m is not None:
                    hi = max(hi, m[1]) if run else m[1]
                    run.append(m)
        self.nbytes = sum(live.size for live, _, _ in self.spans) + sum(
            self.flat[i].nbytes for i in self.singles
        )
        self._kept: _Copies | None = None
        self._lock = threading.Lock()

    def take(self) -> _Copies:
        """The copies of the last snapshot whose write has ended (kept by :meth:`give_back`),
        or new buffers (none kept, or they are in use by a write still running)."""
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            return kept
        spans = []
        for live, address, _members in self.spans:
            buffer = np.empty(live.size + _SPAN_ALIGN, np.uint8)
            start = (address - _address(buffer)) % _SPAN_ALIGN
            spans.append(buffer[start : start + live.size])
        singles = []
        for i in self.singles:
            c = np.asarray(self.flat[i])
            singles.append(np.empty(c.shape, c.dtype))
        return _Copies(spans, singles)

    def give_back(self, copies: _Copies) -> None:
        """Keep ``copies`` (their write has ended) for the next snapshot, when the structure's
        copies take at most ``SNAPSHOT_KEEP_BYTES``."""
        if self.nbytes <= SNAPSHOT_KEEP_BYTES:
            with self._lock:
                self._kept = copies

    def copy_of(self, span: np.ndarray, i: int) -> np.ndarray:
        """Component ``i``'s copy in the copy of its ``span``."""
        c = self.flat[i]
        return np.ndarray(c.shape, c.dtype, span, self.offsets[i])

    def path_of(self, records: Sequence[SaveRecord], i: int) -> str:
        return records[bisect.bisect_right(self.starts, i) - 1].path


class _Copies:
    """One set of copy buffers of a :class:`_SnapshotPlan` (a buffer per span, an array per
    component copied by itself) and the records made over them, once (the same buffers give
    the same records)."""

    __slots__ = ("records", "singles", "spans")

    def __init__(self, spans: list[np.ndarray], singles: list[np.ndarray]) -> None:
        self.spans = spans
        self.singles = singles
        self.records: RecordList | None = None


class _Snapshot:
    """The copies of one moment taken by :func:`_snapshot`; :meth:`records` makes the records
    that hold them (left to the thread that writes them: the calling thread only copies), and
    :meth:`release` hands the buffers back to the plan once the write has ended."""

    __slots__ = ("_copies", "_plan", "_records")

    def __init__(self, records: Sequence[SaveRecord], plan: _SnapshotPlan, copies: _Copies) -> None:
        self._records, self._plan, self._copies = records, plan, copies

    def records(self) -> RecordList:
        """Records like the live ones (shared attributes) holding the copies.

        They have the live records' structure: a ``RecordList``'s key holds for them too, so a
        repeated save is written from its skeleton. Made once per set of buffers: copies kept
        from an earlier save come with their records (the same objects, so the writer's
        per-record work is not done again either).
        """
        made = self._copies.records
        if made is not None:
            return made
        plan, spans, records = self._plan, self._copies.spans, self._records
        singles = iter(self._copies.singles)
        copies = [
            next(singles) if n < 0 else np.ndarray(c.shape, c.dtype, spans[n], off)
            for c, n, off in zip(plan.flat, plan.span_of, plan.offsets, strict=True)
        ]
        key = records.structure() if isinstance(records, RecordList) else None
        out = RecordList(key=key)
        starts = plan.starts
        for n, r in enumerate(records):
            copy = SaveRecord.__new__(SaveRecord)
            copy.__dict__.update(r.__dict__)  # what is not a component is the live record's
            copy.components = copies[starts[n] : starts[n + 1]]
            out.append(copy)
        self._copies.records = out
        return out

    def release(self) -> None:
        """The write of these copies has ended: the next snapshot may copy into them."""
        self._plan.give_back(self._copies)


def _snapshot(records: Sequence[SaveRecord], plan: _SnapshotPlan | None = None) -> _Snapshot:
    """Copies of every record's components that held together at one moment.

    Double collect: copy every component, then compare every live buffer with its copy. If
    none differs, each buffer held its copied bytes from its copy to its comparison, and all
    those intervals contain the moment between the last copy and the first comparison: the
    copies are the values of that one moment (the guard of a blocking save's second checksum,
    over the whole set instead of one buffer at a time). Otherwise copy again, up to
    ``SNAPSHOT_ATTEMPTS`` times, then refuse: a save never holds a mix of old and new values.
    Bytes are compared, so a writer that changes a buffer and puts back exactly the bytes it
    replaced, both between that buffer's copy and its comparison, goes unseen.

    Components are copied and compared by span of their base buffers (``plan``, made here
    when not given): a span that differs is compared again component by component, since its
    bytes between the components (padding, variables not saved) may change; only a change of
    a component counts.

    Raises:
        ConcurrentWriteError: variables kept changing in another thread during every attempt.
    """
    if plan is None:
        plan = _SnapshotPlan(records)
    flat = plan.flat
    changed = ""
    copies = plan.take()
    spans, singles = copies.spans, copies.singles
    for _ in range(SNAPSHOT_ATTEMPTS):
        for (live, _, _), span in zip(plan.spans, spans, strict=True):
            np.copyto(span, live)
        for i, single in zip(plan.singles, singles, strict=True):
            np.copyto(single, flat[i])
        changed = ""
        for (live, _, members), span in zip(plan.spans, spans, strict=True):
            if _unchanged(live, span):
                continue
            i = next((i for i in members if not _unchanged(flat[i], plan.copy_of(span, i))), -1)
            if i >= 0:
                changed = plan.path_of(records, i)
                break
        if not changed:
            i = next(
                (
                    i
                    for i, c in zip(plan.singles, singles, strict=True)
                    if not _unchanged(flat[i], c)
                ),
                -1,
            )
            changed = plan.path_of(records, i) if i >= 0 else ""
        if not changed:
            return _Snapshot(records, plan, copies)
    plan.give_back(copies)
    raise ConcurrentWriteError(
        "changed while a non-blocking save copied the variables",
        variable=changed,
        expected="no writes during the copy",
        found=f"writes during each of {SNAPSHOT_ATTEMPTS} attempts",
        hint="call save() from the thread that updates the variables, or pause the other writers while it runs",
    )


class Checkpoint(Trackable):
    """Groups trackable objects and saves or restores them together.

    Args:
        **roots: the objects to save, by name (modules, optimizers, variables, containers).

    Example:
        >>> import numpy as np, parallelvars as pv, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> with pv.MirroredStrategy(2).scope():
        ...     w = pv.Variable(np.arange(3, dtype=np.float32), name="w")
        >>> ckpt = pv.Checkpoint(w=w)
        >>> path = ckpt.save(os.path.join(d, "run"))
        >>> os.path.basename(path)
        'run-1.h5'
        >>> w.assign(np.zeros(3, np.float32)) is w
        True
        >>> ckpt.restore(path).assert_consumed() is not None
        True
        >>> w.components[1].tolist()
        [0.0, 1.0, 2.0]
    """

    def __init__(self, **roots: Any) -> None:
        from parallelvars.variables import _make_distributed_variable

        if "save_counter" in roots:
            raise InvalidArgumentError(
                "'save_counter' is reserved for the checkpoint's own counter"
            )
        for name, value in roots.items():
            if value is None:
                raise InvalidArgumentError(f"checkpoint root {name!r} is None")
        self._roots = dict(roots)
        # Outside any strategy on purpose: the counter is one value, whoever creates the checkpoint.
        self.save_counter = _make_distributed_variable(
            ParallelDevice(1), initial_value=np.int64(0), name="save_counter", trainable=False
        )
        # The skeleton of the structure saved last: a repeated save of it is written from the
        # cached bytes instead of by HDF5 (see checkpoint._skeleton).
        self._pv_skeletons = SkeletonCache()
        # The last save's object graph, records and graph document, saved again while the graph
        # is unchanged (see _gather).
        self._pv_save_memo: tuple[ObjectGraph, RecordList, dict[str, Any]] | None = None
        # How a non-blocking save copies those records (see _snapshot).
        self._pv_snapshot_plan: tuple[Sequence[SaveRecord], _SnapshotPlan] | None = None

    def __getattr__(self, name: str) -> Any:
        roots = self.__dict__.get("_roots", {})
        if name in roots:
            return roots[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        # A trackable attached after construction is a root like the constructor's, and one
        # attached after restore() receives its saved value (deferred restoration), as on a Module.
        if name.startswith("_") or name == "save_counter" or not is_trackable(value):
            object.__setattr__(self, name, value)
            return
        value = _wrap(value)
        self._roots[name] = value
        self._maybe_restore_child(name, value)

    def _trackable_children(self) -> dict[str, Any]:
        return {**self._roots, "save_counter": self.save_counter}

    def _metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"save_counter": int(self.save_counter)}
        step = self._roots.get("step")
        if step is not None and np.ndim(step) == 0:
            try:
                meta["step"] = int(np.asarray(step))
            except (TypeError, ValueError):
                pass
        return meta

    def write(self, path: str | os.PathLike[str]) -> str:
        """Write a checkpoint to exactly ``path`` (atomically); returns ``path``."""
        # One pause for the gather and the write: resumed in between, the collector would walk
        # everything the gather made (all of it young) once more before the write.
        with _gc_paused():
            return self._prepare_write()(path)

    def _prepare_write(self, *, copy: bool = False) -> Callable[[str | os.PathLike[str]], str]:
        """Gather what a write saves now; the returned callable writes it to a path.

        With ``copy=True`` every component buffer is copied first (a consistent snapshot, see
        :func:`_snapshot`), so the variables may change, in another thread too, before the
        callable runs: it writes the values as they were at this call (the records holding
        the copies are made by the callable, in the thread that writes). Without, components
        are views written as they are.
        """
        with _gc_paused():
            records, object_graph, metadata = self._gather(False)
            snapshot = self._snapshot(records) if copy else None

        writer = _checkpoint_writer()  # every rank writes its part under MPI

        def write(path: str | os.PathLike[str]) -> str:
            try:
                with _gc_paused():  # a few objects per variable, all alive until the write ends
                    return writer(
                        os.fspath(path),
                        records if snapshot is None else snapshot.records(),
                        object_graph=object_graph,
                        metadata=metadata,
                        skeletons=self._pv_skeletons,
                    )
            finally:
                if snapshot is not None:
                    snapshot.release()

        return write

    def _gather(self, copy: bool) -> tuple[list[SaveRecord], dict[str, Any], dict[str, Any]]:
        """The records of every saved variable (slots marked), the object graph and metadata.

        While the object graph is the last save's (:meth:`ObjectGraph.unchanged`: every
        container has the same children, every trackable the same slots), the last save's
        records and graph document are the ones saved: a variable's record holds what cannot
        change for its object (name, devices, kind, shape, dtype, sharding, its component
        views), and its path and slot attributes are the graph's. So a repeated save costs an
        identity comparison per object here, and the writer's per-record work (``RecordList``)
        is done once per structure. Any change builds a new graph and new records.
        """
        memo = self._pv_save_memo
        if memo is None or not memo[0].unchanged():
            self._pv_snapshot_plan = None  # the old records' buffers are not kept alive by it
            memo = self._pv_save_memo = self._gather_new()
        _, records, object_graph = memo
        if copy:
            return self._snapshot(records).records(), object_graph, self._metadata()
        return records, object_graph, self._metadata()

    def _snapshot(self, records: Sequence[SaveRecord]) -> _Snapshot:
        """A snapshot of ``records`` (:func:`_snapshot`), copied by the plan made for them at
        the first non-blocking save of their structure."""
        plan = self._pv_snapshot_plan
        if plan is None or plan[0] is not records:
            plan = self._pv_snapshot_plan = (records, _SnapshotPlan(records))
        return _snapshot(records, plan[1])

    def _drop_snapshot_copies(self) -> None:
        """Free the copies kept from the last non-blocking save (``SNAPSHOT_KEEP_BYTES``); the
        next one allocates them again. A manager calls this when it closes."""
        self._pv_snapshot_plan = None

    def _gather_new(self) -> tuple[ObjectGraph, RecordList, dict[str, Any]]:
        """A new object graph and records (see :meth:`_gather`)."""
        graph = build_object_graph(self)
        records = RecordList()
        node_ids = []
        for node_id, obj, var_path, saveable in graph.saveables():
            record = saveable.gather(obj)
            record.path = var_path
            records.append(record)
            node_ids.append(node_id)
        by_node: dict[int, SaveRecord] | None = None
        for node in graph.nodes:
            if not node["slots"]:
                continue
            if by_node is None:
                by_node = dict(zip(node_ids, records, strict=True))
            for var_id, slot_name, slot_id in node["slots"]:
                rec = by_node[slot_id]  # a slot is a variable node of this graph: one dict lookup
                rec.attrs["slot_of"] = graph.nodes[var_id]["path"]
                rec.attrs["slot_name"] = slot_name
        return graph, records, graph.to_json()

    def save(self, file_prefix: str | os.PathLike[str]) -> str:
        """Write ``<file_prefix>-<n>.h5`` with ``n`` the incremented ``save_counter``; returns it."""
        with self._count_save() as count:
            return self.write(f"{os.fspath(file_prefix)}-{count.number}.h5")

    def _count_save(self) -> SaveCount:
        """Increment ``save_counter`` for a save; the returned count takes it back on failure."""
        return SaveCount(self.save_counter)

    def restore(
        self, path: str | os.PathLike[str], *, allow_cast: bool = False
    ) -> CheckpointLoadStatus:
        """Restore from ``path`` (``.h5`` may be omitted); all or nothing for existing objects.

        Args:
            path: the checkpoint file.
            allow_cast: convert values saved with another dtype instead of raising.

        Returns:
            A status with ``assert_consumed()``, ``assert_existing_objects_matched()`` and
            ``expect_partial()``.
        """
        p = os.fspath(path)
        if not os.path.exists(p) and os.path.exists(p + ".h5"):
            p += ".h5"
        with _gc_paused():
            try:
                session = _Session(p, allow_cast, self)
            except (NotACheckpointError, CheckpointNotFoundError) as exc:
                raise with_foreign_hint(exc, p) from None
            try:
                session.restore_into(0, self)
            finally:
                session.release()
        return CheckpointLoadStatus(session, self)

    read = restore
