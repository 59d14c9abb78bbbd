"""CRC-32C (Castagnoli) and the checksum masking of LevelDB tables and TensorFlow bundles.

The checksum itself comes from the ``crc32c`` package (hardware accelerated, and it reads numpy
arrays and memoryviews without copying them). TensorFlow never stores a raw CRC next to the data
it covers: a CRC of bytes that themselves contain CRCs is weak, so stored values are *masked*
(rotated right by 15 bits and offset by a constant), and unmasked before comparison.
"""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c

__all__ = ["MASK_DELTA", "crc32c", "mask", "unmask", "masked_crc32c"]

MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF


def crc32c(data: Any, value: int = 0) -> int:
    """The CRC-32C of ``data`` (any buffer: bytes, memoryview, C-contiguous numpy array).

    Args:
        data: the bytes to checksum.
        value: the CRC of the bytes that precede ``data``, to extend a running checksum.
    """
    return int(_crc32c.crc32c(data, value=value))


def mask(crc: int) -> int:
    """Mask a CRC the way TensorFlow stores it: rotate right by 15 bits, add ``MASK_DELTA``."""
    crc &= _U32
    return ((((crc >> 15) | (crc << 17)) & _U32) + MASK_DELTA) & _U32


def unmask(masked: int) -> int:
    """Invert :func:`mask`."""
    rot = (masked - MASK_DELTA) & _U32
    return ((rot >> 17) | (rot << 15)) & _U32


def masked_crc32c(data: Any, value: int = 0) -> int:
    """``mask(crc32c(data, value))``."""
    return mask(crc32c(data, value))
