"""Tracked objects: the object graph that checkpoints walk.

A :class:`Trackable` names its children (``_trackable_children``). :class:`Module` tracks every
attribute holding a variable, a module, or a list / tuple / dict of them; lists and dicts
assigned to a module become :class:`TrackedList` / :class:`TrackedDict` so that items added
later are tracked too. Leaves are objects with a registered saveable (variables).

Deferred restoration: when a checkpoint is restored before some object exists, the restore
leaves a note on the parent (``_pv_deferred``); the moment a child of that name is attached
(``module.kernel = pv.Variable(...)``, ``layers.append(...)``) it receives its saved value.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["Trackable", "Module", "TrackedList", "TrackedDict", "children_of", "is_trackable"]


class Trackable:
    """Base of every object with named checkpoint children."""

    def _trackable_children(self) -> dict[str, Any]:
        """The named children of this object, in a stable order."""
        return {}

    def _checkpoint_slots(self) -> list[tuple[Any, str, Any]]:
        """``(variable, slot_name, slot_variable)`` triples (optimizers override)."""
        return []

    def _lookup_slot(self, variable: Any, slot_name: str) -> Any:
        """The slot variable for ``variable`` named ``slot_name``, or None (optimizers override)."""
        return None

    def _checkpoint_stage(
        self, slots: list[tuple[Any, str]], children: list[str]
    ) -> tuple[dict[tuple[int, str], Any], dict[str, Any], Callable[[], None] | None]:
        """Make now what a restore has values for: ``slots`` (``(variable, slot_name)`` pairs)
        and the missing ``children`` (names), unattached.

        Returns the slot variables made (by ``(id(variable), slot_name)``), the children made
        (by name) and a callable that attaches them, which the restore calls once every value
        checked out (optimizers override; by default nothing is made).
        """
        return {}, {}, None

    # -- deferred restoration
    def _pv_deferred_map(self) -> dict[str, Any]:
        d = self.__dict__.get("_pv_deferred")
        if d is None:
            d = {}
            object.__setattr__(self, "_pv_deferred", d)
        return d

    def _pv_deferred_slots(self) -> dict[tuple[int, str], Any]:
        d = self.__dict__.get("_pv_deferred_slot_map")
        if d is None:
            d = {}
            object.__setattr__(self, "_pv_deferred_slot_map", d)
        return d

    def _maybe_restore_child(self, name: str, value: Any) -> None:
        deferred = self.__dict__.get("_pv_deferred")
        if deferred and name in deferred and is_trackable(value):
            deferred[name].apply(value)  # a mismatch raises and leaves the note for another try
            del deferred[name]

    def _maybe_restore_slot(self, variable: Any, slot_name: str, slot_variable: Any) -> None:
        """Optimizers call this after creating a slot, so a pending restore can fill it."""
        deferred = self.__dict__.get("_pv_deferred_slot_map")
        key = (id(variable), slot_name)
        if deferred and key in deferred:
            deferred[key].apply(slot_variable)
            del deferred[key]


def is_trackable(value: Any) -> bool:
    """True for objects a checkpoint saves or walks into."""
    get = _get_saveable
    if get is None:  # imported on first use: the registry imports this module's users
        get = _load_get_saveable()
    if get(value) is not None:  # first: a variable, the common case, in one cached lookup
        return True
    if isinstance(value, Trackable):
        return True
    if isinstance(value, (list, tuple)):
        return any(is_trackable(v) for v in value)
    if isinstance(value, dict):
        return any(is_trackable(v) for v in value.values())
    return False


_get_saveable: Callable[[Any], Any] | None = None


def _load_get_saveable() -> Callable[[Any], Any]:
    global _get_saveable
    from parallelvars.checkpoint.registry import get_saveable

    _get_saveable = get_saveable
    return get_saveable


class _Container(Trackable):
    """An ephemeral node for a plain tuple, list or dict found inside the graph."""

    def __init__(self, items: Iterable[tuple[str, Any]]) -> None:
        self._items = dict(items)

    def _trackable_children(self) -> dict[str, Any]:
        return {k: v for k, v in self._items.items() if is_trackable(v)}


def _as_node(value: Any) -> Any:
    if isinstance(value, Trackable):
        return value
    if isinstance(value, (list, tuple)):
        return _Container((str(i), v) for i, v in enumerate(value))
    if isinstance(value, dict):
        return _Container((str(k), v) for k, v in value.items())
    return value


def children_of(obj: Any) -> dict[str, Any]:
    """The trackable children of ``obj`` (containers turned into nodes)."""
    if not isinstance(obj, Trackable):
        return {}
    return {name: _as_node(value) for name, value in obj._trackable_children().items()}


class TrackedList(list, Trackable):
    """A list whose items are checkpoint children named ``"0"``, ``"1"``, ..."""

    def _trackable_children(self) -> dict[str, Any]:
        return {str(i): v for i, v in enumerate(self) if is_trackable(v)}

    def _added(self, start: int) -> None:
        """Items from ``start`` on may be new: hand each one its pending restore, if any."""
        deferred = self.__dict__.get("_pv_deferred")
        if not deferred:
            return  # nothing pending (the usual case): no per-item work at all
        n = len(self)
        if n - start <= len(deferred):
            indices: Iterable[int] = range(start, n)
        else:  # fewer notes than items: visit the notes, not the list
            indices = sorted(int(k) for k in deferred if k.isdigit() and start <= int(k) < n)
        for i in indices:
            self._maybe_restore_child(str(i), self[i])

    def append(self, value: Any) -> None:
        super().append(_wrap(value))
        self._added(len(self) - 1)

    def extend(self, values: Iterable[Any]) -> None:
        start = len(self)
        super().extend(_wrap(v) for v in values)
        self._added(start)

    def insert(self, index: Any, value: Any) -> None:
        super().insert(index, _wrap(value))
        self._added(0)

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(
            index, _wrap(value) if not isinstance(index, slice) else [_wrap(v) for v in value]
        )
        self._added(0)

    def __iadd__(self, values: Any) -> TrackedList:  # type: ignore[misc]
        self.extend(values)
        return self

    def __hash__(self) -> int:  # type: ignore[override]  # identity: containers are graph nodes
        return id(self)

    def __eq__(self, other: object) -> bool:
        return list.__eq__(self, other)


class TrackedDict(dict, Trackable):
    """A dict whose values are checkpoint children named by their (string) keys."""

    def _trackable_children(self) -> dict[str, Any]:
        return {str(k): v for k, v in self.items() if is_trackable(v)}

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, _wrap(value))
        self._maybe_restore_child(str(key), self[key])

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __hash__(self) -> int:  # type: ignore[override]
        return id(self)

    def __eq__(self, other: object) -> bool:
        return dict.__eq__(self, other)


def _wrap(value: Any) -> Any:
    if type(value) is list:
        return TrackedList(value)
    if type(value) is dict:
        return TrackedDict(value)
    return value


class Module(Trackable):
    """A tracked container: attributes holding variables, modules, lists, tuples and dicts are saved.

    Example:
        >>> import numpy as np, parallelvars as pv
        >>> class Dense(pv.Module):
        ...     def __init__(self):
        ...         self.kernel = pv.Variable(np.zeros((2, 3), np.float32), name="kernel")
        >>> m = pv.Module()
        >>> m.layers = [Dense(), Dense()]
        >>> [v.name for v in m.variables]
        ['kernel', 'kernel']
    """

    def __setattr__(self, name: str, value: Any) -> None:
        value = _wrap(value)
        object.__setattr__(self, name, value)
        if not name.startswith("_pv_"):
            self._maybe_restore_child(name, value)

    def _trackable_children(self) -> dict[str, Any]:
        return {
            name: value
            for name, value in vars(self).items()
            if not name.startswith("_pv_") and is_trackable(value)
        }

    @property
    def variables(self) -> list[Any]:
        """Every variable reachable from this module, each once, in walk order."""
        return list(_walk_variables(self))

    @property
    def trainable_variables(self) -> list[Any]:
        return [v for v in _walk_variables(self) if getattr(v, "trainable", False)]


def _walk_variables(root: Any) -> Iterator[Any]:
    from parallelvars.variables import ParallelVariable

    seen: set[int] = set()
    queue = deque([root])  # breadth-first; popleft is O(1) where list.pop(0) is O(n)
    order: list[Any] = []
    while queue:
        node = queue.popleft()
        for child in children_of(node).values():
            if id(child) in seen:
                continue
            seen.add(id(child))
            if isinstance(child, ParallelVariable):
                order.append(child)
            else:
                queue.append(child)
    yield from order
