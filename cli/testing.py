"""Test support for the command line: the pieces tests check without running ``main``.

As with ``numpy.testing``, this module is for tests, not for programs; its names follow the
internals they come from and may change with them (``tools/count_private_imports.py`` counts
the tests that import private modules instead).

What it offers: the error table (:func:`classify`, :class:`UsageError`, :data:`EXIT_USAGE`,
:data:`EXIT_INTERNAL`), the output sink (:class:`Output`, :func:`json_document`, :class:`Spool`; :mod:`cli_output`, whose ``SPOOL_MEMORY`` a test may lower), one row of ``inspect`` (:func:`inspect_row`), ``diff``'s results for a batch of variables read
in bulk (:func:`diff_settle`) and whether two described alike (:func:`diff_same_signature`), :mod:`cli_common` (shared helpers,
:func:`natural_key`, :func:`metadata_text`) and the demo's model (:class:`MLP`,
:func:`loss_and_grads`, :func:`make_blobs`).
"""

from __future__ import annotations

from parallelvars.cli import _common as cli_common
from parallelvars.cli import _output as cli_output
from parallelvars.cli._common import metadata_text, natural_key
from parallelvars.cli._errors import EXIT_INTERNAL, EXIT_USAGE, UsageError, classify
from parallelvars.cli._mlp import MLP, loss_and_grads, make_blobs
from parallelvars.cli._output import Output, Spool, json_document
from parallelvars.cli.diff import _same_signature as diff_same_signature
from parallelvars.cli.diff import _settle as diff_settle
from parallelvars.cli.inspect import _row as inspect_row

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_USAGE",
    "MLP",
    "Output",
    "Spool",
    "UsageError",
    "classify",
    "diff_same_signature",
    "diff_settle",
    "inspect_row",
    "json_document",
    "cli_common",
    "cli_output",
    "loss_and_grads",
    "make_blobs",
    "metadata_text",
    "natural_key",
]
