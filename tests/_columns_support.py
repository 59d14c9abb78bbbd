"""Editing a native file's columns document in tests: remove it (the index-only file every
earlier version wrote) or write it again from the file's index (as a writer would)."""

from __future__ import annotations

import json
from typing import Any

import h5py
import numpy as np

from parallelvars.checkpoint.h5io.layout import COLUMNS_DATASET, DOCUMENTS_ATTR, INDEX_DATASET
from parallelvars.testing import columns_parts as _columns_parts
from parallelvars.testing import write_json as _write_json


def documents(path: str) -> list[str]:
    with h5py.File(path, "r") as f:
        return [d.decode() for d in f.attrs.get(DOCUMENTS_ATTR, [])]


def strip_columns(path: str) -> None:
    """Remove the columns document and its mention in the document list (in place)."""
    with h5py.File(path, "r+") as f:
        listed = [d for d in f.attrs[DOCUMENTS_ATTR] if d.decode() != COLUMNS_DATASET]
        if COLUMNS_DATASET in f:
            del f[COLUMNS_DATASET]
        f.attrs[DOCUMENTS_ATTR] = np.array(listed)


def columns_text(index: dict[str, Any]) -> str:
    """The columns document our writer makes of ``index``."""
    head, tail = _columns_parts(index)
    return head + ", ".join(str(c) for m in index.values() for c in m["crc32c"]) + tail


def read_index(path: str) -> dict[str, Any]:
    with h5py.File(path, "r") as f:
        return json.loads(bytes(f[INDEX_DATASET][()]).decode())


def read_columns(path: str) -> dict[str, Any]:
    with h5py.File(path, "r") as f:
        return json.loads(bytes(f[COLUMNS_DATASET][()]).decode())


def write_columns(path: str, doc: Any = None, *, text: str | None = None) -> None:
    """Replace the columns document with ``doc`` (or ``text``; by default, the columns of the
    file's index), its checksum recomputed, listed among the documents."""
    if doc is None and text is None:
        text = columns_text(read_index(path))
    with h5py.File(path, "r+") as f:
        if COLUMNS_DATASET in f:
            del f[COLUMNS_DATASET]
        _write_json(f, COLUMNS_DATASET, doc, text=text)
        listed = [d.decode() for d in f.attrs[DOCUMENTS_ATTR]]
        if COLUMNS_DATASET not in listed:
            listed.insert(1, COLUMNS_DATASET)
        f.attrs[DOCUMENTS_ATTR] = np.array([d.encode() for d in listed])
