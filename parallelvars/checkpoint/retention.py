"""Which checkpoints a :class:`~parallelvars.checkpoint.CheckpointManager` keeps: retention as
policy values.

At every commit the manager hands its policy the checkpoints it lists (oldest first, the new
one last) and the time of the last checkpoint kept for good; the policy gives each one a
:class:`Keep` verdict:

* ``LIST``: kept and listed in ``manager.checkpoints`` (the newest is always listed);
* ``PRESERVE``: kept for good, no longer listed (and never deleted by a manager);
* ``DELETE``: deleted, once the state file no longer names it.

Policies combine with ``|`` (:class:`AnyOf`): each checkpoint gets the strongest verdict any of
them gives. ``CheckpointManager(max_to_keep=5, keep_checkpoint_every_n_hours=2)`` is
``LatestN(5) | EveryNSeconds(2 * 3600)``; ``max_to_keep=None`` is :class:`KeepAll`.

Example:
    >>> from parallelvars.checkpoint.retention import EveryNSeconds, LatestN, Retained, retain
    >>> class C:  # anything with a number and a time (seconds)
    ...     def __init__(self, number, time): self.number, self.time = number, time
    >>> listed = [C(n, n * 1800.0) for n in range(4)]  # one every half hour
    >>> kept = retain(LatestN(2) | EveryNSeconds(3600), listed, last_preserved=None)
    >>> [c.number for c in kept.listed], [c.number for c in kept.preserved], [c.number for c in kept.deleted]
    ([2, 3], [0], [1])
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from parallelvars.errors import InvalidArgumentError

__all__ = [
    "AnyOf",
    "CheckpointInfo",
    "EveryNSeconds",
    "Keep",
    "KeepAll",
    "LatestN",
    "Retained",
    "RetentionPolicy",
    "policy_from_arguments",
    "retain",
]


class Keep(enum.IntEnum):
    """A policy's verdict on one checkpoint; a larger value keeps more."""

    DELETE = 0
    PRESERVE = 1
    LIST = 2


class CheckpointInfo(Protocol):
    """What a policy knows of a checkpoint: its number and when it was written (seconds since
    the epoch)."""

    @property
    def number(self) -> int: ...

    @property
    def time(self) -> float: ...


class RetentionPolicy(abc.ABC):
    """Decides, at each commit, what becomes of the checkpoints a manager lists."""

    @abc.abstractmethod
    def decide(
        self, checkpoints: Sequence[CheckpointInfo], last_preserved: float | None
    ) -> list[Keep]:
        """One verdict per checkpoint of ``checkpoints`` (listed, oldest first, the newest
        last); ``last_preserved``: when the last checkpoint kept for good was written (None:
        none yet)."""

    def __or__(self, other: RetentionPolicy) -> AnyOf:
        """Keep what either keeps (the strongest verdict of the two)."""
        if not isinstance(other, RetentionPolicy):
            return NotImplemented
        mine = self.policies if isinstance(self, AnyOf) else (self,)
        theirs = other.policies if isinstance(other, AnyOf) else (other,)
        return AnyOf((*mine, *theirs))


@dataclass(frozen=True)
class KeepAll(RetentionPolicy):
    """Every checkpoint stays listed (``max_to_keep=None``)."""

    def decide(
        self, checkpoints: Sequence[CheckpointInfo], last_preserved: float | None
    ) -> list[Keep]:
        return [Keep.LIST] * len(checkpoints)


@dataclass(frozen=True)
class LatestN(RetentionPolicy):
    """The ``n`` newest checkpoints stay listed; older ones are deleted (``max_to_keep=n``)."""

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise InvalidArgumentError(f"LatestN needs n >= 1, got {self.n!r}")

    def decide(
        self, checkpoints: Sequence[CheckpointInfo], last_preserved: float | None
    ) -> list[Keep]:
        old = max(len(checkpoints) - self.n, 0)
        return [Keep.DELETE] * old + [Keep.LIST] * (len(checkpoints) - old)


@dataclass(frozen=True)
class EveryNSeconds(RetentionPolicy):
    """Keep for good one checkpoint per ``seconds``: oldest first, each written at least
    ``seconds`` after the last one kept for good (the first when none was)
    (``keep_checkpoint_every_n_hours=h`` is ``EveryNSeconds(h * 3600)``)."""

    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, int | float):
            raise InvalidArgumentError(f"EveryNSeconds needs a number, got {self.seconds!r}")

    def decide(
        self, checkpoints: Sequence[CheckpointInfo], last_preserved: float | None
    ) -> list[Keep]:
        out = []
        for c in checkpoints:
            if last_preserved is None or c.time - last_preserved >= self.seconds:
                out.append(Keep.PRESERVE)
                last_preserved = c.time
            else:
                out.append(Keep.DELETE)
        return out


@dataclass(frozen=True)
class AnyOf(RetentionPolicy):
    """Keep what any of ``policies`` keeps: each checkpoint's strongest verdict."""

    policies: tuple[RetentionPolicy, ...]

    def decide(
        self, checkpoints: Sequence[CheckpointInfo], last_preserved: float | None
    ) -> list[Keep]:
        out = [Keep.DELETE] * len(checkpoints)
        for policy in self.policies:
            out = list(map(max, out, policy.decide(checkpoints, last_preserved)))
        return out


C = TypeVar("C", bound=CheckpointInfo)


@dataclass(frozen=True)
class Retained(Generic[C]):
    """What a commit keeps: the checkpoints still listed, those newly kept for good, those to
    delete (each oldest first), and when the last one kept for good was written."""

    listed: list[C]
    preserved: list[C]
    deleted: list[C]
    last_preserved: float | None


def retain(
    policy: RetentionPolicy, listed: Sequence[C], last_preserved: float | None
) -> Retained[C]:
    """Apply ``policy`` to the checkpoints a manager lists (oldest first, the newest last,
    which stays listed whatever the policy says)."""
    verdicts = policy.decide(listed, last_preserved)
    if len(verdicts) != len(listed):
        raise InvalidArgumentError(
            f"{type(policy).__name__}.decide gave {len(verdicts)} verdicts for "
            f"{len(listed)} checkpoints (expected one each)"
        )
    if verdicts:
        verdicts[-1] = Keep.LIST
    out: Retained[C] = Retained([], [], [], last_preserved)
    for c, verdict in zip(listed, verdicts, strict=True):
        if verdict == Keep.LIST:
            out.listed.append(c)
        elif verdict == Keep.PRESERVE:
            out.preserved.append(c)
        else:
            out.deleted.append(c)
    if out.preserved:
        out = Retained(out.listed, out.preserved, out.deleted, out.preserved[-1].time)
    return out


def policy_from_arguments(
    max_to_keep: int | None, keep_checkpoint_every_n_hours: float | None
) -> RetentionPolicy:
    """The policy of ``CheckpointManager``'s ``max_to_keep`` and
    ``keep_checkpoint_every_n_hours``: the ``max_to_keep`` newest listed (all with None), and
    of those leaving the window, one per ``keep_checkpoint_every_n_hours`` kept for good."""
    policy: RetentionPolicy = KeepAll() if max_to_keep is None else LatestN(max_to_keep)
    if keep_checkpoint_every_n_hours is not None:
        policy = policy | EveryNSeconds(keep_checkpoint_every_n_hours * 3600.0)
    return policy
