"""The on-disk encoding of ``DT_STRING`` tensors in a bundle's data file.

For N elements: ``varint64 len_0 ... len_{N-1}``, then the masked CRC-32C of the lengths taken as
fixed-width integers (uint32 little-endian, uint64 for a length above 2**32 - 1), then the string
bytes back to back. The entry checksum covers the fixed-width lengths, the 4 stored checksum
bytes and the string bytes (not the varint bytes).

Example:
    >>> data, crc = encode_strings([b"ab", b"", b"xyz"])
    >>> data.hex(" ")
    '02 00 03 1b 42 8b ca 61 62 78 79 7a'
"""

from __future__ import annotations

from collections.abc import Sequence

from ._crc import crc32c, mask, unmask
from ._proto import DecodeError, decode_varint, encode_varint

__all__ = ["encode_strings", "decode_strings", "StringChecksumError"]

_U32_MAX = 0xFFFFFFFF


class StringChecksumError(DecodeError):
    """The checksum of the lengths, or of the whole tensor, does not match."""

    def __init__(self, what: str, expected: int, found: int) -> None:
        super().__init__(what)
        self.what = what
        self.expected = expected
        self.found = found


def _fixed_lengths(lengths: Sequence[int], byteorder: str) -> bytes:
    return b"".join(n.to_bytes(4 if n <= _U32_MAX else 8, byteorder) for n in lengths)  # type: ignore[arg-type]


def encode_strings(values: Sequence[bytes], byteorder: str = "little") -> tuple[bytes, int]:
    """The data bytes of a string tensor (flattened, row-major) and its *unmasked* CRC-32C."""
    lengths = [len(v) for v in values]
    crc = crc32c(_fixed_lengths(lengths, byteorder))
    stored = mask(crc).to_bytes(4, byteorder)  # type: ignore[arg-type]
    crc = crc32c(stored, crc)
    body = b"".join(values)
    crc = crc32c(body, crc)
    return b"".join(encode_varint(n) for n in lengths) + stored + body, crc


def decode_strings(
    data: bytes, count: int, byteorder: str = "little", expected_crc: int | None = None
) -> list[bytes]:
    """Split the data bytes of a string tensor of ``count`` elements.

    Args:
        data: exactly the entry's bytes.
        count: the number of elements (from the entry's shape).
        byteorder: the bundle's byte order (for the fixed-width lengths under the checksum).
        expected_crc: the entry's unmasked checksum, or None to skip checking it.

    Raises:
        DecodeError: the bytes are malformed (``StringChecksumError`` for a checksum mismatch).
    """
    end = len(data)
    if count > end:
        raise DecodeError(f"{count} strings cannot fit in {end} bytes")
    pos = 0
    lengths = []
    for _ in range(count):
        n, pos = decode_varint(data, pos, end)
        lengths.append(n)
    if end - pos < 4:
        raise DecodeError("string tensor ends before its length checksum")
    crc = crc32c(_fixed_lengths(lengths, byteorder))
    stored = int.from_bytes(data[pos : pos + 4], byteorder)  # type: ignore[arg-type]
    if unmask(stored) != crc:
        raise StringChecksumError(
            "checksum of the string lengths does not match", unmask(stored), crc
        )
    crc = crc32c(data[pos : pos + 4], crc)
    pos += 4
    if sum(lengths) != end - pos:
        raise DecodeError(
            f"string lengths add up to {sum(lengths)} bytes, the entry holds {end - pos}"
        )
    if expected_crc is not None:
        crc = crc32c(data[pos:], crc)
        if crc != expected_crc:
            raise StringChecksumError("checksum does not match", expected_crc, crc)
    out = []
    for n in lengths:
        out.append(data[pos : pos + n])
        pos += n
    return out
