"""Hugging Face shard sets: finding and reading ``model.safetensors.index.json``."""

from __future__ import annotations

import os
from typing import Any

from parallelvars._fileio import load_json, read_input
from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    NotACheckpointError,
)
from parallelvars.formats.safetensors._header import _no_duplicates
from parallelvars.formats.safetensors._integrity import _index_crc
from parallelvars.formats.safetensors._layout import CRC_KEY, INDEX_NAME, MAX_HEADER_SIZE, META_KEY


def _find_index(path: str) -> str | None:
    if path.endswith(".index.json"):
        return path
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, INDEX_NAME)):
            return os.path.join(path, INDEX_NAME)
        found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors.index.json"))
        if len(found) == 1:
            return os.path.join(path, found[0])
    return None


def _read_index(index: str, *, within: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The index's metadata and weight map; ``within``: the folder it was found in (None: the
    user named it), for the rule of every file a reader opens."""
    raw = read_input(index, max_bytes=MAX_HEADER_SIZE, what="shard index", within=within)
    doc = load_json(
        raw,
        file=index,
        what="shard index",
        max_bytes=MAX_HEADER_SIZE,
        object_pairs_hook=_no_duplicates(index),
    )
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise NotACheckpointError(
            "not a safetensors index: no weight_map of names to files",
            file=index,
            expected='{"weight_map": {...}}',
            found=f"keys {sorted(doc) if isinstance(doc, dict) else type(doc).__name__}",
        )
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError("the index metadata is not an object", file=index)
    info = metadata.get(META_KEY)
    if CRC_KEY in metadata or (isinstance(info, dict) and info.get("checksums")):
        stored = metadata.get(CRC_KEY)
        found = _index_crc(metadata, weight_map)
        if stored != found:
            raise ChecksumMismatchError(
                "the index does not match its checksum",
                file=index,
                variable=CRC_KEY,
                expected=f"crc32c {stored}",
                found=f"crc32c {found}",
            )
    for shard in set(weight_map.values()):
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise CorruptCheckpointError(
                "shard file names must be plain names in the index's folder",
                file=index,
                variable=shard,
            )
    return metadata, weight_map
