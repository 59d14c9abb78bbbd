"""Our native HDF5 layout as a format adapter: a thin wrapper over
:mod:`parallelvars.checkpoint.h5io`.

Reading opens an :class:`~parallelvars.checkpoint.h5io.H5Reader` (which validates the file and
verifies each component's checksum as it is read); writing calls
:func:`~parallelvars.checkpoint.h5raw.native.save_native` (the generated layout; entries read
from another file are streamed in runs of components read in bulk), which
replaces the target atomically. The layout itself is documented in that module. Paths are our
slash paths as they are; there is no ``names=`` option.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import h5py

from parallelvars.checkpoint.entry import check_entry
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.checkpoint.h5io.attributes import attribute_problem
from parallelvars.checkpoint.h5raw.native import save_native
from parallelvars.errors import InvalidEntryError

from ._graph import check_writable_graph, object_graph_for
from ._h5 import H5_ERRORS, is_hdf5
from ._json import carried_metadata
from ._registry import FormatSpec
from ._view import CheckpointView, Entry

__all__ = ["FORMAT", "HDF5View", "open_hdf5", "write_hdf5"]


class HDF5View(CheckpointView):
    """A :class:`CheckpointView` over an :class:`H5Reader`.

    Attributes:
        reader: the underlying reader (``verify_all()``, ``object_graph``).
        object_graph: the stored object graph, or None.
    """

    def __init__(self, reader: H5Reader) -> None:
        self.reader = reader
        self.format = "hdf5"
        self.path = reader.path
        self.metadata = dict(reader.metadata)

    @property
    def object_graph(self) -> dict[str, Any] | None:
        """The stored object graph, or None (read from the file when asked for)."""
        return self.reader.object_graph

    @property
    def graph_kind(self) -> str | None:
        """What :attr:`object_graph` is, known from the open without decoding it again:
        "parallelvars" (a mapping), "other", or None (no graph)."""
        return self.reader.graph_kind

    def __getitem__(self, key: str) -> Entry:
        return self.reader[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.reader)

    def __len__(self) -> int:
        return len(self.reader)

    def summaries(self) -> dict[str, tuple[str, Any, tuple[int, ...], int, int, Any]] | None:
        """Each variable's kind, dtype, shape, components, bytes and attributes from the
        file's index, without an entry made per variable (:meth:`H5Reader.summaries`)."""
        return self.reader.summaries()

    def summary(self, key: str) -> tuple[str, Any, tuple[int, ...], int, int, Any] | None:
        """One variable's entry of :meth:`summaries`, made when asked for
        (:meth:`H5Reader.summary`)."""
        return self.reader.summary(key)

    def bulk_components(self, paths: list[str]) -> Iterator[tuple[str, list[Any] | None]]:
        """Each of ``paths`` with its components read in bulk, checksums verified (None: read
        that one the general way, ``self[path]``; :meth:`H5Reader.bulk_components`)."""
        return self.reader.bulk_components(paths)

    def differing_components(self, paths: list[str]) -> dict[str, list[int]]:
        """The components that differ from component 0, for the variables at ``paths`` that
        the reader compares in bulk (:meth:`H5Reader.differing_components`)."""
        return self.reader.differing_components(paths)

    def verify_all(self) -> list[str]:
        """Check every component against its stored checksum; the problems found."""
        return self.reader.verify_all()

    def close(self) -> None:
        self.reader.close()


def open_hdf5(path: str | os.PathLike[str]) -> HDF5View:
    """Open a checkpoint file of our HDF5 layout (lazily; checksums verified on read).

    The view's entries are made when asked for and not kept by the reader (a view is walked
    once, by a converter or a command: its memory stays that of the index, whatever the
    number of variables)."""
    return HDF5View(H5Reader(path, keep_entries=False))


def write_hdf5(
    path: str | os.PathLike[str],
    entries: Mapping[str, Entry],
    *,
    metadata: Mapping[str, Any] | None = None,
    object_graph: Mapping[str, Any] | None = None,
) -> str:
    """Write ``entries`` in our HDF5 layout, streaming its components in runs.

    Args:
        path: the output file.
        entries: the entries to write.
        metadata: root attributes (default: the source view's, minus the ones the writer
            sets itself: format version, library version, creation time).
        object_graph: the object graph to store (default: the source view's native graph when
            it describes exactly these entries, else one rebuilt from the paths and the
            entries' slot relations; see :mod:`._graph`).

    Returns:
        The file written.
    """
    p = os.fspath(path)
    if metadata is None:
        metadata = getattr(entries, "metadata", None) or {}
    if object_graph is None:
        object_graph = object_graph_for(entries)
    if object_graph is not None:
        check_writable_graph(object_graph, p)
    values = []
    for key, entry in entries.items():
        check_entry(entry, p)
        if entry.path != key:
            raise InvalidEntryError(
                f"entry stored under {key!r} has another path", file=p, variable=entry.path
            )
        problem = attribute_problem(entry.attrs or {})
        if problem is not None:
            what, expected, found = problem
            raise InvalidEntryError(
                what, file=p, variable=entry.path, expected=expected, found=found
            )
        values.append(entry)
    meta = carried_metadata(metadata)
    problem = attribute_problem(meta)
    if problem is not None:
        what, expected, found = problem
        raise InvalidEntryError(f"metadata {what}", file=p, expected=expected, found=found)
    return save_native(p, values, object_graph=object_graph, metadata=meta)


def sniff(path: str, head: bytes) -> bool:
    """True for an HDF5 file with our root attribute ``parallelvars_format``."""
    if not is_hdf5(path, head):
        return False
    try:
        with h5py.File(path, "r") as f:
            return "parallelvars_format" in f.attrs
    except H5_ERRORS:
        return False


FORMAT = FormatSpec(
    name="hdf5",
    description="parallelvars native HDF5 checkpoint (every component, checksummed)",
    suffixes=(".h5", ".hdf5"),
    sniff=sniff,
    open=open_hdf5,
    write=write_hdf5,
)
