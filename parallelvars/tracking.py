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

import operator
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import repeat
from operator import is_
from typing import Any

__all__ = [
    "Trackable",
    "Module",
    "TrackedList",
    "TrackedDict",
    "children_of",
    "is_trackable",
    "node_children",
    "same_children",
]


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


def _trackable_only(items: dict[str, Any]) -> dict[str, Any]:
    """The items of ``items`` whose values are trackable (:func:`is_trackable`), in order.

    A saveable is registered per type (``get_saveable`` looks at ``type(value)`` only), so one
    value of each type answers for all of that type: a container of thousands of variables is
    checked once per distinct type instead of once per item. ``items`` is returned as it is
    when every value has a saveable.
    """
    get = _get_saveable
    if get is None:
        get = _load_get_saveable()
    values = items.values()
    one_of_each = dict(zip(map(type, values), values, strict=True)).values()
    if all(get(value) is not None for value in one_of_each):
        return items
    return {k: v for k, v in items.items() if is_trackable(v)}


class _Container(Trackable):
    """An ephemeral node for a plain tuple, list or dict (``source``) found inside the graph."""

    def __init__(self, items: Iterable[tuple[str, Any]], source: Any = None) -> None:
        self._items = dict(items)
        self._source = source

    def _trackable_children(self) -> dict[str, Any]:
        return dict(_trackable_only(self._items))


def _as_node(value: Any) -> Any:
    if isinstance(value, Trackable):
        return value
    if isinstance(value, (list, tuple)):
        return _Container(((str(i), v) for i, v in enumerate(value)), value)
    if isinstance(value, dict):
        return _Container(((str(k), v) for k, v in value.items()), value)
    return value


_PLAIN_CONTAINERS = (list, tuple, dict)
_NO_CLASS: Any = None  # (what getattr gives for an object without __class__)


def _any_plain_container(values: Iterable[Any]) -> bool:
    """``any(isinstance(v, (list, tuple, dict)) for v in values)``, asked once per distinct
    class: ``isinstance`` answers from ``type(v)`` and from ``v.__class__`` (which a proxy
    forwards to the object it wraps), so both of every value are collected in C loops."""
    values = list(values)
    classes: set[Any] = set(map(type, values))
    classes.update(map(getattr, values, repeat("__class__"), repeat(_NO_CLASS)))
    return any(isinstance(c, type) and issubclass(c, _PLAIN_CONTAINERS) for c in classes)


def children_of(obj: Any) -> dict[str, Any]:
    """The trackable children of ``obj`` (containers turned into nodes)."""
    if not isinstance(obj, Trackable):
        return {}
    children = obj._trackable_children()
    if not _any_plain_container(children.values()):  # (mostly: variables and modules)
        return dict(children)
    return {name: _as_node(value) for name, value in children.items()}


_index_names: list[str] = []


def _item_names(count: int) -> list[str]:
    """``["0", "1", ..., str(count - 1)]``: a list's child names, made once per process (a
    list of thousands of variables is walked at every save and restore)."""
    global _index_names
    if len(_index_names) < count:
        _index_names = list(map(str, range(max(count, 2 * len(_index_names)))))
    return _index_names[:count]


# -- snapshots of a node's children, so a repeated save can tell cheaply that the graph it walked
# before is the graph now. A snapshot keeps the node's children (names, and the values by
# identity) and, where the node is a list, a dict or a module whose children come from the base
# classes' rules, its raw contents: when those are the same objects, so are the children (only a
# plain list, tuple or dict among them can become trackable or stop being so, as its own
# contents change: those are asked again). Anything else asks the node again and compares.
_LIST, _DICT, _MODULE, _OTHER = range(4)


_PRIVATE = operator.methodcaller("startswith", "_pv_")  # a module's own attributes


def type_decides_isinstance(cls: type) -> bool:
    """Whether ``isinstance(x, C)`` of every instance ``x`` of ``cls`` is ``issubclass(cls, C)``
    for the classes the graph asks about (containers, lists, tuples, dicts): ``isinstance``
    also asks an instance's ``__class__`` where its type defines its own (a proxy forwards it
    to the object it wraps), except for a variable proxy, which wraps an array."""
    known = _DECIDED.get(cls)
    if known is None:
        owner = next(k for k in cls.__mro__ if "__class__" in vars(k))
        from parallelvars._proxy import ParallelVariable

        known = _DECIDED[cls] = owner is object or issubclass(cls, ParallelVariable)
    return known


