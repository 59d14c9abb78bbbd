"""Pausing the cyclic garbage collector around a save or restore."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

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
