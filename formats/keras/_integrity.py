"""Integrity of the Keras files we write: each dataset's CRC-32C and the structure checksum over
everything the reader takes from the file besides tensor bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import crc32c as _crc32c
import h5py
import numpy as np

from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
)
from parallelvars.formats._json import jsonable
from parallelvars.formats.keras._layout import CRC_ATTR, STRUCTURE_ATTR


class _Datasets(Protocol):
    """What the structure checksum reads of a store: its keys, each key's stored dtype and shape,
    and each dataset's recorded CRC-32C (``_store._H5Store`` is one; this module sits below it).
    """

    @property
    def crcs(self) -> Mapping[str, int | None]: ...

    def keys(self) -> Sequence[str]: ...

    def stored(self, key: str) -> tuple[np.dtype, tuple[int, ...]]: ...


def _dataset_crc(ds: h5py.Dataset, file: str, key: str) -> int | None:
    raw = ds.attrs.get(CRC_ATTR)
    if raw is None:
        return None
    value = np.asarray(raw)
    if value.shape != () or value.dtype.kind not in "iu" or not 0 <= int(value) < (1 << 32):
        raise CorruptCheckpointError(
            "the crc32c attribute is damaged",
            file=file,
            variable=key,
            expected="an integer in [0, 2**32)",
            found=repr(raw)[:80],
        )
    return int(value)


def _structure_crc(store: _Datasets, layout: Any, info: Any) -> int:
    """CRC-32C of a canonical description of what the reader takes from the file's structure."""
    keys = store.keys()
    doc = {
        "layout": jsonable(layout),
        "info": jsonable(info),
        "datasets": [
            [k, str(store.stored(k)[0]), list(store.stored(k)[1]), store.crcs[k]] for k in keys
        ],
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return int(_crc32c.crc32c(text.encode("ascii")))


def _verify_structure(h5: h5py.File, file: str, store: _Datasets, layout: Any, info: Any) -> None:
    raw = h5.attrs.get(STRUCTURE_ATTR)
    if raw is None:
        if isinstance(info, dict) and info.get("checksums"):
            raise CorruptCheckpointError(
                "the structure checksum is missing",
                file=file,
                variable=STRUCTURE_ATTR,
                expected=f"root attribute {STRUCTURE_ATTR}",
                found="none",
            )
        return  # a file from Keras or another tool
    value = np.asarray(raw)
    if value.shape != () or value.dtype.kind not in "iu":
        raise CorruptCheckpointError(
            "the structure checksum attribute is damaged",
            file=file,
            variable=STRUCTURE_ATTR,
            expected="an integer",
            found=repr(raw)[:80],
        )
    found = _structure_crc(store, layout, info)
    if int(value) != found:
        raise ChecksumMismatchError(
            "the file's structure (names, order, attributes, dtypes, shapes) does "
            "not match its checksum",
            file=file,
            variable=STRUCTURE_ATTR,
            expected=f"crc32c {int(value):#010x}",
            found=f"crc32c {found:#010x}",
        )