_DECIDED: dict[type, bool] = {}


def _may_be_plain(cls: type) -> bool:
    """Whether an instance of ``cls`` may be a list, tuple or dict to ``isinstance``."""
    return issubclass(cls, _PLAIN_CONTAINERS) or not type_decides_isinstance(cls)


def _volatile(items: Iterable[Any]) -> tuple[tuple[Any, bool], ...]:
    """``(item, is_trackable(item))`` of the plain containers among ``items``."""
    items = list(items)
    if not any(map(_may_be_plain, set(map(type, items)))):
        return ()  # (asked once per type: no item is one)
    return tuple(
        (v, is_trackable(v))
        for v in items
        if isinstance(v, (list, tuple, dict)) and not isinstance(v, Trackable)
    )


def node_children(obj: Any) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """The trackable children of a graph node (``obj._trackable_children()``, containers not
    yet turned into nodes) and a snapshot of them for :func:`same_children`.

    The snapshot holds the children (and the node's raw contents) by reference: the objects
    stay alive as long as it does, so an identity it compares cannot be another object's.
    """
    children = obj._trackable_children()
    method = type(obj)._trackable_children
    source: Any = obj
    raw: Any = None
    how = _OTHER
    if type(obj) is _Container:
        source = obj._source
        if type(source) in (list, tuple):
            how, raw = _LIST, tuple(source)
        elif type(source) is dict:
            how, raw = _DICT, (tuple(source), tuple(source.values()))
    elif method is TrackedList._trackable_children:
        how, raw = _LIST, tuple(obj)
    elif method is TrackedDict._trackable_children:
        how, raw = _DICT, (tuple(obj), tuple(obj.values()))
    elif method is Module._trackable_children:
        source = vars(obj)
        how, raw = _MODULE, (tuple(source), tuple(source.values()))
    if how == _LIST:
        volatile = _volatile(raw)
    elif how == _DICT:
        volatile = _volatile(raw[1])
    elif how == _MODULE:  # (a module's _pv_ attributes are never its children)
        if any(map(_PRIVATE, source)):
            volatile = _volatile(v for k, v in source.items() if not k.startswith("_pv_"))
        else:
            volatile = _volatile(raw[1])
    else:
        volatile = ()
    snapshot = (how, obj, source, raw, tuple(children), tuple(children.values()), volatile)
    return children, snapshot


def same_children(snapshot: tuple[Any, ...]) -> bool:
    """Whether the node of a :func:`node_children` snapshot has the same children now (the
    same names, in the same order, naming the same objects)."""
    how, obj, source, raw, names, values, volatile = snapshot
    if how == _MODULE:
        source = vars(obj)  # (asked again: a module's __dict__ can be replaced)
    if how == _LIST:
        fast = len(source) == len(raw) and all(map(is_, source, raw))
    elif how != _OTHER:
        keys, items = raw
        fast = (
            len(source) == len(keys)
            and all(map(is_, source, keys))
            and all(map(is_, source.values(), items))
        )
    else:
        fast = False
    if fast and all(is_trackable(v) is was for v, was in volatile):
        return True
    if type(obj) is _Container:  # the contents of a plain container, as _as_node reads them
        obj = _as_node(source)
    children = obj._trackable_children()
    return (
        len(children) == len(names)
        and all(map(is_, children.values(), values))
        and tuple(children) == names
    )


class TrackedList(list, Trackable):
    """A list whose items are checkpoint children named ``"0"``, ``"1"``, ..."""

    def _trackable_children(self) -> dict[str, Any]:
        return _trackable_only(dict(zip(_item_names(len(self)), self, strict=True)))

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
        return _trackable_only(dict(zip(map(str, self), self.values(), strict=True)))

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
        # (the attributes not named _pv_..., then those whose values are trackable: each
        # step one C loop while every value's type has a saveable, see _trackable_only)
        items = vars(self)
        if any(map(_PRIVATE, items)):
            items = {name: value for name, value in items.items() if not name.startswith("_pv_")}
        return dict(_trackable_only(items))

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
