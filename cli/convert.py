"""``parallelvars convert``: rewrite a checkpoint in another format."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any

from parallelvars import formats
from parallelvars._fileio import remove_made
from parallelvars.formats._graph import shared_objects
from parallelvars.formats._select import describe_left_out
from parallelvars.formats.safetensors._hf import HF_FILES

from ._common import (
    add_destination_options,
    add_format_option,
    destination_path,
    format_bytes,
    note_made,
    open_view,
    reader_options,
    size_arg,
)
from ._errors import UsageError
from ._output import Output

__all__ = ["add_parser", "run", "same_file"]

_EPILOG = """\
--components all keeps every component of every variable (formats without a place for
components store them under suffixed names; an on-read SUM/MEAN variable's plain key holds its
aggregate, its parts are parallel_component_0..N-1); --components logical keeps one value per
variable, the logical value of every kind (what a restore onto one device gives: the primary
of a mirrored variable, the aggregate of an on-read variable, the full tensor of a sharded one),
which is what a non-parallel reader expects. --components primary is the older name of
logical, with the same meaning. A variable of independent buffers has no single value:
--components logical refuses it, as extract does.

--model-only leaves out the optimizer's state (its slots, step count and beta powers) and the
checkpoint's bookkeeping (save_counter, step), which a library that loads a model strictly
(torch load_state_dict(strict=True), Keras load_weights, transformers from_pretrained) refuses;
--only and --exclude select paths by glob pattern. A note says what was left out and why.

A Keras .keras archive holds the model's architecture besides its weights: writing one takes
the model's own archive as a template (--like TEMPLATE.keras), whose config.json and
metadata.json are kept and whose weights are replaced. Weights that do not fit the template
(other layers, shapes or dtypes) are refused. A legacy Keras file (--to keras-legacy) lists
its layers in the model's order, which Keras 3 weights do not record: --like MODEL.keras gives it.

A Hugging Face folder (DST a folder, or model.safetensors, with --to safetensors) gets the small
files transformers needs beside the weights (config.json, generation_config.json, the tokenizer
and processor files; nothing else, each a regular file of at most 64 MiB): from SRC's folder when
SRC is one, else from --like MODEL_FOLDER (the folder the trained model came from). A file of
that name already in DST's folder is kept.

Sizes take decimal (KB, MB, GB) or binary (KiB, MiB, GiB) units: 5GB = 5*10^9 bytes,
100KiB = 102400 bytes.

examples:
  parallelvars convert run.h5 model.safetensors
  parallelvars convert run.h5 model.safetensors --components logical --max-shard-size 5GB
  parallelvars convert run.h5 model.safetensors --components logical --model-only --names dotted
  parallelvars convert run.h5 enc.npz --only 'model/encoder' --exclude '*/bias'
  parallelvars convert ckpt-3 run.h5 --from tf
  parallelvars convert run.h5 tf1/model.ckpt --to tf --names tf1 --components logical
  parallelvars convert model.weights.h5 weights.npz --to npz
  parallelvars convert model.keras run.h5
  parallelvars convert run.h5 trained.keras --like model.keras
  parallelvars convert run.h5 exported/ --to safetensors --components logical --model-only \
      --names dotted --like gpt2-folder/
  parallelvars convert run.h5 shards/ --to safetensors --max-shard-size 5GB

DST's missing folders are made, as a library save makes them (a note names them); a write that
fails or is interrupted takes them back."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "convert",
        help="convert a checkpoint to another format",
        description="Convert a checkpoint from one format to another, one component at a time.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", metavar="SRC", help="checkpoint to read")
    parser.add_argument(
        "destination",
        metavar="DST",
        help="file (or prefix) to write; a folder (ending in /, or existing) gets model.<suffix> "
        "or Hugging Face's shard names inside",
    )
    add_format_option(parser, "--from", "format of SRC")
    add_format_option(parser, "--to", "format of DST", "by default from DST's suffix")
    add_destination_options(parser)
    parser.add_argument(
        "--components",
        choices=("all", "logical", "primary"),
        default="all",
        help="keep every component, or one logical value per variable (primary: the older "
        "name of logical) (default: all)",
    )
    parser.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        type=size_arg,
        help="split the output into files of at most SIZE (e.g. 5GB, 500MB, 100KiB, 1e9), "
        "for formats that shard (units: B, KB, MB, GB, TB decimal; KiB, MiB, GiB, TiB binary)",
    )
    parser.add_argument(
        "--like",
        metavar="TEMPLATE",
        help="for a .keras DST: the model's own .keras archive, whose config is kept and whose "
        "weights are replaced; for --to keras-legacy: the model's .keras archive, whose config "
        "gives the layers' order; for a Hugging Face folder DST (safetensors): the model's own "
        "folder, whose config.json, tokenizer and processor files are carried",
    )
    parser.add_argument(
        "--only",
        metavar="PATTERN",
        action="append",
        help="keep only the paths matching this glob pattern (repeatable; 'model' also keeps "
        "what lies under model/)",
    )
    parser.add_argument(
        "--exclude",
        metavar="PATTERN",
        action="append",
        help="leave out the paths matching this glob pattern (repeatable)",
    )
    parser.add_argument(
        "--model-only",
        action="store_true",
        help="leave out optimizer state (slots, step counts, beta powers) and the checkpoint's "
        "bookkeeping (save_counter, step): what torch, Keras and transformers load strictly",
    )
    parser.add_argument(
        "--root",
        metavar="PATH",
        help="export the subtree at PATH as the whole model: model/dense/kernel goes out as "
        "dense/kernel (dense.kernel with --names dotted, a torch state_dict's key)",
    )
    parser.add_argument(
        "--names",
        choices=(*formats.NAME_STYLES, "tf1"),
        help="key style for formats with flat keys (safetensors, npz): slash keeps our paths "
        "(model/dense/kernel), dotted is PyTorch's (model.dense.kernel), tf is TensorFlow's "
        "object keys; for --to tf: tf (object-based, tf.train.Checkpoint), slash (each "
        "variable under its path) or tf1 (tf.compat.v1.train.Saver's names: each variable "
        "under its name, Adam's slots as V/Adam, V/Adam_1, beta1_power; with --components "
        "logical); default: the format's own",
    )
    return parser


