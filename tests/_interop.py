"""The rule of the real-client tests (tests/test_export_interop.py, test_keras_interop.py,
test_examples.py): a library that is not installed skips its tests, except in CI's interop step
(`.ci/run`), which sets ``PARALLELVARS_INTEROP_REQUIRED=1`` so that a broken install fails
instead of passing with everything skipped."""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest

__all__ = ["REQUIRED", "need"]

#: Set by CI's interop step: every library these tests use must be there.
REQUIRED = os.environ.get("PARALLELVARS_INTEROP_REQUIRED") == "1"


def need(module: str) -> Any:
    """``module``, or a skip when it is not installed; an ImportError under ``REQUIRED``."""
    if REQUIRED:
        return importlib.import_module(module)
    return pytest.importorskip(module)
