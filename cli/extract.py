"""``parallelvars extract``: one variable (or one component) to a ``.npy`` file."""

from __future__ import annotations

import argparse
import difflib
import os
from typing import Any

import numpy as np

from parallelvars._aggregate import has_logical_value, no_value_what
from parallelvars._dtypes import dtype_name
from parallelvars.errors import MissingVariableError

from ._common import add_format_option, format_bytes, non_negative_int, open_view, shape_str
from ._errors import UsageError
from ._output import Output

__all__ = ["add_parser", "run", "npy_ready"]

_EPILOG = """\
Without --component the variable's logical value is written: what a restore onto a single
device gives (the primary of a mirrored variable, the aggregate of an on-read variable, the
full tensor of a sharded one). Independent buffers have no single value: pick one with
--component. The file is written with numpy.save and never pickled, so np.load reads it
without allow_pickle.

dtypes that .npy cannot describe (bfloat16, the float8 family, int4...) are written as their
raw bits in an unsigned integer of the same width, with a note saying how to view them again,
e.g. np.load("w.npy").view(ml_dtypes.bfloat16). Strings are written as fixed-width bytes (S).

examples:
  parallelvars extract run.h5 model/dense/kernel -o kernel.npy
  parallelvars extract run.h5 model/dense/kernel -o kernel_dev1.npy --component 1"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "extract",
        help="write one variable to a .npy file",
        description="Write one variable (its logical value, or one component) to a .npy file.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="checkpoint file, directory or prefix")
    parser.add_argument("name", metavar="NAME", help="variable path, as inspect lists it")
    parser.add_argument(
        "-o", "--output", metavar="OUT", required=True, help="the .npy file to write"
    )
    parser.add_argument(
        "--component", metavar="I", type=non_negative_int,
        help="write component I (0 is the primary) instead of the logical value",
    )  # fmt: skip
    add_format_option(parser, "--from", "format of CKPT")
    return parser


def _round_trips(dtype: np.dtype) -> bool:
    """Whether the .npy header can describe ``dtype`` so that ``np.load`` gives it back."""
    try:
        descr = np.lib.format.dtype_to_descr(dtype)
        return bool(np.lib.format.descr_to_dtype(descr) == dtype)
    except (TypeError, ValueError):
        return False


def npy_ready(value: np.ndarray) -> tuple[np.ndarray, str | None]:
    """``value`` in a dtype that ``numpy.save`` writes without pickling, and a note if changed.

    Raises:
        UsageError: the value cannot be written faithfully (strings ending in NUL bytes).
    """
    dtype = value.dtype
    if dtype.kind == "O":
        items = value.ravel().tolist()
        if not all(isinstance(x, bytes) for x in items):
            raise UsageError(f"cannot write Python objects of dtype {dtype} without pickling")
        if any(x.endswith(b"\0") for x in items):
            raise UsageError("strings ending in NUL bytes cannot be stored as fixed-width bytes")
        width = max((len(x) for x in items), default=1) or 1
        fixed = np.array(items, dtype=f"S{width}").reshape(value.shape)
        return fixed, f"strings written as fixed-width bytes ({fixed.dtype.str})"
    if _round_trips(dtype):
        return value, None
    bits = np.dtype(f"<u{dtype.itemsize}")
    if dtype.itemsize not in (1, 2, 4, 8) or dtype.fields is not None:
        raise UsageError(f"dtype {dtype} has no .npy representation")
    note = (
        f"{dtype.name} has no .npy dtype: wrote its raw bits as {bits.name}; read it back with "
        f"np.load(path).view(ml_dtypes.{dtype.name})"
    )
    return np.ascontiguousarray(value).view(bits), note


def _save(path: str, value: np.ndarray) -> None:
    """``numpy.save`` to exactly ``path``, atomically: a reader never sees half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:  # a file object: numpy.save would otherwise append ".npy"
            np.save(f, value, allow_pickle=False)
        os.replace(tmp, path)
    except OSError as exc:  # name the file asked for, not the temporary one
        raise type(exc)(exc.errno, exc.strerror, path) from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def run(args: argparse.Namespace) -> int:
    out: Output = args.out
    with open_view(args.checkpoint, args.from_format, args.read_options) as view:
        if args.name not in view:
            close = difflib.get_close_matches(args.name, list(view), n=3)
            raise MissingVariableError(
                "no such variable",
                file=args.checkpoint,
                variable=args.name,
                hint=f"did you mean {', '.join(repr(c) for c in close)}?"
                if close
                else "list the variables with 'parallelvars inspect'",
            )
        entry = view[args.name]
        if args.component is not None and args.component >= entry.num_components:
            raise UsageError(
                f"{args.checkpoint}: variable {args.name!r}: no component {args.component} "
                f"(expected 0..{entry.num_components - 1})"
            )
        if args.component is None and not has_logical_value(entry):
            raise UsageError(
                f"{args.checkpoint}: variable {args.name!r} holds {no_value_what(entry)} "
                "and no single value; pick one with --component"
            )
        value = entry.value() if args.component is None else entry.component(args.component)
        kind = entry.kind
    stored, note = npy_ready(np.asarray(value))
    _save(args.output, stored)
    data = {
        "checkpoint": args.checkpoint,
        "variable": args.name,
        "kind": kind,
        "component": args.component,
        "output": args.output,
        "dtype": dtype_name(value.dtype),
        "stored_dtype": stored.dtype.str,
        "shape": [int(s) for s in stored.shape],
        "bytes": int(stored.nbytes),
        "note": note,
    }
    what = "logical value" if args.component is None else f"component {args.component}"
    if note:
        out.note(note)
    out.emit(
        data,
        f"wrote {args.output}: {args.name} ({what}, {dtype_name(value.dtype)} "
        f"{shape_str(stored.shape)}, {format_bytes(int(stored.nbytes))})",
    )
    return 0
