"""Checkpoint formats: a neutral lazy view, adapters, and conversion between them.

Format names: ``hdf5`` (our native layout), ``safetensors``, ``npz``, ``keras``,
``keras-legacy`` and ``tf``. See :mod:`parallelvars.formats._view` for the neutral view.

Example:
    >>> from parallelvars import formats
    >>> formats.convert("run.h5", "model.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

from ._convert import convert, format_for_path
from ._names import NAME_STYLES, component_key, from_key, parse_component_key, to_key
from ._registry import (
    FORMAT_NAMES,
    FormatSpec,
    detect_format,
    get_format,
    open_checkpoint,
    write_checkpoint,
)
from ._reshard import reshard, split_offsets
from ._view import KINDS, ArrayEntry, CheckpointView, DictView, Entry, logical_value

__all__ = [
    "FORMAT_NAMES",
    "KINDS",
    "NAME_STYLES",
    "ArrayEntry",
    "CheckpointView",
    "DictView",
    "Entry",
    "FormatSpec",
    "component_key",
    "convert",
    "detect_format",
    "format_for_path",
    "from_key",
    "get_format",
    "logical_value",
    "open_checkpoint",
    "parse_component_key",
    "reshard",
    "split_offsets",
    "to_key",
    "write_checkpoint",
]
