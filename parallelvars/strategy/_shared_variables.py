"""Variables created inside replica functions: every replica asks, one variable is made.

Inside a replica function of a strategy with several replicas, each replica's ``Variable()``
call reaches the strategy's creator; the strategy turns the calls into one ``merge_call`` whose
merge function, :func:`_create_once`, checks that every replica asked for the same variable and
makes it from the first replica's arguments (TensorFlow's shared variable creator).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from parallelvars.enums import Aggregation
from parallelvars.errors import ReplicaError
from parallelvars.strategy._values import PerReplica


class _Creates(Protocol):
    """What :func:`_create_once` needs of a strategy: its creator step."""

    def _create(self, next_creator: Any, kwargs: dict[str, Any]) -> Any: ...


class _Creation:
    """One replica's request to create a variable (an opaque value for ``merge_call``)."""

    __slots__ = ("kwargs", "next_creator")

    def __init__(self, next_creator: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.next_creator = next_creator
        self.kwargs = kwargs


def _canonical_name(name: Any) -> str:
    """A variable name without the ``_<digits>`` that makes names unique (``dense_1/kernel``
    is ``dense/kernel``): replicas that build the same model may number their layers apart."""
    if name is None:
        return "Variable"
    return "/".join(re.sub(r"_\d+$", "", part) for part in str(name).split("/"))


def _creation_signature(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What must be the same when every replica creates "the same" variable."""
    from parallelvars._dtypes import as_dtype
    from parallelvars.enums import Synchronization

    def norm(key: str, value: Any) -> Any:
        try:
            if key == "synchronization":
                return Synchronization.parse(value)
            if key == "aggregation":
                return Aggregation.parse(value)
            if key == "dtype":
                return None if value is None else as_dtype(value)
        except Exception:
            return repr(value)
        return value

    sig = {k: norm(k, v) for k, v in kwargs.items() if k not in ("initial_value", "name")}
    sig["name"] = _canonical_name(kwargs.get("name"))
    initial: Any = kwargs.get("initial_value")
    if not callable(initial):
        shape = getattr(initial, "shape", None)  # a variable's, without reading its value
        sig["shape"] = tuple(shape) if shape is not None else np.shape(np.asarray(initial))
    return sig


def _create_once(strategy: _Creates, request: Any) -> Any:
    """The merge function behind variable creation in a replica function: the first replica's
    arguments make the one variable every replica receives.

    Every replica must ask for the same variable (TensorFlow's shared variable creator matches
    them by name): the same name up to the ``_<digits>`` of unique names, and the same shape,
    dtype, synchronization, aggregation, trainability and sharding. Initial values may differ
    (the first replica's is used).

    Raises:
        ReplicaError: a replica asked for another variable than the first replica.
    """
    if not isinstance(request, PerReplica):
        return strategy._create(request.next_creator, request.kwargs)
    first = request.values[0]
    expected = _creation_signature(first.kwargs)
    for i, other in enumerate(request.values[1:], start=1):
        found = _creation_signature(other.kwargs)
        if found != expected:
            what = sorted(
                k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k)
            )
            raise ReplicaError(
                f"replicas 0 and {i} of {strategy!r} created different variables at the same "
                f"point: replica 0 {first.kwargs.get('name')!r}, replica {i} "
                f"{other.kwargs.get('name')!r} differ in {', '.join(what)} (expected "
                + ", ".join(f"{k}={expected.get(k)!r}" for k in what)
                + ", found "
                + ", ".join(f"{k}={found.get(k)!r}" for k in what)
                + "); every replica must create the same variables in the same order"
            )
    return strategy._create(first.next_creator, first.kwargs)
