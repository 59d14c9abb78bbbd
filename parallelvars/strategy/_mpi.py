"""MultiWorkerMirroredStrategy: one process per replica, reductions over MPI (mpi4py).

Each process holds its own component of every variable (the component of replica ``rank``);
``num_replicas_in_sync`` is the number of processes and replica ids are ranks, so the global
devices are ``cpu:0 .. cpu:{size-1}``, the same names a one-process
``MirroredStrategy(size)`` uses. The user code is the same as with ``MirroredStrategy``: every
process runs it, ``strategy.run`` calls the replica function once (for this process's replica)
and the cross-replica API (``reduce``, ``batch_reduce``, ``broadcast``, the reductions inside
``merge_call`` and ``apply_gradients``) meets the other processes in MPI collectives.

Collectives use the buffer interface of mpi4py on numpy arrays, in place, without pickling;
arrays travel as raw bytes (``MPI.BYTE``), so every dtype works, bfloat16 and float8 included.

Reduction order. ``MPI_Allreduce`` leaves the order (and grouping) of the additions to the
implementation, which may change with the message size, the number of processes or the
library version, so its sums are not reproducible and need not match a one-process run. We
a reduce-scatter / all-gather of our own in which MPI only moves bytes: the buffer is cut into
one chunk per rank, ``Alltoall`` gives rank ``j`` every rank's chunk ``j``, rank ``j`` adds them
left to right in rank order, and ``Allgather`` shares the summed chunks. Every element is thus
summed in rank order, so the result is bit-identical on every process, from run to run, and
equal to ``MirroredStrategy``'s (which adds replicas in device order). It moves about as many
bytes as a ring all-reduce (~2 buffers per rank). Small buffers use one ``Allgather`` of whole
rows and the same rank-ordered sum.

Tensor fusion. ``apply_gradients`` packs this process's dense gradients of one dtype into one
flat buffer laid out like the variables' arena (or takes it as it is from
``Optimizer.gradient_buffers``) and reduces it with one rank-ordered all-reduce per dtype per
step (``_allreduce_flat``); the update core consumes the reduced buffer directly. Gradients of
another dtype than their variables' are packed and all-reduced the same way, one buffer per
pair of gradient and variable dtype, and cast once; sparse gradients of arena variables are gathered with one
``_allgather_sparse`` for all of them (see :mod:`parallelvars.optimizers._fused`).
``batch_reduce`` likewise packs every gradient of one dtype into one buffer and runs one
collective per dtype instead of one per variable (``fusion=False`` turns both off, for the
benchmark).

Initial values are broadcast from rank 0 when a variable is created, so the replicas start
identical; each step then applies the same reduced gradients everywhere, keeping them
bit-identical.

Sharded variables. ``shard_axis=k`` makes a
:class:`~parallelvars.variables.RankShardedVariable`: rank ``r`` holds shard ``r`` of rank 0's
initial value (one ``Scatterv``; the ``numpy.array_split`` geometry of one process), reads give
that shard, and :meth:`MultiWorkerMirroredStrategy.gather` is the explicit collective for the
full value. ``batch_reduce`` (so ``apply_gradients``) reduce-scatters the dense gradients of
sharded variables (one ``Alltoallv`` per dtype: each rank receives every rank's rows of its own
shard and adds them in rank order, half the traffic of the all-reduce) and all-gathers sparse
``IndexedSlices`` (one ``Allgatherv`` per dtype after one gather of the row counts; rank order,
as one process concatenates its replicas' slices). The update and the slots stay local.

Checkpoints: the strategy registers itself as the process's cluster strategy
(:mod:`parallelvars.strategy._cluster`), and ``Checkpoint`` then writes through the collective
layout writer, :func:`parallelvars.checkpoint.h5io.collective.write_collective`, over its
communicator: every rank writes its own components to its own HDF5 file, in parallel, and rank 0 commits the
index file at the path ``save()`` returns, whose components are external links into the rank
files. Both kinds of file are generated (``h5raw/native.py``), and repeated saves of one
structure reuse the checkpoint's cached generated metadata.

Failure. Creating the strategy installs a ``sys.excepthook`` that prints an uncaught exception
with the rank and calls ``MPI.COMM_WORLD.Abort(1)``, so a rank that raises ends the whole job
instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import numpy as np

from parallelvars._geometry import shard_offsets
from parallelvars._write_plan import merge_reduction
from parallelvars.devices import ParallelDevice
from parallelvars.enums import Aggregation, ReduceOp, Synchronization
from parallelvars.errors import (
    ContextError,
    DistributedValueError,
    GradientError,
)
from parallelvars.strategy import _context
from parallelvars.strategy._base import ReplicaContext, Strategy, _is_variable
from parallelvars.strategy._cluster import set_cluster_strategy
from parallelvars.strategy._collectives import MPICollectives
from parallelvars.strategy._reduce import _is_sparse, _mean_of, reduce_values
from parallelvars.strategy._values import Mirrored, PerReplica, _map_structure, _needs_walk

__all__ = ["MultiWorkerMirroredStrategy", "install_abort_on_error"]


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "MultiWorkerMirroredStrategy needs mpi4py and an MPI library: "
            "pip install 'parallelvars[mpi]'"
        ) from exc
    return MPI


# ----------------------------------------------------------------------------- failure
_HOOK_INSTALLED = False


def install_abort_on_error() -> None:
    """Make an uncaught exception in this process abort the whole MPI job.

    The exception is printed (with the rank) before ``MPI.COMM_WORLD.Abort(1)``, which makes
    ``mpiexec`` stop every rank, including those blocked in a collective. Idempotent.
    """
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    MPI = _import_mpi()
    previous = sys.excepthook

    def hook(exc_type: Any, exc: Any, tb: Any) -> None:
        comm = MPI.COMM_WORLD
        if comm.Get_size() <= 1 or issubclass(exc_type, SystemExit):
            previous(exc_type, exc, tb)
            return
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"[rank {comm.Get_rank()} of {comm.Get_size()}] {text}")
        sys.stderr.write(f"[rank {comm.Get_rank()}] aborting the MPI job\n")
        sys.stderr.flush()
        comm.Abort(1)

    sys.excepthook = hook
    _HOOK_INSTALLED = True


# ----------------------------------------------------------------------------- contexts
class _MPIReplicaContext(ReplicaContext):
    """The replica context of this process's replica (id = rank)."""

    strategy: MultiWorkerMirroredStrategy

    @property
    def devices(self) -> tuple[str, ...]:
        return self.strategy.parameter_devices

    def merge_call(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run ``fn(strategy, *args, **kwargs)`` in cross-replica context, in every process.

        Arrays and floats among the arguments are this replica's parts of per-replica values
        (they arrive as one-element :class:`PerReplica`), so reductions inside ``fn`` combine
        them across processes. Every process must make the same merge_calls in the same order.
        """
        self._check_current()
        strategy = self.strategy
        margs = strategy._as_local(tuple(args))
        mkwargs = strategy._as_local(dict(kwargs or {}))
        with _context.push_mode(_context.Mode(strategy, None)):
            result = fn(strategy, *margs, **mkwargs)
        return strategy._select_local(result)

    def _write_variable(self, var: Any, op: str, value: Any) -> Any:
        """Merge the ranks' writes to ``var`` by its aggregation, then apply the result once."""
        merge_reduction(var, op, self.strategy)  # refused before the collective, on every rank
        return self.merge_call(_merge_write, args=(var, op, value))


def _merge_write(strategy: MultiWorkerMirroredStrategy, var: Any, op: str, value: Any) -> None:
    rop = merge_reduction(var, op, strategy)
    if rop is None:  # rank 0's value
        local = value.values[0] if isinstance(value, PerReplica) else value
        merged = strategy._bcast_array(np.array(local, copy=True))
    else:  # each rank's value is its replica's part
        merged = strategy.reduce(
            rop, value if isinstance(value, PerReplica) else PerReplica([value])
        )
    var._apply_write(op, merged)


def _rank_sharded(x: Any) -> bool:
    """One process's shard of a variable sharded across processes."""
    return getattr(x, "_self_kind", None) == "sharded" and hasattr(x, "full_shape")


def _local_part(value: Any) -> Any:
    return value.values[0] if isinstance(value, PerReplica) and len(value) else value


def _rows_of_shard(total: Any, var: Any) -> Any:
    """The rows of a sparse sum that fall in ``var``'s local shard, indexed within it.

    Repeated indices are summed first (in occurrence order, as the update of one process sums
    them), so each kept row is bit for bit the one-process row.
    """
    dedup = getattr(total, "deduplicate", None)
    if dedup is not None:
        total = dedup()
    where = var.local_slice()
    axis = var.shard_axis
    idx, vals = np.asarray(total.indices), np.asarray(total.values)
    rows = var.full_shape[0]
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= rows):  # (on every rank alike)
        raise GradientError(
            "sparse gradient index out of range",
            variable=var.name,
            expected=f"0 <= index < {rows}",
            found=f"{int(idx.min())}..{int(idx.max())}",
        )
    if axis == 0:
        lo, hi = where[0].start, where[0].stop
        keep = (idx >= lo) & (idx < hi)
        return type(total)(vals[keep], idx[keep] - lo, tuple(var.shape))
    columns = (slice(None), *where[1:])  # the values' axis k is the variable's
    return type(total)(vals[columns], idx, tuple(var.shape))


