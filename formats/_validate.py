"""An entry checked against the documented model (kind, dtype, shape, components and their
attributes) before it is written and after it is decoded.
"""

from __future__ import annotations

import itertools

from parallelvars.errors import (
    InvalidEntryError,
    ShapeMismatchError,
)

from ._view import KINDS, Entry


def check_entry(entry: Entry, file: str | None = None) -> None:
    """Raise a clear error when ``entry``'s kind, components or shard offsets do not agree."""
    if entry.kind not in KINDS:
        raise InvalidEntryError(
            "unknown kind", variable=entry.path, expected=f"one of {KINDS}", found=repr(entry.kind)
        )
    if entry.num_components < 1:
        raise InvalidEntryError("an entry needs at least one component", variable=entry.path)
    if entry.kind == "single" and entry.num_components != 1:
        raise ShapeMismatchError(
            "a single variable has exactly one component",
            file=file,
            variable=entry.path,
            expected=1,
            found=entry.num_components,
        )
    if entry.kind == "sharded":
        shape = tuple(int(s) for s in entry.shape)
        try:
            axis = int(entry.attrs["shard_axis"])
            offsets = [int(o) for o in entry.attrs["shard_offsets"]]
        except (KeyError, TypeError, ValueError):
            raise ShapeMismatchError(
                "a sharded variable needs integer attrs shard_axis and shard_offsets",
                file=file,
                variable=entry.path,
                expected="shard_axis and shard_offsets",
                found=f"attrs {sorted(entry.attrs)}",
            ) from None
        if not 0 <= axis < len(shape):
            raise ShapeMismatchError(
                "shard axis out of range",
                file=file,
                variable=entry.path,
                expected=f"0 <= axis < {len(shape)}",
                found=axis,
            )
        if (
            len(offsets) != entry.num_components
            or (offsets and offsets[0] != 0)
            or any(b < a for a, b in itertools.pairwise(offsets))
            or (offsets and offsets[-1] > shape[axis])
        ):
            raise ShapeMismatchError(
                "shard offsets do not tile the sharded axis",
                file=file,
                variable=entry.path,
                expected=f"{entry.num_components} ascending offsets from 0 within {shape[axis]}",
                found=offsets,
            )
