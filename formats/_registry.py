"""Format registry: names, detection by magic bytes (suffix as fallback), open and write.

Each adapter module defines ``FORMAT = FormatSpec(...)``; the modules are imported only when a
format is first needed, so ``import parallelvars.formats`` stays cheap.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from parallelvars._fileio import open_input
from parallelvars.checkpoint._foreign import TORCH_PICKLE_HINT, is_torch_pickle
from parallelvars.checkpoint._gcfreeze import older_objects_frozen
from parallelvars.errors import CheckpointNotFoundError, InvalidArgumentError, NotACheckpointError

from ._view import CheckpointView, Entry

__all__ = [
    "FormatSpec",
    "FORMAT_NAMES",
    "get_format",
    "detect_format",
    "format_for_suffix",
    "open_checkpoint",
    "write_checkpoint",
    "check_destination",
]


@dataclass(frozen=True)
class FormatSpec:
    """What the registry knows of one format.

    Attributes:
        name: the format name used by ``--from`` / ``--to``.
        description: one line for ``--help`` and the format table.
        suffixes: file suffixes used as a fallback when the magic bytes say nothing.
        sniff: ``sniff(path, head)`` -> True when the file (or directory) is of this format;
            ``head`` holds the first bytes of a file (empty for a directory).
        open: ``open(path, **options)`` -> a :class:`CheckpointView`.
        write: ``write(path, entries, **options)`` -> the path written; ``entries`` is any
            ``Mapping[str, Entry]``.
        outputs: ``outputs(path)`` -> the files a write at ``path`` replaces (default: the
            path itself); a TF prefix's index and data shards, a shard set's index.
    """

    name: str
    description: str
    suffixes: tuple[str, ...]
    sniff: Callable[[str, bytes], bool]
    open: Callable[..., CheckpointView]
    write: Callable[..., str]
    options: Mapping[str, str] = field(default_factory=dict)
    outputs: Callable[[str], list[str]] | None = None


# name -> module that defines FORMAT; imported lazily. Detection tries them in this order.
_ADAPTER_MODULES: dict[str, str] = {
    "hdf5": "parallelvars.formats.hdf5",
    "keras": "parallelvars.formats.keras",
    "keras-legacy": "parallelvars.formats.keras",
    "safetensors": "parallelvars.formats.safetensors",
    "npz": "parallelvars.formats.npz",
    "tf": "parallelvars.formats.tf",
}
FORMAT_NAMES: tuple[str, ...] = tuple(_ADAPTER_MODULES)
#: Formats whose files are only ever HDF5 files or zip archives: detection imports their
#: adapter (Keras: tens of milliseconds) only for a file that is one, so sniffing a
#: safetensors file, a TF checkpoint or a folder never loads it.
_HDF5_OR_ZIP = frozenset({"keras", "keras-legacy"})

_loaded: dict[str, FormatSpec] = {}


def get_format(name: str) -> FormatSpec:
    """The :class:`FormatSpec` registered under ``name``."""
    key = name.lower()
    if key not in _ADAPTER_MODULES:
        raise InvalidArgumentError(
            f"unknown format {name!r} (expected one of {', '.join(FORMAT_NAMES)})"
        )
    if key not in _loaded:
        module = importlib.import_module(_ADAPTER_MODULES[key])
        specs = getattr(module, "FORMATS", None) or (module.FORMAT,)
        for spec in specs:
            _loaded[spec.name] = spec
    return _loaded[key]


def _head(path: str, n: int = 512) -> bytes:
    if os.path.isdir(path):
        return b""
    fd = open_input(path)  # a FIFO, device or socket is refused, never opened blocking
    try:
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)


def format_for_suffix(path: str | os.PathLike[str]) -> str | None:
    """The format a file name implies, or None. The longest matching suffix wins, so
    ``model.weights.h5`` is ``keras`` while ``run.h5`` is ``hdf5``."""
    lower = os.fspath(path).lower()
    best: tuple[int, str] | None = None
    for name in FORMAT_NAMES:
        try:
            spec = get_format(name)
        except ImportError:
            continue
        for suffix in spec.suffixes:
            if lower.endswith(suffix) and (best is None or len(suffix) > best[0]):
                best = (len(suffix), name)
    return best[1] if best else None


def _hdf5_or_zip(path: str, head: bytes) -> bool:
    """Whether the file whose first bytes are ``head`` is a zip archive or an HDF5 file (a
    folder is neither)."""
    if not head:
        return False
    from ._h5 import is_hdf5

    return head.startswith(b"PK") or is_hdf5(path, head)


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format of ``path``: by magic bytes or layout first, by suffix as a fallback."""
    p = os.fspath(path)
    exists = os.path.exists(p)
    head = _head(p) if exists else b""
    candidates = list(FORMAT_NAMES)
    for name in candidates:
        if name in _HDF5_OR_ZIP and not _hdf5_or_zip(p, head):
            continue  # (what its sniff would say, without importing it)
        try:
            spec = get_format(name)
        except ImportError:
            continue
        if spec.sniff(p, head):
            return name
    if not exists:  # a suffix says nothing about a file that is not there
        raise CheckpointNotFoundError("no such file or directory", file=p)
    by_suffix = format_for_suffix(p)
    if by_suffix is not None:
        return by_suffix
    raise NotACheckpointError(
        "not a checkpoint of any known format",
        file=p,
        expected=f"one of {', '.join(FORMAT_NAMES)}",
        found="a directory with no checkpoint files in it"
        if os.path.isdir(p)
        else f"first bytes {head[:8]!r}",
        hint=TORCH_PICKLE_HINT if head.startswith(b"PK") and is_torch_pickle(p) else None,
    )


