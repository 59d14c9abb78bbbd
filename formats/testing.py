"""Test support for the formats: the byte-level codecs and helpers that tests check directly.

As with ``numpy.testing``, this module is for tests, not for programs: it is imported by no
part of the library, and its names follow the internals they come from, so they may change
with them. It exists so that tests reach the private pieces through one documented seam
rather than each test importing private modules (``tools/count_private_imports.py`` counts
the tests that do not).

What it offers:

* **TensorFlow checkpoint codecs**, checked against TensorFlow's specification byte by byte:
  :mod:`tf_crc` (masked CRC32C: :func:`crc32c`, :func:`mask`), :mod:`tf_ordered_code`
  (:func:`encode_slice_key`), the bundle protos (:class:`BundleEntry`, :class:`BundleHeader`,
  :func:`encode_entry` / :func:`decode_entry`, :func:`encode_header` / :func:`decode_header`),
  the SSTable (:class:`TableBuilder`, :class:`TableReader`, :data:`BLOCK_SIZE`,
  :func:`find_short_successor`, :func:`find_shortest_separator`), checkpoint keys
  (:func:`parse_key`, :func:`escape_local_name`, :func:`unescape_local_name`,
  :func:`component_attribute`), the state file's C escapes (:func:`c_escape`,
  :func:`c_unescape`), string tensors (:func:`encode_strings`, :func:`decode_strings`), the
  object graph (:func:`decode_graph`), and :mod:`tf_bundle`.
* **Other formats' internals**: :mod:`zip_policy` (the zip member bounds, the writer of
  STORED members), :mod:`keras_write`,
  :func:`keras_layer_order`, :mod:`hf_folder` (Hugging Face folders), :func:`attr_to_python` (HDF5 attributes).
* **Helpers**: :func:`jsonable`, :func:`parse_size`, :func:`select_entries`,
  :class:`StagedEntry` (a restore's view of another format's entry).
"""

from __future__ import annotations

from parallelvars.formats import _info as info_views
from parallelvars.formats import _zip as zip_policy
from parallelvars.formats._graph import check_writable_graph
from parallelvars.formats._h5 import attr_to_python
from parallelvars.formats._json import jsonable
from parallelvars.formats._select import select_entries
from parallelvars.formats._sizes import parse_size
from parallelvars.formats._staged import StagedEntry
from parallelvars.formats.keras import _write as keras_write
from parallelvars.formats.keras._archive import keras_layer_order
from parallelvars.formats.safetensors import _hf as hf_folder
from parallelvars.formats.tf import _bundle as tf_bundle
from parallelvars.formats.tf import _crc as tf_crc
from parallelvars.formats.tf import _ordered_code as tf_ordered_code
from parallelvars.formats.tf._crc import crc32c, mask
from parallelvars.formats.tf._graph import decode_graph
from parallelvars.formats.tf._keys import (
    component_attribute,
    escape_local_name,
    parse_key,
    unescape_local_name,
)
from parallelvars.formats.tf._ordered_code import encode_slice_key
from parallelvars.formats.tf._proto import (
    BundleEntry,
    BundleHeader,
    decode_entry,
    decode_header,
    encode_entry,
    encode_header,
)
from parallelvars.formats.tf._sstable import (
    BLOCK_SIZE,
    TableBuilder,
    TableReader,
    find_short_successor,
    find_shortest_separator,
)
from parallelvars.formats.tf._state import c_escape, c_unescape
from parallelvars.formats.tf._strings import decode_strings, encode_strings

__all__ = [
    "info_views",
    "StagedEntry",
    "BLOCK_SIZE",
    "BundleEntry",
    "BundleHeader",
    "TableBuilder",
    "TableReader",
    "attr_to_python",
    "c_escape",
    "c_unescape",
    "component_attribute",
    "crc32c",
    "decode_entry",
    "decode_graph",
    "decode_header",
    "decode_strings",
    "encode_entry",
    "encode_header",
    "encode_slice_key",
    "encode_strings",
    "escape_local_name",
    "find_short_successor",
    "find_shortest_separator",
    "hf_folder",
    "check_writable_graph",
    "jsonable",
    "keras_layer_order",
    "keras_write",
    "mask",
    "parse_key",
    "parse_size",
    "select_entries",
    "tf_bundle",
    "tf_crc",
    "tf_ordered_code",
    "unescape_local_name",
    "zip_policy",
]
