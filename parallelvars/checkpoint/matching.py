"""The restore planner: matching a saved object graph with the live one, then one apply step.

A :class:`RestoreSession` is one ``Checkpoint.restore`` call: the file (our HDF5 layout, or a
source of another format plugged in through :mod:`parallelvars.checkpoint.sources`), its
object graph, and what has been matched so far. :meth:`RestoreSession.plan` matches the saved
subgraph at a node with a live object by local names, starting at the root, and checks
everything (shapes, dtypes, device counts, checksums) without writing: it returns a
:class:`RestorePlan`, the list of ``(stored entry, live target, rule)`` it will apply, and
:meth:`RestorePlan.apply` writes them. So a failed restore leaves every variable as it was.

Saved objects that do not exist yet are remembered on their parent (a :class:`Pending` note)
and restored the moment they are attached (deferred restoration): lazily built layers,
optimizer slots created by the first step.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections import deque
from collections.abc import Callable
from operator import is_
from typing import Any, NamedTuple

from parallelvars._threads import run_partitioned
from parallelvars.checkpoint._restore import DirectRestore, commit_plans, plan_direct
from parallelvars.checkpoint.graph import (
    checked_graph_nodes,
    graph_from_paths,
    is_leaf,
    slot_relations,
)
from parallelvars.checkpoint.h5io.read import H5Reader
from parallelvars.checkpoint.registry import get_saveable
from parallelvars.checkpoint.sources import Source, SourceEntry, open_source
from parallelvars.errors import CheckpointError, RestoreMismatchError
from parallelvars.tracking import Trackable, children_of

__all__ = ["Pending", "RestorePlan", "RestoreSession", "RestoreStep"]


class RestoreSession:
    """One ``restore()`` call: the file, its graph, and what has been matched so far."""

    def __init__(self, path: str, allow_cast: bool, root: Any = None) -> None:
        self.path = path
        self.allow_cast = allow_cast
        # Our HDF5 layout, or a plug-in's source of another format (see sources); a name-based
        # TensorFlow checkpoint seen through the live names of ``root``'s objects.
        self._reader: Any = open_source(path)
        for_root = None if root is None else getattr(self._reader, "for_root", None)
        if for_root is not None:
            try:
                self._reader = for_root(root)
            except BaseException:
                self._reader.close()
                raise
        self._names = self._reader if hasattr(self._reader, "over") else None
        # Saved path -> why no live object can take it (reported by the load status).
        unrestorable = getattr(self._reader, "unrestorable", None)
        self.reasons: dict[str, str] = {} if unrestorable is None else dict(unrestorable())
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

    def reader(self) -> Source:
        if self._reader is None:
            source = open_source(self.path)
            self._reader = source if self._names is None else self._names.over(source)
        return self._reader

    def release(self) -> None:
        """Close the file once nothing waits for a live object (no note is pending); the saved
        graph is then dropped too, keeping only each node's path for the load status.
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

    def restore_into(
        self,
        node_id: int,
        obj: Any,
        agree: Callable[[BaseException | None, list[Any]], None] | None = None,
    ) -> None:
        """Match the saved subgraph at ``node_id`` with ``obj`` and restore it, all or nothing.

        ``agree(error, pieces)`` (a multi-process restore) is called on every process once its
        plan is made or failed, before anything is written, with the pieces of saved
        components this process read in part (their checksums are verified together); it
        raises when any process failed, so a restore that cannot serve every process changes
        no variable anywhere.
        """
        try:
            plan = self.plan(node_id, obj)
        except BaseException as exc:
            if agree is not None:
                agree(exc, [])  # tell the others (and raise this error here)
            raise
        pieces = [p for step in plan.steps for p in getattr(step.rule, "pieces", ())]
        try:
            if agree is not None:
                agree(None, pieces)
            elif pieces:  # (one process: no other reads complete them; refused there)
                from parallelvars.checkpoint._restore import verify_pieces

                verify_pieces(pieces, self.path)
        except BaseException:
            plan.discard(recycle=False)
            raise
        plan.apply()

    def plan(self, node_id: int, obj: Any) -> RestorePlan:
        """Match the saved subgraph at ``node_id`` with ``obj`` and check everything (shapes,
        dtypes, device counts, checksums) without writing; :meth:`RestorePlan.apply` writes it.

        An object that can make now what the file holds for it (an optimizer, its slots and
        step counters for variables matched here: ``_checkpoint_stage``) makes them unattached;
        they are attached when the plan is applied, so a failed check leaves it as it was.
        """
        plan = RestorePlan(self)
        self._match_subgraph(plan, node_id, obj)
        self._check(plan)
        return plan

    def _match_subgraph(self, plan: RestorePlan, node_id: int, obj: Any) -> None:
        """The matching half of :meth:`plan`: saved nodes with live objects (``plan.matched``),
        what waits for a live object (``plan.deferred``, ``plan.deferred_slots``) and what
        ``_checkpoint_stage`` made (``plan.attach``)."""
        matched, deferred, deferred_slots = plan.matched, plan.deferred, plan.deferred_slots
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
        for live, slots, names in wanted.values():
            # Children this restore noted earlier (a model attached after the optimizer).
            notes = live.__dict__.get("_pv_deferred") or {}
            earlier = {
                name: note.node_id
                for name, note in notes.items()
                if isinstance(note, Pending) and note.session is self
            }
            made_slots, made_children, done = live._checkpoint_stage(
                [(v, n) for v, n, _ in slots], [*names, *earlier]
            )
            if done is not None:
                plan.attach.append(done)
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
                deferred[:] = [d for d in deferred if not (d[0] is live and d[1] in made_children)]
                self._match(found, matched, deferred)

    def _check(self, plan: RestorePlan) -> None:
        """The checking half of :meth:`plan`: each matched variable's stored entry and rule
        (``plan.steps``, or ``plan.direct`` for those restored in bulk), every checksum
        verified. Raising leaves nothing staged."""
        reader: Any = self.reader()  # (a Source; the native reader also has a table)
        plan.reader = reader
        nodes, matched = self.nodes, plan.matched
        checks, check_sizes = [], []
        # The variables matched: (node id, live object, saved path), in matched order.
        nids = list(matched)
        paths: list[Any] = list(
            map(dict.get, map(nodes.__getitem__, nids), itertools.repeat("path"))
        )
        is_variable = list(map(operator.is_not, paths, itertools.repeat(None)))
        plan.variable_ids = list(itertools.compress(nids, is_variable))
        items = list(
            itertools.compress(zip(nids, matched.values(), paths, strict=True), is_variable)
        )
        # The common case (a variable taking its saved components one for one) in bulk; the
        # rest each through its saveable's plan.
        table = getattr(reader, "table", None)
        if table is not None:
            plan.direct, rest = plan_direct(table, [it[1] for it in items], [it[2] for it in items])
            taken_items, items = items, [items[k] for k in rest]
            plan.direct_paths = [it[2] for it in taken_items]

        def plan_each(items: list[tuple[int, Any, str]]) -> None:
            for _, live, path in items:
                stored = reader[path]
                saveable = get_saveable(live)
                assert saveable is not None
                rule = saveable.plan_restore(
                    live, stored, file=self.path, path=path, allow_cast=self.allow_cast
                )
                plan.steps.append(RestoreStep(stored, live, rule))
                plan.left_out.extend(getattr(rule, "unmatched", ()))

        plan_each(items)
        # All or nothing: every checksum is verified before the first value is written. The
        # common case's components are read in a few large reads and verified there (those
        # whose bytes do not match go the general way, which names the damage). Of the others,
        # a native file's small components are read ahead in a few large reads that both
        # passes then use, and verified as they are read (stage() names those); the rest are
        # verified here; checksums and copies in C, spread over the cores.
        try:
            if plan.direct is not None:
                plan_each([taken_items[k] for k in plan.direct.read(reader)])
            # A rule that reads some components only (a process's shard of a variable sharded
            # across processes: the saved shards overlapping it) names them in ``needed``:
            # only those are verified, read ahead or not (the others are not this process's).
            needs = [getattr(step.rule, "needed", None) for step in plan.steps]
            staged = [step.stored for step in plan.steps]
            verified = reader.stage(
                [st for st, need in zip(staged, needs, strict=True) if need is None]
            )
            for stored, need in zip(staged, needs, strict=True):
                size = 0
                for i in range(stored.num_components) if need is None else need:
                    nbytes = stored.component_nbytes(i)
                    size += nbytes
                    if (stored.path, i) not in verified:
                        checks.append(functools.partial(stored.verify, i))
                        check_sizes.append(nbytes)
                plan.sizes.append(size)
            run_partitioned(checks, check_sizes)
        except BaseException:
            plan.discard(recycle=False)
            raise

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
                leafy[cls] = is_leaf(lives[types.index(cls)])
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
            leaf = leafy[type(live)] = is_leaf(live)
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


