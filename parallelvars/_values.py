"""Per-replica and parallel values: the value classes variables and devices hand out.

:class:`PerReplica` holds one value per replica; :class:`ParallelValue` is a per-replica value
on which every operation applies to each element (the seed parallel device's parallel tensor),
and :func:`each_part` / :func:`part_attribute` / :data:`PARALLEL_OPERATORS` are that per-element
computation, shared with an independent-buffers variable. This module sits below variables and
strategies and knows neither; :mod:`parallelvars.strategy._values` re-exports these names with
the strategy-side values (``Mirrored``) and the structure walks of ``run()`` and ``merge_call``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from parallelvars.errors import DistributedValueError

__all__ = [
    "PARALLEL_OPERATORS",
    "ParallelValue",
    "PerReplica",
    "each_part",
    "part_attribute",
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
