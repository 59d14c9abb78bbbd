"""Test support for the core: what a test needs to craft hostile files and check internals.

As with ``numpy.testing``, this module is for tests, not for programs: it is imported by no
part of the library, and its names follow the internals they come from, so they may change
with them. It exists so that tests reach the private pieces through one documented seam
rather than each test importing private modules; a test that can check a behaviour through
the public API should (``tools/count_private_imports.py`` counts the tests that do not).

What it offers:

* **Crafting checkpoint files**: :func:`write_json` (a JSON attribute the way the native
  writer stores it), :func:`columns_parts` / :func:`columns_table` (the columns document and
  its table), :func:`index_template` / :data:`crc_mark` (the index text with a mark for each
  record's checksums), :func:`index_of` (the index a save records of its records),
  :func:`held_value` (a value held in the global heap),
  :class:`PlanCache` (a checkpoint's cache of the generated metadata of its last structure),
  :func:`lookup3` (HDF5's metadata checksum), :mod:`h5policy` (the HDF5 file policy),
  :mod:`manager_state` (the manager's state file).
* **Restore internals**: :mod:`restore_rules` (``DIRECT_MIN_COMPONENTS`` and the rules),
  :class:`Piece` and :func:`verify_pieces`; :mod:`gcfreeze` (the collector's permanent
  generation during a long save or restore).
* **Foundation helpers**: :mod:`fileio` and its JSON bounds (:data:`MAX_JSON_DEPTH`,
  :func:`json_depth`, :func:`load_json`), :func:`open_input`, :func:`checkpoint_root`,
  :func:`write_error`; :mod:`threads`; :func:`as_dtype`; :func:`is_int` / :func:`is_index`;
  :func:`coalesce` (how bulk reads merge byte ranges into spans).
"""

from __future__ import annotations

from parallelvars import _fileio as fileio
from parallelvars import _threads as threads
from parallelvars._dtypes import as_dtype, sum_dtype
from parallelvars._fileio import (
    MAX_JSON_DEPTH,
    checkpoint_root,
    json_depth,
    load_json,
    open_input,
    write_error,
)
from parallelvars._ints import is_index, is_int, unique_ints
from parallelvars._spans import coalesce
from parallelvars.checkpoint import _gcfreeze as gcfreeze
from parallelvars.checkpoint import _h5policy as h5policy
from parallelvars.checkpoint import _restore as restore_rules
from parallelvars.checkpoint import _state as manager_state
from parallelvars.checkpoint._restore import Piece, verify_pieces
from parallelvars.checkpoint.h5io.attributes import _write_json as write_json
from parallelvars.checkpoint.h5io.columns import _columns_parts as columns_parts
from parallelvars.checkpoint.h5io.columns import _columns_table as columns_table
from parallelvars.checkpoint.h5io.records import PlanCache, crc_mark
from parallelvars.checkpoint.h5io.records import _index_template as index_template
from parallelvars.checkpoint.h5io.stored import _held_value as held_value
from parallelvars.checkpoint.h5raw.lookup3 import lookup3
from parallelvars.checkpoint.h5raw.native import _index_of as index_of

__all__ = [
    "crc_mark",
    "index_template",
    "MAX_JSON_DEPTH",
    "Piece",
    "PlanCache",
    "as_dtype",
    "checkpoint_root",
    "coalesce",
    "columns_parts",
    "columns_table",
    "fileio",
    "gcfreeze",
    "h5policy",
    "held_value",
    "index_of",
    "is_index",
    "is_int",
    "json_depth",
    "load_json",
    "lookup3",
    "manager_state",
    "open_input",
    "restore_rules",
    "sum_dtype",
    "threads",
    "unique_ints",
    "verify_pieces",
    "write_error",
    "write_json",
]
