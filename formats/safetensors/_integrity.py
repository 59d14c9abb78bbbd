"""Our integrity record in ``__metadata__["parallelvars_crc32c"]``: the header's CRC (of its
bytes as stored, in the ``raw:`` records our writer writes; of a canonical description in older
files), the record's string form, the shard index's CRC, and their verification on opening.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import crc32c as _crc32c
import numpy as np

from parallelvars._fileio import load_json
from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
)
from parallelvars.formats.safetensors._layout import CRC_KEY, META_KEY

_HEX = frozenset("0123456789abcdef")


def _header_crc(
    metadata: Mapping[str, str],
    tensors: Mapping[str, tuple[str, list[int], list[int]]],
    crcs: Mapping[str, str],
) -> str:
    """CRC-32C of a canonical description of a header: every tensor's name, dtype string,
    shape, offsets and CRC, and every metadata item but our checksum record."""
    doc = {
        "metadata": {k: v for k, v in metadata.items() if k != CRC_KEY},
        "tensors": {
            name: [dtype, list(shape), list(offsets), crcs[name]]
            for name, (dtype, shape, offsets) in tensors.items()
        },
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{_crc32c.crc32c(text.encode('ascii')):08x}"


def _crc_record(header_crc: str, crcs: Mapping[str, str], prefix: str = "") -> str:
    return prefix + header_crc + "".join(crcs[name] for name in sorted(crcs))


#: The prefix of a record whose header CRC covers the header's own bytes (what our writer
#: writes): the CRC-32C of the JSON header exactly as stored, every hex digit of the record
#: read as ``0``. A record without it (older files) covers the canonical description
#: (:func:`_header_crc`).
RAW_PREFIX = "raw:"


def _record_at(raw: bytes, record: str) -> int:
    """Where the hex digits of the ``raw:`` record ``record`` begin in the header bytes
    ``raw``; -1 when they are not there once, written as our writer writes them."""
    needle = f"{json.dumps(CRC_KEY)}:{json.dumps(record)}".encode("ascii")
    at = raw.find(needle)
    if at < 0 or raw.find(needle, at + 1) >= 0:
        return -1
    return at + len(json.dumps(CRC_KEY)) + 2 + len(RAW_PREFIX)


def raw_header_crc(raw: bytes, at: int, digits: int) -> str:
    """CRC-32C of the header bytes ``raw`` with the ``digits`` record digits at ``at`` read as
    ``0`` (8 hex digits)."""
    crc = _crc32c.crc32c(raw[:at])
    crc = _crc32c.crc32c(b"0" * digits, crc)
    return f"{_crc32c.crc32c(raw[at + digits :], crc):08x}"


def record_header_crc(record: str) -> str:
    """The header CRC a record carries (8 hex digits), either form."""
    return (
        record[len(RAW_PREFIX) : len(RAW_PREFIX) + 8]
        if record.startswith(RAW_PREFIX)
        else record[:8]
    )


def _index_crc(metadata: Mapping[str, Any], weight_map: Mapping[str, str]) -> str:
    """CRC-32C of a canonical description of a shard set's index (all but our checksum)."""
    doc = {
        "metadata": {k: v for k, v in metadata.items() if k != CRC_KEY},
        "weight_map": dict(weight_map),
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{_crc32c.crc32c(text.encode('ascii')):08x}"


def _record_crcs(
    file: str,
    metadata: Mapping[str, str],
    names: Sequence[str],
    header: bytes,
    describe: Callable[[], Mapping[str, tuple[str, list[int], list[int]]]],
) -> np.ndarray | None:
    """Check our checksum record of a header (``header``: its JSON bytes as stored; ``names``:
    its tensors in file order; ``describe``: each tensor's dtype string, shape and offsets as
    written, asked only for an older record, whose CRC covers that description); the tensors'
    CRCs in ``names``' order (int64), or None for a file without a record.

    A file whose parallel info says it carries checksums must have the record.
    """
    raw = metadata.get(CRC_KEY)
    if raw is None:
        info = metadata.get(META_KEY)
        if info is not None and '"checksums"' in info:
            try:
                flagged = load_json(
                    info.encode("utf-8", "surrogatepass"), file=file, variable=META_KEY
                ).get("checksums")
            except (CorruptCheckpointError, AttributeError):
                flagged = None  # reported by the info parser
            if flagged:
                raise CorruptCheckpointError(
                    "the checksum record is missing",
                    file=file,
                    variable=CRC_KEY,
                    expected=f"a {CRC_KEY!r} metadata item",
                    found="none",
                )
        return None
    count = len(names)
    record = raw
    by_bytes = raw.startswith(RAW_PREFIX)
    if by_bytes:
        raw = raw[len(RAW_PREFIX) :]
    if len(raw) != 8 * (1 + count) or not set(raw) <= _HEX:
        raise CorruptCheckpointError(
            "the checksum record is damaged",
            file=file,
            variable=CRC_KEY,
            expected=f"{8 * (1 + count)} hex digits for {count} tensors",
            found=f"{raw[:80]!r}",
        )
    stored = raw[:8]
    if by_bytes:
        at = _record_at(header, record)
        if at < 0:
            raise CorruptCheckpointError(
                "the checksum record is not where the header's bytes hold it",
                file=file,
                variable=CRC_KEY,
                expected=f"one {CRC_KEY!r} item of plain text",
                found="none or several",
            )
        found = raw_header_crc(header, at, len(raw))
    else:
        ordered = sorted(names)
        digits = [raw[8 * k : 8 * k + 8] for k in range(1, count + 1)]
        found = _header_crc(metadata, describe(), dict(zip(ordered, digits, strict=True)))
    if found != stored:
        raise ChecksumMismatchError(
            "the safetensors header does not match its checksum",
            file=file,
            variable=CRC_KEY,
            expected=f"crc32c {stored}",
            found=f"crc32c {found}",
        )
    # Each tensor's 8 hex digits (name order) as an integer, in bulk, then in file order.
    # (a digit at a time: temporaries of a byte or an int64 per tensor, not eight int64s)
    hexes = np.frombuffer(raw.encode("ascii"), np.uint8)[8:].reshape(count, 8)
    by_name = np.zeros(count, np.int64)
    for j in range(8):
        digit = hexes[:, j] - 48
        digit -= (digit > 9).view(np.uint8) * 39
        by_name <<= 4
        by_name |= digit
    out = np.empty(count, np.int64)
    out[sorted(range(count), key=names.__getitem__)] = by_name
    return out
