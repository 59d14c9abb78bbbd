"""Distributed values: :class:`PerReplica`, :class:`Mirrored`, and how they cross replica borders.

``select_replica(i, structure)`` is what replica ``i`` sees of an argument (its own element of
every per-replica value, everything else as is); ``regroup(values)`` is the inverse, used for the
results of ``run()`` and the arguments of ``merge_call``: the same object from every replica stays
that object, the components of one variable become that variable, anything else becomes a
:class:`PerReplica`. Lists, tuples (named tuples too) and dicts are walked element by element.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

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


class PerReplica:
    """A value that differs per replica: element ``i`` belongs to replica ``i``.

    Args:
        values: one value per replica, in replica order.

    Example:
        >>> import parallelvars as pv
        >>> x = pv.PerReplica([1.0, 2.0])
        >>> x.values, len(x)
        ((1.0, 2.0), 2)
    """

    __slots__ = ("_values",)

    def __init__(self, values: Sequence[Any]) -> None:
        values = tuple(values)
        if not values:
            raise DistributedValueError(f"a {type(self).__name__} needs at least one value")
        self._values = values

    @property
    def values(self) -> tuple[Any, ...]:
        """The per-replica values, in replica order."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, i: int) -> Any:
        return self._values[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self._values)!r})"


class Mirrored(PerReplica):
    """A value held as one copy per replica device, every copy equal (``strategy.broadcast``).

    Passed to ``run()``, replica ``i`` receives copy ``i``; reduced, it counts once per copy
    (``SUM`` gives ``n`` times the value, ``MEAN`` the value).
    """

    __slots__ = ()


class ParallelValue(PerReplica):
    """A value on a parallel device: one element per component device, and every operation on
    it applies to each element (the seed parallel device's parallel tensor).

    ``ParallelDevice.pack(values)`` makes one; arithmetic, comparisons, indexing, numpy ufuncs
    and functions and array methods on it (or on an independent-buffers variable) give another,
    element ``i`` computed from element ``i`` of every parallel operand, so ``x @ kernel + bias``
    runs once per device. ``ParallelDevice.unpack`` gives the elements back; passed to
    ``strategy.run``, replica ``i`` receives element ``i`` as from any :class:`PerReplica`.
    ``len()``, iteration and ``.values`` see the elements; indexing indexes every element.

    Example:
        >>> import numpy as np, parallelvars as pv
        >>> x = pv.ParallelDevice(2).pack([np.float32(1.0), np.float32(3.0)])
        >>> [float(v) for v in (x * 2 + 1).values]
        [3.0, 7.0]
    """

    __slots__ = ()

    def _pv_parts(self) -> tuple[Any, ...]:
        return self._values

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if kwargs.get("out") is not None:
            return NotImplemented  # the elements are separate arrays: no one output to write
        return each_part(getattr(ufunc, method), inputs, kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return each_part(func, args, kwargs)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        # Without this numpy would read the value as a sequence through the per-element
        # indexing above; a parallel value has no one array, as a parallel tensor has none.
        raise DistributedValueError(
            f"a ParallelValue of {len(self._values)} elements is one value per device, not one "
            "array (take its elements with ParallelDevice.unpack(value) or value.values)"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name.startswith("_pv_"):
            raise AttributeError(name)
        return part_attribute(self, name, getattr(self._values[0], name))


def _parts_of(x: Any) -> tuple[Any, ...] | None:
    """The elements ``x`` contributes to a per-element computation, or None when ``x`` is the
    same for every element (a per-replica value's values; a parallel variable's components)."""
    if isinstance(x, PerReplica):
        return x.values
    get = getattr(type(x), "_pv_parts", None)
    return None if get is None else get(x)


def each_part(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> ParallelValue:
    """``fn`` once per element ``i``: every parallel operand among ``args`` and ``kwargs`` (and
    inside lists and tuples of them) replaced by its element ``i``, other operands as they are.

    Raises:
        DistributedValueError: parallel operands with different numbers of elements.
    """
    counts = {len(p) for p in map(_parts_of, _operands(args, kwargs)) if p is not None}
    if len(counts) != 1:
        raise DistributedValueError(
            "parallel operands of different sizes meet in one operation "
            f"(expected one number of elements, found {sorted(counts)})"
        )
    (n,) = counts

    def part(x: Any, i: int) -> Any:
        parts = _parts_of(x)
        if parts is not None:
            return parts[i]
        if isinstance(x, (list, tuple)) and any(_parts_of(item) is not None for item in x):
            items = [part(item, i) for item in x]
            return type(x)(*items) if _is_namedtuple(x) else type(x)(items)
        return x

    return ParallelValue(
        [
            fn(*(part(a, i) for a in args), **{k: part(v, i) for k, v in kwargs.items()})
            for i in range(n)
        ]
    )


def _operands(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[Any]:
    for x in (*args, *kwargs.values()):
        yield x
        if isinstance(x, (list, tuple)):
            yield from x


def part_attribute(value: Any, name: str, first: Any) -> Any:
    """Attribute ``name`` of every element of the parallel ``value`` (``first``: element 0's):
    a method runs on each element, anything else is read from each."""
    if callable(first):
        return lambda *args, **kwargs: each_part(
            lambda element, *a, **k: getattr(element, name)(*a, **k), (value, *args), kwargs
        )
    return each_part(lambda element: getattr(element, name), (value,), {})


def _make_operators() -> dict[str, Callable[..., Any]]:
    """The operators of a parallel value, by dunder name: each runs per element."""
    import operator

    ops: dict[str, Callable[..., Any]] = {}
    for key in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "lshift",
                "rshift", "and", "or", "xor"):  # fmt: skip
        op = getattr(operator, key if key not in ("and", "or") else key + "_")
        ops[f"__{key}__"] = lambda self, other, op=op: each_part(op, (self, other), {})
        ops[f"__r{key}__"] = lambda self, other, op=op: each_part(
            lambda a, b: op(b, a), (self, other), {}
        )
    ops["__divmod__"] = lambda self, other: each_part(divmod, (self, other), {})
    ops["__rdivmod__"] = lambda self, other: each_part(lambda a, b: divmod(b, a), (self, other), {})
    for key in ("lt", "le", "eq", "ne", "gt", "ge"):
        op = getattr(operator, key)
        ops[f"__{key}__"] = lambda self, other, op=op: each_part(op, (self, other), {})
    for key, op in (("neg", operator.neg), ("pos", operator.pos), ("abs", abs),
                    ("invert", operator.invert)):  # fmt: skip
        ops[f"__{key}__"] = lambda self, op=op: each_part(op, (self,), {})
    ops["__getitem__"] = lambda self, key: each_part(lambda a, k: a[k], (self, key), {})
    return ops


PARALLEL_OPERATORS = _make_operators()
for _name, _method in PARALLEL_OPERATORS.items():
    setattr(ParallelValue, _name, _method)  # indexing too: x[0] indexes every element
ParallelValue.__hash__ = None  # type: ignore[assignment]  # == is element-wise
del _name, _method


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


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
