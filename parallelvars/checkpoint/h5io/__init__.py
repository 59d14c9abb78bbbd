"""Reading and writing the native HDF5 layout (version 1).

The layout (documented with an ``h5dump``-style example in ``docs/FORMAT.md``):

* root attributes ``parallelvars_format`` (= 1), ``parallelvars_version``, ``created`` and
  whatever the writer knows (``save_counter``, ``step``);
* one group per variable at its object path, with attributes ``kind``, ``dtype``, ``shape``,
  ``num_components``, ``devices``, ``aggregation`` and, for sharded variables, ``shard_axis``
  and ``shard_offsets`` (``name``, ``synchronization`` and ``trainable`` are in the index only);
* in it one dataset per component, ``primary`` and ``parallel_component_1`` ..., whose
  CRC-32C (of its C-order bytes) is in the index (files of earlier versions also have it as
  the dataset's ``crc32c`` attribute);
* for sharded variables a virtual dataset ``value`` stitching the shards together;
* the object graph as JSON in the dataset ``/_parallelvars/object_graph``, and an index of every
  variable (attributes, checksums, data offsets) as JSON in ``/_parallelvars/index``, padded
  with spaces to a capacity fixed by the structure.

No object records times, so the same content gives the same bytes. Saves are written by the
generator (``h5raw/native.py``: the metadata made from the structure, cached for a repeated
save of it); the libhdf5 writer here is the reference its files are compared with, and writes
what the generator cannot express.

bfloat16 and the float8 family are stored as HDF5 opaque types of their size, with the
``dtype`` group attribute naming them (the convention Keras uses); strings as variable-length
bytes.

Reading is lazy and fast: contiguous datasets are read with ``pread`` straight into the
destination buffer and checksummed there (a verification pass streams in bounded chunks). The
file is never memory-mapped, so a file truncated while it is read is an error, not SIGBUS. A
restore reads its small components ahead in a few large reads (``H5Reader.stage``).

Modules: ``layout`` (format constants, kinds and aggregations, limits, path validation,
storage dtypes), ``attributes`` (attribute and JSON-document encoding and decoding), ``write``
(:func:`write_h5`, :func:`write_h5_index`), ``stored`` (:class:`StoredVariable`, one variable
of a file), ``read`` (:class:`H5Reader`, :func:`is_native_checkpoint`), ``bulk`` (the reader's
commands' side: summaries, bulk component reads, ``verify_all``), ``collective``
(:func:`~parallelvars.checkpoint.h5io.collective.write_collective`, the multi-process writer
built on the generator's ``save_native`` and ``write_native_index``), ``records`` (a save's
records, the structure key, the index template, the plan cache).
"""

from __future__ import annotations

from parallelvars._fileio import checksum
from parallelvars.checkpoint.h5io.layout import (
    DOCUMENTS_ATTR,
    FORMAT_VERSION,
    GRAPH_DATASET,
    HDF5_SIGNATURE,
    INDEX_DATASET,
    META_GROUP,
)
from parallelvars.checkpoint.h5io.read import H5Reader, is_native_checkpoint
from parallelvars.checkpoint.h5io.stored import StoredVariable
from parallelvars.checkpoint.h5io.write import (
    ComponentLink,
    LinkedVariable,
    atomic_write,
    write_h5,
    write_h5_index,
)

__all__ = [
    "FORMAT_VERSION",
    "META_GROUP",
    "DOCUMENTS_ATTR",
    "GRAPH_DATASET",
    "HDF5_SIGNATURE",
    "INDEX_DATASET",
    "H5Reader",
    "StoredVariable",
    "write_h5",
    "write_h5_index",
    "ComponentLink",
    "LinkedVariable",
    "atomic_write",
    "checksum",
    "is_native_checkpoint",
]
