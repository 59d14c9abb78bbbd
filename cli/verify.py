"""``parallelvars verify``: check a checkpoint's structure and checksums."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

import numpy as np

from parallelvars.checkpoint.entry import check_entry
from parallelvars.checkpoint.h5io import HDF5_SIGNATURE, H5Reader
from parallelvars.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidEntryError,
    NotACheckpointError,
)
from parallelvars.formats import CheckpointView, Entry, detect_format

from ._common import add_format_option, format_bytes, natural_key, open_view
from ._output import Output, Progress

__all__ = ["add_parser", "run", "check_structure", "check_data"]

_EPILOG = """\
Native HDF5 checkpoints are checked by the checkpoint reader itself: the layout, the object
graph and every dataset's checksum. Other formats are checked by opening every variable and
reading every component, so that the format's own checks run (TensorFlow's CRC32C, the
safetensors header, Keras' layout), and by checking that each component has the dtype and
shape its metadata announces.

Exit code 0 when the checkpoint is sound; 1 when a problem is found, each problem named on
its own line; 2 when CKPT is missing or not a checkpoint at all.

examples:
  parallelvars verify run.h5
  parallelvars verify ckpt-3 --from tf --json"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "verify",
        help="check a checkpoint's structure and checksums",
        description="Check a checkpoint's structure and checksums, reading every component.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="checkpoint file, directory or prefix")
    add_format_option(parser, "--from", "format of CKPT")
    return parser


def _describe(entry_path: str, where: str, exc: BaseException) -> str:
    # Our errors already name the file and the variable; others get the variable prepended.
    if isinstance(exc, CheckpointError) and exc.variable is not None:
        return str(exc) if not where else f"{exc} [{where}]"
    what = str(exc) or type(exc).__name__
    if not isinstance(exc, CheckpointError):
        what = f"{type(exc).__name__}: {what}"
    return f"variable {entry_path!r}{' ' + where if where else ''}: {what}"


def check_structure(entry: Entry) -> list[str]:
    """Problems with an entry's metadata: the core's entry checks (kind, component count,
    aggregation, devices, shard layout), in their one wording."""
    try:
        check_entry(entry)
    except InvalidEntryError as exc:
        return [str(exc)]
    return []


def check_data(entry: Entry, progress: Progress | None = None) -> list[str]:
    """Read every component; problems with reading it, or with its dtype and shape."""
    problems = []
    for i in range(entry.num_components):
        where = f"component {i}"
        try:
            expected_shape = tuple(int(s) for s in entry.component_shape(i))
            value = entry.component(i)
        except Exception as exc:  # a reader's own check failed: that is what we report
            problems.append(_describe(entry.path, where, exc))
            continue
        finally:
            if progress is not None:
                progress.advance(entry.component_nbytes(i))
        found = tuple(int(s) for s in np.shape(value))
        if found != expected_shape:
            problems.append(
                f"variable {entry.path!r} {where}: shape mismatch "
                f"(expected {expected_shape}, found {found})"
            )
        dtype = getattr(value, "dtype", None)
        if dtype != entry.dtype:
            problems.append(
                f"variable {entry.path!r} {where}: dtype mismatch "
                f"(expected {entry.dtype}, found {dtype})"
            )
    return problems


def _verify_view(view: CheckpointView, out: Output) -> tuple[list[str], dict[str, int]]:
    problems: list[str] = []
    entries = []
    for key in sorted(view, key=natural_key):
        try:
            entries.append(view[key])
        except Exception as exc:
            problems.append(_describe(key, "", exc))
    stats = {
        "num_variables": len(entries),
        "num_components": sum(int(e.num_components) for e in entries),
        "bytes": sum(int(e.nbytes) for e in entries),
    }
    with out.progress(stats["bytes"], "verify") as bar:
        for entry in entries:
            structural = check_structure(entry)
            problems.extend(structural)
            if not structural:
                problems.extend(check_data(entry, bar))
    return problems, stats


