"""The neutral, lazy view of a checkpoint that every format adapter reads into and writes from.

A :class:`CheckpointView` is a read-only ``Mapping`` from a tensor path (our slash-separated
object path, ``"model/dense/kernel"``) to an :class:`Entry`. Opening a view reads only
metadata; tensor bytes are read when :meth:`Entry.component` (or
:meth:`Entry.read_component_into`) is called, so converting a file never holds more than one
component in memory. Writers take any ``Mapping[str, Entry]`` (a view from another format, or
entries built in memory with :class:`ArrayEntry`) and stream it entry by entry.

Kinds (``Entry.kind``) and what the components are:

==============  ====================================================================
``single``      one component, the value
``mirrored``    N components that are meant to be equal; component 0 is the primary
``on_read``     N per-device components aggregated on read (``attrs["aggregation"]``:
                ``"sum"``, ``"mean"`` or ``"only_first_replica"``)
``independent`` N components, each its own value
``sharded``     N slices of one logical value along ``attrs["shard_axis"]``, starting at
                ``attrs["shard_offsets"][i]``
==============  ====================================================================

Common ``attrs`` keys: ``devices`` (list of device names), ``aggregation``,
``synchronization``, ``trainable``, ``shard_axis``, ``shard_offsets``, ``name`` (the
variable's own name), ``slot_of`` / ``slot_name`` (for an optimizer slot: the path of the
variable it serves and the slot's name). Adapters may add keys of their own; writers ignore
keys they do not know.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from parallelvars.errors import ComponentIndexError, InvalidEntryError
from parallelvars.variables import aggregate_parts

__all__ = ["KINDS", "Entry", "ArrayEntry", "CheckpointView", "DictView", "logical_value"]

KINDS = ("single", "mirrored", "on_read", "independent", "sharded")


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
        """Read component ``i`` into ``out`` (same shape and dtype); adapters may do it in place."""
        out[...] = self.component(i)

    def component_nbytes(self, i: int) -> int:
        return int(np.prod(self.component_shape(i), dtype=np.int64)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of all components together."""
        return sum(self.component_nbytes(i) for i in range(self.num_components))

    def value(self) -> np.ndarray:
        """The logical value: what a restore onto a single device gives (see :func:`logical_value`)."""
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
        if not components:
            raise InvalidEntryError("an entry needs at least one component", variable=path)
        self.path = path
        self._components = [np.asarray(c) for c in components]
        self.dtype = self._components[0].dtype
        self.kind = kind or ("single" if len(self._components) == 1 else "mirrored")
        if self.kind not in KINDS:
            raise InvalidEntryError(
                "unknown kind", variable=path, expected=f"one of {KINDS}", found=repr(self.kind)
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
        np.copyto(out, self._components[i])

    def component_array(self, i: int) -> np.ndarray:
        """Component ``i`` without a copy (do not mutate it)."""
        self._check_index(i)
        return self._components[i]


class CheckpointView(Mapping[str, Entry]):
    """A read-only mapping from tensor path to :class:`Entry`, with file-level metadata.

    Attributes:
        format: the format name (``"hdf5"``, ``"safetensors"``, ...).
        path: the file or directory the view reads.
        metadata: file-level metadata (strings, numbers), format dependent.
    """

    format: str = "memory"
    path: str = "<memory>"
    metadata: Mapping[str, Any] = {}

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
    """Whether ``entry``'s logical value is computed from its parts: an on-read SUM or MEAN
    variable of several components. Flat formats store that aggregate under the plain key
    (what a plain consumer and TensorFlow read) and every part under ``parallel_component_<i>``."""
    if entry.kind != "on_read" or entry.num_components < 2:
        return False
    return str(entry.attrs.get("aggregation", "sum")).lower() != "only_first_replica"


def logical_value(entry: Entry) -> np.ndarray:
    """The value a restore onto one device gives, following DESIGN.md's rules.

    single / mirrored: the primary; on_read: the aggregate (sum in device order, mean, or the
    first component); sharded: the shards stitched together; independent: only when there is a
    single component (otherwise there is no one logical value, and ``ValueError`` is raised).
    """
    kind = entry.kind
    if kind in ("single", "mirrored") or (entry.num_components == 1 and kind != "sharded"):
        return entry.component(0)
    if kind == "on_read":
        n = entry.num_components
        return aggregate_parts(
            entry.component(0),
            (entry.component(i) for i in range(1, n)),
            n,
            str(entry.attrs.get("aggregation", "sum")),
        )
    if kind == "sharded":
        out = np.empty(entry.shape, entry.dtype)
        axis = int(entry.attrs["shard_axis"])
        for i, start in enumerate(entry.attrs["shard_offsets"]):
            index: list[Any] = [slice(None)] * out.ndim
            size = entry.component_shape(i)[axis]
            index[axis] = slice(int(start), int(start) + size)
            entry.read_component_into(i, out[tuple(index)])
        return out
    raise InvalidEntryError(
        f"variable {entry.path!r}: {entry.num_components} independent components have no single "
        "logical value; read each component instead"
    )
