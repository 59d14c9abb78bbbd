"""The source plug-in of :mod:`parallelvars.formats`: every format it reads, as a restore reads
it (see :mod:`parallelvars.checkpoint.sources`).

``Checkpoint.restore`` of a file that is not in our HDF5 layout (a TensorFlow prefix or
directory, safetensors, a shard set's index, npz, a Keras ``.weights.h5`` or ``.keras``) finds
:data:`SOURCES` through the ``parallelvars.sources`` entry point (or the registration that
importing :mod:`parallelvars.formats` makes), which opens the file as a :class:`ViewSource`:
its entries shown to the restore rules as stored variables (:class:`StagedEntry`).

All or nothing holds as for our own files. A native file has a checksum per component,
verified before the first value is written. Another format's reader checks what it can (sizes
against the file at opening, checksums where the format has them) as it reads; so the check
pass of a restore reads every component of another format into memory and the apply pass
copies from there: nothing is written until everything was read. The cost is one copy of the
restored values held at once.

A name-based TensorFlow checkpoint (``tf.compat.v1.train.Saver``: no object graph, keys are
variable names) is seen through the live model (:meth:`ViewSource.for_root`, see
:mod:`parallelvars.formats.tf._live_names`).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from parallelvars.checkpoint.entry import Entry
from parallelvars.checkpoint.sources import Source
from parallelvars.errors import ParallelVarsError

from ._graph import carried_graph
from ._registry import detect_format, open_checkpoint

__all__ = [
    "KERAS_OPTIMIZER_REASON",
    "SOURCES",
    "FormatSources",
    "StagedEntry",
    "ViewSource",
    "reasons_of",
]


class StagedEntry(Entry):
    """An entry of another format's view as a restore reads it.

    :meth:`verify` reads component ``i`` (the format's own checks run then) and keeps it;
    :meth:`read_component_into` copies it into place and lets it go.
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
        """Copy component ``i`` into ``out``: its shape, and its dtype unless ``cast`` (the
        restore rules checked both against the entry before planning this read)."""
        del cast  # a dtype other than the entry's reaches here only when casting is allowed
        with self._lock:
            data = self._staged.pop(i, None)
        if data is None:
            data = self._entry.component(i)
        if out.dtype == data.dtype:
            np.copyto(out, data)
        else:
            out[...] = data.astype(out.dtype)


class ViewSource(Mapping[str, StagedEntry]):
    """A view of another format as a restore reads it: staged entries and the native graph
    the file carries (``object_graph``; None when it carries none)."""

    def __init__(self, path: str, format: str) -> None:
        self.path = path
        self.format = format
        self.view = open_checkpoint(path, format=format)
        self.object_graph = carried_graph(self.view)

    def __getitem__(self, key: str) -> StagedEntry:
        return StagedEntry(self.view[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.view)

    def __len__(self) -> int:
        return len(self.view)

    def stage(self, variables: Iterable[Any]) -> set[tuple[str, int]]:
        """The native reader's read-ahead (:meth:`H5Reader.stage`); another format reads each
        component when it is verified, so nothing is read ahead and nothing is verified here."""
        del variables
        return set()

    def unstage(self) -> None:
        """Nothing was read ahead (see :meth:`stage`)."""

    def for_root(self, root: Any) -> Source:
        """This source seen through the live objects of ``root``: a name-based TensorFlow
        checkpoint under the live paths (:func:`~parallelvars.formats.tf._live_names.by_live_names`),
        any other source as it is."""
        if self.object_graph is not None or self.format != "tf":
            return self
        from .tf._live_names import by_live_names  # only for TensorFlow checkpoints

        return by_live_names(self, root)

    def unrestorable(self) -> dict[str, str]:
        """Saved paths no live object can take, with the reason (:func:`reasons_of`)."""
        return reasons_of(self)

    def close(self) -> None:
        self.view.close()

    def __del__(self) -> None:
        # A restore with pending slots keeps its source open until they are created; one that
        # never is closes with the source (as H5Reader does).
        with contextlib.suppress(Exception):
            self.close()


class FormatSources:
    """The source plug-in of :mod:`parallelvars.formats`
    (:class:`~parallelvars.checkpoint.sources.SourcePlugin`): every format the registry reads
    but our own HDF5 layout."""

    def detect(self, path: str) -> str | None:
        """The format detection gives ``path`` when it is one we read other than our own, else
        None."""
        try:
            name = detect_format(path)
        except ParallelVarsError:
            return None
        return None if name == "hdf5" else name

    def open(self, path: str, format: str) -> ViewSource:
        return ViewSource(path, format)


#: The plug-in object the ``parallelvars.sources`` entry point names.
SOURCES = FormatSources()


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
