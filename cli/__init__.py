"""The ``parallelvars`` command line.

``main`` only wires subcommands together: each lives in its own module with
``add_parser(subparsers)`` and ``run(args) -> int``. Errors are mapped to one line and an exit
code by :mod:`parallelvars.cli._errors`; results go through :class:`parallelvars.cli._output.Output`.

Example:
    >>> from parallelvars.cli import main
    >>> main(["inspect", "run.h5", "--json"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from parallelvars import __version__

from ._errors import EXIT_USAGE, classify, debug_from_env
from ._output import Output, one_line

__all__ = ["COMMANDS", "build_parser", "main"]

#: Subcommand modules, in the order ``--help`` lists them. A new subcommand is a module with
#: ``add_parser(subparsers)`` and ``run(args) -> int`` plus one name here.
COMMANDS: tuple[str, ...] = ("inspect", "convert", "reshard", "diff", "verify", "extract", "demo")

_DESCRIPTION = """\
Inspect, convert, reshard, compare, verify and extract checkpoints of parallel variables, and
run an end-to-end demonstration (parallelvars demo).

Formats: hdf5 (the native layout), safetensors, npz, keras, keras-legacy, tf. The format of an
input is detected from its first bytes (or its suffix); --from / --to override it."""

_EPILOG = """\
examples:
  parallelvars demo --dir /tmp/demo
  parallelvars inspect run.h5
  parallelvars convert run.h5 model.safetensors --components logical --max-shard-size 5GB
  parallelvars reshard run.h5 run-2dev.h5 --devices 2
  parallelvars diff run.h5 model.safetensors --atol 1e-6
  parallelvars verify run.h5 --json
  parallelvars extract run.h5 model/dense/kernel -o kernel.npy

exit codes:
  0  success (no difference, no problem)
  1  diff found a difference, or verify found a problem
  2  bad usage, or an input that cannot be read (missing, truncated, not a checkpoint)
  3  internal error (a bug; rerun with --debug and report the traceback)

Set PARALLELVARS_DEBUG=1 (or pass --debug) to see tracebacks."""


class _ParserExit(Exception):
    """Raised instead of ``sys.exit`` so that ``main`` returns its code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and no ``sys.exit`` behind ``main``'s back."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {one_line(message)} (see '{self.prog} --help')\n")
        raise _ParserExit(EXIT_USAGE)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise _ParserExit(status)


def _add_common_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """--json/--quiet/--debug, accepted both before and after the subcommand.

    The copy on each subcommand uses SUPPRESS defaults, so that an option given before the
    subcommand is not reset by the subparser's own default.
    """
    default: object = argparse.SUPPRESS if suppress else False
    group = parser.add_argument_group("output options")
    group.add_argument(
        "--json", action="store_true", default=default, help="print the result as one JSON document"
    )
    group.add_argument(
        "-q", "--quiet", action="store_true", default=default, help="no progress bars and no notes"
    )
    group.add_argument(
        "--debug",
        action="store_true",
        default=default,
        help="show the traceback of an error (also PARALLELVARS_DEBUG=1)",
    )
    parser.add_argument(
        "--follow-state-outside",
        action="store_true",
        default=default,
        help="follow a TensorFlow 'checkpoint' state file that names a checkpoint outside its directory",
    )


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with every subcommand."""
    parser = _Parser(
        prog="parallelvars",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common_options(parser, suppress=False)
    parser.add_argument("--version", action="version", version=f"parallelvars {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_Parser
    )
    for name in COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        sub = module.add_parser(subparsers)
        _add_common_options(sub, suppress=True)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``parallelvars`` command; returns the exit code.

    Args:
        argv: the arguments after the program name; ``sys.argv[1:]`` when None.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    if "--version" in args_list and not any(a in COMMANDS for a in args_list):
        # What argparse's version action prints, without importing every subcommand first.
        print(f"parallelvars {__version__}")
        return 0
    debug = debug_from_env() or "--debug" in args_list
    out = Output()
    try:
        args = build_parser().parse_args(args_list)
        out = Output(json_mode=args.json, quiet=args.quiet)
        args.out = out
        debug = debug or args.debug
        from ._common import read_options  # here, so that --version loads no format code

        args.read_options = read_options(args)
        return int(args._run(args))
    except _ParserExit as exc:
        return exc.code
    except (Exception, KeyboardInterrupt) as exc:
        code, message = classify(exc)
        if debug:
            traceback.print_exc(file=sys.stderr)
        out.error(message)
        return code
    finally:
        sys.stdout.flush()
