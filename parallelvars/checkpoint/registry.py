"""The saveable registry: which types a checkpoint saves, and how each one restores.

A :class:`Saveable` turns one live object into a :class:`SaveRecord` (its named tensors
``primary``, ``parallel_component_1`` ... plus group attributes) and plans its restore from a
stored variable. Planning validates everything (shape, dtype, device count) *without* touching
the object and returns a callable that applies the restore; the checkpoint runs every plan
first and applies them only when all succeeded, so a restore is all or nothing.

Register your own type with :func:`register_saveable`; registering a type twice needs
``override=True``.
"""

from __future__ import annotations

import abc
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parallelvars.checkpoint.entry import Entry
from parallelvars.errors import InvalidArgumentError

__all__ = [
    "Saveable",
    "SaveRecord",
    "register_saveable",
    "unregister_saveable",
    "get_saveable",
    "PRIMARY",
    "COMPONENT_PREFIX",
    "component_name",
    "component_index",
    "extra_component_index",
    "generation",
]


#: The dataset name of component 0 in our HDF5 layout (flat formats key it by the path alone).
PRIMARY = "primary"
#: Components ``i >= 1`` are ``parallel_component_<i>`` in every layout and format we write.
COMPONENT_PREFIX = "parallel_component_"
# A record's dtype when it has no components (the constructor's and ``SaveRecord.made``'s).
_NO_COMPONENTS_DTYPE = np.dtype(np.float64)
_EXTRA_COMPONENT = re.compile(r"parallel_component_([1-9][0-9]*)")


def component_name(i: int) -> str:
    """The dataset name of component ``i``: ``primary`` for 0, else ``parallel_component_i``."""
    return PRIMARY if i == 0 else f"{COMPONENT_PREFIX}{i}"


def extra_component_index(name: str) -> int | None:
    """``i`` for the name ``parallel_component_<i>`` (``i >= 1``, no leading zeros), else None."""
    match = _EXTRA_COMPONENT.fullmatch(name)
    return int(match.group(1)) if match else None


def component_index(name: str) -> int | None:
    """The inverse of :func:`component_name` (None for other names)."""
    return 0 if name == PRIMARY else extra_component_index(name)


@dataclass
class SaveRecord(Entry):
    """What one object saves: an :class:`~parallelvars.checkpoint.entry.Entry` built from live
    buffers (``component(i)`` is the buffer itself, not a copy: writers only read it).

    Attributes:
        path: the object path in the checkpoint (set by the checkpoint).
        kind: ``single``, ``mirrored``, ``on_read``, ``independent`` or ``sharded``.
        components: the arrays to write, component 0 first (views, never copies).
        shape: the logical shape.
        attrs: group attributes (devices, aggregation, shard axis and offsets, ...).
    """

    kind: str
    components: Sequence[np.ndarray]
    shape: tuple[int, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    path: str = ""
    dtype: np.dtype = field(init=False, repr=False, compare=False)
    num_components: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.dtype = self.components[0].dtype if len(self.components) else _NO_COMPONENTS_DTYPE
        self.num_components = len(self.components)

    def component_shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.components[i].shape)

    def component(self, i: int) -> np.ndarray:
        return self.components[i]

    @classmethod
    def made(
        cls,
        kinds: Sequence[str],
        components: Sequence[Sequence[np.ndarray]],
        shapes: Sequence[tuple[int, ...]],
        attrs: Sequence[dict[str, Any]],
    ) -> list[SaveRecord]:
        """``[SaveRecord(kind=k, components=c, shape=s, attrs=a) ...]`` of the columns, the
        same records without a call of the constructor each (a first save makes one per
        variable)."""
        new = object.__new__
        out: list[SaveRecord] = []
        add = out.append
        for kind, comps, shape, attr in zip(kinds, components, shapes, attrs, strict=True):
            r = new(cls)
            r.kind = kind
            r.components = comps
            r.shape = shape
            r.attrs = attr
            r.path = ""
            r.dtype = comps[0].dtype if len(comps) else _NO_COMPONENTS_DTYPE
            r.num_components = len(comps)
            add(r)
        return out

    @property
    def tensors(self) -> dict[str, np.ndarray]:
        """The named tensors: ``primary``, ``parallel_component_1`` ..."""
        return {component_name(i): c for i, c in enumerate(self.components)}


class Saveable(abc.ABC):
    """How one type of object is saved and restored."""

    @abc.abstractmethod
    def gather(self, obj: Any) -> SaveRecord:
        """The record to save for ``obj`` (component arrays as views of its buffers)."""

    def gather_all(self, objs: Sequence[Any]) -> list[SaveRecord]:
        """The records of ``objs``, in order: :meth:`gather` of each (a saveable may make
        them together, the same records)."""
        return list(map(self.gather, objs))

    @abc.abstractmethod
    def plan_restore(
        self, obj: Any, stored: Entry, *, file: str, path: str, allow_cast: bool
    ) -> Callable[[], None]:
        """Validate ``stored`` against ``obj`` and return the callable that restores it.

        Must not modify ``obj``; raises a :class:`~parallelvars.errors.CheckpointError` naming
        ``file`` and ``path`` when the stored value cannot be restored into ``obj``.
        """


_registry: dict[type, Saveable] = {}
# What get_saveable answered for each type asked about (cleared on every registration).
_by_type: dict[type, Saveable | None] = {}
_lock = threading.Lock()
_UNKNOWN: Any = object()
# Counts the registrations: what a walk of the graph found saveable holds while it is unchanged.
_generation = 0


def generation() -> int:
    """A number that changes whenever a type is registered or unregistered."""
    return _generation


def register_saveable(cls: type, saveable: Saveable, *, override: bool = False) -> None:
    """Make instances of ``cls`` (and subclasses) saveable with ``saveable``."""
    with _lock:
        if cls in _registry and not override:
            raise InvalidArgumentError(
                f"{cls.__module__}.{cls.__qualname__} already has a saveable "
                f"({type(_registry[cls]).__name__}); pass override=True to replace it"
            )
        _registry[cls] = saveable
        _by_type.clear()
        _bump()


def unregister_saveable(cls: type) -> None:
    with _lock:
        _registry.pop(cls, None)
        _by_type.clear()
        _bump()


def _bump() -> None:
    global _generation
    _generation += 1


def get_saveable(obj: Any) -> Saveable | None:
    """The saveable registered for ``type(obj)`` or its nearest base class, if any."""
    if not _registry:
        return None
    found = _by_type.get(type(obj), _UNKNOWN)  # (asked once per object: answered per type)
    return type_saveable(type(obj)) if found is _UNKNOWN else found


def type_saveable(cls: type) -> Saveable | None:
    """The saveable registered for ``cls`` or its nearest base class, if any."""
    if not _registry:
        return None
    try:
        return _by_type[cls]  # a checkpoint asks once per object: once per type is enough
    except KeyError:
        pass
    with _lock:  # (under the lock: a registration meanwhile cannot leave a stale answer)
        found = None
        for klass in cls.__mro__:
            found = _registry.get(klass)
            if found is not None:
                break
        _by_type[cls] = found
    return found
