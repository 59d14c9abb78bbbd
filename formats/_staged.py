"""A restore's view of entries read lazily from another format: :class:`StagedEntry`, and why
some saved values of a source cannot restore anywhere (:func:`reasons_of`)."""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from parallelvars.checkpoint.entry import Entry

__all__ = ["KERAS_OPTIMIZER_REASON", "StagedEntry", "reasons_of"]


class StagedEntry(Entry):
    """An entry of another format's view as a restore reads it.

    :meth:`verify` reads component ``i`` (the format's own checks run then) and keeps it;
    :meth:`read_component_into` copies it into place and lets it go, into an ``out`` of the
    entry's dtype, or of another one with ``cast`` (the source protocol's flag, as the native
    reader takes it).
    """

    def __init__(self, entry: Any) -> None:
        self._entry = entry
        self.path: str = entry.path
        self.kind: str = entry.kind
        self.dtype = np.dtype(entry.dtype)
        self.shape = tuple(int(s) for s in entry.shape)
        self.num_components = int(entry.num_components)
        self.attrs: dict[str, Any] = dict(entry.attrs or {})
        self._staged: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def component_shape(self, i: int) -> tuple[int, ...]:
        return tuple(int(s) for s in self._entry.component_shape(i))

    def component_nbytes(self, i: int) -> int:
        return int(self._entry.component_nbytes(i))

    @property
    def nbytes(self) -> int:
        return sum(self.component_nbytes(i) for i in range(self.num_components))

    def verify(self, i: int) -> None:
        """Read component ``i`` now (raising whatever the format finds wrong) and keep it."""
        data = self._entry.component(i)
        with self._lock:
            self._staged[i] = data

    def component(self, i: int) -> np.ndarray:
        """Component ``i``: the copy :meth:`verify` kept (handed over, not kept twice), else
        read now."""
        with self._lock:
            data = self._staged.pop(i, None)
        return self._entry.component(i) if data is None else data

    def read_component_into(self, i: int, out: np.ndarray, *, cast: bool = False) -> None:
        """Copy component ``i`` into ``out``, checked as :meth:`Entry.read_component_into`
        checks it: the component of the declared shape and the entry's dtype, ``out`` of the
        declared shape and, unless ``cast``, of the entry's dtype (``cast``: converted into
        ``out``'s, as ``astype`` converts, as :class:`StoredVariable` does with it).

        Raises:
            InvalidEntryError: the component or ``out`` has another shape than declared.
            DtypeMismatchError: the component has another dtype than the entry's, or ``out``
                does without ``cast``.
        """
        with self._lock:
            data = self._staged.pop(i, None)
        if data is None:
            data = self._entry.component(i)
        declared = self.dtype.newbyteorder("=")
        if not cast or out.dtype.newbyteorder("=") == declared:
            self._copy_checked(i, data, out)
            return
        data = np.asarray(data)
        want = tuple(int(d) for d in self.component_shape(i))
        if data.shape != want or data.dtype.newbyteorder("=") != declared or out.shape != want:
            self._copy_checked(i, data, out)  # raises, naming what differs
        np.copyto(out, data, casting="unsafe")


_KERAS_VARIABLES = re.compile(r"^(?:(.*)/)?_variables/[0-9]+$")


def reasons_of(source: Mapping[str, Any]) -> dict[str, str]:
    """Why some saved values of ``source`` cannot restore anywhere, by path: what a
    :class:`NamedSource` could not map, and a Keras 3 optimizer's state in a TensorFlow
    checkpoint (an object with ``_variables/<i>`` children; its ``_iterations`` and
    ``_learning_rate`` too)."""
    out = dict(getattr(source, "reasons", None) or {})
    if getattr(source, "format", None) != "tf":
        return out
    owners = {m.group(1) or "" for path in source if (m := _KERAS_VARIABLES.match(path))}
    for path in source:
        parent, _, name = path.rpartition("/")
        counter = parent in owners and name in ("_iterations", "_learning_rate")
        if path not in out and (counter or _KERAS_VARIABLES.match(path)):
            out[path] = KERAS_OPTIMIZER_REASON
    return out


#: Why a Keras 3 optimizer's state in a TensorFlow checkpoint is not restored.
KERAS_OPTIMIZER_REASON = (
    "a Keras 3 optimizer's state (its variables saved by position, no beta powers): not "
    "mapped onto our optimizers"
)
