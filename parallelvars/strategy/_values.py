"""Distributed values: :class:`PerReplica`, :class:`Mirrored`, and how they cross replica borders.

``select_replica(i, structure)`` is what replica ``i`` sees of an argument (its own element of
every per-replica value, everything else as is); ``regroup(values)`` is the inverse, used for the
results of ``run()`` and the arguments of ``merge_call``: the same object from every replica stays
that object, the components of one variable become that variable, anything else becomes a
:class:`PerReplica`. Lists, tuples (named tuples too) and dicts are walked element by element.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# The value classes live below variables (parallelvars._values); their names stay public here.
from parallelvars._values import ParallelValue, PerReplica, _is_namedtuple, each_part
from parallelvars.errors import DistributedValueError

__all__ = [
    "PerReplica",
    "Mirrored",
    "ParallelValue",
    "each_part",
    "select_replica",
    "regroup",
    "local_results",
]


class Mirrored(PerReplica):
    """A value held as one copy per replica device, every copy equal (``strategy.broadcast``).

    Passed to ``run()``, replica ``i`` receives copy ``i``; reduced, it counts once per copy
    (``SUM`` gives ``n`` times the value, ``MEAN`` the value).
    """

    __slots__ = ()


def _needs_walk(x: Any) -> bool:
    """Whether ``x`` contains a per-replica value anywhere (cheap for the common flat cases)."""
    if isinstance(x, PerReplica):
        return True
    if isinstance(x, (list, tuple)):
        return any(_needs_walk(i) for i in x)
    if isinstance(x, dict):
        return any(_needs_walk(i) for i in x.values())
    return False


def _map_structure(fn: Callable[[Any], Any], x: Any) -> Any:
    if isinstance(x, PerReplica):
        return fn(x)
    if _is_namedtuple(x):
        return type(x)(*(_map_structure(fn, i) for i in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_map_structure(fn, i) for i in x)
    if isinstance(x, dict):
        return type(x)((k, _map_structure(fn, v)) for k, v in x.items())
    return x


def map_leaves(fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn`` of every leaf of ``x``, in the structure of ``x``: lists, tuples (named tuples too)
    and dicts are walked; anything else, a per-replica value included, is a leaf."""
    if isinstance(x, PerReplica):
        return fn(x)
    if _is_namedtuple(x):
        return type(x)(*(map_leaves(fn, i) for i in x))
    if isinstance(x, (list, tuple)):
        return type(x)(map_leaves(fn, i) for i in x)
    if isinstance(x, dict):
        return type(x)((k, map_leaves(fn, v)) for k, v in x.items())
    return fn(x)


def select_replica(replica_id: int, structure: Any, num_replicas: int | None = None) -> Any:
    """What replica ``replica_id`` sees of ``structure``: per-replica values replaced by its part.

    Raises:
        ValueError: a per-replica value has another number of values than ``num_replicas``.
    """
    if not _needs_walk(structure):
        return structure

    def pick(v: PerReplica) -> Any:
        if num_replicas is not None and len(v) != num_replicas:
            raise DistributedValueError(
                f"a {type(v).__name__} value has {len(v)} values for {num_replicas} replicas "
                f"(expected {num_replicas}, found {len(v)})"
            )
        return v.values[replica_id]

    return _map_structure(pick, structure)


def split_per_replica(structure: Any, num_replicas: int) -> list[Any]:
    """``[select_replica(i, structure, num_replicas) for i in range(num_replicas)]``, fast.

    The common shapes (a per-replica value, or a flat tuple / list of per-replica and plain
    values, as ``run()`` arguments are) are transposed in one pass instead of being walked
    once per replica.
    """
    if type(structure) is PerReplica:
        vals = structure.values
        if len(vals) == num_replicas:
            return list(vals)
    elif type(structure) in (tuple, list) and not any(
        isinstance(x, (list, tuple, dict)) for x in structure
    ):
        cols = []
        for x in structure:
            if type(x) is PerReplica:
                if len(x.values) != num_replicas:
                    break
                cols.append(x.values)
            elif isinstance(x, PerReplica):  # a subclass (Mirrored): keep the general path
                break
            else:
                cols.append((x,) * num_replicas)
        else:
            kind = type(structure)
            return [kind(col[i] for col in cols) for i in range(num_replicas)]
    return [select_replica(i, structure, num_replicas) for i in range(num_replicas)]


def regroup(values: Sequence[Any], owner_of: Callable[[Sequence[Any]], Any] | None = None) -> Any:
    """Merge one value per replica into one value.

    Args:
        values: replica ``i``'s value at index ``i``.
        owner_of: given the values, returns the variable whose components they are, or ``None``.

    Returns:
        The shared object when every replica gave the same one; a variable when the values are
        its components; a structure of regrouped elements when every replica gave a list, tuple
        or dict of the same shape; else a :class:`PerReplica`.
    """
    first = values[0]
    if all(v is first for v in values):
        return first
    if owner_of is not None:
        owner = owner_of(values)
        if owner is not None:
            return owner
    kind = type(first)
    if isinstance(first, (list, tuple, dict)):
        _check_same_structure(values)
        if isinstance(first, dict):
            return kind((k, regroup([v[k] for v in values], owner_of)) for k in first)
        items = [regroup([v[j] for v in values], owner_of) for j in range(len(first))]
        return kind(*items) if _is_namedtuple(first) else kind(items)
    return PerReplica(values)


def _check_same_structure(values: Sequence[Any]) -> None:
    """Replicas that return (or pass to ``merge_call``) a list, tuple or dict must all give one
    of the same type and length (keys): TensorFlow's regroup asserts it too.

    Raises:
        ReplicaError: a replica's structure differs from replica 0's.
    """
    from parallelvars.errors import ReplicaError

    first = values[0]
    kind = type(first)
    for i, v in enumerate(values[1:], start=1):
        if type(v) is not kind:
            found = f"a {type(v).__name__}"
        elif isinstance(first, dict) and v.keys() != first.keys():
            found = f"keys {sorted(map(str, v))}"
        elif not isinstance(first, dict) and len(v) != len(first):
            found = f"{len(v)} elements"
        else:
            continue
        expected = (
            f"keys {sorted(map(str, first))}"
            if isinstance(first, dict)
            else f"{len(first)} elements"
        )
        raise ReplicaError(
            f"replica {i} gave a value of another structure than replica 0, which gave a "
            f"{kind.__name__} (expected {expected}, found {found}); the replicas' values are "
            "grouped element by element, so every replica must give the same structure"
        )


def local_results(value: Any) -> tuple[Any, ...]:
    """The per-device parts of ``value``: a per-replica value's values, a variable's components,
    else ``(value,)``."""
    if isinstance(value, PerReplica):
        return value.values
    components = getattr(
        value, "_self_components", None
    )  # a ParallelVariable, without importing it
    if components is not None and hasattr(value, "_self_kind"):
        return tuple(components)
    return (value,)
