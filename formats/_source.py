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
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from parallelvars.checkpoint.sources import Source
from parallelvars.errors import ParallelVarsError

from ._graph import carried_graph
from ._registry import detect_format, open_checkpoint
from ._staged import KERAS_OPTIMIZER_REASON, StagedEntry, reasons_of

__all__ = [
    "KERAS_OPTIMIZER_REASON",
    "SOURCES",
    "FormatSources",
    "StagedEntry",
    "ViewSource",
    "reasons_of",
]


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
