"""Where a write to a parallel variable goes: one decision for every way of writing.

Variables are written in two shapes:

* a *value write*, ``op`` of ``value`` with ``op`` one of ``assign`` / ``assign_add`` /
  ``assign_sub`` (also ``+=`` and ``-=``): the replicas' values can be merged;
* an *in-place change*, a function applied to an array in place: the other in-place operators,
  item assignment, ``fill`` / ``sort`` / ``partition`` / ``put``, a ufunc or a writing numpy
  function (``np.copyto``, ``np.put``, ...) with the variable as output.

:func:`route` decides for both, from the variable's kind and the calling context:

========================================================  ==============  ==========
context                                                   kind            route
========================================================  ==============  ==========
any                                                       sharded         ``FULL``
a replica function of the variable's devices              on_read,        ``OWN``
                                                          independent
a replica function of the variable's devices              mirrored        ``MERGE``
a replica function of a multi-process strategy holding    mirrored        ``MERGE``
this process's component
otherwise                                                 on_read         ``LOGICAL``
otherwise                                                 single,         ``EVERY``
                                                          mirrored,
                                                          independent
========================================================  ==============  ==========

* ``OWN``: this replica's component only.
* ``MERGE``: the replicas' writes are merged by the variable's aggregation
  (:func:`merge_reduction`; with NONE the threaded strategy takes the one value every replica
  wrote) and the result applied once, as a cross-replica write.
* ``LOGICAL``: once, as a write of the whole variable: each part of an on-read SUM variable
  receives its share of the total, other aggregations write every component.
* ``EVERY``: every component alike.
* ``FULL``: the full value, of which the shards are views.

An in-place change on ``MERGE`` or ``LOGICAL`` is applied to a copy of the value as it reads
there (this replica's component; the aggregate of an on-read variable) and the result assigned,
which merges it or writes it as a whole like any assign.
"""

from __future__ import annotations

import enum
from typing import Any

from parallelvars import _modes
from parallelvars.enums import Aggregation, ReduceOp
from parallelvars.errors import ContextError

__all__ = ["Route", "merge_reduction", "route"]


class Route(enum.Enum):
    """Where a write goes (see the module's table)."""

    OWN = "own"
    MERGE = "merge"
    LOGICAL = "logical"
    EVERY = "every"
    FULL = "full"


def route(var: Any) -> tuple[Route, int | None]:
    """Where a write to ``var`` goes from here, and this replica's component index (``OWN``
    and ``MERGE`` inside a replica function of the variable's devices, else None)."""
    kind = var._self_kind
    if kind == "sharded":
        return _FULL
    ctx = _modes.replica_context()
    if ctx is None or ctx.strategy._is_default:
        # Outside replica functions: the common case, decided without more lookups.
        return _LOGICAL if kind == "on_read" else _EVERY
    i = var._replica_index()
    if i is not None:
        return (_OWN if kind in ("on_read", "independent") else _MERGE), i
    if kind == "on_read":
        return _LOGICAL
    if kind != "independent" and ctx.strategy._merges_writes_of(var):
        # A process-local component of a variable spread over processes: merged across
        # replicas like any mirrored write in a replica function.
        return _MERGE_HERE
    return _EVERY


# Module constants: a class attribute of an Enum costs a lookup on every write.
_OWN, _MERGE = Route.OWN, Route.MERGE
_MERGE_HERE: tuple[Route, int | None] = (Route.MERGE, None)
_FULL: tuple[Route, int | None] = (Route.FULL, None)
_LOGICAL: tuple[Route, int | None] = (Route.LOGICAL, None)
_EVERY: tuple[Route, int | None] = (Route.EVERY, None)


def merge_reduction(var: Any, op: str, strategy: Any) -> ReduceOp | None:
    """How the replicas' writes to ``var`` combine: ``ReduceOp.SUM`` / ``MEAN`` of every
    replica's value, or None for the first replica's value (``ONLY_FIRST_REPLICA``).

    Raises:
        ContextError: the variable's aggregation is NONE: nothing says how to merge (the
            threaded strategy handles NONE before asking, see ``_merge_same_write``).
    """
    agg = var.aggregation
    if agg is Aggregation.NONE:
        raise ContextError(
            f"variable {var.name!r}: {op}() inside a replica function of {strategy!r} with "
            f"{strategy.num_replicas_in_sync} replicas needs an aggregation to merge the "
            "replicas' writes (expected aggregation SUM, MEAN or ONLY_FIRST_REPLICA, found "
            "NONE); create the variable with one, or write it in cross-replica context"
        )
    if agg is Aggregation.ONLY_FIRST_REPLICA:
        return None
    return ReduceOp.SUM if agg is Aggregation.SUM else ReduceOp.MEAN
