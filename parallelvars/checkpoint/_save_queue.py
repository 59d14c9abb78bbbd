"""The background writes of non-blocking saves: at most one in flight per manager, in order.

concurrent.futures joins its worker threads when the main thread ends, before the atexit hooks
that tear h5py down, so a pending save completes and commits; the hook registered here (after
h5py was imported, so run before h5py's own: atexit is last in, first out) reports what failed
then, since nobody else will. From then on (a save from an atexit hook) ``submit_or_run``
writes in the calling thread.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

from parallelvars._threads import submit_or_run

__all__ = ["SaveQueue"]


class SaveQueue:
    """One worker thread, so at most one write is in flight and writes run in order; the
    future holds a write's outcome until :meth:`wait` hands it to the caller."""

    def __init__(self, at_exit: Callable[[str | None, BaseException], None]) -> None:
        # at_exit(path, error): reports a write that failed when the interpreter exits.
        self._at_exit = at_exit
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[None] | None = None
        self.pending: str | None = None  # where the write in flight goes

    def submit(self, path: str, job: Callable[[], None]) -> None:
        """Run ``job`` (the write of ``path``) in the background."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-save")
        self.pending = path
        _PENDING.add(self)
        self._future = submit_or_run(self._executor, job)

    def wait(self) -> None:
        """Wait for the write in flight; raise its error, if it had one."""
        future = self._future
        if future is not None:
            futures.wait([future])  # an interrupt here leaves the save to the next wait()
            self._future = None
        _PENDING.discard(self)
        err = None if future is None else future.exception()
        if err is not None:
            raise err

    def shutdown(self) -> None:
        """Stop the worker (after :meth:`wait`)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _report_at_exit(self) -> None:
        """At interpreter exit: finish a write in flight; report its error."""
        future, self._future = self._future, None
        err = None if future is None else future.exception()  # waits for it
        if err is not None:
            self._at_exit(self.pending, err)


# Queues with a write started and not yet waited for.
_PENDING: set[SaveQueue] = set()


@atexit.register
def _finish_pending_saves() -> None:
    for queue in list(_PENDING):
        _PENDING.discard(queue)
        with contextlib.suppress(Exception):
            queue._report_at_exit()
