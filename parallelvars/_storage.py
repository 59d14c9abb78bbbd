"""Component storage: arenas that hold the stacked buffers of many variables side by side.

A variable with ``n`` components of shape ``s`` needs an ``(n, *s)`` buffer. Variables of one
dtype and component count are carved out of a shared 2-D arena of shape ``(n, capacity)``:
variable ``j`` owns columns ``[offset_j, offset_j + size_j)``. Component ``i`` of the variable
is then the contiguous row slice ``arena[i, offset:offset+size]``, and a run of neighbouring
variables is one contiguous slab per row, so the update core can apply an optimizer step to a
whole model with a handful of numpy calls. Optimizer state lives in *shadow* arenas with the
same layout (``Arena.shadow(key)``), so variable, gradient and slot slices line up.

Arenas are created lazily and freed with the last variable that uses them (the pool holds only
a weak reference to the arena it is filling).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Arena", "Placement", "allocate"]

_ALIGN_BYTES = 64  # offsets of larger variables start on a cache line
_PACK_BELOW_BYTES = 4096  # smaller variables are packed without padding
_BLOCK_BYTES = 32 << 20  # a fresh shared arena holds this much (pages are touched lazily)
_DEDICATED_BYTES = 8 << 20  # variables at least this big get an arena of their own


class Arena:
    """A ``(n, capacity)`` buffer of one dtype, handed out in aligned column ranges."""

    def __init__(self, n: int, dtype: np.dtype, capacity: int) -> None:
        self.n = int(n)
        self.dtype = np.dtype(dtype)
        self.capacity = int(capacity)
        self.buffer = np.zeros((self.n, self.capacity), self.dtype)
        self.used = 0
        self._shadows: dict[Any, Arena] = {}
        self._lock = threading.Lock()

    def end_of(self, offset: int, size: int) -> int:
        """Where the next variable starts after one of ``size`` elements at ``offset``.

        After a variable of at least a page the next one starts on a cache line; small ones
        are packed back to back, so that a run of small variables is one gap-free span (its
        gradients are then staged with a single ``np.concatenate``). The padding after a
        variable depends on that variable alone, so its slots can initialise it.
        """
        end = offset + size
        if size * self.dtype.itemsize < _PACK_BELOW_BYTES:
            return end
        step = max(1, _ALIGN_BYTES // self.dtype.itemsize)
        return min(self.capacity, -(-end // step) * step)

    def try_allocate(self, size: int) -> int | None:
        """Reserve ``size`` columns; the offset, or ``None`` when the arena is full."""
        with self._lock:
            start = self.used
            if start + size > self.capacity:
                return None
            self.used = self.end_of(start, size)
            return start

    def view(self, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        """The ``(n, *shape)`` view of the columns starting at ``offset``."""
        size = int(np.prod(shape, dtype=np.int64))
        return self.buffer[:, offset : offset + size].reshape((self.n, *shape))

    def shadow(self, key: Any, dtype: Any = None) -> Arena:
        """An arena with this one's layout (same ``n`` and capacity), created on first use.

        Used for optimizer slots and gradients: the slot of a variable at ``offset`` lives at
        the same ``offset`` of the shadow, so one slice covers a run of variables in both.
        """
        dt = self.dtype if dtype is None else np.dtype(dtype)
        k = (key, dt)
        with self._lock:
            if k not in self._shadows:
                shadow = Arena(self.n, dt, self.capacity)
                shadow.used = self.used
                self._shadows[k] = shadow
            return self._shadows[k]

    def __repr__(self) -> str:
        return f"<Arena n={self.n} dtype={self.dtype} used={self.used}/{self.capacity}>"


@dataclass(frozen=True)
class Placement:
    """Where a variable's stacked buffer lives: ``arena.view(offset, shape)``."""

    arena: Arena
    offset: int
    size: int


_pool: dict[tuple[int, np.dtype], weakref.ref[Arena]] = {}
_pool_lock = threading.Lock()


def allocate(n: int, shape: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, Placement | None]:
    """A zeroed ``(n, *shape)`` buffer, carved from a shared arena where the dtype allows.

    Returns the buffer and its placement (``None`` for object dtypes, which numpy cannot pool).
    """
    dt = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    size = int(np.prod(shape, dtype=np.int64))
    if dt.kind == "O" or dt.itemsize == 0:
        return np.zeros((n, *shape), dt), None
    nbytes = max(1, size * dt.itemsize)
    if nbytes >= _DEDICATED_BYTES:
        arena = Arena(n, dt, max(size, 1))
        offset = arena.try_allocate(size)
        assert offset == 0
        return arena.view(0, shape), Placement(arena, 0, size)
    key = (int(n), dt)
    with _pool_lock:
        ref = _pool.get(key)
        current = ref() if ref is not None else None
        offset = current.try_allocate(size) if current is not None else None
        if current is not None and offset is not None:
            arena = current
        else:
            capacity = max(_BLOCK_BYTES // (dt.itemsize * max(n, 1)), size)
            arena = Arena(n, dt, capacity)
            offset = arena.try_allocate(size)
            assert offset is not None
            _pool[key] = weakref.ref(arena)
    return arena.view(offset, shape), Placement(arena, offset, size)
