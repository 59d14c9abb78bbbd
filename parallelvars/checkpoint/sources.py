"""What ``Checkpoint.restore`` reads: a :class:`Source`, our HDF5 layout or a plugged-in format.

A native checkpoint is read by :class:`~parallelvars.checkpoint.h5io.H5Reader`. Every other
format (a TensorFlow checkpoint, safetensors, npz, a Keras file) is read through a
:class:`SourcePlugin`: an object that tells the formats it reads (:meth:`SourcePlugin.detect`)
and opens them as a :class:`Source` (:meth:`SourcePlugin.open`). The core never imports a
format; plug-ins reach it in two ways:

* the entry point group ``parallelvars.sources`` (``[project.entry-points."parallelvars.sources"]``
  in a distribution's ``pyproject.toml``): each entry names a plug-in object, loaded the first
  time a restore meets a file that is not ours. parallelvars itself declares
  ``formats = "parallelvars.formats._source:SOURCES"``, so a restore of a safetensors file works
  without ``import parallelvars.formats``;
* :func:`register_source_plugin`, which ``parallelvars.formats`` calls when it is imported (so
  a source checkout used without installing works once the formats are imported).

All or nothing holds for every source: :meth:`Source.stage` and each entry's ``verify`` check
every component before the first value is written (see :mod:`parallelvars.checkpoint.matching`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from importlib import metadata
from typing import Any, Protocol

import numpy as np

from parallelvars.checkpoint._foreign import PLUGIN_MISSING, foreign_kind
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.checkpoint.h5io import read as _h5read
from parallelvars.errors import NotACheckpointError

__all__ = [
    "ENTRY_POINT_GROUP",
    "Source",
    "SourceEntry",
    "SourcePlugin",
    "open_source",
    "register_source_plugin",
    "source_plugins",
]

#: The entry point group of source plug-ins.
ENTRY_POINT_GROUP = "parallelvars.sources"


class SourceEntry(Protocol):
    """One saved variable of a :class:`Source` (an :class:`~parallelvars.checkpoint.entry.Entry`
    a restore can verify before it writes anything)."""

    path: str
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...]
    num_components: int
    attrs: dict[str, Any]

    def component_shape(self, i: int) -> tuple[int, ...]: ...

    def component_nbytes(self, i: int) -> int: ...

    def component(self, i: int) -> np.ndarray: ...

    def verify(self, i: int) -> None:
        """Check component ``i`` (its checksum, or read it and keep it), raising what is wrong."""

    def read_component_into(self, i: int, out: np.ndarray, *, cast: bool = False) -> None: ...


class Source(Protocol):
    """A checkpoint as a restore reads it: a ``Mapping[str, SourceEntry]`` from saved path to
    entry, with the object graph the file carries.

    Attributes:
        path: the file (or directory) opened.
        object_graph: the saved object graph document (see
            :mod:`parallelvars.checkpoint.graph`), or None when the file carries none: the
            restore then builds one from the paths.

    Optional members, looked up with ``getattr``:

    * ``for_root(root) -> Source``: this source seen through the live objects of ``root``
      (a TensorFlow name-based checkpoint maps its variable names onto live paths);
    * ``over(source) -> Source``: the same view over ``source``, the file opened again (a
      restore with pending notes closes its file and opens it again when an object appears);
    * ``unrestorable() -> dict[str, str]``: saved paths no live object can take, with the
      reason (reported by the load status);
    * ``table``: the native reader's index table (the bulk path of the restore).
    """

    path: str
    object_graph: Any

    def __getitem__(self, path: str) -> SourceEntry: ...

    def __iter__(self) -> Iterator[str]: ...

    def __len__(self) -> int: ...

    def __contains__(self, path: object) -> bool: ...

    def stage(self, entries: Iterable[Any]) -> set[tuple[str, int]]:
        """Read ahead what the restore of ``entries`` needs; returns the ``(path, component)``
        pairs verified while doing so (a source that reads each component when it is verified
        returns an empty set)."""

    def unstage(self) -> None:
        """Drop what :meth:`stage` read ahead."""

    def close(self) -> None: ...


class SourcePlugin(Protocol):
    """Opens files of formats other than ours as :class:`Source` objects."""

    def detect(self, path: str) -> str | None:
        """The name of the format of ``path`` when this plug-in reads it (never our own
        layout), else None."""

    def open(self, path: str, format: str) -> Source:
        """Open ``path``, of the format :meth:`detect` named, for a restore."""


_lock = threading.Lock()
_plugins: list[SourcePlugin] = []
_loaded = False
_load_errors: list[str] = []


def register_source_plugin(plugin: SourcePlugin) -> None:
    """Let restores read what ``plugin`` reads (once; registering it again changes nothing)."""
    with _lock:
        if not any(p is plugin for p in _plugins):
            _plugins.append(plugin)


def source_plugins() -> tuple[SourcePlugin, ...]:
    """The registered plug-ins, after loading those of the ``parallelvars.sources`` entry
    points (the first call only)."""
    global _loaded
    with _lock:
        if _loaded:
            return tuple(_plugins)
    found: list[Any] = []
    errors: list[str] = []
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            found.append(entry.load())
        except Exception as exc:  # a broken plug-in must not break restores of the others
            errors.append(f"{entry.name} = {entry.value}: {type(exc).__name__}: {exc}")
    for plugin in found:
        register_source_plugin(plugin)
    with _lock:
        _loaded = True
        _load_errors[:] = errors
        return tuple(_plugins)


def _open_plugged(path: str, kind: str | None) -> Source | None:
    """``path`` opened by the first plug-in that reads it, else None.

    Raises:
        NotACheckpointError: ``path`` looks like another format (``kind``) and no plug-in is
            registered at all.
    """
    plugins = source_plugins()
    if not plugins and kind is not None and kind != "hdf5":
        broken = f" (loading failed: {'; '.join(_load_errors)})" if _load_errors else ""
        raise NotACheckpointError(
            f"{PLUGIN_MISSING}{broken}",
            file=path,
            expected=f"a plug-in in the entry point group {ENTRY_POINT_GROUP!r}",
            found=f"{kind}, which the core does not read by itself",
            hint="install parallelvars with pip (it declares the plug-in of parallelvars.formats), "
            "or import parallelvars.formats before the restore",
        )
    for plugin in plugins:
        name = plugin.detect(path)
        if name is not None:
            return plugin.open(path, name)
    return None


def open_source(path: str) -> Source:
    """Open ``path`` for a restore: an :class:`H5Reader`, or a plug-in's source for a file of
    another format. What is neither raises the native reader's error (which
    ``Checkpoint.restore`` completes with a hint where one helps)."""
    kind = foreign_kind(path)  # a coarse look at the name and first bytes: no plug-in loaded
    if kind is not None and kind != "hdf5":
        source = _open_plugged(path, kind)
        if source is not None:
            return source
    try:
        return H5Reader(path, read_ahead=_h5read.RESTORE_READ_AHEAD)
    except NotACheckpointError:
        source = (
            _open_plugged(path, kind) if kind == "hdf5" else None
        )  # a Keras file, plainly named
        if source is None:
            raise
    return source
