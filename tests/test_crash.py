"""SIGKILL a process that saves in a loop at random moments; the latest checkpoint survives whole.

The driver is bench/soak_crash.py (hundreds of kills there); here a short run of the same code.
"""

from __future__ import annotations

import sys

import pytest
import soak_crash

import parallelvars as pv

KILLS = 22


@pytest.mark.slow  # about 8 s of repeated SIGKILLs; CI runs it (.ci/run, -m slow)
@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_sigkill_during_saves_never_loses_or_tears_the_latest_checkpoint(tmp_path):
    result = soak_crash.run_kills(str(tmp_path), KILLS, seed=1234, max_delay=0.2, max_to_keep=3)
    assert result.failures == []
    assert result.kills == KILLS
    assert result.steps == sorted(result.steps)  # never backwards
    assert result.steps[-1] >= 5  # the loop made progress between kills
    # The next manager on the directory removes what the last kill left half-written.
    ckpt, _ = soak_crash.build()
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=3) as mgr:
        assert soak_crash.leftover_temporaries(str(tmp_path)) == []
        # max_to_keep, plus one checkpoint committed by a kill between its rename and the state
        # update: it is adopted on reopening, and retention applies at the next save.
        assert len(mgr.checkpoints) <= 3 + 1
        assert mgr.checkpoints[-1] == pv.latest_checkpoint(tmp_path)
        assert mgr.restore_or_initialize() == pv.latest_checkpoint(tmp_path)
    print(
        f"kills survived: {result.kills}, steps saved: {result.steps[-1]}, "
        f"kills that left a half-written file: {result.mid_write}"
    )
    assert result.mid_write >= 1  # some kills did land inside a write
