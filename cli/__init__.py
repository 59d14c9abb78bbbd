"""The ``parallelvars`` command line."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``parallelvars`` command; returns the exit code."""
    raise SystemExit("parallelvars: the command line is not built yet")
