"""``Checkpoint``: save and restore an object graph in the native HDF5 layout (a restore also
reads every format a source plug-in reads, see :mod:`parallelvars.checkpoint.sources`).

The facade over the checkpoint package's concepts, one module each:

* :mod:`~parallelvars.checkpoint.graph`: the object graph. Saving walks it breadth-first from
  the checkpoint's roots; every object with a registered saveable (variables) is written at
  the first path that reaches it (``model/layers/0/kernel``). The graph itself (children,
  slot relations) goes into the file.
* :mod:`~parallelvars.checkpoint.matching`: the restore planner. Restoring matches the saved
  graph against the live one by local names, starting at the root. Everything is checked
  first (shapes, dtypes, device counts, checksums) and applied only when all of it is sound,
  so a failed restore leaves every variable as it was. Saved objects that do not exist yet are
  remembered on their parent and restored the moment they are attached (deferred
  restoration): lazily built layers, optimizer slots created by the first step.
* :mod:`~parallelvars.checkpoint.status`: what a restore matched (:class:`CheckpointLoadStatus`).
* :mod:`~parallelvars.checkpoint.snapshot`: the copies a non-blocking save writes.
* :mod:`~parallelvars.checkpoint.h5io`: the bytes of the native layout.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from parallelvars.checkpoint import _restore  # (also registers the variable saveable)
from parallelvars.checkpoint._foreign import with_foreign_hint
from parallelvars.checkpoint._gcfreeze import FREEZE_STEP, freeze_made_so_far, older_objects_frozen
from parallelvars.checkpoint._h5policy import PARTS_SUFFIX  # noqa: F401 - <file>.parts/: a multi-process save's files
from parallelvars.checkpoint.graph import (  # noqa: F401 - the graph's names, as before
    GRAPH_VERSION,
    ObjectGraph,
    build_object_graph,
    checked_graph_nodes,
    escape_name,
    graph_from_paths,
    slot_relations,
    unescape_name,
)
from parallelvars.checkpoint.h5io.collective import write_collective
from parallelvars.checkpoint.h5io.records import PlanCache, RecordList
from parallelvars.checkpoint.h5raw.native import save_native
from parallelvars.checkpoint.matching import RestoreSession
from parallelvars.checkpoint.registry import SaveRecord
from parallelvars.checkpoint.snapshot import Snapshot, SnapshotPlan, plan_replicas, take_snapshot
from parallelvars.checkpoint.status import CheckpointLoadStatus
from parallelvars.devices import ParallelDevice
from parallelvars.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    NotACheckpointError,
)
from parallelvars.strategy._cluster import cluster_strategy
from parallelvars.tracking import Trackable, _wrap, is_trackable

__all__ = [
    "Checkpoint",
    "CheckpointLoadStatus",
    "SaveCount",
    "build_object_graph",
    "checked_graph_nodes",
    "escape_name",
    "graph_from_paths",
    "slot_relations",
    "unescape_name",
]


def _checkpoint_writer(plans: PlanCache | None = None) -> Callable[..., str]:
    """``writer(path, records, *, object_graph, metadata)`` for this process's saves:
    under a multi-process strategy (:mod:`parallelvars.strategy._cluster`), every rank writes
    its part of one logical checkpoint through the strategy's communicator
    (:func:`~parallelvars.checkpoint.h5io.collective.write_collective`, the rank files' and
    the index file's generated metadata cached with ``plans``); else the single-file
    writer (:func:`~parallelvars.checkpoint.h5raw.native.save_native`: the generated layout,
    the structure's metadata cached in ``plans`` for the next save)."""
    strategy = cluster_strategy()
    if strategy is None:

        def write_one(path: str, records: Sequence[SaveRecord], **options: Any) -> str:
            _plan_replicas(records)
            with older_objects_frozen():  # a first save's plan: a few containers per variable
                return save_native(path, records, cache=plans, **options)

        return write_one
    comm, local, everyone = strategy.comm, strategy.parameter_devices, strategy.worker_devices

    def write(path: str, records: Sequence[SaveRecord], **options: Any) -> str:
        return write_collective(
            comm,
            path,
            records,
            local,
            everyone,
            cache=plans,
            plan_replicas=plan_replicas,
            **options,
        )

    return write


def _plan_replicas(records: Sequence[SaveRecord]) -> None:
    """From the second save of a ``RecordList`` on, give it the plan of runs its replicas are
    compared by (:class:`SnapshotPlan`, read by the writer: ``h5raw.component_bytes._replica_plan``);
    a first save compares them one by one (making the plan costs more, once). A snapshot's
    copies get none (:func:`plan_replicas` decides)."""
    if isinstance(records, RecordList):
        plan_replicas(records)


def collective_rank() -> int | None:
    """This process's rank when checkpoints are written collectively (MPI), else None."""
    strategy = cluster_strategy()
    return None if strategy is None else int(strategy.cluster_rank)


def _restore_agreement(path: str) -> Callable[[BaseException | None, list[Any]], None] | None:
    """Under a multi-process strategy, ``agree(error, pieces)`` for a restore: every process
    reports whether its plan (matching, shapes, checksums of what it reads) succeeded and the
    pieces of saved shards it read in part, before any writes (one allgather); every process
    raises when one failed, or when the pieces of a shard do not add up to its checksum
    (every process checks all pieces, so all reach the same verdict). None in one process."""
    strategy = cluster_strategy()
    if strategy is None or int(strategy.num_replicas_in_sync) <= 1:
        return None
    comm, rank = strategy.comm, int(strategy.cluster_rank)

    def agree(error: BaseException | None, pieces: list[Any]) -> None:
        mine = None if error is None else f"rank {rank}: {type(error).__name__}: {error}"
        everyone = comm.allgather((mine, [tuple(p) for p in pieces]))
        failed = [e for e, _ in everyone if e is not None]
        if failed and error is None:
            raise CheckpointError(
                "the restore cannot give every process its values; nothing was restored",
                file=path,
                found="; ".join(failed),
            )
        if error is None:
            _restore.verify_pieces([_restore.Piece(*p) for _, ps in everyone for p in ps], path)

    return agree


# Suffixes of the formats a checkpoint is converted to, never written by Checkpoint.write.
FOREIGN_SUFFIXES = (
    (".weights.h5", "keras"),
    (".keras", "keras"),
    (".safetensors", "safetensors"),
    (".safetensors.index.json", "safetensors"),
    (".npz", "npz"),
    (".index", "tf"),
    (".pt", "torch"),
    (".pth", "torch"),
    (".bin", "torch"),
)


def check_native_name(path: str) -> None:
    """Refuse a native write under a name another format's readers expect (an HDF5 file named
    ``x.safetensors`` fails in safetensors with "header too large")."""
    lowered = path.lower()
    for suffix, fmt in FOREIGN_SUFFIXES:
        if lowered.endswith(suffix):
            raise InvalidArgumentError(
                f"{path}: Checkpoint.write writes our HDF5 layout, and {suffix} names the {fmt} "
                "format; write a .h5 file and convert it (parallelvars convert, "
                "parallelvars.formats.convert(..., model_only=True) for a model's export)"
            )


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
        from parallelvars._creation import _make_distributed_variable

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
        # The generated metadata of the structure saved last (see h5raw/native.py: Prepared;
        # under MPI, of this rank's file, and on rank 0 of the index file too): a repeated
        # save puts the new values in it.
        self._pv_plans = PlanCache()
        # The last save's object graph, records and graph document, saved again while the graph
        # is unchanged (see _gather).
        self._pv_save_memo: tuple[ObjectGraph, RecordList, dict[str, Any]] | None = None
        # A graph of the live objects a load status built (see _live_graph), taken by the next
        # save while it is unchanged.
        self._pv_live_graph: ObjectGraph | None = None
        # How a non-blocking save copies those records (see take_snapshot).
        self._pv_snapshot_plan: tuple[Sequence[SaveRecord], SnapshotPlan] | None = None

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
        """Write a checkpoint to exactly ``path`` (atomically); returns ``path``.

        The file is always our HDF5 layout. A name whose suffix is another format's
        (``.safetensors``, ``.npz``, ``.keras``, ``.weights.h5``, ``.index``, ``.pt``) is refused
        (InvalidArgumentError), never an HDF5 file under that name: write ``.h5`` and convert it
        (``parallelvars convert``, :func:`parallelvars.formats.convert`).
        """
        check_native_name(os.fspath(path))
        return self._prepare_write()(path)

    def _prepare_write(self, *, copy: bool = False) -> Callable[[str | os.PathLike[str]], str]:
        """Gather what a write saves now; the returned callable writes it to a path.

        With ``copy=True`` every component buffer is copied first (a consistent snapshot, see
        :func:`take_snapshot`), so the variables may change, in another thread too, before the
        callable runs: it writes the values as they were at this call (the records holding
        the copies are made by the callable, in the thread that writes). Without, components
        are views written as they are.
        """
        records, object_graph, metadata = self._gather(False)
        snapshot = self._snapshot(records) if copy else None

        writer = _checkpoint_writer(self._pv_plans)  # every rank writes its part under MPI

        def write(path: str | os.PathLike[str]) -> str:
            try:
                return writer(
                    os.fspath(path),
                    records if snapshot is None else snapshot.records(),
                    object_graph=object_graph,
                    metadata=metadata,
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
            self._pv_save_memo = None
            with older_objects_frozen():  # a graph and records: a few containers per variable
                memo = self._pv_save_memo = self._gather_new(self._live_graph())
        self._pv_live_graph = None  # (the memo holds the graph now)
        _, records, object_graph = memo
        if copy:
            return self._snapshot(records).records(), object_graph, self._metadata()
        return records, object_graph, self._metadata()

    def _snapshot(self, records: Sequence[SaveRecord]) -> Snapshot:
        """A snapshot of ``records`` (:func:`take_snapshot`), copied by the plan made for them at
        the first non-blocking save of their structure."""
        plan = self._pv_snapshot_plan
        if plan is None or plan[0] is not records:
            # (one plan per records: the one a blocking save compares their replicas by, if
            # made, and from now on the blocking saves compare by this one)
            made = getattr(records, "replicas", None)
            if not isinstance(made, SnapshotPlan):
                made = SnapshotPlan(records)
                if isinstance(records, RecordList) and not records.copied:
                    records.replicas = made
            plan = self._pv_snapshot_plan = (records, made)
        return take_snapshot(records, plan[1])

    def _drop_snapshot_copies(self) -> None:
        """Free the copies kept from the last non-blocking save (``SNAPSHOT_KEEP_BYTES``); the
        next one allocates them again. A manager calls this when it closes."""
        if self._pv_snapshot_plan is not None:
            self._pv_snapshot_plan[1].drop_kept()  # (the records' replicas plan may be it)
        self._pv_snapshot_plan = None

    def _live_graph(self) -> ObjectGraph:
        """The object graph of the live objects now.

        The last save's graph while it is :meth:`~ObjectGraph.unchanged` (an identity
        comparison per child instead of a walk that makes a few containers per object), else a
        new one, kept for the next save (a load status builds one for
        ``assert_consumed()``; the save that follows a restore then reuses it).
        """
        for graph in (
            None if self._pv_save_memo is None else self._pv_save_memo[0],
            self._pv_live_graph,
        ):
            if graph is not None and graph.unchanged():
                return graph
        self._pv_live_graph = None
        graph = self._pv_live_graph = build_object_graph(self)
        return graph

    def _gather_new(self, graph: ObjectGraph) -> tuple[ObjectGraph, RecordList, dict[str, Any]]:
        """The records of the object graph ``graph`` (see :meth:`_gather`)."""
        records = RecordList()
        node_ids, objs, paths, saveables = graph.leaf_columns()
        freeze_made_so_far()  # (the graph is kept: later collections need not walk it again)
        # Each run of variables of one saveable gathered together (Saveable.gather_all), in
        # pieces between which what was made is frozen for the collector (see graph.py).
        start = 0
        for saveable, run in itertools.groupby(saveables):
            stop = start + len(list(run))
            for k in range(start, stop, FREEZE_STEP):
                records.extend(saveable.gather_all(objs[k : min(k + FREEZE_STEP, stop)]))
                freeze_made_so_far()  # (the records are kept too)
            start = stop
        for record, path in zip(records, paths, strict=True):
            record.path = path
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
        with older_objects_frozen():  # the collector runs, walking only what the restore makes
            try:
                session = RestoreSession(p, allow_cast, self)
            except (NotACheckpointError, CheckpointNotFoundError) as exc:
                raise with_foreign_hint(exc, p) from None
            try:
                session.restore_into(0, self, _restore_agreement(p))
            finally:
                session.release()
        return CheckpointLoadStatus(session, self)

    read = restore
