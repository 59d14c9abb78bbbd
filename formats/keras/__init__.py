"""Keras weight files: Keras 3 ``.weights.h5`` (``keras``) and legacy Keras HDF5 (``keras-legacy``).

Both are read and written with h5py; datasets are read only when a component is asked for.

``keras`` (Keras 3 ``save_weights`` / ``H5IOStore``, FORMATS.md 3.2)::

    /vars                       @name="sequential"   (the model's own variables)
    /layers/dense/vars          @name="hidden"       0: kernel, 1: bias
    /layers/batch_normalization/vars @name="bn"      0..3
    /optimizer/vars             @name="adam"         0: iterations, 1: learning_rate, ...

  Entry paths are the dataset paths (``layers/dense/vars/0``): Keras itself records no variable
  names, only their order. The groups' attributes are kept in the view's metadata
  (``keras_weights_layout``), so a file read and written back has the same groups, datasets,
  attributes and values, and Keras loads it into the same architecture. Entries from other
  formats whose paths are not of that form go to ``<parent>/vars/<i>`` in order
  (``model/dense/kernel`` -> ``model/dense/vars/0``), with their path kept in the parallel info.

``keras-legacy`` (Keras 2 ``save_weights("x.h5")`` and the ``model_weights/`` group of
``model.save("x.h5")``, FORMATS.md 3.1)::

    @layer_names = ["hidden", "bn", ...]        (split into layer_names0, 1, ... when large)
    /hidden  @weight_names = ["sequential/hidden/kernel", ...]
    /hidden/sequential/hidden/kernel           (Keras 2 names end in ":0")

  Entry paths are the weight names without the ``:0`` suffix (``sequential/hidden/kernel``);
  ``optimizer_weights/`` of a full-model file is read under ``optimizer_weights/<name>``. Layer
  order, the exact weight names and the string attributes are kept in the view's metadata
  (``keras_legacy_layout``). Entries from other formats are grouped into layers by their parent
  path (``model/dense/kernel`` -> layer ``dense``), top-level paths into
  ``top_level_model_weights``, as Keras does.

Parallel variables: Keras counts the datasets of a layer, so only primaries (and the stitched
value of a sharded variable) go where Keras looks; extra components go under the reserved group
``/_parallel_components/<primary's path>/parallel_component_<i>`` and the parallel info (see
:mod:`parallelvars.formats._info`) into the root attribute ``parallelvars``, written only when there is something
to record. Keras ignores both.

Integrity (files we write; Keras ignores all of it): the file is written with
``libver="latest"``, so HDF5 checksums its own metadata (superblock, object headers, B-trees);
every dataset has a ``crc32c`` attribute (CRC-32C of its bytes), checked when it is read; the
root attribute ``parallelvars_crc32c`` is a CRC-32C of a canonical description of everything
the reader takes from the structure (dataset keys and order, dtypes, shapes and CRCs, layer and
weight names, the groups' attributes, the parallel info), checked on opening. String attributes
are written fixed-length, as Keras 2 writes its name lists, so no string lives in HDF5's global
heap (which has no checksum, and whose parser can loop on a damaged file); the one exception is
the ``dtype`` attribute of bfloat16 and other ml_dtypes datasets, which Keras compares with a
``str``. Every h5py error on a damaged file is raised as a
:class:`~parallelvars.errors.CorruptCheckpointError` naming the file (and dataset). Files from
Keras carry none of this and are read as they are.

dtypes: numpy dtypes are stored natively; bfloat16 (and the other ml_dtypes types) as HDF5
OPAQUE data (``|V2``) with a dataset attribute ``dtype="bfloat16"``, as Keras writes it. String
tensors are refused.

``.keras`` archives (Keras 3 ``model.save``): the ``keras`` format reads the
``model.weights.h5`` inside and writes an archive from a template (``like=``), keeping its
``config.json`` and ``metadata.json`` (:mod:`._archive`).

Modules: ``_layout`` (our reserved names), ``_archive`` (``.keras`` archives and the ``keras`` entry points), ``_store`` (datasets as a lazy tensor store),
``_integrity`` (dataset and structure checksums), ``_read`` (opening either layout),
``_write`` (shared writing helpers), ``_weights`` (Keras 3 ``.weights.h5``) and ``_legacy`` (legacy Keras).
"""

from __future__ import annotations

from parallelvars.formats._registry import FormatSpec
from parallelvars.formats.keras._archive import open_keras, sniff_keras, write_keras
from parallelvars.formats.keras._layout import RESERVED
from parallelvars.formats.keras._legacy import (
    open_keras_legacy,
    sniff_keras_legacy,
    write_keras_legacy,
)

__all__ = [
    "FORMATS",
    "RESERVED",
    "open_keras",
    "open_keras_legacy",
    "write_keras",
    "write_keras_legacy",
]

FORMATS = (
    FormatSpec(
        name="keras",
        description="Keras 3 .weights.h5 or .keras archive (layers/<name>/vars/<i>)",
        suffixes=(".weights.h5", ".keras"),
        sniff=sniff_keras,
        open=open_keras,
        write=write_keras,
        options={"like": "for a .keras archive: the model's own archive (its config is kept)"},
    ),
    FormatSpec(
        name="keras-legacy",
        description="legacy Keras HDF5 weights (layer_names / weight_names, model_weights/)",
        suffixes=(),
        sniff=sniff_keras_legacy,
        open=open_keras_legacy,
        write=write_keras_legacy,
        options={"like": "the model's .keras archive (its config gives the layers' order)"},
    ),
)
