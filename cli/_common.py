"""Pieces the subcommands share: argument types, format options, sizes, progress over entries."""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from parallelvars._fileio import make_folder
from parallelvars.checkpoint.entry import MAX_COMPONENTS, CountingEntry
from parallelvars.errors import InvalidArgumentError
from parallelvars.formats import (
    FORMAT_NAMES,
    CheckpointView,
    Entry,
    detect_format,
    format_for_path,
    get_format,
    open_checkpoint,
)
from parallelvars.formats._sizes import parse_size

from ._errors import UsageError
from ._output import Output, Progress

__all__ = [
    "add_destination_options",
    "add_format_option",
    "metadata_text",
    "natural_key",
    "destination_path",
    "note_made",
    "format_bytes",
    "open_view",
    "read_options",
    "reader_options",
    "output_format",
    "size_arg",
    "positive_int",
    "device_count",
    "non_negative_int",
    "non_negative_float",
    "progress_entries",
    "shape_str",
]


def size_arg(text: str) -> int:
    """An argparse type: bytes in ``text`` by :func:`parallelvars.formats._sizes.parse_size`
    (``5GB``, ``500MB``, ``100KiB``, ``1.5GiB``, ``1e9``, ``4096``), the library's one grammar.

    Raises:
        argparse.ArgumentTypeError: the text is not a size, or not a positive one.
    """
    try:
        return parse_size(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number(
    cast: Callable[[str], Any], low: float, what: str, high: float | None = None
) -> Callable[[str], Any]:
    """An argparse type: ``cast(text)``, finite, at least ``low`` and (when given) at most
    ``high``, else an error naming ``what``."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not np.isfinite(value) or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what.replace(" ", "_")  # argparse names the type in its messages
    return parse


positive_int = _number(int, 1, "a positive integer")
device_count = _number(int, 1, f"a positive integer up to {MAX_COMPONENTS}", MAX_COMPONENTS)
non_negative_int = _number(int, 0, "an integer >= 0")
non_negative_float = _number(float, 0, "a finite number >= 0")


def add_format_option(
    parser: argparse.ArgumentParser, flag: str, what: str, default: str = "detected when not given"
) -> None:
    """``--from`` / ``--to``: one of the registered format names."""
    parser.add_argument(
        flag,
        dest=flag.lstrip("-").replace("-", "_") + "_format",
        metavar="FORMAT",
        choices=FORMAT_NAMES,
        type=str.lower,
        help=f"{what}: one of {', '.join(FORMAT_NAMES)}; {default}",
    )


def read_options(args: argparse.Namespace) -> dict[str, Any]:
    """The reader options the command line gives every command (``--follow-state-outside``),
    from one command's parsed arguments; ``main`` hands them to the command as
    ``args.read_options``."""
    return {"follow_state_outside": True} if getattr(args, "follow_state_outside", False) else {}


def reader_options(options: Mapping[str, Any], fmt: str) -> dict[str, Any]:
    """The reader ``options`` (see :func:`read_options`) that the reader of format ``fmt`` takes."""
    known = get_format(fmt).options
    return {k: v for k, v in options.items() if k in known}


def open_view(path: str, fmt: str | None, options: Mapping[str, Any]) -> CheckpointView:
    """Open ``path`` as a checkpoint view (format detected unless ``fmt``), with the command's
    reader ``options`` (``args.read_options``)."""
    name = fmt or detect_format(path)
    return open_checkpoint(path, format=name, **reader_options(options, name))


def output_format(path: str, explicit: str | None, fallback: str | None) -> str:
    """The format to write ``path`` in: ``explicit``, else by suffix, else ``fallback``."""
    name = explicit or format_for_path(path) or fallback
    if name is None:
        raise UsageError(f"{path}: cannot tell the output format from the name; pass --to FORMAT")
    return name


# The file a command writes into a folder destination, per format (Hugging Face's names for
# safetensors: model.safetensors, or model-00001-of-00002.safetensors + the index).
_FOLDER_FILES = {
    "safetensors": "model.safetensors",
    "hdf5": "model.h5",
    "keras": "model.weights.h5",
    "keras-legacy": "model.h5",
    "npz": "model.npz",
    "tf": "model",  # a prefix: model.index + model.data-00000-of-00001
}


def add_destination_options(parser: argparse.ArgumentParser) -> None:
    """``--parents``: accepted as before; a command always makes its destination's missing
    folders (:func:`destination_path`)."""
    parser.add_argument("--parents", action="store_true", help=argparse.SUPPRESS)


def is_folder_destination(path: str) -> bool:
    """A destination ending in a path separator, or an existing directory, is a folder."""
    return path.endswith(("/", os.sep)) or os.path.isdir(path)


def destination_path(
    path: str, fmt: str | None, *, made: list[str] | None = None
) -> tuple[str, str]:
    """Where a command writes, and in which format: the one rule for every output argument.

    * A destination ending in ``/`` or naming an existing directory is a folder: the output
      goes inside it under the format's usual name (``_FOLDER_FILES``); the format must then
      come from ``--to`` (or the command's fallback, passed as ``fmt``).
    * Otherwise it is a file (or a TF prefix) and its format is ``fmt`` or its suffix.
    * The folders the output goes into are made when missing, the library's rule
      (:func:`parallelvars._fileio.make_folder`); the ones made are appended to ``made``
      (deepest first), for the command to say so and for :func:`remove_made` to take back
      when the write fails or is interrupted.

    Returns ``(path to hand to the writer, format name)``.
    """
    if is_folder_destination(path):
        if fmt is None:
            raise UsageError(f"{path}: is a folder; pass --to FORMAT to say what to write in it")
        folder, target = path, os.path.join(path, _FOLDER_FILES.get(fmt, "model"))
    else:
        fmt = fmt or format_for_path(path)
        if fmt is None:
            raise UsageError(
                f"{path}: cannot tell the output format from the name; pass --to FORMAT"
            )
        folder, target = os.path.dirname(path) or os.curdir, path
    if not os.path.isdir(folder):
        if os.path.lexists(folder):
            raise UsageError(f"{folder}: is not a folder")
        missing = make_folder(folder, target)
        if made is not None:
            made.extend(missing)
    return target, fmt


def note_made(out: Output, made: list[str]) -> None:
    """Say which folders :func:`destination_path` made (the topmost: the rest lie inside)."""
    if made:
        out.note(f"made the folder {made[-1]}")


_DIGITS = re.compile(r"(\d+)")


def natural_key(path: str) -> tuple[tuple[tuple[int, int | str], ...], ...]:
    """Sort key putting paths in natural order: ``vars/2`` before ``vars/10``.

    The one ordering of every listing the commands print (inspect, diff, verify): path segment
    by segment, runs of digits compared as numbers, everything else as text.
    """
    return tuple(map(_segment_key, path.split("/")))


@functools.lru_cache(maxsize=1 << 16)
def _segment_key(segment: str) -> tuple[tuple[int, int | str], ...]:
    """One segment's part of :func:`natural_key` (segments repeat across the paths of a
    checkpoint, ``model``, ``layers``, ``kernel``: each is split once, in a bounded cache)."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in _DIGITS.split(segment) if part
    )


