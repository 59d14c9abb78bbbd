"""safetensors: single files and Hugging Face shard sets, read lazily and written streaming.

A file is ``u64 LE N``, an N-byte JSON header (``name -> {dtype, shape, data_offsets}`` plus an
optional ``__metadata__`` of string -> string), then the tensors' raw little-endian bytes. The
reader checks the header as strictly as the reference implementation does (see FORMATS.md
2.3) before it reads or allocates any tensor: a header length beyond 100,000,000 bytes, a file
shorter than its header or data, invalid UTF-8 or JSON, duplicate names, unknown dtype strings,
offsets that overlap or leave holes, a byte size that does not match dtype and shape, and
trailing bytes each raise an error of :mod:`parallelvars.errors` naming the file and tensor.

Writing streams: the header is computed from the entries' metadata, then each tensor is read
from its source and written, one at a time. Tensors are ordered by alignment, then name, so
every tensor starts aligned to its item size (like the reference writer).

What our files hold (key style ``names``, default ``"dotted"``, see :mod:`parallelvars.formats._names`):

* every variable's primary (component 0) under the variable's own key, so
  ``safetensors.safe_open`` / ``load_file`` and ``transformers`` find ordinary tensors;
* extra components of parallel variables under ``<key>/parallel_component_<i>``;
* a sharded variable once, as its full stitched value under its key;
* ``__metadata__``: ``"format": "pt"`` (what ``transformers`` expects), the source's file
  metadata as strings, and ``"parallelvars"``: the parallel info (kinds, components, attrs,
  exact paths; see :mod:`parallelvars.formats._info`), so our reader gets back exactly what was written;
* ``__metadata__["parallelvars_crc32c"]``: integrity data that plain readers ignore, one string
  of 8-digit hex CRC-32Cs: first of a canonical description of the header (every name, dtype,
  shape, offsets and tensor CRC, and every other metadata item), then of each tensor's bytes in
  name order. The CRCs are known only once the tensors are streamed, so the header is written
  with placeholders of the same width and rewritten in place. Our reader verifies the header on
  opening and each tensor's bytes when it is read (the first partial read of a tensor checks
  the whole tensor once); a file whose parallel info says ``"checksums"`` must have the record.
  Files from other writers have none and are read as before. A shard set's index carries the
  same key in its ``metadata``: a CRC-32C of its canonical weight map and metadata.

Shard sets (``max_shard_size=``) follow the Hugging Face convention: ``model-00001-of-00002.
safetensors``, ... and ``model.safetensors.index.json`` with ``metadata.total_size`` (the sum of
the tensors' byte sizes) and ``weight_map``; the parallel info goes into the index's
``metadata.parallelvars``. A set whose tensors all fit in one shard is written as one file.

dtypes: BOOL, U8/I8..U64/I64, F16, BF16, F32, F64, C64 and the float8 types F8_E4M3
(``float8_e4m3fn``), F8_E5M2, F8_E4M3FNUZ, F8_E5M2FNUZ, F8_E8M0 (``float8_e8m0fnu``) map to
numpy / ml_dtypes dtypes bit for bit. Other fixed-size dtypes (complex128, other ml_dtypes) are
stored as their raw bytes in a ``U8`` tensor with a trailing axis of the item size and their
dtype recorded in the parallel info. The sub-byte types F4 and F6_* and string tensors are
refused with :class:`~parallelvars.errors.UnsupportedDtypeError`.

Modules: ``_dtypes`` (dtype strings), ``_header`` (header limits and validation),
``_integrity`` (our CRC record), ``_index`` (shard-set index), ``_reader`` and ``_writer``.
This package never shadows the ``safetensors`` library: it is imported only by its full name.
"""

from __future__ import annotations

import os
import struct

from parallelvars.formats._registry import FormatSpec
from parallelvars.formats.safetensors._header import read_header
from parallelvars.formats.safetensors._index import _find_index
from parallelvars.formats.safetensors._layout import INDEX_NAME, MAX_HEADER_SIZE
from parallelvars.formats.safetensors._reader import open_safetensors
from parallelvars.formats.safetensors._writer import write_safetensors

__all__ = [
    "FORMAT",
    "INDEX_NAME",
    "MAX_HEADER_SIZE",
    "open_safetensors",
    "read_header",
    "write_safetensors",
]


def sniff(path: str, head: bytes) -> bool:
    """True for a safetensors file, a safetensors index, or a folder holding one."""
    if os.path.isdir(path):
        single = os.path.join(path, "model.safetensors")  # (a FIFO there: opening says so)
        return _find_index(path) is not None or (
            os.path.lexists(single) and not os.path.isdir(single)
        )
    if path.endswith(".index.json"):
        return b'"weight_map"' in head and (
            path.endswith(".safetensors.index.json") or b".safetensors" in head
        )
    if len(head) < 10:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    try:
        size = os.path.getsize(path)
    except OSError:
        return False
    if n < 2 or n > MAX_HEADER_SIZE or 8 + n > size:
        return False
    return head[8:].lstrip(b" \t\r\n").startswith(b"{")


def outputs(path: str) -> list[str]:
    """The files a write at ``path`` replaces: the file and the index of a set of its name."""
    p = (
        os.path.join(path, "model.safetensors")
        if os.path.isdir(path) or path.endswith("/")
        else path
    )
    if p.endswith(".index.json"):
        p = p[: -len(".index.json")]
    return [p, f"{p}.index.json"]


FORMAT = FormatSpec(
    name="safetensors",
    description="safetensors file or Hugging Face shard set (model.safetensors.index.json)",
    suffixes=(".safetensors", ".safetensors.index.json"),
    sniff=sniff,
    open=open_safetensors,
    write=write_safetensors,
    options={
        "names": "key style: dotted (default), slash or tf",
        "max_shard_size": "split into Hugging Face shards of at most this size (e.g. 5GB)",
        "like": "write: a Hugging Face model folder whose config.json, tokenizer and processor "
        "files go beside the weights (default: the source's folder, when it is one)",
    },
    outputs=outputs,
)
