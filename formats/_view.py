"""The neutral, lazy view of a checkpoint that every format adapter reads into and writes from.

A :class:`CheckpointView` is a read-only ``Mapping`` from a tensor path (our slash-separated
object path, ``"model/dense/kernel"``) to an :class:`Entry`. Opening a view reads only
metadata; tensor bytes are read when :meth:`Entry.component` (or
:meth:`Entry.read_component_into`) is called, so converting a file never holds more than one
component in memory. Writers take any ``Mapping[str, Entry]`` (a view from another format, or
entries built in memory with :class:`ArrayEntry`) and stream it entry by entry.

The entry model itself (:class:`Entry`, :class:`ArrayEntry`, the kinds and their attributes)
belongs to the core, :mod:`parallelvars.checkpoint.entry`, and the logical value of an entry
to :mod:`parallelvars._aggregate` (the restore rule table); this module re-exports
them and adds what is specific to views.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from parallelvars._aggregate import logical_value, rule_for
from parallelvars.checkpoint.entry import (
    KINDS,
    ArrayEntry,
    Entry,
    check_name_text,
    layout_problem,
)
from parallelvars.checkpoint.h5raw.objects import frozen
from parallelvars.errors import InvalidEntryError

__all__ = [
    "KINDS",
    "Entry",
    "ArrayEntry",
    "CheckpointView",
    "DictView",
    "aggregates",
    "checked_summary",
    "logical_value",
    "check_summary_layout",
    "described_aggregate",
    "refuse_summary_mismatch",
    "summary_mismatch",
]


class CheckpointView(Mapping[str, Entry]):
    """A read-only mapping from tensor path to :class:`Entry`, with file-level metadata.

    Attributes:
        format: the format name (``"hdf5"``, ``"safetensors"``, ...).
        path: the file or directory the view reads.
        metadata: file-level metadata (strings, numbers), format dependent.
        files: every file the view reads: the one named and those found next to it (a shard
            set's index and shards, a TF checkpoint's index and data shards); a writer never
            writes over one of them (``write_checkpoint``).
    """

    format: str = "memory"
    path: str = "<memory>"
    metadata: Mapping[str, Any] = {}
    _files: tuple[str, ...] | None = None
    #: True for a view whose ``summary`` and entries are made from one description of each
    #: variable (an index's or a table's row), so that they cannot differ: a writer planned by
    #: its summaries reads its entries' components without comparing each entry with its
    #: summary first (:func:`summary_mismatch`; reading a stored entry's attributes would
    #: make a copy of them, kept with the entry).
    summaries_match_entries: bool = False

    @property
    def files(self) -> tuple[str, ...]:
        if self._files is not None:
            return self._files
        return () if self.path == "<memory>" else (self.path,)

    @files.setter
    def files(self, value: Sequence[str]) -> None:
        self._files = tuple(value)

    def close(self) -> None:
        """Release open files. A closed view must not be read again."""

    def __enter__(self) -> CheckpointView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} format={self.format} path={self.path!r} entries={len(self)}>"
        )


class DictView(CheckpointView):
    """A view over entries held in a dict (in memory, or wrapping other entries)."""

    def __init__(
        self,
        entries: Mapping[str, Entry] | Sequence[Entry],
        *,
        format: str = "memory",
        path: str = "<memory>",
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(entries, Mapping):
            self._entries = dict(entries)
        else:
            self._entries = {e.path: e for e in entries}
        self.format = format
        self.path = path
        self.metadata = dict(metadata or {})

    @classmethod
    def derived(cls, source: Mapping[str, Entry], entries: Mapping[str, Entry]) -> DictView:
        """A view of ``entries`` that keeps ``source``'s format, path, metadata and object graph
        (for views rewritten from another: converted, resharded)."""
        out = cls(
            entries,
            format=getattr(source, "format", "memory"),
            path=getattr(source, "path", "<memory>"),
            metadata=getattr(source, "metadata", None),
        )
        out.files = tuple(getattr(source, "files", ()))
        graph = getattr(source, "object_graph", None)
        if graph is not None:
            out.object_graph = graph  # type: ignore[attr-defined]  # the HDF5 writer may keep it
        return out

    def __getitem__(self, key: str) -> Entry:
        return self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def aggregates(entry: Entry) -> bool:
    """Whether ``entry``'s logical value is computed from its parts (an on-read SUM or MEAN
    variable of several components, by the core's rule table). Flat formats store that
    aggregate under the plain key (what a plain consumer and TensorFlow read) and every part
    under ``parallel_component_<i>``."""
    return described_aggregate(entry.kind, entry.num_components, entry.attrs)


def described_aggregate(kind: str, n: int, attrs: Mapping[str, Any] | None) -> bool:
    """:func:`aggregates` of a variable described by its kind, number of components and
    attributes (a view's summary): no entry made."""
    return int(n) > 1 and rule_for(kind, attrs or {}).value in ("sum", "mean")


def check_summary_layout(
    key: str, kind: str, shape: Any, n: int, attrs: Any, file: str | None
) -> None:
    """``check_entry``'s checks of a variable's name and layout, on the fields of its
    summary: what a writer that plans from summaries checks before any entry is made.

    Raises:
        InvalidEntryError: the name is not text or the layout is not one of the kind's,
            naming ``file`` and the variable."""
    check_name_text(key, file)
    problem = layout_problem(kind, tuple(map(int, shape)), int(n), attrs or {})
    if problem is not None:
        what, expected, found = problem
        raise InvalidEntryError(what, file=file, variable=key, expected=expected, found=found)


def refuse_summary_mismatch(
    entry: Entry, kind: str, dtype: Any, shape: Any, n: int, attrs: Any, file: str | None, key: str
) -> None:
    """Refuse ``entry`` where it differs from the summary a writer planned it by
    (:func:`summary_mismatch`).

    Raises:
        InvalidEntryError: naming ``file``, the variable and the first field that differs,
            the summary's value against the entry's."""
    differs = summary_mismatch(entry, kind, dtype, shape, n, attrs)
    if differs is not None:
        field, summarized, found = differs
        raise InvalidEntryError(
            f"the view's entry differs from its summary in its {field}",
            file=file,
            variable=key,
            expected=f"{summarized!r} (the summary's)",
            found=f"{found!r} (the entry's)",
        )


def checked_summary(known: Any, file: str | None, key: str) -> tuple[Any, ...]:
    """A view's ``summary(key)`` as the writers read it: a tuple of kind, dtype, shape,
    number of components, bytes and attributes (anything else refused naming the view's
    variable: a view's ``summary`` is trusted for its layout only until its entry is made,
    see :func:`summary_mismatch`, unless the view makes both from one description:
    :attr:`CheckpointView.summaries_match_entries`)."""
    if type(known) is not tuple or len(known) != 6:
        raise InvalidEntryError(
            "the view's summary of the variable is not a description",
            file=file,
            variable=key,
            expected="(kind, dtype, shape, components, bytes, attributes)",
            found=f"a {type(known).__name__}",
        )
    return known


def summary_mismatch(
    entry: Entry, kind: str, dtype: Any, shape: Any, n: int, attrs: Any
) -> tuple[str, Any, Any] | None:
    """The first field in which ``entry`` differs from the summary a writer planned it by:
    ``(field, the summary's, the entry's)``, or None."""
    if entry.kind != kind:
        return "kind", kind, entry.kind
    if np.dtype(entry.dtype) != np.dtype(dtype):
        return "dtype", np.dtype(dtype), np.dtype(entry.dtype)
    if tuple(map(int, entry.shape)) != tuple(map(int, shape)):
        return "shape", tuple(map(int, shape)), tuple(map(int, entry.shape))
    if int(entry.num_components) != int(n):
        return "number of components", int(n), int(entry.num_components)
    # (each value as the writer's class keys take it: types apart, floats by their bits,
    # arrays by dtype and bytes; the names in any order)
    mine, told = entry.attrs or {}, attrs or {}
    if len(mine) != len(told) or not all(
        k in told and _same_value(v, told[k]) for k, v in mine.items()
    ):
        return "attributes", dict(told), dict(mine)
    return None


def _same_value(a: Any, b: Any) -> bool:
    """``frozen(a) == frozen(b)``, without making either key for the values every variable
    has (text, integers, booleans, None, lists of them: compared as they are)."""
    if a is b:
        return True
    t = type(a)
    if t is type(b):
        if t is str or t is int or t is bool:
            return bool(a == b)
        if t is list:
            return len(a) == len(b) and all(map(_same_value, a, b))
    return bool(frozen(a) == frozen(b))
