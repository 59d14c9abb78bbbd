"""What ``Checkpoint.restore`` reads: our HDF5 layout, or any other format we read.

A native checkpoint is read by :class:`~parallelvars.checkpoint.h5io.H5Reader`. Any other
format (a TensorFlow prefix or directory, safetensors, a shard set's index, npz, a Keras
``.weights.h5`` or ``.keras``) is opened through :mod:`parallelvars.formats` (imported only
then: the core does not need the adapters) and its entries are shown to the restore rules
as stored variables (:class:`StagedEntry`).

All or nothing holds for both. A native file has a checksum per component, verified before
the first value is written. Another format's reader checks what it can (sizes against the
file at opening, checksums where the format has them) as it reads; so the check pass of a
restore reads every component of another format into memory and the apply pass copies from
there: nothing is written until everything was read. The cost is one copy of the restored
values held at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from parallelvars.checkpoint._foreign import foreign_kind
from parallelvars.checkpoint.entry import Entry
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.errors import NotACheckpointError, ParallelVarsError

__all__ = ["StagedEntry", "ViewSource", "open_source"]


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
        from parallelvars.formats import open_checkpoint
        from parallelvars.formats._graph import carried_graph

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

    def close(self) -> None:
        self.view.close()

    def __del__(self) -> None:
        # A restore with pending slots keeps its source open until they are created; one that
        # never is closes with the source (as H5Reader does).
        with contextlib.suppress(Exception):
            self.close()


def _detected(path: str) -> str | None:
    """The format detection gives ``path`` when it is one we read other than our own, else None."""
    from parallelvars.formats import detect_format

    try:
        name = detect_format(path)
    except ParallelVarsError:
        return None
    return None if name == "hdf5" else name


def open_source(path: str) -> H5Reader | ViewSource:
    """Open ``path`` for a restore: an :class:`H5Reader`, or a :class:`ViewSource` for a file of
    another format we read. What is neither raises the native reader's error (which
    ``Checkpoint.restore`` completes with a hint where one helps)."""
    kind = foreign_kind(path)  # a coarse look at the name and first bytes: no import
    if kind is not None and kind != "hdf5":
        name = _detected(path)
        if name is not None:
            return ViewSource(path, name)
    try:
        return H5Reader(path, map_file=True)
    except NotACheckpointError:
        name = _detected(path) if kind == "hdf5" else None  # a Keras file under a plain name
        if name is None:
            raise
    return ViewSource(path, name)
