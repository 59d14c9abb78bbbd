"""Enumerations shared by variables, strategies and optimizers."""

from __future__ import annotations

import enum
from typing import TypeVar

from parallelvars.errors import DistributedValueError

__all__ = ["Synchronization", "Aggregation", "ReduceOp"]


_E = TypeVar("_E", bound="_Named")


class _Named(enum.Enum):
    """An enum whose values are lower-case strings, as stored in checkpoints."""

    @classmethod
    def parse(cls: type[_E], value: object) -> _E:
        """Accept a member, its value (``"sum"``) or its name (``"SUM"``)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value.lower() in (member.value, member.name.lower()):
                    return member
        raise DistributedValueError(
            f"invalid {cls.__name__}: {value!r} (expected one of {', '.join(m.name for m in cls)})"
        )

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class Synchronization(_Named):
    """When the components of a variable are kept in sync.

    ``AUTO`` means ``ON_WRITE`` for variables a strategy creates. ``ON_WRITE`` variables are
    mirrored: every write reaches every component. ``ON_READ`` variables keep one value per
    replica and are aggregated (see :class:`Aggregation`) when read in cross-replica context.
    """

    AUTO = "auto"
    ON_WRITE = "on_write"
    ON_READ = "on_read"


class Aggregation(_Named):
    """How per-replica writes or values are combined."""

    NONE = "none"
    SUM = "sum"
    MEAN = "mean"
    ONLY_FIRST_REPLICA = "only_first_replica"


class ReduceOp(_Named):
    """Cross-replica reductions."""

    SUM = "sum"
    MEAN = "mean"
