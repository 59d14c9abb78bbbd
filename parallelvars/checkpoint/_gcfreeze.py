"""Keeping a restore's collections short without pausing the collector.

A restore of many variables makes a few containers per saved object (the decoded object graph,
the plan) that stay alive until it ends. Every full collection during it walks every tracked
object of the process, the program's own model included, so with the collector running as it is
a restore of 50,000 variables took about twice as long as with it paused (``bench/bench_gc.py``).
Pausing it (``gc.disable()``) would stop collection in every thread, a training loop beside the
restore included. Instead, the objects that exist when the restore starts are moved to the
collector's permanent generation (``gc.freeze()``) and given back (``gc.unfreeze()``) when it
ends: the collector keeps running in every thread and collects every new object as usual; it only
skips walking what already existed, which it would have found alive anyway.

A program that freezes objects itself (``gc.get_freeze_count() > 0``, e.g. before forking
workers) is left alone: its frozen objects must stay frozen, so the restore then changes nothing.
Overlapping restores in several threads give the objects back once, after the last one.

Limits: ``gc.freeze()`` and ``gc.unfreeze()`` act on every tracked object of the process, and
Python offers no way to freeze or give back only some of them, nor to tell who froze what.
So (1) :func:`freeze_made_so_far` also freezes the objects other threads made since the block
began (a training loop's cyclic garbage made during a long first save is collected only after
the block ends, when ``gc.unfreeze()`` gives it back); and (2) when another thread calls
``gc.freeze()`` itself inside the block, the ``gc.unfreeze()`` at its end gives back what that
thread froze too. The freeze count cannot tell that call apart either (frozen objects that die
leave the permanent generation, so the count also falls), so the block does not try: a program
that freezes should do it before or after a save or restore, not during one.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["FREEZE_STEP", "freeze_made_so_far", "older_objects_frozen"]

#: Entries (graph nodes, records, plan rows: a few objects each) a long step makes between two
#: calls of :func:`freeze_made_so_far`: every step that freezes as it goes uses this cadence.
FREEZE_STEP = 8192

_lock = threading.Lock()
_depth = 0  # restores inside, all threads
_ours = False  # whether the objects frozen now were frozen by us


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """Inside, the objects that existed on entry are not walked by the collector."""
    global _depth, _ours
    with _lock:
        if _depth == 0:
            _ours = gc.get_freeze_count() == 0  # the program's own freeze: leave it alone
            if _ours:
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _ours:
                gc.unfreeze()
                _ours = False


def freeze_made_so_far() -> None:
    """Inside :func:`older_objects_frozen` (and only where it froze the objects itself): freeze
    the objects made since too. For a long operation that keeps what it made until it ends (a
    first save's records, plan and index: a few containers per variable), so that the
    collections its later steps trigger do not walk them again and again; they are given back
    to the collector with the others when the outermost block ends."""
    with _lock:
        if _depth > 0 and _ours:
            gc.freeze()
