"""HDF5 fractal heaps: where a group's links live in dense storage.

A fractal heap (``FRHP`` header) keeps objects in direct blocks (``FHDB``) of a doubling table:
rows 0 and 1 of blocks of the starting size, each later row's blocks twice the size of the
row before, ``width`` blocks a row. A direct block holds its checksum in its prefix, taken over
the whole block with the checksum field zeroed.
"""

from __future__ import annotations

__all__ = ["direct_block_extent"]


def direct_block_extent(image: bytes, at: int) -> tuple[int, int, int] | None:
    """(start, end, checksum offset) of the fractal heap direct block at ``at`` of ``image``,
    from its heap header (``FRHP``: 8-byte addresses and lengths, no filters, checksummed
    direct blocks); None for anything else."""
    if image[at + 4 : at + 5] != b"\x00":
        return None
    heap = int.from_bytes(image[at + 5 : at + 13], "little")
    hdr = image[heap : heap + 146]
    if len(hdr) < 146 or hdr[:5] != b"FRHP\x00" or hdr[7:9] != b"\x00\x00" or not hdr[9] & 2:
        return None
    width = int.from_bytes(hdr[110:112], "little")
    first = int.from_bytes(hdr[112:120], "little")
    bits = int.from_bytes(hdr[128:130], "little")
    off_size = (bits + 7) // 8
    if not (width and first and 0 < off_size <= 8):
        return None
    offset = int.from_bytes(image[at + 13 : at + 13 + off_size], "little")
    # The doubling table: rows 0 and 1 of blocks of the first size, then each row's twice
    # the last's, ``width`` blocks a row.
    row = offset // (width * first)
    size = first if row == 0 else first << (row.bit_length() - 1)
    cpos = at + 13 + off_size
    if cpos + 4 > at + size or at + size > len(image):
        return None
    return at, at + size, cpos
