"""TensorFlow V2 checkpoints (``TensorBundle``), read and written without TensorFlow.

A checkpoint is ``<prefix>.index`` (a LevelDB-style table of tensor metadata) plus
``<prefix>.data-NNNNN-of-NNNNN`` shards of raw tensor bytes, and usually a ``checkpoint``
state file naming the latest prefix of the directory. This package reads one lazily as a
:class:`~parallelvars.formats.CheckpointView` (opening parses the index; tensors are read and
CRC-checked on demand) and writes any view as a bundle whose bytes match TensorFlow's.

Modules: ``_crc`` (CRC-32C and masking), ``_proto`` (protobuf wire coding, bundle messages),
``_sstable`` (the index table), ``_ordered_code`` (slice keys), ``_strings`` (string tensors),
``_dtypes``, ``_bundle`` (key-level reader and writer), ``_graph`` (object graph), ``_keys``
(key naming), ``_state`` (the ``checkpoint`` file), ``_reader`` (the view), ``_writer``.

Example:
    >>> from parallelvars.formats import open_checkpoint, write_checkpoint  # doctest: +SKIP
    >>> with open_checkpoint("train_dir") as view:  # the latest checkpoint of the directory
    ...     write_checkpoint("out.h5", view)
"""

from __future__ import annotations

import os
import re
from typing import Any

from parallelvars._fileio import open_input
from parallelvars.errors import ForeignReferenceError, ParallelVarsError

from .._registry import FormatSpec
from ._bundle import BundleReader, BundleWriter
from ._keys import GRAPH_KEY, METADATA_KEY, escape_local_name, unescape_local_name
from ._reader import TfCheckpointView, TfEntry, resolve_prefix
from ._sstable import TABLE_MAGIC
from ._state import STATE_FILENAME
from ._writer import write_bundle

__all__ = [
    "FORMAT",
    "GRAPH_KEY",
    "METADATA_KEY",
    "BundleReader",
    "BundleWriter",
    "TfCheckpointView",
    "TfEntry",
    "escape_local_name",
    "open_tf",
    "resolve_prefix",
    "sniff",
    "unescape_local_name",
    "write_bundle",
]

_MAGIC_BYTES = TABLE_MAGIC.to_bytes(8, "little")
_DATA_NAME = re.compile(r"\.data-\d{5,}-of-\d{5,}")


def _is_index(path: str, within: str | None) -> bool:
    """Whether ``path`` ends like an index; read only under the rule of every file a reader
    opens (``within``: the folder it was found in; a FIFO or a link out is no index here)."""
    try:
        fd = open_input(path, within=within)
    except (OSError, ParallelVarsError):
        return False
    try:
        size = os.fstat(fd).st_size
        return size >= 48 and os.pread(fd, 8, size - 8) == _MAGIC_BYTES
    except OSError:
        return False
    finally:
        os.close(fd)


def _odd(path: str) -> bool:
    """Whether ``path`` is there but neither a regular file nor a folder (a FIFO, a device) or
    a symbolic link: not opened while sniffing; opening it says what it is."""
    return os.path.islink(path) or (
        os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)
    )


def sniff(path: str, head: bytes = b"") -> bool:
    """True for a TensorFlow checkpoint: a directory holding a ``checkpoint`` state file or an
    ``*.index``, an ``.index`` file or data shard, or a prefix whose ``.index`` exists."""
    try:
        if os.path.isdir(path):
            names = os.listdir(path)
            if STATE_FILENAME in names:
                try:
                    if _is_index(resolve_prefix(path) + ".index", path):
                        return True
                except ForeignReferenceError:
                    return True  # a TensorFlow directory; opening says why it is refused
                except (ValueError, OSError):
                    pass
            return any(
                n.endswith(".index")
                and (_is_index(os.path.join(path, n), path) or _odd(os.path.join(path, n)))
                for n in names
            )
        folder = os.path.dirname(path) or os.curdir
        if os.path.isfile(path):
            prefix = resolve_prefix(path)
            index = prefix + ".index"
            return prefix != path and _is_index(index, None if index == path else folder)
        index = path + ".index"  # (a folder there too: opening the prefix says what it is)
        return _is_index(index, folder) or _odd(index) or os.path.isdir(index)
    except OSError:
        return False


def open_tf(path: str | os.PathLike[str], **options: Any) -> TfCheckpointView:
    """Open a checkpoint (prefix, ``.index``, or directory) as a lazy view.

    Options: ``verify`` (check CRCs on read, default True), ``parallel_kind``
    (``"mirrored"``), ``assemble_slices`` (False), ``skip_unsupported`` (False),
    ``follow_state_outside`` (False: a directory's state file naming a checkpoint outside the
    directory is refused); see :class:`TfCheckpointView`.
    """
    return TfCheckpointView(path, **options)


def outputs(path: str) -> list[str]:
    """The files a write at ``path`` replaces: the prefix's index and data shards (a folder
    gets a new prefix: nothing)."""
    if os.path.isdir(path):
        return []
    prefix = path[: -len(".index")] if path.endswith(".index") else path
    folder, base = os.path.split(prefix)
    try:
        names = os.listdir(folder or os.curdir)
    except OSError:
        names = []
    shards = [
        os.path.join(folder, n)
        for n in names
        if _DATA_NAME.fullmatch(n[len(base) :] if n.startswith(base) else "")
    ]
    return [prefix + ".index", *shards]


FORMAT = FormatSpec(
    name="tf",
    description="TensorFlow V2 checkpoint (<prefix>.index + <prefix>.data-NNNNN-of-NNNNN)",
    suffixes=(".index",),
    sniff=sniff,
    open=open_tf,
    write=write_bundle,
    options={
        "verify": "read: check each tensor's CRC-32C (default true)",
        "parallel_kind": "read: kind of variables with parallel_component_N keys (mirrored)",
        "assemble_slices": "read: partitioned tensors as single entries, not sharded (false)",
        "skip_unsupported": "read: leave out DT_VARIANT/DT_RESOURCE tensors instead of failing",
        "follow_state_outside": "read: follow a state file naming a checkpoint outside its directory (false)",
        "names": "write: 'tf' (tf.train.Checkpoint's object keys + graph), 'slash' (each "
        "variable under its path) or 'tf1' (tf.compat.v1.train.Saver's names and TF1 slot names)",
        "naming": "write: the older spelling of names: 'object' ('tf') or 'name' ('slash')",
        "update_state": "write: make it the latest in the directory's 'checkpoint' file (true)",
    },
    outputs=outputs,
)
