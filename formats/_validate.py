"""An entry checked against the documented model before it is written and after it is decoded:
the core's one entry validation (:func:`parallelvars.checkpoint.entry.check_entry`)."""

from __future__ import annotations

from parallelvars.checkpoint.entry import check_entry

__all__ = ["check_entry"]
