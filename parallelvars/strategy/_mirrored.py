"""MirroredStrategy: one thread per replica, ``merge_call`` as a rendezvous of all replicas.

The replica threads form a persistent pool (started on the first ``run``), so a step costs a
handful of lock hand-offs instead of thread starts. Each thread parks on its own lock; a step
releases them all, and the caller waits on one lock that the last replica to finish releases.

A ``merge_call`` is a rendezvous: each replica records its arguments and parks, the last one to
arrive groups the arguments, runs the merge function in cross-replica mode and releases the
others with their part of the result. An exception anywhere aborts the step: the abort flag is
set, every parked replica is released and raises, and ``run`` re-raises the first exception in
its caller once every replica has returned, so no thread stays blocked and the pool is ready for
the next step.
"""

from __future__ import annotations

import _thread
import contextvars
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from parallelvars._write_plan import merge_reduction
from parallelvars.devices import ParallelDevice
from parallelvars.enums import Aggregation, ReduceOp
from parallelvars.errors import ContextError, DistributedValueError, ReplicaError
from parallelvars.strategy import _context
from parallelvars.strategy._base import ReplicaContext, Strategy, _short
from parallelvars.strategy._values import PerReplica, _needs_walk, regroup, split_per_replica

__all__ = ["MirroredStrategy"]


class _ReplicaAborted(ReplicaError):
    """Raised in a replica that is stopped because another replica failed."""


