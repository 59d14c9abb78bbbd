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
from ._view import (
    CheckpointView,
    Entry,
    check_summary_layout,
    checked_summary,
    refuse_summary_mismatch,
)

__all__ = ["FORMAT", "HDF5View", "open_hdf5", "write_hdf5"]


class HDF5View(CheckpointView):
    """A :class:`CheckpointView` over an :class:`H5Reader`.

    Attributes:
        reader: the underlying reader (``verify_all()``, ``object_graph``).
        object_graph: the stored object graph, or None.
    """

    #: Its summaries come from the index's table, validated at open (a name that is not
    #: Unicode text has none): a writer or a reshard need not check them again, as they skip
    #: the reader's entries (``layout_checked``).
    summaries_checked = True
    #: Its entries are made from the same rows of the index (:meth:`H5Reader.summary`).
    summaries_match_entries = True

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
    # A view that describes its variables without making entries (``summary``: an index's
    # or a parallel info's table) has each checked from that and handed to the writer as a
    # _Planned, its entry made only while its components are read: the writer's plan holds
    # no entry (nor a copy of its attributes) per variable. Any other entry is checked and
    # held as it is.
    summary = getattr(entries, "summary", None)
    # (a view whose descriptions are checked already: its names and layouts not again)
    checked = bool(getattr(entries, "summaries_checked", False))
    # (a view whose entries are made from its summaries: not compared with them)
    matched = bool(getattr(entries, "summaries_match_entries", False))
    values: list[Any] = []
    for key in entries:
        known = summary(key) if summary is not None else None
        if known is None:
            entry = entries[key]
            check_entry(entry, p)
            if entry.path != key:
                raise InvalidEntryError(
                    f"entry stored under {key!r} has another path", file=p, variable=entry.path
                )
            attrs = entry.attrs or {}
            values.append(entry)
        else:
            kind, dtype, shape, n, _, attrs = checked_summary(known, p, key)
            if not checked:
                check_summary_layout(key, kind, shape, n, attrs, p)
            values.append(_Planned(entries, key, kind, dtype, shape, n, attrs, p, matched))
        problem = attribute_problem(attrs)
        if problem is not None:
            what, expected, found = problem
            raise InvalidEntryError(what, file=p, variable=key, expected=expected, found=found)
    meta = carried_metadata(metadata)
    problem = attribute_problem(meta)
    if problem is not None:
        what, expected, found = problem
        raise InvalidEntryError(f"metadata {what}", file=p, expected=expected, found=found)
    return save_native(p, values, object_graph=object_graph, metadata=meta)


class _Planned:
    """A variable handed to the writer as its view's summary describes it: the layout and
    the attributes as the view lists them (read, not copied), its components read through the
    entry the view makes (``entries[path]``) when the writer first asks for one and let go
    once the last is read (the writer reads them in order, a run at a time), so the writer
    holds no entry per variable. ``source`` is that entry (for
    :class:`~parallelvars.checkpoint.entry.ReadAhead`: the view reads the run in bulk),
    checked against the summary when made (a view whose summary and entry disagree is
    refused, naming the file and the variable, before any of its bytes is written), unless
    ``matched``: the view makes both from one description
    (:attr:`~._view.CheckpointView.summaries_match_entries`)."""

    __slots__ = (
        "_entries",
        "_file",
        "_made",
        "_matched",
        "attrs",
        "dtype",
        "kind",
        "num_components",
        "path",
        "shape",
    )

    def __init__(
        self,
        entries: Mapping[str, Entry],
        path: str,
        kind: str,
        dtype: Any,
        shape: tuple[int, ...],
        num_components: int,
        attrs: Mapping[str, Any],
        file: str,
        matched: bool = False,
    ) -> None:
        self._entries = entries
        self._file = file
        self._matched = matched
        self._made: Entry | None = None
        self.path, self.kind, self.dtype, self.shape = path, kind, dtype, shape
        self.num_components, self.attrs = num_components, attrs

    @property
    def source(self) -> Entry:
        made = self._made
        if made is None:
            made = self._entries[self.path]
            if not self._matched:
                refuse_summary_mismatch(
                    made,
                    self.kind,
                    self.dtype,
                    self.shape,
                    self.num_components,
                    self.attrs,
                    self._file,
                    self.path,
                )
            self._made = made
        return made

    def component_shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.source.component_shape(i))

    def _last(self, i: int) -> Entry:
        """The entry to read component ``i`` from; let go after it when ``i`` is the last."""
        entry = self.source
        if i >= self.num_components - 1:
            self._made = None
        return entry

    def component(self, i: int) -> Any:
        return self._last(i).component(i)

    def read_component_into(self, i: int, out: Any) -> None:
        self._last(i).read_component_into(i, out)


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
