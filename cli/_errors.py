"""Exit codes, and the one table that maps an exception to a one-line message and a code.

The command never shows a traceback unless ``--debug`` (or ``PARALLELVARS_DEBUG=1``) is given;
every error becomes one line on stderr, ``parallelvars: error: <message>``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from parallelvars.errors import InvalidArgumentError, MissingVariableError, ParallelVarsError

__all__ = [
    "EXIT_OK",
    "EXIT_DIFFERENT",
    "EXIT_USAGE",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "ERROR_TABLE",
    "UsageError",
    "classify",
    "debug_from_env",
]

EXIT_OK = 0
#: ``diff`` found a difference, or ``verify`` found a problem.
EXIT_DIFFERENT = 1
#: Bad command line, or an input the library refused (missing, truncated, not a checkpoint...).
EXIT_USAGE = 2
#: A bug: an exception nobody expected. Kept apart from 1 so that a script testing
#: ``diff``'s "different" never mistakes a crash for an answer.
EXIT_INTERNAL = 3
#: Ctrl-C, as shells report SIGINT.
EXIT_INTERRUPTED = 130


class UsageError(InvalidArgumentError):
    """An argument that parses but makes no sense (a component index out of range, ...).

    An :class:`~parallelvars.errors.InvalidArgumentError`, so a ``ParallelVarsError`` and a
    ``ValueError``: it is bad input, like the library's own input errors.
    """


def _describe_os_error(exc: BaseException) -> str:
    assert isinstance(exc, OSError)
    if exc.filename is not None and exc.strerror:
        where = os.fspath(exc.filename)
        what = exc.strerror[0].lower() + exc.strerror[1:]
        if exc.filename2 is not None:
            return f"{where} -> {os.fspath(exc.filename2)}: {what}"
        return f"{where}: {what}"
    return str(exc) or type(exc).__name__


def _describe_key_error(exc: BaseException) -> str:
    # KeyError's str() is the repr of its argument; ours (MissingVariableError) is plain.
    if isinstance(exc, MissingVariableError) or not exc.args:
        return str(exc)
    return f"no such key: {exc.args[0]!r}" if not isinstance(exc.args[0], str) else exc.args[0]


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


#: Exception type -> (exit code, how to word it). The first row whose type matches wins, so
#: specific types come before general ones. Anything not listed is a bug: EXIT_INTERNAL.
ERROR_TABLE: Sequence[tuple[type[BaseException], int, Callable[[BaseException], str]]] = (
    (KeyboardInterrupt, EXIT_INTERRUPTED, lambda e: "interrupted"),
    (UsageError, EXIT_USAGE, _describe),
    # Every error the library raises on purpose is about its input (a missing, truncated,
    # corrupt or foreign file; a variable that is not there; devices that do not fit).
    (MissingVariableError, EXIT_USAGE, _describe_key_error),
    (ParallelVarsError, EXIT_USAGE, _describe),
    # Files that are not there, not readable, or not writable.
    (OSError, EXIT_USAGE, _describe_os_error),
    # A ValueError from outside the library (numpy refusing a value handed on from the
    # command line) is still bad input; the library's own are ParallelVarsError above.
    (ValueError, EXIT_USAGE, _describe),
    # A format whose optional dependency is not installed.
    (ImportError, EXIT_USAGE, lambda e: f"a format needs a module that is not installed: {e}"),
)


def classify(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one-line message for ``exc``."""
    for exc_type, code, describe in ERROR_TABLE:
        if isinstance(exc, exc_type):
            return code, describe(exc)
    return EXIT_INTERNAL, (
        f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)"
    )


def debug_from_env(environ: os._Environ[str] | dict[str, str] | None = None) -> bool:
    """Whether ``PARALLELVARS_DEBUG`` asks for tracebacks (``1``, ``true``, ``yes``, ``on``)."""
    env = os.environ if environ is None else environ
    return env.get("PARALLELVARS_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}