class _Step:
    """The shared state of one ``run``: results, the merge rendezvous and the abort flag."""

    def __init__(self, strategy: MirroredStrategy, parks: Sequence[Any]) -> None:
        n = strategy.num_replicas_in_sync
        self.strategy = strategy
        self.n = n
        self.lock = threading.Lock()
        self.parks = parks
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.results: list[Any] = [None] * n
        self.error: BaseException | None = None
        self.error_replica = -1
        self.aborted = False
        self.finished: list[int] = []
        self.merge_counts = [0] * n
        self.arrived: list[int] = []
        self.merge_args: list[Any] = [None] * n
        self.merge_out: list[Any] = []

    # Called with self.lock held.
    def _abort_locked(self, error: BaseException, replica: int) -> None:
        if self.error is None:
            self.error = error
            self.error_replica = replica
        if not self.aborted:
            self.aborted = True
            waiting, self.arrived = self.arrived, []
            for i in waiting:
                self.parks[i].release()

    def _stopped(self, replica: int) -> _ReplicaAborted:
        return _ReplicaAborted(
            f"replica {replica} of {self.strategy!r} stopped because replica "
            f"{self.error_replica} raised {type(self.error).__name__}: {self.error}"
        )

    def merge(
        self, replica: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        with self.lock:
            if self.aborted:
                raise self._stopped(replica)
            self.merge_counts[replica] += 1
            if self.finished:
                err = ReplicaError(
                    f"replica {replica} of {self.strategy!r} entered merge_call number "
                    f"{self.merge_counts[replica]}, but replica(s) {sorted(self.finished)} already "
                    f"returned after {[self.merge_counts[i] for i in sorted(self.finished)]} "
                    "merge_call(s): every replica must make the same number of merge_calls"
                )
                self._abort_locked(err, replica)
                raise err
            self.merge_args[replica] = (fn, args, kwargs)
            # The last arrival is not parked, so it is not listed among those an abort releases.
            last = len(self.arrived) == self.n - 1
            if not last:
                self.arrived.append(replica)
        if not last:
            self.parks[replica].acquire()  # released by the last arrival or by an abort
            if self.aborted:
                raise self._stopped(replica)
            return self.merge_out[replica]
        try:
            out = self._run_merge()
        except BaseException as e:
            with self.lock:
                self._abort_locked(e, replica)
            raise
        with self.lock:
            self.merge_out = out
            waiting, self.arrived = self.arrived, []
            self.merge_args = [None] * self.n
        for i in waiting:
            self.parks[i].release()
        return out[replica]

    def _run_merge(self) -> list[Any]:
        calls = self.merge_args
        fn = calls[0][0]
        code = getattr(fn, "__code__", None)
        for i, (f, a, kw) in enumerate(calls):
            if code is not None and getattr(f, "__code__", code) is not code:
                raise ReplicaError(
                    f"merge_call number {self.merge_counts[i]}: replica 0 called "
                    f"{getattr(fn, '__qualname__', fn)} but replica {i} called "
                    f"{getattr(f, '__qualname__', f)}"
                )
            if len(a) != len(calls[0][1]) or kw.keys() != calls[0][2].keys():
                raise ReplicaError(
                    f"merge_call number {self.merge_counts[i]}: replica {i} passed "
                    f"{len(a)} argument(s) {sorted(kw)} but replica 0 passed "
                    f"{len(calls[0][1])} {sorted(calls[0][2])}"
                )
        owner_of = self.strategy._owner_of
        args = tuple(regroup([c[1][j] for c in calls], owner_of) for j in range(len(calls[0][1])))
        kwargs = {k: regroup([c[2][k] for c in calls], owner_of) for k in calls[0][2]}
        modes = _context._MODES
        token = modes.set((*modes.get(), _context.Mode(self.strategy, None)))
        try:
            result = fn(self.strategy, *args, **kwargs)
        finally:
            modes.reset(token)
        if not _needs_walk(result):
            return [result] * self.n
        try:
            return split_per_replica(result, self.n)
        except ValueError as e:
            raise ReplicaError(f"merge_call result: {e}") from None

    def finish(self, replica: int, result: Any, error: BaseException | None) -> None:
        with self.lock:
            self.results[replica] = result
            self.finished.append(replica)
            if error is not None:
                self._abort_locked(error, replica)
            elif self.arrived and not self.aborted:
                waiting = sorted(self.arrived)
                self._abort_locked(
                    ReplicaError(
                        f"replica {replica} of {self.strategy!r} returned after "
                        f"{self.merge_counts[replica]} merge_call(s) while replica(s) {waiting} "
                        f"wait in merge_call number {self.merge_counts[waiting[0]]}: every "
                        "replica must make the same number of merge_calls"
                    ),
                    replica,
                )
            last = len(self.finished) == self.n
        if last:
            self.done.release()


class _MirroredReplicaContext(ReplicaContext):
    """The replica context of one replica thread: merge_call meets the other replicas."""

    def __init__(self, strategy: MirroredStrategy, replica_id: int, step: _Step) -> None:
        super().__init__(strategy, replica_id)
        self._step = step

    def merge_call(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self._check_current()
        return self._step.merge(self.replica_id_in_sync_group, fn, tuple(args), dict(kwargs or {}))

    def _write_variable(self, var: Any, op: str, value: Any) -> Any:
        """Merge the replicas' writes to ``var`` by its aggregation, then apply the result once.

        Aggregation NONE: the replicas must write one value (TensorFlow writes each replica's
        own copy, so equal writes keep the copies equal); it is written once.
        """
        if var.aggregation is Aggregation.NONE:
            return self.merge_call(_merge_same_write, args=(var, op, value))
        return self.merge_call(_merge_write, args=(var, op, value))


def _merge_write(strategy: Strategy, var: Any, op: str, value: Any) -> None:
    rop = merge_reduction(var, op, strategy)
    per_replica = isinstance(value, PerReplica)
    if rop is None:  # the first replica's value
        merged = value.values[0] if per_replica else value
    elif per_replica:
        if rop is ReduceOp.MEAN and var.dtype.kind not in "fcV":
            # The mean of equal integers is the integer; of different ones, in general not one
            # (TensorFlow refuses every per-replica write then).
            merged = _same_value(
                strategy,
                var,
                op,
                value,
                "an integer variable with aggregation MEAN",
                "use a float variable",
            )
        else:
            merged = strategy.reduce(rop, value)
    elif rop is ReduceOp.SUM:
        arr = np.asarray(value)
        if not (arr.ndim == 0 and arr.dtype.kind in "biufc" and arr == 0):
            raise DistributedValueError(
                f"variable {var.name!r} (aggregation SUM): every replica of {strategy!r} wrote "
                f"the same value {_short(value)}, which cannot be summed over the replicas, as in "
                f"TensorFlow (expected each replica's own value; for one shared value use "
                "aggregation MEAN or ONLY_FIRST_REPLICA, or write it in cross-replica context)"
            )
        merged = value  # zero from every replica sums to zero
    else:
        merged = value  # the mean of n equal writes
    var._apply_write(op, merged)


def _merge_same_write(strategy: Strategy, var: Any, op: str, value: Any) -> None:
    if isinstance(value, PerReplica):
        value = _same_value(
            strategy,
            var,
            op,
            value,
            "aggregation NONE",
            "create the variable with aggregation SUM, MEAN or ONLY_FIRST_REPLICA",
        )
    var._apply_write(op, value)


def _same_value(
    strategy: Strategy, var: Any, op: str, value: PerReplica, what: str, hint: str
) -> Any:
    """The one value every replica wrote, for a variable that cannot combine different ones.

    Raises:
        ReplicaError: two replicas wrote different values.
    """
    first = np.asarray(value.values[0])
    for i, other in enumerate(value.values[1:], start=1):
        if not np.array_equal(first, np.asarray(other), equal_nan=first.dtype.kind in "fc"):
            raise ReplicaError(
                f"variable {var.name!r} ({what}): replicas 0 and {i} of {strategy!r} called "
                f"{op}() with different values (expected one value from every replica, found "
                f"{_short(value.values[0])} and {_short(other)}); to combine different values "
                f"{hint}, or write it in cross-replica context"
            )
    return value.values[0]


def _replica_body(
    strategy: MirroredStrategy,
    replica: int,
    step: _Step,
    fn: Callable[..., Any],
    args: Any,
    kwargs: Any,
) -> Any:
    # Runs inside a copy of the caller's context: this set is discarded with the copy.
    ctx = _MirroredReplicaContext(strategy, replica, step)
    _context._MODES.set((*_context._MODES.get(), _context.Mode(strategy, ctx)))
    return fn(*args, **kwargs)


class _ReplicaPool:
    """Persistent replica threads. Holds no reference to its strategy, so that dropping the
    strategy shuts the threads down (``weakref.finalize``)."""

    def __init__(self, n: int, name: str) -> None:
        self.n = n
        self.jobs: list[Any] = [None] * n
        self.wakes = [_thread.allocate_lock() for _ in range(n)]
        self.parks = [_thread.allocate_lock() for _ in range(n)]
        for lock in (*self.wakes, *self.parks):
            lock.acquire()
        self.closed = False
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"{name}-replica-{i}", daemon=True)
            for i in range(n)
        ]
        for t in self.threads:
            t.start()
        self.idents = frozenset(t.ident for t in self.threads)

    def _loop(self, i: int) -> None:
        wake = self.wakes[i]
        jobs = self.jobs
        while True:
            wake.acquire()
            job = jobs[i]
            jobs[i] = None
            if job is None:
                return
            step, context, body_args = job
            del job
            try:
                result = context.run(_replica_body, *body_args)
            except BaseException as e:
                step.finish(i, None, e)
            else:
                step.finish(i, result, None)
            # Drop this step's objects now rather than at the next wake-up.
            step = context = body_args = result = None

    def dispatch(self, jobs: Sequence[Any]) -> None:
        for i, job in enumerate(jobs):
            self.jobs[i] = job
        for wake in self.wakes:
            wake.release()

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for i, wake in enumerate(self.wakes):
            self.jobs[i] = None
            wake.release()