def open_checkpoint(
    path: str | os.PathLike[str], format: str | None = None, **options: Any
) -> CheckpointView:
    """Open ``path`` as a lazy :class:`CheckpointView` (format detected unless given)."""
    p = os.fspath(path)
    name = format or detect_format(p)
    return get_format(name).open(p, **options)


def write_checkpoint(
    path: str | os.PathLike[str],
    entries: Mapping[str, Entry],
    format: str | None = None,
    **options: Any,
) -> str:
    """Write ``entries`` to ``path`` in ``format`` (by default, from the suffix).

    Every format takes ``components`` (``"all"`` or ``"logical"``), ``only``, ``exclude``,
    ``model_only`` and ``root`` (the selection of :func:`~parallelvars.formats.convert`); the rest of
    ``options`` are the format's own (:attr:`FormatSpec.options`). An option the format's
    writer does not take is an InvalidArgumentError.
    """
    p = os.fspath(path)
    if format is None:
        format = format_for_suffix(p)
        if format is None:
            raise InvalidArgumentError(
                f"{p}: cannot tell the output format from the name; pass format="
            )
    spec = get_format(format)
    check_destination(entries, p, spec)
    export = {k: options.pop(k) for k in _EXPORT_OPTIONS if k in options}
    _check_options(spec, p, options)
    if export:
        from ._select import exported

        entries = exported(entries, target=spec.name, **export)
    # (What exists now, the source's view and entries, stays alive until the write ends: the
    # collector need not walk it again and again while the writer makes its plan.)
    with older_objects_frozen():
        return spec.write(p, entries, **options)


# Options of every format's write: what goes out (see formats._convert.exported).
_EXPORT_OPTIONS = ("components", "only", "exclude", "model_only", "root", "on_left_out")


def _check_options(spec: FormatSpec, path: str, options: Mapping[str, Any]) -> None:
    """Refuse an option ``spec``'s writer does not take, naming the ones it does."""
    try:
        params = inspect.signature(spec.write).parameters
    except (TypeError, ValueError):  # pragma: no cover - our writers are plain functions
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    takes = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise InvalidArgumentError(
            f"{path}: format {spec.name!r} takes no option {', '.join(map(repr, unknown))}; "
            f"it takes {', '.join(map(repr, [*_EXPORT_OPTIONS[:5], *takes]))}"
        )


def _same(a: str, b: str) -> bool:
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_destination(entries: Mapping[str, Entry], path: str, spec: FormatSpec) -> None:
    """Refuse a write at ``path`` that would replace a file the source of ``entries`` reads
    (any of a view's :attr:`~CheckpointView.files`: a shard of the set being converted, its
    index, a TF checkpoint's data shard)."""
    sources = tuple(getattr(entries, "files", ()))
    if not sources:
        return
    outputs = spec.outputs(path) if spec.outputs is not None else [path]
    for out in outputs:
        for src in sources:
            if _same(out, src):
                raise InvalidArgumentError(
                    f"{path}: writing it would replace {out}, a file of the source checkpoint "
                    f"{getattr(entries, 'path', src)}; write somewhere else"
                )
