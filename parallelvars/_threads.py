"""Spreading independent, GIL-releasing work (checksums, copies) over a few threads.

Checksumming and copying hundreds of megabytes is done in C with the GIL released (crc32c,
``np.copyto``), so on a machine with several cores a restore can verify and copy on all of them.
The work is split into contiguous groups of about equal bytes, one per thread; the calling
thread takes the first group, so nothing is handed off when there is a single core or little
work.

``PARALLELVARS_THREADS`` sets the number of threads (1 turns this off); the default is the
number of cores, at most 4 (memory bandwidth, not arithmetic, bounds this work).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from parallelvars.errors import InvalidArgumentError

__all__ = ["run_in_order", "run_partitioned", "submit_or_run", "thread_count"]

_T = TypeVar("_T")

_DEFAULT_MAX = 4
# Below this many bytes the hand-off costs more than it saves.
MIN_PARALLEL_BYTES = 16 << 20

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def thread_count() -> int:
    """Threads to use: ``PARALLELVARS_THREADS`` if set, else the cores (at most 4)."""
    env = os.environ.get("PARALLELVARS_THREADS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise InvalidArgumentError(
                f"PARALLELVARS_THREADS must be a whole number, found {env!r}"
            ) from None
    return max(1, min(_DEFAULT_MAX, os.cpu_count() or 1))


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="parallelvars")
            _pool_size = workers
        return _pool


def submit_or_run(pool: ThreadPoolExecutor, fn: Callable[..., _T], *args: Any) -> Future[_T]:
    """``pool.submit(fn, *args)``; at interpreter exit, ``fn`` run now in the calling thread.

    When the main thread ends, ``concurrent.futures`` joins its pools' threads (each finishes
    the work it was given: a save in flight completes) and from then on refuses new work with
    ``RuntimeError``, in every pool. Work handed over from then on (by a save finishing at exit,
    or from an ``atexit`` hook) runs inline instead; its outcome is in the returned future
    either way. Only for pools that are never shut down while still in use.
    """
    try:
        return pool.submit(fn, *args)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        pass
    future: Future[_T] = Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:  # like a pool thread; an interrupt still reaches the caller
        future.set_exception(exc)
    return future


def partition(weights: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Split ``range(len(weights))`` into at most ``parts`` contiguous ranges of about equal weight."""
    total = sum(weights)
    bounds: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, w in enumerate(weights):
        acc += w
        # Close the current range once it holds its share of what has been seen so far.
        if (
            len(bounds) < parts - 1
            and acc * parts >= total * (len(bounds) + 1)
            and i + 1 < len(weights)
        ):
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, len(weights)))
    return bounds


_in_worker = threading.local()


def _run_range(
    calls: Sequence[Callable[[], object]], lo: int, hi: int, worker: bool = False
) -> None:
    if worker:
        _in_worker.active = True
    for call in calls[lo:hi]:
        call()


def run_partitioned(calls: Sequence[Callable[[], object]], weights: Sequence[int]) -> None:
    """Run every call once, spread over threads by weight (bytes); raise the first error.

    The calls must be independent of each other. Every thread has finished when this returns
    or raises, so no call is still running afterwards (an interrupt that arrives meanwhile is
    raised once they have). When several calls fail, the error of
    the earliest range (in the order of ``calls``) is raised; a range stops at its first error.
    """
    threads = thread_count()
    # A call that itself spreads work runs it inline: waiting on the pool from inside the
    # pool could wait forever.
    nested = getattr(_in_worker, "active", False)
    if threads < 2 or nested or len(calls) < 2 or sum(weights) < MIN_PARALLEL_BYTES:
        _run_range(calls, 0, len(calls))
        return
    ranges = partition(weights, threads)
    futures: list[Future[None]] = []
    if len(ranges) > 1:
        pool = _executor(len(ranges) - 1)
        futures = [submit_or_run(pool, _run_range, calls, lo, hi, True) for lo, hi in ranges[1:]]
    error: BaseException | None = None
    try:
        _run_range(calls, *ranges[0])
    except BaseException as exc:
        error = exc
    interrupt = _wait_all(futures)  # every thread has stopped before this returns or raises
    if interrupt is not None:
        raise interrupt
    for fut in futures:
        failed = fut.exception()
        if error is None and failed is not None:
            error = failed
    if error is not None:
        raise error


def _wait_all(
    futures: Sequence[Future[Any]], stop: Callable[[], None] | None = None
) -> BaseException | None:
    """Wait until every one of ``futures`` is done, even when an interrupt (``KeyboardInterrupt``,
    an error raised by a signal handler) reaches this thread while it waits: the caller frees
    or reuses the memory the calls write into once this returns, so no call may still be
    running then. Returns the first interrupt (the caller raises it); ``stop`` is called when
    one arrives, to make the calls not yet started end early."""
    interrupt: BaseException | None = None
    while True:
        try:
            wait(futures)
            return interrupt
        except BaseException as exc:
            if interrupt is None:
                interrupt = exc
                if stop is not None:
                    stop()


def run_in_order(calls: Sequence[Callable[[], object]]) -> None:
    """Run every call once, each thread taking the next call not yet taken, in order (reads
    of a file in file order stay close together); raise the error of the earliest failed
    call once every thread has stopped (a thread stops at its first error, the others at
    the next call they would take; an interrupt that arrives meanwhile stops them the same
    way and is raised once they have)."""
    threads = min(thread_count(), len(calls))
    if threads < 2 or getattr(_in_worker, "active", False):
        for call in calls:
            call()
        return
    taken = iter(range(len(calls)))  # (next() on it is atomic: the threads share it)
    errors: dict[int, BaseException] = {}

    def work(worker: bool) -> None:
        if worker:
            _in_worker.active = True
        for k in taken:
            if errors:
                return
            try:
                calls[k]()
            except BaseException as exc:
                errors[k] = exc
                return

    def stop() -> None:  # (an interrupt: the threads stop at the next call they would take)
        errors.setdefault(len(calls), KeyboardInterrupt())

    pool = _executor(threads - 1)
    futures = [submit_or_run(pool, work, True) for _ in range(threads - 1)]
    interrupt: BaseException | None = None
    try:
        work(False)
    except BaseException as exc:  # (an interrupt between two calls)
        interrupt = exc
        stop()
    later = _wait_all(futures, stop)  # every thread has stopped before this returns or raises
    interrupt = interrupt if interrupt is not None else later
    if interrupt is not None:
        raise interrupt
    if errors:
        raise errors[min(errors)]