# Metadata keys whose value is a POSIX timestamp (seconds), shown as ISO 8601 UTC.
_TIMESTAMP_KEYS = frozenset({"created"})


def metadata_text(key: str, value: Any) -> str:
    """A metadata value as one line of human output (timestamps in ISO 8601, UTC)."""
    if (
        key in _TIMESTAMP_KEYS
        and isinstance(value, (int, float, str))
        and not isinstance(value, bool)
    ):
        try:
            stamp = datetime.datetime.fromtimestamp(float(value), tz=datetime.timezone.utc)
        except (ValueError, OverflowError, OSError):
            pass
        else:
            return stamp.isoformat(timespec="seconds")
    return str(value).replace("\n", " ")


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; exact bytes below 1 KiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def shape_str(shape: Any) -> str:
    """``(3, 2)`` -> ``"(3, 2)"``, ``()`` -> ``"()"``, ``(4,)`` -> ``"(4,)"``."""
    return str(tuple(int(s) for s in shape))


class _CountingEntries(Mapping[str, Entry]):
    def __init__(self, entries: Mapping[str, Entry], progress: Progress) -> None:
        self._entries = entries
        self._progress = progress

    def __getitem__(self, key: str) -> Entry:
        return CountingEntry(self._entries[key], self._progress.advance)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def progress_entries(
    out: Output, entries: Mapping[str, Entry], desc: str
) -> tuple[Mapping[str, Entry], Progress]:
    """``entries`` wrapped so that reading their components draws a progress bar.

    Returns the wrapped mapping and the bar (close it when done). When no bar is drawn the
    entries are returned unwrapped, so writers keep any fast path they have for their own
    entry types.
    """
    if not out.show_progress:
        return entries, Progress()
    total = sum(int(entry.nbytes) for entry in entries.values())
    bar = out.progress(total, desc)
    return _CountingEntries(entries, bar), bar
