"""The saved-entry model: one saved variable as every reader, writer and tool sees it.

An :class:`Entry` is a variable's metadata (``path``, ``kind``, ``dtype``, ``shape``,
``attrs``, ``num_components``) and its components, read on demand. The registry's
:class:`~parallelvars.checkpoint.registry.SaveRecord` (live buffers), the HDF5 reader's
:class:`~parallelvars.checkpoint.h5io.StoredVariable`, every format's entries and the
rewritten entries of a conversion or re-shard are all entries; writers take any
``Mapping[str, Entry]`` and stream it entry by entry.

Kinds (``Entry.kind``) and what the components are:

==============  ====================================================================
``single``      one component, the value
``mirrored``    N components that are meant to be equal; component 0 is the primary
``on_read``     N per-device components aggregated on read (``attrs["aggregation"]``:
                ``"sum"``, ``"mean"`` or ``"only_first_replica"``; ``"none"`` has no
                single value)
``independent`` N components, each its own value
``sharded``     N slices of one logical value along ``attrs["shard_axis"]``, starting at
                ``attrs["shard_offsets"][i]``
==============  ====================================================================

Common ``attrs`` keys: ``devices`` (list of device names), ``aggregation``,
``synchronization``, ``trainable``, ``shard_axis``, ``shard_offsets``, ``name`` (the
variable's own name), ``slot_of`` / ``slot_name`` (for an optimizer slot: the path of the
variable it serves and the slot's name). Adapters may add keys of their own; writers ignore
keys they do not know.

:func:`check_entry` is the one validation of an entry's layout (kind, number of components,
dimensions, aggregation, devices, shard axis and offsets); the HDF5 reader, the writers and the
formats' plans all use it, so a bad entry reads the same wherever it is found.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from parallelvars import _geometry
from parallelvars.enums import Aggregation
from parallelvars.errors import (
    CheckpointError,
    ComponentIndexError,
    DtypeMismatchError,
    InvalidEntryError,
    ShapeMismatchError,
)

__all__ = [
    "AGGREGATIONS",
    "KINDS",
    "MAX_COMPONENTS",
    "ArrayEntry",
    "CountingEntry",
    "Entry",
    "ForwardingEntry",
    "ReadAhead",
    "check_entry",
    "COMPONENT_REFUSALS",
    "in_file",
    "layout_problem",
    "naming_file",
]

# The documented variable kinds and on-read aggregations (the enums' values).
KINDS = ("single", "mirrored", "on_read", "independent", "sharded")
AGGREGATIONS = tuple(a.value for a in Aggregation)
MAX_COMPONENTS = 1 << 16


class Entry(abc.ABC):
    """One saved variable: its metadata, and its components read on demand."""

    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    kind: str
    num_components: int
    attrs: Mapping[str, Any]

    def component_shape(self, i: int) -> tuple[int, ...]:
        """The shape of component ``i`` (a shard's shape for sharded entries)."""
        self._check_index(i)
        if self.kind != "sharded":
            return tuple(self.shape)
        axis = int(self.attrs["shard_axis"])
        offsets = self.attrs["shard_offsets"]  # indexed, not copied: O(1) per component
        stop = int(offsets[i + 1]) if i + 1 < len(offsets) else int(self.shape[axis])
        shape = list(self.shape)
        shape[axis] = stop - int(offsets[i])
        return tuple(shape)

    @abc.abstractmethod
    def component(self, i: int) -> np.ndarray:
        """Read component ``i`` into a new array that the caller owns."""

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        """Read component ``i`` into ``out`` and fill it entirely.

        ``out`` must have the component's declared shape (:meth:`component_shape`) and the
        entry's dtype (byte order aside); what is read must be exactly the declared shape
        and dtype, as :meth:`component` gives it: a component of another shape or dtype is
        refused (no broadcast, no cast), so a writer never stores other bytes than the entry
        declares. An ``out`` of another dtype is refused too, as the native reader refuses
        it without ``allow_cast``: a float64 component read into float32 or int32 would be
        rounded, overflowed or truncated without a word. A caller that means to convert
        reads :meth:`component` and converts it (as a restore with ``allow_cast=True``
        does). Adapters that override this to read in place must check ``out`` the same
        way (:meth:`check_out`), agree with :meth:`component` and write every element of
        ``out`` (writers reuse their buffers from one tensor to the next).

        Raises:
            InvalidEntryError: the component or ``out`` has another shape than declared.
            DtypeMismatchError: the component or ``out`` has another dtype than the entry's.
        """
        self._copy_checked(i, self.component(i), out)

    def check_out(self, i: int, out: np.ndarray, *, file: str | None = None) -> None:
        """Check that ``out`` can take component ``i`` as it is: the component's declared
        shape and the entry's dtype (byte order aside: every reader converts the values into
        an ``out`` of the other byte order). ``file``: the file the entry is read from, named
        in the error.

        Raises:
            InvalidEntryError: ``out`` has another shape than the component.
            DtypeMismatchError: ``out`` has another dtype than the entry (no cast here:
                :meth:`read_component_into`).
        """
        self._refuse(
            i,
            out,
            "is read into another dtype than its variable's",
            file=file,
            hint="read component(i) and convert it where a cast is meant",
        )

    def _copy_checked(self, i: int, data: np.ndarray, out: np.ndarray) -> None:
        """Copy component ``i``'s ``data`` into ``out`` after checking that ``data`` has the
        component's declared shape and the entry's dtype (byte order aside), and ``out``
        the same (:meth:`check_out`)."""
        data = np.asarray(data)
        self._refuse(i, data, "has another dtype than its variable")
        self.check_out(i, out)
        np.copyto(out, data, casting="equiv")

    def _refuse(
        self,
        i: int,
        array: np.ndarray,
        other_dtype: str,
        *,
        file: str | None = None,
        hint: str | None = None,
    ) -> None:
        """Raise unless ``array`` has component ``i``'s declared shape and the entry's dtype
        (byte order aside): :class:`InvalidEntryError` for the shape, else
        :class:`DtypeMismatchError` (``component {i} {other_dtype}``, with ``hint``), each
        naming ``file`` (where there is one), the variable and expected versus found."""
        want = tuple(int(d) for d in self.component_shape(i))
        if tuple(array.shape) != want:
            raise InvalidEntryError(
                f"component {i} has another shape than its variable",
                file=file,
                variable=self.path,
                expected=want,
                found=tuple(array.shape),
            )
        declared = np.dtype(self.dtype)
        if array.dtype.newbyteorder("=") != declared.newbyteorder("="):
            raise DtypeMismatchError(
                f"component {i} {other_dtype}",
                file=file,
                variable=self.path,
                expected=declared,
                found=array.dtype,
                hint=hint,
            )

    def component_nbytes(self, i: int) -> int:
        return math.prod(self.component_shape(i)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of all components together."""
        return sum(self.component_nbytes(i) for i in range(self.num_components))

    def value(self) -> np.ndarray:
        """The logical value: what a restore onto a single device gives.

        See :func:`parallelvars._aggregate.logical_value`; an entry with no single
        value (independent buffers, on-read with aggregation ``none``) raises
        :class:`~parallelvars.errors.InvalidEntryError`.
        """
        from parallelvars._aggregate import logical_value

        return logical_value(self)

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.num_components:
            raise ComponentIndexError(
                f"variable {self.path!r} has {self.num_components} components, no component {i}"
            )

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.path!r} kind={self.kind} dtype={self.dtype} "
            f"shape={tuple(self.shape)} components={self.num_components}>"
        )


class ArrayEntry(Entry):
    """An entry whose components are numpy arrays in memory (or views of them)."""

    def __init__(
        self,
        path: str,
        components: Sequence[np.ndarray],
        *,
        kind: str | None = None,
        shape: Sequence[int] | None = None,
        attrs: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(components, (np.ndarray, np.generic, str, bytes)):
            # An array is not a list of components: taking its rows as components (or its
            # truth value, as before) would save something else than was meant.
            found = (
                f"one array of shape {tuple(components.shape)}"
                if isinstance(components, (np.ndarray, np.generic))
                else f"a {type(components).__name__}"
            )
            raise InvalidEntryError(
                "components must be a sequence of arrays, one per device",
                variable=path,
                expected="a list or tuple of component arrays",
                found=found,
                hint="wrap a single value in a list: ArrayEntry(path, [value])",
            )
        self._components = [np.asarray(c) for c in components]
        if not self._components:
            raise InvalidEntryError("an entry needs at least one component", variable=path)
        self.path = path
        self.dtype = self._components[0].dtype
        self.kind = kind or ("single" if len(self._components) == 1 else "mirrored")
        if self.kind not in KINDS:
            raise InvalidEntryError(
                "unknown variable kind",
                variable=path,
                expected=f"one of {', '.join(KINDS)}",
                found=repr(self.kind),
            )
        self.num_components = len(self._components)
        self.attrs = dict(attrs or {})
        self.shape = tuple(
            int(s) for s in (shape if shape is not None else self._components[0].shape)
        )

    def component(self, i: int) -> np.ndarray:
        self._check_index(i)
        return np.array(self._components[i], copy=True)

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        self._check_index(i)
        if type(self).component is not ArrayEntry.component:  # a subclass reads its own way
            super().read_component_into(i, out)
            return
        self._copy_checked(i, self._components[i], out)

    def component_array(self, i: int) -> np.ndarray:
        """Component ``i`` without a copy (do not mutate it)."""
        self._check_index(i)
        return self._components[i]


class ForwardingEntry(Entry):
    """An entry that passes every read through to ``source``, with ``source``'s metadata
    (subclasses change what they need: the kind, the attrs, what a read does)."""

    def __init__(self, source: Entry) -> None:
        self.source = source
        self.path = source.path
        self.dtype = np.dtype(source.dtype)
        self.shape = tuple(int(s) for s in source.shape)
        self.kind = source.kind
        self.num_components = int(source.num_components)
        self.attrs = dict(source.attrs or {})

    def component_shape(self, i: int) -> tuple[int, ...]:
        return tuple(int(s) for s in self.source.component_shape(i))

    def component(self, i: int) -> np.ndarray:
        return self.source.component(i)

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        self.source.read_component_into(i, out)

    def value(self) -> np.ndarray:
        return self.source.value()


class CountingEntry(ForwardingEntry):
    """Passes reads through to ``source`` and reports the bytes of each read to ``count``
    (a progress bar, a convert progress callback)."""

    def __init__(self, source: Entry, count: Callable[[int], Any]) -> None:
        super().__init__(source)
        self._count = count

    def component(self, i: int) -> np.ndarray:
        value = self.source.component(i)
        self._count(self.component_nbytes(i))
        return value

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        self.source.read_component_into(i, out)
        self._count(self.component_nbytes(i))

    def value(self) -> np.ndarray:
        value = self.source.value()
        self._count(math.prod(self.shape) * self.dtype.itemsize)
        return value


#: The errors an entry raises for a component unlike what it declares.
COMPONENT_REFUSALS = (InvalidEntryError, DtypeMismatchError, ShapeMismatchError)


def in_file(
    e: CheckpointError, file: str, *, prefix: str = "", variable: str | None = None
) -> CheckpointError | None:
    """``e``, an entry's refusal of a component of another shape or dtype than it declares
    (:data:`COMPONENT_REFUSALS`, raised by :meth:`Entry.read_component_into` or
    :meth:`Entry.check_out`), as the error a writer raises: naming ``file``, the checkpoint
    being written, then the variable (``variable``, default the entry's path), ``prefix``
    (a writer's tensor key) before its message, expected versus found and its hint. None when
    ``e`` names a file already (the file the entry is read from): it goes on as it is. The
    writer raises the result ``from e`` (:class:`naming_file` does)."""
    if e.file is not None:
        return None
    return type(e)(
        prefix + e.what,
        file=file,
        variable=e.variable if variable is None else variable,
        expected=e.expected,
        found=e.found,
        hint=e.hint,
    )


class naming_file:
    """Within it, an entry's refusal of a component (:data:`COMPONENT_REFUSALS`) that names
    no file is raised again naming ``file``, the checkpoint being written (:func:`in_file`,
    the entry's error as the cause): every writer reads its components in one of these, or
    calls :func:`in_file` itself where it reads tensor by tensor (a ``try`` costs nothing
    there; entering this costs microseconds), so each such error names the output file, the
    variable and expected versus found."""

    __slots__ = ("file", "prefix", "variable")

    def __init__(self, file: str, *, prefix: str = "", variable: str | None = None) -> None:
        self.file, self.prefix, self.variable = file, prefix, variable

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> None:
        if isinstance(e, COMPONENT_REFUSALS):
            named = in_file(e, self.file, prefix=self.prefix, variable=self.variable)
            if named is not None:
                raise named from e


def stored_source(entry: Entry) -> Entry:
    """The entry at the bottom of a chain of forwarding entries (a reshard's, a selection's,
    a progress counter's ``source``): the one that reads a file."""
    while True:
        source = getattr(entry, "source", None)
        if not isinstance(source, Entry):
            return entry
        entry = source


class ReadAhead:
    """Has the files a writer streams entries from read the next run's components in bulk.

    A writer that streams many entries in runs calls ``ahead(entries)`` before reading a
    run's components: the entries at the bottom of their forwarding chains
    (:func:`stored_source`) that say which open file reads them in bulk (``prefetcher()``:
    a native file's variables, :meth:`~parallelvars.checkpoint.h5io.read.H5Reader.prefetch`)
    are read by that file now, a few large reads checked against their checksums, and the
    run's reads then take those bytes; any other entry reads as before. Each call replaces
    the previous run's bytes (the writer bounds a run); :meth:`close` drops the last."""

    def __init__(self) -> None:
        self._readers: dict[int, Any] = {}

    def __call__(self, entries: Iterable[Entry]) -> None:
        wanted: dict[int, dict[str, None]] = {}
        last: Entry | None = None
        for entry in entries:
            if entry is last:  # (a writer's tensors of one entry come together)
                continue
            last = entry
            base = stored_source(entry)
            get = getattr(base, "prefetcher", None)
            reader = get() if get is not None else None
            if reader is not None:
                self._readers[id(reader)] = reader
                wanted.setdefault(id(reader), {})[base.path] = None
        for key, reader in self._readers.items():
            reader.prefetch(list(wanted.get(key, ())))

    def close(self) -> None:
        for reader in self._readers.values():
            reader.prefetch(())
        self._readers = {}

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def layout_problem(
    kind: str, shape: Sequence[int], num_components: int, attrs: Mapping[str, Any]
) -> tuple[str, Any, Any] | None:
    """What is wrong with a variable's layout, as ``(what, expected, found)``, or None.

    The kind and aggregation are in their documented sets, the number of components fits the
    kind, dimensions are not negative, ``devices`` (when present) names one device per
    component, and a sharded variable's ``shard_offsets`` start at 0 and cover its shard axis
    exactly, so no reader ever leaves a row unwritten.
    """
    n = num_components
    if kind not in KINDS:
        return "unknown variable kind", f"one of {', '.join(KINDS)}", repr(kind)
    if not 1 <= n <= MAX_COMPONENTS or (kind == "single" and n != 1):
        expected = "1" if kind == "single" else f"1 to {MAX_COMPONENTS}"
        return "impossible number of components", expected, n
    if shape and min(shape) < 0:
        return "negative dimension", "dimensions >= 0", tuple(shape)
    aggregation = attrs.get("aggregation")
    if aggregation is not None and str(aggregation).lower() not in AGGREGATIONS:
        return "unknown aggregation", f"one of {', '.join(AGGREGATIONS)}", repr(aggregation)
    devices = attrs.get("devices")
    if devices is not None and (
        not isinstance(devices, (list, tuple))
        or len(devices) != n
        or not all(isinstance(d, str) for d in devices)
    ):
        return "devices do not match the components", f"{n} device names", repr(devices)
    if kind != "sharded":
        return None
    axis: Any = attrs.get("shard_axis")
    offsets: Any = attrs.get("shard_offsets")
    if not _is_int(axis) or not 0 <= int(axis) < len(shape):
        return "shard_axis out of range", f"an axis of shape {tuple(shape)}", repr(axis)
    if not isinstance(offsets, (list, tuple, np.ndarray)) or not all(_is_int(o) for o in offsets):
        return "shard_offsets is not a list of integers", f"{n} offsets", repr(offsets)
    offsets = [int(o) for o in offsets]
    if len(offsets) != n:
        return "shard_offsets do not match the components", f"{n} offsets", len(offsets)
    problem = _geometry.offsets_problem(offsets, int(shape[int(axis)]), n)
    if problem is not None:
        return (
            "shard_offsets do not cover the shard axis exactly",
            f"{problem} of axis {int(axis)}",
            offsets,
        )
    return None


def check_name_text(
    name: str,
    file: str | None = None,
    *,
    error: type[CheckpointError] = InvalidEntryError,
    variable: str | None = None,
) -> None:
    """Raise ``error`` naming ``file``, the variable (``variable``, default ``name``), expected
    and found when ``name`` is not valid Unicode text: every format stores names as UTF-8, and
    a lone surrogate has no UTF-8 form (the reference libraries refuse it)."""
    if name.isascii():
        return
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(
            "the name is not valid Unicode text",
            file=file,
            variable=name if variable is None else variable,
            expected="text without lone surrogates",
            found=f"{exc.object[exc.start : exc.end]!a} at position {exc.start}",
        ) from None


def check_entry(
    entry: Entry,
    file: str | None = None,
    *,
    error: type[CheckpointError] = InvalidEntryError,
    variable: str | None = None,
) -> None:
    """Raise ``error`` naming ``file``, the variable (``variable``, default the entry's path),
    expected and found when ``entry``'s name is not valid Unicode text (a lone surrogate, which
    no format can store) or its layout is not one of the documented ones (see
    :func:`layout_problem`).

    Writers and the formats' plans raise :class:`~parallelvars.errors.InvalidEntryError` (the
    entry handed to them is wrong); readers pass
    :class:`~parallelvars.errors.CorruptCheckpointError` (the file is).
    """
    if getattr(entry, "layout_checked", False):  # checked when its file was opened
        return
    check_name_text(entry.path, file=file, error=error, variable=variable)
    shape = tuple(map(int, entry.shape))
    problem = layout_problem(entry.kind, shape, int(entry.num_components), entry.attrs or {})
    if problem is not None:
        what, expected, found = problem
        name = entry.path if variable is None else variable
        raise error(what, file=file, variable=name, expected=expected, found=found)
