"""Size arguments (``"5GB"``, ``"512MiB"``, a byte count) parsed to bytes."""

from __future__ import annotations

from parallelvars.errors import InvalidArgumentError


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or ``"500MB"``, ``"2GiB"``, ``"1e9"`` (Hugging Face units)."""
    if isinstance(size, int):
        value = size
    else:
        text = str(size).strip().upper().replace(" ", "")
        units = {
            "KIB": 1 << 10,
            "MIB": 1 << 20,
            "GIB": 1 << 30,
            "TIB": 1 << 40,
            "KB": 10**3,
            "MB": 10**6,
            "GB": 10**9,
            "TB": 10**12,
            "B": 1,
        }
        for suffix, factor in units.items():
            if text.endswith(suffix):
                try:
                    value = int(float(text[: -len(suffix)]) * factor)
                except ValueError:
                    raise InvalidArgumentError(
                        f"cannot read size {size!r} (expected e.g. 500MB or 2GiB)"
                    ) from None
                break
        else:
            try:
                value = int(float(text))
            except ValueError:
                raise InvalidArgumentError(
                    f"cannot read size {size!r} (expected e.g. 500MB or 2GiB)"
                ) from None
    if value <= 0:
        raise InvalidArgumentError(f"size must be positive, got {size!r}")
    return value
