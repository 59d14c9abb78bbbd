"""Names and limits of the safetensors layout as we use it: the header size limit, our
``__metadata__`` keys, the shard index's file name and the default key style.
"""

from __future__ import annotations

MAX_HEADER_SIZE = 100_000_000
INDEX_NAME = "model.safetensors.index.json"
META_KEY = "parallelvars"
#: ``__metadata__`` key of our checksums: one string of 8-digit hex CRC-32Cs, the header's then
#: each tensor's bytes', in name order. Our writer prefixes it ``raw:`` and its header CRC covers
#: the header's bytes as stored (the record's digits read as ``0``); an older record, without
#: the prefix, covers a canonical description of the header (see _integrity).
CRC_KEY = "parallelvars_crc32c"
DEFAULT_NAMES = "dotted"
#: Shard-set index ``metadata`` key of our shards' checksums: shard file name -> the header
#: CRC-32C of its ``CRC_KEY`` record (8 hex digits), which covers every tensor's CRC; a reader
#: refuses a shard that is not the one the index was written with.
SHARDS_KEY = "parallelvars_shards"