class RestoreStep(NamedTuple):
    """One variable of a :class:`RestorePlan`: its saved entry, the live object that takes
    it, and the rule that writes one into the other (its saveable's ``plan_restore``; see
    :mod:`parallelvars.checkpoint._restore` for the rules of parallel variables)."""

    stored: SourceEntry
    target: Any
    rule: Callable[[], None]


class RestorePlan:
    """A checked restore of one saved subgraph: nothing is written until :meth:`apply`.

    Attributes:
        steps: ``(stored entry, live target, rule)`` of each variable restored through its
            saveable's rule.
        direct: the variables that take their saved components one for one, restored in
            bulk (one row of columns each, no object per variable), or None.
        sizes: the bytes of each step (to spread them over the cores).
        matched: saved node id -> the live object matched with it.
        variable_ids: the node ids of the variables among them.
        left_out: saved components the rules leave out (reported by the load status).
        attach: what attaches the objects made for this restore (an optimizer's slots).
        deferred / deferred_slots: saved children and slots with no live object yet; applying
            leaves a :class:`Pending` note for each on its live parent.
    """

    def __init__(self, session: RestoreSession) -> None:
        self.session = session
        self.reader: Any = None  # the source the entries come from (set by the check)
        self.steps: list[RestoreStep] = []
        self.direct: DirectRestore | None = None
        self.direct_paths: list[str] = []  # the saved path of each variable offered to direct
        self.sizes: list[int] = []
        self.matched: dict[int, Any] = {}
        self.variable_ids: list[int] = []
        self.left_out: list[str] = []
        self.attach: list[Callable[[], None]] = []
        self.deferred: list[tuple[Any, str, int]] = []
        self.deferred_slots: list[tuple[Any, Any, str, int]] = []

    def apply(self) -> None:
        """Write every value, attach what was made, and leave the notes of what waits."""
        session = self.session
        applied = False
        try:
            written: list[str] = []
            if self.direct is not None:
                self.direct.commit()
                written = [self.direct_paths[k] for k in self.direct.taken]
            # (a file changed since it was verified: ConcurrentWriteError naming these)
            commit_plans(
                [step.rule for step in self.steps],
                [step.stored.path for step in self.steps],
                self.sizes,
                file=session.path,
                written=written,
            )
            applied = True
        finally:
            self.discard(recycle=applied)
        for done in self.attach:
            done()
        session.matched.update(self.matched)
        session.unmatched_parts.extend(self.left_out)
        session.restored.update(self.variable_ids)
        for parent, name, child_id in self.deferred:
            parent._pv_deferred_map()[name] = Pending(session, child_id)
            session.pending += 1
        for opt, var, slot_name, slot_id in self.deferred_slots:
            opt._pv_deferred_slots()[(id(var), slot_name)] = Pending(session, slot_id)
            session.pending += 1

    def discard(self, recycle: bool = True) -> None:
        """Drop what was read ahead for this plan (applied, or given up): its staging memory
        is kept for the next restore only when ``recycle`` (every copy out of it is done; a
        failed or interrupted restore frees it, as a thread may still write into it)."""
        if isinstance(self.reader, H5Reader):  # (the native reader stages into that memory)
            self.reader.unstage(recycle)
        elif self.reader is not None:  # (a source's unstage() takes no argument)
            self.reader.unstage()
        if self.direct is not None:
            self.direct.release(recycle)


class Pending:
    """A saved object waiting for its live counterpart to be attached."""

    def __init__(self, session: RestoreSession, node_id: int) -> None:
        self.session = session
        self.node_id = node_id

    def plan(self, obj: Any) -> Callable[[], None]:
        """Check the restore into ``obj`` (raising leaves this note as it was); the callable
        returned writes it and closes the note."""
        commit = self.session.plan(self.node_id, obj).apply

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