class MirroredStrategy(Strategy):
    """Synchronous replication over several devices of one machine (one thread per replica).

    Args:
        devices: a number of replicas (``cpu:0 .. cpu:N-1``) or a list of device names.
            Defaults to one device.

    Example:
        >>> import numpy as np, parallelvars as pv
        >>> strategy = pv.MirroredStrategy(2)
        >>> with strategy.scope():
        ...     w = pv.Variable(np.zeros(3, np.float32), name="w")
        >>> w.kind, len(w.components)
        ('mirrored', 2)
        >>> def step(x):
        ...     ctx = pv.get_replica_context()
        ...     return ctx.merge_call(lambda s, v: s.reduce(pv.ReduceOp.SUM, v), args=(x,))
        >>> float(strategy.run(step, args=(pv.PerReplica([1.0, 2.0]),)))
        3.0
    """

    def __init__(self, devices: int | Sequence[str] | ParallelDevice | None = None) -> None:
        super().__init__(1 if devices is None else devices)
        # The replica threads of run(), and of runs nested in a merge_call function (one pool
        # and lock per level of nesting: the replicas of the run outside are parked meanwhile).
        self._pools: list[_ReplicaPool] = []
        self._run_locks = [threading.Lock()]

    def _get_pool(self, depth: int = 0) -> _ReplicaPool:
        while len(self._pools) <= depth:
            level = len(self._pools)
            pool = _ReplicaPool(
                self.num_replicas_in_sync,
                f"parallelvars-{id(self):x}" + (f"-nested{level}" if level else ""),
            )
            self._pools.append(pool)
            weakref.finalize(self, pool.shutdown)
        while len(self._run_locks) <= depth:
            self._run_locks.append(threading.Lock())
        return self._pools[depth]

    def _run_depth(self) -> int:
        """0 for a run from outside the replica threads; ``d + 1`` for a run from a merge_call
        function running in a replica thread of the run at depth ``d``.

        Raises:
            ContextError: called from a replica thread in a replica context (the runs of
                replica functions do not nest; a merge_call function may run them).
        """
        ident = threading.get_ident()
        for depth, pool in enumerate(self._pools):
            if ident in pool.idents:
                if _context.current_mode().replica_context is not None:
                    raise ContextError(
                        f"run() of {self!r} called from one of its own replica functions: "
                        "runs do not nest; call it from a merge_call function "
                        "(cross-replica context) or outside run()"
                    )
                return depth + 1
        return 0

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        n = self.num_replicas_in_sync
        if n == 1:
            return super()._run(fn, args, kwargs)
        depth = self._run_depth()
        pool = self._get_pool(depth)
        split = _needs_walk(args)
        with self._run_locks[depth]:
            step = _Step(self, pool.parks)
            # Copy the caller's context inside our scope (entered here without the generator
            # machinery of scope(); _check_can_run has ruled out another strategy's scope), so
            # the replicas see our variable creator and cross-replica mode under their own.
            tokens = None
            if _context.current_mode().strategy is not self:
                tokens = (
                    _context._MODES.set((*_context._MODES.get(), _context.Mode(self, None))),
                    _context._CREATORS.set((*_context._CREATORS.get(), self._variable_creator)),
                )
            try:
                per_args = split_per_replica(args, n) if split else [args] * n
                per_kwargs = (
                    split_per_replica(kwargs, n) if kwargs and _needs_walk(kwargs) else [kwargs] * n
                )
                jobs = [
                    (
                        step,
                        contextvars.copy_context(),
                        (self, i, step, fn, per_args[i], per_kwargs[i]),
                    )
                    for i in range(n)
                ]
            finally:
                if tokens is not None:
                    _context._CREATORS.reset(tokens[1])
                    _context._MODES.reset(tokens[0])
            pool.dispatch(jobs)
            del jobs
            try:
                step.done.acquire()
            except BaseException as e:  # KeyboardInterrupt while waiting: stop the replicas
                with step.lock:
                    step._abort_locked(e, -1)
                step.done.acquire()
                raise
        if step.error is not None:
            err = step.error
            if (
                step.error_replica >= 0
                and hasattr(err, "add_note")
                and not isinstance(err, ReplicaError)
            ):
                err.add_note(f"(raised in replica {step.error_replica} of {self!r})")
            raise err
        return regroup(step.results, self._owner_of)
