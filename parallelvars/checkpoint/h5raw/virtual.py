"""A virtual dataset's mapping, as HDF5 stores it in a global heap object.

Version 0 of the encoding: version (1 byte), number of entries (8), then per entry the source
file's name (``.``: this file) and the source dataset's name (NUL-terminated), the source
selection and the virtual selection, and after the entries the lookup3 checksum of everything
before it. libhdf5 2.0 writes version 1 (a flags byte per entry instead of the file name) and
version-3 hyperslabs, which HDF5 before 1.12 (Debian 12's ``hdf5-tools`` 1.10) cannot read; we
write what every HDF5 since 1.10 reads, and h5py reads both the same.

Our mappings are a sharded variable's ``value``: each shard's whole dataset (selection "all")
placed at its rows of the value (a regular hyperslab, version 2: flags 0x01, the length of the
rest, the rank, then start, stride, count and block per dimension in 8 bytes each), or nothing
("none") for an empty shard.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from parallelvars.checkpoint.h5raw.lookup3 import lookup3

__all__ = ["mapping"]

_ALL = struct.pack("<IIII", 3, 1, 0, 0)  # selection "all", version 1
_NONE = struct.pack("<IIII", 0, 1, 0, 0)  # selection "none", version 1
_SAME_FILE = 0x04


def _hyperslab(start: Sequence[int], block: Sequence[int]) -> bytes:
    """A regular hyperslab selection of one block at ``start``: version 2 (8-byte numbers,
    read by HDF5 1.10 and later)."""
    rank = len(start)
    values = [v for s, b in zip(start, block, strict=True) for v in (s, 1, 1, b)]
    head = struct.pack("<IIBII", 2, 2, 0x01, 4 + 8 * len(values), rank)
    return head + struct.pack(f"<{len(values)}Q", *values)


def _hyperslab_v3(start: Sequence[int], block: Sequence[int]) -> bytes:
    """The same selection as libhdf5 2.0 encodes it (version 3: numbers as wide as the
    largest needs), which HDF5 before 1.12 cannot read."""
    rank = len(start)
    values = [v for s, b in zip(start, block, strict=True) for v in (s, 1, 1, b)]
    top = max(values, default=0)
    width, code = (2, "H") if top <= 0xFFFF else (4, "I") if top <= 0xFFFFFFFF else (8, "Q")
    head = struct.pack("<IIBBI", 2, 3, 0x01, width, rank)
    return head + struct.pack(f"<{len(values)}{code}", *values)


def mapping(
    sources: Sequence[str],
    shape: Sequence[int],
    axis: int,
    bounds: Sequence[int],
    *,
    files: Sequence[str] | None = None,
) -> bytes:
    """The mapping of a virtual dataset of ``shape`` made of the datasets ``sources`` (absolute
    paths in the same file, or with ``files`` in those files: names as the links to them
    have them), source ``i`` holding rows ``bounds[i]:bounds[i + 1]`` of ``axis``."""
    out = [struct.pack("<BQ", 0, len(sources))]
    for i, name in enumerate(sources):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        file = b"." if files is None else files[i].encode("utf-8")
        out.append(file + b"\x00" + name.encode("utf-8") + b"\x00" + _ALL)
        if hi <= lo or 0 in [d for k, d in enumerate(shape) if k != axis]:
            out.append(_NONE)
        else:
            start = [lo if k == axis else 0 for k in range(len(shape))]
            block = [hi - lo if k == axis else int(d) for k, d in enumerate(shape)]
            out.append(_hyperslab(start, block))
    body = b"".join(out)
    return body + lookup3(body).to_bytes(4, "little")
