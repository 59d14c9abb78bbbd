"""``parallelvars reshard``: rewrite a checkpoint for another number of devices."""

from __future__ import annotations

import argparse
from typing import Any

from parallelvars import formats
from parallelvars._fileio import remove_made
from parallelvars.checkpoint._gcfreeze import freeze_made_so_far, older_objects_frozen
from parallelvars.checkpoint.entry import MAX_COMPONENTS

from ._common import (
    add_destination_options,
    add_format_option,
    destination_path,
    device_count,
    note_made,
    open_view,
    output_format,
    progress_entries,
)
from ._errors import UsageError
from ._output import Output
from .convert import same_file

__all__ = ["add_parser", "run"]

_EPILOG = """\
What each kind becomes on M devices: mirrored -> the primary on all M; on_read SUM -> the
total in component 0 and zeros elsewhere (the sum is preserved exactly); on_read MEAN -> the
mean on all M; on_read ONLY_FIRST_REPLICA -> the primary on all M; sharded -> the full value
re-split into M shards (numpy.array_split sizes); single -> unchanged. Independent buffers
and on-read variables with aggregation none have no single value and cannot be redistributed:
they need M equal to the devices they were saved with, or the command stops with an error
naming the variable.

examples:
  parallelvars reshard run.h5 run-8dev.h5 --devices 8
  parallelvars reshard run.h5 run-1dev.h5 --devices 1 --json"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "reshard",
        help="rewrite a checkpoint for another number of devices",
        description="Redistribute every variable of a checkpoint onto M devices.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", metavar="SRC", help="checkpoint to read")
    parser.add_argument("destination", metavar="DST", help="file (or prefix) to write")
    parser.add_argument(
        "--devices",
        metavar="M",
        type=device_count,
        required=True,
        help=f"number of devices (1 to {MAX_COMPONENTS})",
    )
    add_format_option(parser, "--from", "format of SRC")
    add_format_option(parser, "--to", "format of DST", "by default from DST's suffix, else SRC's")
    add_destination_options(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    out: Output = args.out
    if same_file(args.source, args.destination):
        raise UsageError(f"{args.destination}: is the same file as SRC; write somewhere else")
    # (What the command keeps until the file is written, the source's index, the entries and
    # the writer's plan, is frozen out of the collector's walks as it is made: see _gcfreeze.)
    with (
        older_objects_frozen(),
        open_view(args.source, args.from_format, args.read_options) as view,
    ):
        freeze_made_so_far()
        entries = formats.reshard(view, args.devices)
        freeze_made_so_far()
        # (each source variable's count, noted as the rewrite checked it)
        before = entries.source_counts
        made: list[str] = []
        destination, fmt = destination_path(
            args.destination,
            args.to_format or output_format(args.destination, None, view.format),
            made=made,
        )
        wrapped, bar = progress_entries(out, entries, "reshard")
        try:
            with bar:
                written = formats.write_checkpoint(destination, wrapped, format=fmt)
        except BaseException:  # an error or Ctrl-C: no folder it made stays behind
            remove_made(made)
            raise
        note_made(out, made)
        count = len(entries)
        src_format = view.format
        # A single variable stays on one device whatever M is: say how many moved.
        spread = entries.spread_count
    data = {
        "source": args.source,
        "source_format": src_format,
        "destination": written,
        "format": fmt,
        "devices": args.devices,
        "source_components": before,
        "num_variables": count,
        "num_on_devices": spread,
    }
    placed = (
        f"{args.devices} device{'s' if args.devices != 1 else ''}"
        if spread == count or args.devices == 1
        else f"{spread} of them on {args.devices} device{'s' if args.devices != 1 else ''}, "
        f"{count - spread} single, as saved"
    )
    out.emit(
        data,
        f"wrote {written} ({fmt}, {count} variable{'s' if count != 1 else ''}, {placed}) "
        f"from {args.source} ({src_format})",
    )
    return 0
