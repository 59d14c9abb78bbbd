"""Checkpoint formats: a neutral lazy view, adapters, and conversion between them.

Every adapter reads a file into a :class:`CheckpointView` (a ``Mapping`` from our slash path
to an :class:`Entry` whose components are read on demand) and writes any mapping of entries,
one tensor at a time. Formats are detected from magic bytes (the file's layout for HDF5
variants), with the suffix as a fallback.

================  =============================  ================================================
name              files                          parallel variables
================  =============================  ================================================
``hdf5``          ``.h5``, ``.hdf5``             native: every component, checksummed
                                                 (:mod:`parallelvars.checkpoint.h5io`)
``safetensors``   ``.safetensors``, HF shard     primaries under their own keys, extra
                  sets (``*.index.json``)        components next to them, info in
                                                 ``__metadata__`` (:mod:`.safetensors`)
``npz``           ``.npz``                       as safetensors, info in the member
                                                 ``__parallelvars__.json`` (:mod:`.npz`)
``keras``         Keras 3 ``.weights.h5``,       primaries where Keras looks, the rest in a
                  ``.keras`` archives            reserved group (:mod:`.keras`)
``keras-legacy``  Keras 2 / ``model.save`` HDF5  as ``keras``
``tf``            TensorFlow checkpoints         see :mod:`.tf`
================  =============================  ================================================

Every format carries the optimizer slots (``slot_of`` / ``slot_name``) and, where it has room,
our object graph (:mod:`._graph`), so a conversion back to HDF5 restores and resumes training.

Name mapping between our paths, dotted ``state_dict`` names and TF keys: :mod:`._names`.
Rewriting for another number of devices: :func:`reshard`. Converting: :func:`convert`.

Example:
    >>> from parallelvars import formats
    >>> formats.convert("run.h5", "model.safetensors")  # doctest: +SKIP
    'model.safetensors'
    >>> with formats.open_checkpoint("model.safetensors") as view:  # doctest: +SKIP
    ...     view["layers/0/attn/q/weight"].value()
"""

from __future__ import annotations

from parallelvars.checkpoint.sources import register_source_plugin

from ._convert import convert, format_for_path
from ._names import NAME_STYLES, component_key, from_key, parse_component_key, part_key, to_key
from ._registry import (
    FORMAT_NAMES,
    FormatSpec,
    detect_format,
    get_format,
    open_checkpoint,
    write_checkpoint,
)
from ._reshard import reshard, split_offsets
from ._source import SOURCES as _SOURCES
from ._view import KINDS, ArrayEntry, CheckpointView, DictView, Entry, logical_value

# Restores of these formats through the core (also declared as the ``parallelvars.sources``
# entry point, so that a restore works without this import).
register_source_plugin(_SOURCES)

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
    "part_key",
    "reshard",
    "split_offsets",
    "to_key",
    "write_checkpoint",
]
