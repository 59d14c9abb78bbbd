"""Size arguments (``"5GB"``, ``"512MiB"``, a byte count) parsed to bytes: the one grammar of
``write_safetensors(max_shard_size=...)`` and of the CLI's ``--max-shard-size``."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from parallelvars.errors import InvalidArgumentError

__all__ = ["SIZE_GRAMMAR", "parse_size"]

# Decimal units are powers of 1000 and binary units powers of 1024, as in `5GB` vs `5GiB`
# (Hugging Face's `max_shard_size` spells them the same way).
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
# A size above 10**30 bytes is a typo; the bound also keeps `1e999999999` from becoming a
# billion-digit integer.
_MAX_EXPONENT = 30

#: The grammar in words, for error messages and help texts.
SIZE_GRAMMAR = (
    "a size such as 5GB, 500MB, 100KiB, 1.5GiB, 1e9 or 4096 "
    "(units: B, KB, MB, GB, TB decimal; KiB, MiB, GiB, TiB binary; none: bytes)"
)


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: a positive int, or text such as ``"5GB"``, ``"500MB"``,
    ``"100KiB"``, ``"1.5GiB"``, ``"1e9"`` or ``"4096"``.

    ``KB``/``MB``/``GB``/``TB`` are decimal (1000-based), ``KiB``/``MiB``/``GiB``/``TiB``
    binary (1024-based), case-insensitive, with optional blanks between number and unit; a
    bare number is bytes. Fractions are rounded down to whole bytes; the result must be at
    least one byte.

    Raises:
        InvalidArgumentError: ``size`` is not a size, or not a positive one.

    Example:
        >>> parse_size("5GB"), parse_size("100KiB"), parse_size("1.5kB"), parse_size("1e3")
        (5000000000, 102400, 1500, 1000)
    """
    if isinstance(size, bool):
        raise InvalidArgumentError(f"expected {SIZE_GRAMMAR}, got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE_RE.match(str(size))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidArgumentError(f"expected {SIZE_GRAMMAR}, got {size!r}")
        try:
            number = Decimal(match.group(1))
        except InvalidOperation:  # pragma: no cover - the pattern admits only numbers
            raise InvalidArgumentError(f"expected {SIZE_GRAMMAR}, got {size!r}") from None
        if number and number.adjusted() > _MAX_EXPONENT:
            raise InvalidArgumentError(f"size {size!r} is too large")
        value = int(number * _UNITS[unit])
    if value < 1:
        raise InvalidArgumentError(f"expected a size of at least one byte, got {size!r}")
    return value