def _verify_native(path: str) -> tuple[list[str], dict[str, int]]:
    """Problems found by the native reader's own ``verify_all`` (index fields at open, then
    every checksum and every group and dataset read through HDF5)."""
    with H5Reader(path, keep_entries=False) as reader:  # (each variable is checked once)
        problems = [str(p) for p in reader.verify_all()]
        table = reader.table
        if table is not None and all(map(str.isascii, table.names)):
            # The counts from the index's table's columns: a summary (its attributes) made
            # only for a variable whose bytes are not its row's (sharded: the logical value;
            # strings), as :meth:`H5Reader.summary` gives them.
            counts = list(table.counts)
            sizes = list(table.row_nbytes)
            for row, (kind, dtype) in enumerate(zip(table.kinds, table.dtypes, strict=True)):
                if kind == "sharded" or dtype.kind == "O":
                    known = reader.summary(table.names[row])
                    sizes[row] = known[4] if known is not None else reader[table.names[row]].nbytes
            stats = {"num_variables": len(counts), "num_components": sum(counts)}
            return problems, {**stats, "bytes": sum(sizes)}
        summary = reader.summaries()  # (from the index's table: no entry made per variable)
        if summary is not None:
            counts = [s[3] for s in summary.values()]
            sizes = [s[4] for s in summary.values()]
        else:
            entries = [reader[k] for k in reader]
            counts = [int(e.num_components) for e in entries]
            sizes = [int(e.nbytes) for e in entries]
        stats = {"num_variables": len(counts), "num_components": sum(counts), "bytes": sum(sizes)}
    return problems, stats


_VARIABLE_RE = re.compile(r"variable '([^']*)'")
_FOUND_RE = re.compile(r"\(found [^()]*\)")


def collapse_repeats(problems: list[str]) -> list[str]:
    """One line per cause: problems that differ only in the variable they name (and what was
    found there) are one line, the first, with the others' names after it. A cause met by every
    component (a multi-process checkpoint copied without its ``.parts/`` folder) is one line,
    not one per component; distinct causes stay apart, in the order first found."""
    groups: dict[str, list[str]] = {}
    for p in problems:
        key = _FOUND_RE.sub("", _VARIABLE_RE.sub("", p, count=1), count=1)
        groups.setdefault(key, []).append(p)
    lines = []
    for same in groups.values():
        first = same[0]
        if len(same) > 1:
            names = [m.group(1) for m in map(_VARIABLE_RE.search, same[1:]) if m]
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            first += f" (the same for {len(same) - 1} more: {shown})" if names else ""
            if not names:
                first += f" (found {len(same)} times)"
        lines.append(first)
    return lines


def _format_of(path: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    try:
        return detect_format(path)
    except NotACheckpointError:
        # An HDF5 file no adapter recognises may be one of ours too damaged to open: let the
        # native reader say what is wrong with it.
        if os.path.isfile(path):
            with open(path, "rb") as f:
                if f.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                    return "hdf5"
        raise


def run(args: argparse.Namespace) -> int:
    out: Output = args.out
    path = args.checkpoint
    fmt = _format_of(path, args.from_format)
    result: tuple[list[str], dict[str, int]]
    try:
        if fmt == "hdf5":
            result = _verify_native(path)
        else:
            with open_view(path, fmt, args.read_options) as view:
                result = _verify_view(view, out)
    except (CorruptCheckpointError, NotACheckpointError) as exc:
        # A file whose format is known (from --from, its bytes or its suffix) but that does not
        # open as one is damaged: a finding (1) whatever the format, not a usage error (2).
        result = [str(exc)], {"num_variables": 0, "num_components": 0, "bytes": 0}
    problems, stats = result
    problems = collapse_repeats(problems)
    data = {"path": path, "format": fmt, "ok": not problems, "problems": problems, **stats}

    def human() -> str:
        if not problems:
            return (
                f"OK: {path} ({fmt}, {stats['num_variables']} variables, "
                f"{stats['num_components']} components, {format_bytes(stats['bytes'])} checked)"
            )
        lines = [f"problem: {p}" for p in problems]
        lines.append(
            f"FAILED: {path} ({fmt}): {len(problems)} problem{'s' if len(problems) != 1 else ''}"
        )
        return "\n".join(lines)

    out.emit(data, human)
    return 0 if not problems else 1