# ----------------------------------------------------------------------------- strategy
class MultiWorkerMirroredStrategy(MPICollectives, Strategy):
    """Synchronous data parallelism with one process per replica, over MPI.

    Launch the same program with ``mpiexec -n N python train.py``; each process holds one
    replica's component of every variable. The API is that of
    :class:`~parallelvars.MirroredStrategy`.

    Args:
        comm: an mpi4py communicator; defaults to ``MPI.COMM_WORLD``.
        fusion: pack the gradients of one dtype into one buffer per ``batch_reduce`` (one
            collective per dtype); ``False`` runs one collective per value.
        abort_on_error: install :func:`install_abort_on_error` (an uncaught exception in any
            rank aborts the job instead of leaving the others blocked).

    Example (run under ``mpiexec -n 2``)::

        strategy = pv.MultiWorkerMirroredStrategy()
        with strategy.scope():
            w = pv.Variable(np.zeros(3, np.float32), name="w")   # rank 0's value everywhere
        total = strategy.run(lambda: np.float32(strategy.cluster_rank + 1))
        strategy.reduce(pv.ReduceOp.SUM, total)                    # 3.0 on every rank
    """

    # A plain value handed to reduce() is this process's part (run() returns it so).
    _plain_is_shared = False

    def __init__(
        self, comm: Any = None, *, fusion: bool = True, abort_on_error: bool = True
    ) -> None:
        MPI = _import_mpi()
        self._MPI = MPI
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self._rank = int(self._comm.Get_rank())
        self._size = int(self._comm.Get_size())
        self.fusion = bool(fusion)
        super().__init__([f"cpu:{self._rank}"])
        self._global_devices = ParallelDevice(self._size)
        if abort_on_error:
            install_abort_on_error()
        # Checkpoints are then written by every process together (see _cluster).
        set_cluster_strategy(self)

    # ------------------------------------------------------------------ topology
    @property
    def comm(self) -> Any:
        """The mpi4py communicator."""
        return self._comm

    @property
    def cluster_rank(self) -> int:
        """This process's rank (its replica id)."""
        return self._rank

    @property
    def num_replicas_in_sync(self) -> int:
        return self._size

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The devices of all replicas, ``cpu:0 .. cpu:{size-1}`` (replica ``i`` on rank ``i``)."""
        return self._global_devices.components

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """This process's device: variables hold this replica's component only."""
        return self._devices.components

    def __repr__(self) -> str:
        return f"MultiWorkerMirroredStrategy(rank={self._rank}, size={self._size})"

    # ------------------------------------------------------------------ variables
    def _make_local(self, device: ParallelDevice, **kwargs: Any) -> Any:
        from parallelvars._creation import _make_distributed_variable, _make_rank_sharded

        self._check_creation_context(kwargs.get("name"))
        if kwargs.get("shard_axis") is not None and self._size > 1:
            # Rank r holds shard r of rank 0's initial value (one Scatterv), no other row.
            def scatter(full: np.ndarray, axis: int, name: str) -> np.ndarray:
                return self._scatter_shards(full, axis, shard_offsets(full.shape[axis], self._size))

            shard = _make_rank_sharded(device, self._rank, self._size, scatter, **kwargs)
            return self._register(shard)
        kwargs.pop("shard_axis", None)
        if kwargs.get("kind") is None:
            sync = Synchronization.parse(kwargs.get("synchronization") or Synchronization.AUTO)
            kwargs["kind"] = "on_read" if sync is Synchronization.ON_READ else "mirrored"
        var = _make_distributed_variable(device, **kwargs)
        # This process holds component `rank` of a variable with one component per process:
        # restores distribute values by these global indices, not by the local count.
        var._self_global = (self._rank, self.num_replicas_in_sync)
        if var.kind == "mirrored":
            for comp in var.components:
                self._bcast_inplace(comp)
        # An on-read variable: every rank's part starts at the initial value (a SUM's total is
        # size times it), as every replica's does under MirroredStrategy and in TensorFlow.
        return self._register(var)

    def _variable_creator(self, next_creator: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:  # an inner creator (independent_buffers, ...) placed it
            return next_creator(**kwargs)
        return self._make_local(self._devices, **kwargs)

    def _merges_writes_of(self, var: Any) -> bool:
        comps: Sequence[Any] = getattr(var, "components", ())
        return (
            self.num_replicas_in_sync > 1 and bool(comps) and self._owners.get(id(comps[0])) is var
        )

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with: Any) -> Iterator[None]:
        """Variables made inside are placed with ``colocate_with`` (always this process)."""
        mode = _context.current_mode()
        if mode.strategy is not self:
            raise ContextError(
                f"colocate_vars_with() of {self!r} needs its scope (current strategy: "
                f"{mode.strategy!r})"
            )

        def creator(next_creator: Any, **kwargs: Any) -> Any:
            return self._make_local(self._devices, **kwargs)

        with _context.variable_creator_scope(creator):
            yield

    # ------------------------------------------------------------------ the fused gradient path
    def _local_replica_count(self) -> int:
        return 1

    def _fused_sum_order(self) -> tuple[int, ...] | None:
        return (0,)

    def _allreduce_flat(self, buffer: np.ndarray) -> np.ndarray:
        """One rank-ordered all-reduce of a whole flat gradient buffer (see ``_allreduce_ordered``)."""
        return buffer if self._size == 1 else self._allreduce_ordered(buffer)

    def _merge_args(self, values: Sequence[Any]) -> Any:
        return self._as_local(values[0])

    # ------------------------------------------------------------------ local values
    def _owned_component(self, x: Any) -> Any:
        if type(x) is np.ndarray:
            return self._owner_of([x])
        return None

    def _as_local(self, structure: Any) -> Any:
        """Arrays and floats become one-element PerReplica (this replica's part); the
        components of our variables become their variables; the rest is left as it is."""

        def wrap(x: Any) -> Any:
            if isinstance(x, PerReplica) or _is_variable(x):
                return x
            if isinstance(x, tuple) and hasattr(x, "_fields"):
                return type(x)(*(wrap(i) for i in x))
            if isinstance(x, (list, tuple)):
                return type(x)(wrap(i) for i in x)
            if isinstance(x, dict):
                return type(x)((k, wrap(v)) for k, v in x.items())
            if _is_sparse(x):  # this replica's sparse value (batch_reduce gathers them)
                return PerReplica([x])
            owner = self._owned_component(x)
            if owner is not None:
                return owner
            if isinstance(x, (np.ndarray, np.generic, float)) and not isinstance(x, bool):
                return PerReplica([x])
            return x

        return wrap(structure)

    def _select_local(self, structure: Any) -> Any:
        """This replica's part of a cross-replica result."""
        if not _needs_walk(structure):
            return structure

        def pick(v: PerReplica) -> Any:
            if len(v) == 1:
                return v.values[0]
            if len(v) == self._size:
                return v.values[self._rank]
            raise DistributedValueError(
                f"a {type(v).__name__} with {len(v)} values for {self._size} replicas "
                f"(expected 1 local value or {self._size}, found {len(v)})"
            )

        return _map_structure(pick, structure)

    # ------------------------------------------------------------------ running
    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ctx = _MPIReplicaContext(self, self._rank)
        a = self._select_local(args)
        kw = self._select_local(kwargs)
        with self.scope(), _context.push_mode(_context.Mode(self, ctx)):
            result = fn(*a, **kw)
        return self._as_local(result)

    # ------------------------------------------------------------------ reductions
    def _values_of(self, value: Any, method: str) -> tuple[tuple[Any, ...], Any]:
        """This process's parts of ``value`` and their devices; devices ``None`` marks a plain
        value, which is already one cross-replica value and is not reduced."""
        if isinstance(value, PerReplica):
            if len(value) == 1:
                return value.values, self.parameter_devices
            if len(value) == self._size:
                return (value.values[self._rank],), self.parameter_devices
            raise DistributedValueError(
                f"{method}(): a {type(value).__name__} with {len(value)} values for "
                f"{self._size} replicas of {self!r} (expected 1 local value or {self._size}, "
                f"found {len(value)})"
            )
        if _is_variable(value):
            return tuple(value.components), tuple(value.devices)
        return (value,), None

    def _reduce_to(
        self, op: ReduceOp, values: Sequence[Any], devices: Any, axis: int | None = None
    ) -> Any:
        if devices is None:
            return reduce_values(op, values, self.parameter_devices[:1], axis)
        if _is_sparse(values[0]):
            raise DistributedValueError(
                f"{type(self).__name__} reduces dense values only (found {type(values[0]).__name__})"
            )
        local = reduce_values(ReduceOp.SUM, values, devices, axis)
        if axis is None:
            count = self._size * len(values)
        else:
            count = 0
            for v in values:
                a = np.asarray(v)
                count += a.shape[axis + a.ndim if axis < 0 else axis]
            counts = self._allgather_rows(np.array([count], np.int64))
            count = int(counts.sum())
        total = self._allreduce_ordered(np.asarray(local))
        if op is ReduceOp.MEAN:
            if count == 0:
                raise DistributedValueError(
                    f"cannot take the mean along axis {axis} of empty values"
                )
            return _mean_of(total, count)
        return total

    def _batch_reduce_to(
        self, op: ReduceOp, values: Sequence[Sequence[Any]], devices: Sequence[Any]
    ) -> list[Any]:
        if not self.fusion:
            return [self._reduce_to(op, v, d) for v, d in zip(values, devices, strict=True)]
        out: list[Any] = [None] * len(values)
        groups: dict[np.dtype, list[tuple[int, np.ndarray]]] = {}
        for i, (v, d) in enumerate(zip(values, devices, strict=True)):
            if d is None or _is_sparse(v[0]):
                out[i] = self._reduce_to(op, v, d)
                continue
            local = v[0] if len(v) == 1 else reduce_values(ReduceOp.SUM, v, d)
            arr = np.asarray(local)
            groups.setdefault(arr.dtype, []).append((i, arr))
        count = self._size * max((len(v) for v in values), default=1)
        # One collective per dtype, in a fixed (sorted) order so every process matches.
        for dtype in sorted(groups, key=lambda dt: dt.str):
            items = groups[dtype]
            sizes = [a.size for _, a in items]
            fused = np.empty(sum(sizes), dtype)
            offset = 0
            for (_, a), n in zip(items, sizes, strict=True):
                fused[offset : offset + n] = a.reshape(-1)
                offset += n
            total = self._allreduce_ordered(fused)
            if op is ReduceOp.MEAN:
                total = _mean_of(total, count)
            offset = 0
            for (i, a), n in zip(items, sizes, strict=True):
                out[i] = total[offset : offset + n].reshape(a.shape)
                offset += n
        return out

    # The optimizers hand sparse gradients of a step to batch_reduce too: this strategy
    # gathers them across processes there (a one-process strategy sums them itself).
    _reduces_sparse = True

    def batch_reduce(
        self, op: ReduceOp | str, value_destination_pairs: Iterable[tuple[Any, Any]]
    ) -> list[Any]:
        """:meth:`Strategy.batch_reduce`, with the values that cross processes in their own way.

        * a dense value whose destination is a sharded variable: a **reduce-scatter**, each
          rank receives only its shard's sum (added in rank order, as the one-process sum);
          one ``Alltoallv`` per dtype;
        * a sparse value (``IndexedSlices``): an all-gather of every rank's indices and values,
          concatenated in rank order (the one-process sum of the replicas' slices); one
          ``Allgatherv`` per dtype after a gather of the row counts. For a sharded destination
          the rows are summed per index and only this rank's rows are kept, indexed within
          its shard.

        Every other value takes the rank-ordered all-reduce of the base class. Every rank must
        pass the same pairs (shapes, dtypes, destinations) in the same order.
        """
        pairs = list(value_destination_pairs)
        special = [
            i
            for i, p in enumerate(pairs)
            if isinstance(p, tuple)
            and len(p) == 2
            and (_rank_sharded(p[1]) or _is_sparse(_local_part(p[0])))
        ]
        rest = [i for i in range(len(pairs)) if i not in set(special)]
        out: list[Any] = [None] * len(pairs)
        reduced = super().batch_reduce(op, [pairs[i] for i in rest])  # checks op and pairs
        for i, r in zip(rest, reduced, strict=True):
            out[i] = r
        if not special:
            return out
        rop = self._parse_reduce_op(op)
        sparse: list[tuple[int, Any, bool]] = []
        dense: dict[np.dtype, list[tuple[int, np.ndarray, Any]]] = {}
        for i in special:
            value, dest = pairs[i]
            parts, devices = self._values_of(value, "batch_reduce")
            local = parts[0]
            if _is_sparse(local):
                sparse.append((i, local, devices is not None))
                continue
            arr = np.asarray(local.read_value() if _is_variable(local) else local)
            if devices is None:  # one cross-replica value already: this rank's rows of it
                out[i] = np.array(arr[dest.local_slice()], copy=True)
                continue
            if arr.shape != dest.full_shape:
                raise DistributedValueError(
                    f"batch_reduce(): the value for sharded variable {dest.name!r} has another "
                    f"shape (expected the full shape {dest.full_shape}, found {arr.shape})"
                )
            dense.setdefault(arr.dtype, []).append((i, arr, dest))
        if sparse:
            crossing = [(i, s) for i, s, across in sparse if across]
            gathered = self._allgather_sparse([(s.indices, s.values) for _, s in crossing])
            totals = {i: s for i, s, across in sparse if not across}  # already one value
            for (i, s), (idx, vals) in zip(crossing, gathered, strict=True):
                if rop is ReduceOp.MEAN:
                    vals = _mean_of(vals, self._size)
                dest = pairs[i][1]
                totals[i] = type(s)(
                    vals, idx, dest.full_shape if _rank_sharded(dest) else s.dense_shape
                )
            for i, total in totals.items():
                dest = pairs[i][1]
                out[i] = _rows_of_shard(total, dest) if _rank_sharded(dest) else total
        for dtype in sorted(dense, key=lambda dt: dt.str):
            items = dense[dtype]
            shards = self._reduce_scatter_shards(
                [(arr, dest.shard_axis, dest.shard_offsets) for _, arr, dest in items]
            )
            for (i, _, _), shard in zip(items, shards, strict=True):
                out[i] = _mean_of(shard, self._size) if rop is ReduceOp.MEAN else shard
        return out

    def gather(self, value: Any, axis: int = 0) -> np.ndarray:
        """The full value across processes, in cross-replica context (a collective: every
        process calls it with its part).

        A sharded variable gives its full value (every rank's shard put together along the
        shard axis; ``axis`` is not used); a per-replica value, or a plain array that is this
        process's part, gives every rank's part concatenated along ``axis`` in rank order; a
        mirrored variable, every rank's component so. Reads of a sharded variable never
        gather: they give the local shard.
        """
        self._require_cross_replica("gather")
        if _rank_sharded(value):
            return self._allgather_along(np.asarray(value.components[0]), value.shard_axis)
        parts, _ = self._values_of(value, "gather")
        local = parts[0]
        arr = np.asarray(local.read_value() if _is_variable(local) else local)
        if arr.ndim == 0:
            raise DistributedValueError("gather() needs values with at least one axis")
        return self._allgather_along(arr, int(axis) % arr.ndim)

    def _broadcast_to(self, value: Any, devices: Sequence[str]) -> Mirrored:
        """Rank 0's value, one copy for this process's replica."""
        src = np.asarray(value.read_value() if _is_variable(value) else value)
        return Mirrored([self._bcast_array(src)])

    def read_var(self, var: Any) -> np.ndarray:
        """The value of ``var``; an on-read variable is aggregated across processes."""
        self._require_cross_replica("read_var")
        if _is_variable(var) and var.kind == "on_read":
            agg = var.aggregation
            if agg is Aggregation.ONLY_FIRST_REPLICA:
                return self._bcast_array(np.asarray(var.components[0]))
            rop = ReduceOp.SUM if agg is Aggregation.SUM else ReduceOp.MEAN
            return cast(np.ndarray, self._reduce_to(rop, var.components, var.devices))
        return super().read_var(var)

    def barrier(self) -> None:
        """Wait for every process."""
        self._comm.Barrier()
