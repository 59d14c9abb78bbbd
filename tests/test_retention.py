"""Retention policies as values (parallelvars.checkpoint.retention), tested without a directory."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import parallelvars as pv
from parallelvars.checkpoint.retention import (
    AnyOf,
    EveryNSeconds,
    Keep,
    KeepAll,
    LatestN,
    policy_from_arguments,
    retain,
)
from parallelvars.errors import InvalidArgumentError


@dataclass(frozen=True)
class C:
    number: int
    time: float


def reference_commit(managed, preserved, last, record, max_to_keep, keep_hours):
    """The manager's rule as it was written before policies (the contract they express)."""
    managed = [*managed, record]
    preserved = list(preserved)
    doomed = []
    while max_to_keep is not None and len(managed) > max_to_keep:
        old = managed.pop(0)
        if keep_hours is not None and (last is None or old.time - last >= keep_hours * 3600.0):
            preserved.append(old)
            last = old.time
        else:
            doomed.append(old)
    return managed, preserved, doomed, last


@settings(max_examples=300, deadline=None)
@given(
    gaps=st.lists(st.floats(0, 5 * 3600, allow_nan=False), min_size=1, max_size=40),
    max_to_keep=st.one_of(st.none(), st.integers(1, 6)),
    keep_hours=st.one_of(st.none(), st.floats(0, 3, allow_nan=False)),
)
def test_the_arguments_policy_is_the_managers_rule(gaps, max_to_keep, keep_hours) -> None:
    policy = policy_from_arguments(max_to_keep, keep_hours)
    times = np.cumsum(gaps).tolist()
    ours = ([], [], [], None)
    theirs = ([], [], [], None)
    for n, t in enumerate(times):
        record = C(n, t)
        theirs = reference_commit(theirs[0], theirs[1], theirs[3], record, max_to_keep, keep_hours)
        kept = retain(policy, [*ours[0], record], ours[3])
        ours = (kept.listed, ours[1] + kept.preserved, kept.deleted, kept.last_preserved)
        assert ours == theirs


def test_latest_n_lists_the_newest() -> None:
    listed = [C(n, float(n)) for n in range(5)]
    assert LatestN(2).decide(listed, None) == [Keep.DELETE] * 3 + [Keep.LIST] * 2
    kept = retain(LatestN(2), listed, None)
    assert [c.number for c in kept.listed] == [3, 4]
    assert [c.number for c in kept.deleted] == [0, 1, 2] and not kept.preserved


def test_every_n_seconds_keeps_one_per_interval_and_the_newest() -> None:
    listed = [C(n, n * 1000.0) for n in range(8)]
    assert [int(v) for v in EveryNSeconds(2500).decide(listed, None)] == [1, 0, 0, 1, 0, 0, 1, 0]
    assert EveryNSeconds(2500).decide(listed, last_preserved=500.0)[0] == Keep.DELETE
    kept = retain(EveryNSeconds(2500), listed, None)  # alone: the newest stays listed
    assert [c.number for c in kept.listed] == [7]
    assert [c.number for c in kept.preserved] == [0, 3, 6] and kept.last_preserved == 6000.0


def test_policies_combine_with_or_into_the_strongest_verdict() -> None:
    combined = LatestN(2) | EveryNSeconds(3600) | KeepAll()
    assert combined == AnyOf((LatestN(2), EveryNSeconds(3600), KeepAll()))
    listed = [C(n, n * 1800.0) for n in range(4)]
    assert (LatestN(2) | EveryNSeconds(3600)).decide(listed, None) == [
        Keep.PRESERVE,
        Keep.DELETE,
        Keep.LIST,
        Keep.LIST,
    ]
    assert combined.decide(listed, None) == [Keep.LIST] * 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_latest_n_refuses_what_is_not_a_count(bad) -> None:
    with pytest.raises(InvalidArgumentError):
        LatestN(bad)


def test_a_manager_takes_a_policy(tmp_path) -> None:
    step = pv.Variable(np.int64(0), name="step")
    ckpt = pv.Checkpoint(step=step)
    with pv.CheckpointManager(ckpt, tmp_path, retention=LatestN(2)) as mgr:
        for _ in range(4):
            mgr.save()
        assert [p.rsplit("-", 1)[1] for p in mgr.checkpoints] == ["3.h5", "4.h5"]
    assert sorted(p.name for p in tmp_path.glob("*.h5")) == ["ckpt-3.h5", "ckpt-4.h5"]
    with pytest.raises(InvalidArgumentError, match="not both"):
        pv.CheckpointManager(ckpt, tmp_path, max_to_keep=3, retention=LatestN(2))
    with pytest.raises(InvalidArgumentError, match="not both"):
        pv.CheckpointManager(ckpt, tmp_path, keep_checkpoint_every_n_hours=1, retention=KeepAll())
    with pytest.raises(pv.errors.InvalidArgumentTypeError):
        pv.CheckpointManager(ckpt, tmp_path, retention=3)