def same_file(a: str, b: str) -> bool:
    """Whether two paths name the same file (or, for a TF prefix, the same prefix)."""
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    try:
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


def _not_carried(dst_format: str, written: Mapping[str, Any]) -> list[str]:
    """What the destination format cannot carry of the source, one line each (empty: all);
    ``written`` is the view the writer took (it keeps the source's object graph)."""
    if dst_format != "tf":
        return []
    graph = getattr(written, "object_graph", None)
    shared = shared_objects(graph) if isinstance(graph, Mapping) else 0
    if not shared:
        return []
    return [
        f"{shared} link(s) of the object graph reach an object another path already reaches; "
        "a TensorFlow checkpoint names each object once, by its first path (a restore is "
        "unaffected)"
    ]


# Formats whose files read back as exactly the entries written to them (every kind, dtype
# and selection: tests/test_commands_bulk.py).
_ROUND_TRIP = frozenset({"hdf5", "safetensors", "npz", "tf"})


def _convert(
    args: argparse.Namespace,
    out: Output,
    destination: str,
    src_format: str,
    dst_format: str,
    left_out: dict[str, str],
    on_written: Callable[[Mapping[str, Any]], Any] | None = None,
) -> str:
    with out.progress(None, "convert") as bar:
        return formats.convert(
            args.source,
            destination,
            from_format=src_format,
            to_format=dst_format,
            components=args.components,
            names=args.names,
            max_shard_size=args.max_shard_size,
            progress=bar.set if out.show_progress else None,  # (no bar: nothing to count)
            read_options=reader_options(args.read_options, src_format),
            like=args.like,
            only=args.only,
            exclude=args.exclude,
            model_only=args.model_only,
            root=args.root,
            on_left_out=left_out.update,
            on_written=on_written,
        )


def run(args: argparse.Namespace) -> int:
    out: Output = args.out
    if same_file(args.source, args.destination):
        raise UsageError(f"{args.destination}: is the same file as SRC; write somewhere else")
    src_format = args.from_format or formats.detect_format(args.source)
    made: list[str] = []
    destination, dst_format = destination_path(args.destination, args.to_format, made=made)
    left_out: dict[str, str] = {}
    folder = os.path.dirname(os.path.abspath(destination))
    there = {n for n in HF_FILES if os.path.lexists(os.path.join(folder, n))}
    taken: list[Mapping[str, Any]] = []  # the view the writer took (its entries, the graph)
    try:
        if same_file(args.source, destination):
            raise UsageError(f"{destination}: is the same file as SRC; write somewhere else")
        written = _convert(args, out, destination, src_format, dst_format, left_out, taken.append)
    except BaseException:  # an error or Ctrl-C: no folder it made stays behind
        remove_made(made)
        raise
    written_entries: Mapping[str, Any] = taken[0] if taken else {}
    note_made(out, made)
    carried = [n for n in HF_FILES if n not in there and os.path.lexists(os.path.join(folder, n))]
    if carried:
        out.note(f"carried the Hugging Face model's {', '.join(carried)} into {folder}")
    notes = describe_left_out(left_out)
    notes += _not_carried(dst_format, written_entries)
    for note in notes:
        out.note(note)
    if dst_format in _ROUND_TRIP:
        # The output holds exactly the entries written (each of these formats records every
        # entry's kind, shape and components): counted from them, not by opening it again.
        count = len(written_entries)
        # (a conversion's view notes each entry's bytes as the writer asks for it: the entries
        # are not made again to be counted)
        sizes = getattr(written_entries, "entry_nbytes", None)
        if sizes is not None:
            total = sum(sizes(k) for k in written_entries)
        else:
            total = sum(int(e.nbytes) for e in written_entries.values())
    else:
        with open_view(written, dst_format, args.read_options) as view:
            count = len(view)
            total = sum(int(view[k].nbytes) for k in view)
            dst_format = view.format
    data = {
        "source": args.source,
        "source_format": src_format,
        "destination": written,
        "format": dst_format,
        "components": args.components,
        "max_shard_size": args.max_shard_size,
        "num_variables": count,
        "bytes": total,
        "notes": notes,
        "left_out": sorted(left_out),
        "carried": carried,
    }
    out.emit(
        data,
        f"wrote {written} ({dst_format}, {count} variable{'s' if count != 1 else ''}, "
        f"{format_bytes(total)}) from {args.source} ({src_format})",
    )
    return 0
