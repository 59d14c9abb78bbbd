"""CheckpointManager: numbering, retention, state file, restart, lock, failures, async saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import parallelvars as pv
from parallelvars.checkpoint import h5io, manager
from parallelvars.checkpoint.h5io import write as h5write
from parallelvars.checkpoint.h5raw import native
from parallelvars.errors import CheckpointLockedError, ParallelVarsError
from parallelvars.testing import PlanCache


def make(num_devices: int = 2):
    with pv.MirroredStrategy(num_devices).scope():
        w = pv.Variable(np.zeros((4, 3), np.float32), name="w")
        e = pv.Variable(np.zeros((6, 2), np.int64), name="e", shard_axis=0)
    step = pv.Variable(np.int64(0), name="step")
    model = pv.Module()
    model.w, model.e = w, e
    return pv.Checkpoint(model=model, step=step), w, e, step


def set_values(w, e, step, k: int) -> None:
    w.assign(np.full((4, 3), k, np.float32))
    e.assign(np.arange(12, dtype=np.int64).reshape(6, 2) + k)
    step.assign(np.int64(k))


def names(paths: list[str]) -> list[str]:
    return [os.path.basename(p) for p in paths]


def listing(d) -> set[str]:
    return set(os.listdir(d))


def test_save_numbers_retention_and_state(tmp_path):
    ckpt, w, e, step = make()
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=3) as mgr:
        assert mgr.latest_checkpoint is None and mgr.checkpoints == []
        for k in range(1, 6):
            set_values(w, e, step, k)
            assert os.path.basename(mgr.save()) == f"ckpt-{k}.h5"
        assert names(mgr.checkpoints) == ["ckpt-3.h5", "ckpt-4.h5", "ckpt-5.h5"]
        assert mgr.latest_checkpoint == str(tmp_path / "ckpt-5.h5")
    assert {f for f in listing(tmp_path) if f.endswith(".h5")} == {
        "ckpt-3.h5",
        "ckpt-4.h5",
        "ckpt-5.h5",
    }
    text = (tmp_path / manager.STATE_FILE).read_text()
    state = json.loads(text)
    assert "\n  " in text  # indented: meant to be read by people
    assert state["latest"] == "ckpt-5.h5"
    assert [c["file"] for c in state["checkpoints"]] == ["ckpt-3.h5", "ckpt-4.h5", "ckpt-5.h5"]
    assert pv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-5.h5")


def test_found_again_after_restart_and_restore(tmp_path):
    ckpt, w, e, step = make()
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=2) as mgr:
        for k in (1, 2, 3):
            set_values(w, e, step, k)
            mgr.save()
    ckpt2, w2, e2, step2 = make(num_devices=3)  # a restart, on another device count
    with pv.CheckpointManager(ckpt2, tmp_path, max_to_keep=2) as mgr2:
        assert names(mgr2.checkpoints) == ["ckpt-2.h5", "ckpt-3.h5"]
        assert mgr2.restore_or_initialize() == str(tmp_path / "ckpt-3.h5")
        assert int(step2) == 3 and int(ckpt2.save_counter) == 3
        for c in w2.components:
            np.testing.assert_array_equal(c, np.full((4, 3), 3, np.float32))
        np.testing.assert_array_equal(np.asarray(e2), np.arange(12).reshape(6, 2) + 3)
        assert os.path.basename(mgr2.save()) == "ckpt-4.h5"
        assert names(mgr2.checkpoints) == ["ckpt-3.h5", "ckpt-4.h5"]


def test_restore_or_initialize_calls_init_fn_when_empty(tmp_path):
    ckpt, _w, *_ = make()
    calls = []
    with pv.CheckpointManager(ckpt, tmp_path, init_fn=lambda: calls.append(1)) as mgr:
        assert mgr.restore_or_initialize() is None
    assert calls == [1]


def test_max_to_keep_none_keeps_everything(tmp_path):
    ckpt, *_ = make()
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=None) as mgr:
        for _ in range(7):
            mgr.save()
        assert len(mgr.checkpoints) == 7


def test_explicit_checkpoint_number_and_overwrite(tmp_path):
    ckpt, w, e, step = make()
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=3, checkpoint_name="model") as mgr:
        assert os.path.basename(mgr.save(checkpoint_number=100)) == "model-100.h5"
        set_values(w, e, step, 9)
        mgr.save(checkpoint_number=100)
        assert names(mgr.checkpoints) == ["model-100.h5"]
        assert os.path.basename(mgr.save(checkpoint_number=np.int64(7))) == "model-7.h5"
        assert mgr.latest_checkpoint.endswith(
            "model-7.h5"
        )  # the last saved, not the largest number
    assert pv.latest_checkpoint(tmp_path).endswith("model-7.h5")
    with h5io.H5Reader(tmp_path / "model-100.h5") as r:
        assert int(r["step"].component(0)) == 9


def test_keep_checkpoint_every_n_hours(tmp_path, monkeypatch):
    clock = [1_000_000.0]
    monkeypatch.setattr(manager.time, "time", lambda: clock[0])
    ckpt, *_ = make()
    with pv.CheckpointManager(
        ckpt, tmp_path, max_to_keep=2, keep_checkpoint_every_n_hours=1.0
    ) as mgr:
        for _ in range(8):
            mgr.save()
            clock[0] += 1800.0  # half an hour per save
        assert names(mgr.checkpoints) == ["ckpt-7.h5", "ckpt-8.h5"]
    # 1..6 left the window; kept: the first, then every one an hour later than the last kept.
    kept = sorted(f for f in listing(tmp_path) if f.endswith(".h5"))
    assert kept == ["ckpt-1.h5", "ckpt-3.h5", "ckpt-5.h5", "ckpt-7.h5", "ckpt-8.h5"]
    state = json.loads((tmp_path / manager.STATE_FILE).read_text())
    assert [p["file"] for p in state["preserved"]] == ["ckpt-1.h5", "ckpt-3.h5", "ckpt-5.h5"]
    # A restart keeps them (never deleting preserved ones) and goes on with the same policy:
    # ckpt-7 leaves the window an hour after ckpt-5 was kept, so it is kept too.
    ckpt2, *_ = make()
    with pv.CheckpointManager(
        ckpt2, tmp_path, max_to_keep=2, keep_checkpoint_every_n_hours=1.0
    ) as mgr:
        ckpt2.save_counter.assign(8)
        mgr.save()
        assert names(mgr.checkpoints) == ["ckpt-8.h5", "ckpt-9.h5"]
    kept = sorted(f for f in listing(tmp_path) if f.endswith(".h5"))
    assert kept == ["ckpt-1.h5", "ckpt-3.h5", "ckpt-5.h5", "ckpt-7.h5", "ckpt-8.h5", "ckpt-9.h5"]


def test_checkpoint_interval(tmp_path):
    ckpt, _w, _e, step = make()
    with pv.CheckpointManager(
        ckpt, tmp_path, step_counter=step, checkpoint_interval=10, max_to_keep=None
    ) as mgr:
        saved = []
        for k in range(0, 35, 5):
            step.assign(np.int64(k))
            saved.append(mgr.save() is not None)
        assert saved == [True, False, True, False, True, False, True]
        step.assign(np.int64(31))
        assert mgr.save() is None
        assert mgr.save(check_interval=False) is not None
    with pytest.raises(ValueError, match="step_counter"):
        pv.CheckpointManager(ckpt, tmp_path / "x", checkpoint_interval=5)


def test_retention_deletes_only_its_own_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "other-1.h5").write_bytes(b"not ours")
    ckpt, *_ = make()
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=1) as mgr:
        for _ in range(3):
            mgr.save()
    assert {"notes.txt", "other-1.h5", "ckpt-3.h5"} <= listing(tmp_path)
    assert "ckpt-1.h5" not in listing(tmp_path) and "ckpt-2.h5" not in listing(tmp_path)


# ----------------------------------------------------------------------------- the lock
def test_second_manager_is_refused_until_the_first_closes(tmp_path):
    ckpt, *_ = make()
    mgr = pv.CheckpointManager(ckpt, tmp_path)
    mgr.save()
    with pytest.raises(CheckpointLockedError, match=str(os.getpid())) as info:
        pv.CheckpointManager(make()[0], tmp_path)
    assert isinstance(info.value, RuntimeError)
    assert pv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1.h5")  # readers need no lock
    mgr.close()
    with pv.CheckpointManager(make()[0], tmp_path) as again:
        assert again.latest_checkpoint == str(tmp_path / "ckpt-1.h5")
    with pytest.raises(ParallelVarsError, match="closed"):
        mgr.save()


HOLD_LOCK = """
import sys, numpy as np, parallelvars as pv
mgr = pv.CheckpointManager(pv.Checkpoint(v=pv.Variable(np.float32(1), name="v")), sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


def test_lock_of_another_process_and_its_release_when_killed(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout.readline().strip() == b"locked"
        with pytest.raises(CheckpointLockedError, match=f"process {proc.pid}"):
            pv.CheckpointManager(make()[0], tmp_path)
    finally:
        proc.kill()
        proc.communicate()
    with pv.CheckpointManager(make()[0], tmp_path) as mgr:  # the dead process's lock is gone
        mgr.save()


# ----------------------------------------------------------------------------- crash leftovers
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftover_temporaries_are_ignored_and_removed(tmp_path):
    ckpt, _w, _e, _step = make()
    with pv.CheckpointManager(ckpt, tmp_path) as mgr:
        mgr.save()
    pid = dead_pid()
    stale = [f".ckpt-2.h5.tmp-{pid}-0badf00d", f".{manager.STATE_FILE}.tmp-{pid}-12345678"]
    for f in stale:
        (tmp_path / f).write_bytes(b"\x89HDF\r\n\x1a\n half a checkpoint")
    live = f".ckpt-9.h5.tmp-{os.getppid()}-abcdef01"  # a live process's: not ours to delete
    (tmp_path / live).write_bytes(b"busy")
    unrelated = f".other.h5.tmp-{pid}-abcdef01"
    (tmp_path / unrelated).write_bytes(b"someone else's")
    assert pv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1.h5")
    with pv.CheckpointManager(make()[0], tmp_path) as mgr:
        assert names(mgr.checkpoints) == ["ckpt-1.h5"]
    left = listing(tmp_path)
    assert not any(f in left for f in stale)
    assert live in left and unrelated in left


def test_committed_checkpoint_missing_from_state_is_adopted(tmp_path):
    """A crash after the checkpoint's rename but before the state's: the checkpoint counts."""
    ckpt, w, e, step = make()
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=2) as mgr:
        mgr.save()
        mgr.save()
    set_values(w, e, step, 3)
    ckpt.save_counter.assign(2)
    ckpt.save(str(tmp_path / "ckpt"))  # writes ckpt-3.h5 without the manager
    assert pv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-3.h5")
    ckpt2, _w2, _, step2 = make()
    with pv.CheckpointManager(ckpt2, tmp_path, max_to_keep=2) as mgr:
        assert names(mgr.checkpoints) == ["ckpt-1.h5", "ckpt-2.h5", "ckpt-3.h5"]
        mgr.restore_or_initialize()
        assert int(step2) == 3
        mgr.save()
        assert names(mgr.checkpoints) == ["ckpt-3.h5", "ckpt-4.h5"]


CRASH_DURING_SAVE = """
import os, sys
import parallelvars as pv
from test_manager import make, set_values
directory, point = sys.argv[1], sys.argv[2]
ckpt, w, e, step = make()
mgr = pv.CheckpointManager(ckpt, directory, max_to_keep=1)
set_values(w, e, step, 1)
mgr.save()
when, op, target = point.split()
real = {"replace": os.replace, "unlink": os.unlink}[op]
def hooked(*args):
    name = os.path.basename(os.fspath(args[-1] if op == "replace" else args[0]))
    if name == target and when == "before":
        os._exit(17)
    real(*args)
    if name == target:
        os._exit(17)
setattr(os, op, hooked)
set_values(w, e, step, 2)
mgr.save()
"""


@pytest.mark.parametrize(
    "point, newest",
    [
        ("before replace ckpt-2.h5", 1),
        ("after replace ckpt-2.h5", 2),
        ("before replace checkpoint.json", 2),
        ("after replace checkpoint.json", 2),
        ("after unlink ckpt-1.h5", 2),
    ],
)
def test_a_crash_at_any_step_of_a_save_keeps_the_newest_checkpoint(
    tmp_path, point, newest, helper_env
):
    """The process dies before or after each rename and deletion of a save (retention keeps
    one): the newest committed checkpoint is found whole, by readers and by the next manager."""
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_DURING_SAVE, str(tmp_path), point],
        capture_output=True,
        timeout=120,
        env=helper_env,
    )
    assert proc.returncode == 17, proc.stderr.decode()  # died at that point
    expected = str(tmp_path / f"ckpt-{newest}.h5")
    assert pv.latest_checkpoint(tmp_path) == expected
    ckpt, w, _e, step = make()
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=1, read_only=True) as reader:
        assert reader.restore_or_initialize() == expected
        assert int(step) == newest and float(np.asarray(w)[0, 0]) == newest
    ckpt, w, e, step = make()
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=1) as mgr:
        assert mgr.latest_checkpoint == expected
        mgr.restore_or_initialize()
        assert int(step) == newest
        set_values(w, e, step, 7)
        mgr.save()
        assert names(mgr.checkpoints) == [f"ckpt-{newest + 1}.h5"]
    assert pv.latest_checkpoint(tmp_path) == str(tmp_path / f"ckpt-{newest + 1}.h5")


def test_state_file_damaged_or_missing_falls_back_to_the_files(tmp_path):
    ckpt, *_ = make()
    with pv.CheckpointManager(ckpt, tmp_path) as mgr:
        mgr.save()
        mgr.save()
    (tmp_path / manager.STATE_FILE).write_text("{ not json")
    assert pv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2.h5")
    os.unlink(tmp_path / manager.STATE_FILE)
    assert pv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2.h5")
    with pv.CheckpointManager(make()[0], tmp_path) as mgr:
        assert names(mgr.checkpoints) == ["ckpt-1.h5", "ckpt-2.h5"]
    assert pv.latest_checkpoint(tmp_path / "missing") is None


def test_state_file_is_checksummed(tmp_path):
    ckpt, *_ = make()
    with pv.CheckpointManager(ckpt, tmp_path) as mgr:
        mgr.save()
    state = json.loads((tmp_path / manager.STATE_FILE).read_text())
    assert state["version"] == 2 and state["crc32c"] == manager._state_checksum(state)
    state["latest"] = "ckpt-0.h5"  # not checked again: not trusted
    (tmp_path / manager.STATE_FILE).write_text(json.dumps(state))
    assert manager._read_state(str(tmp_path)) is None
    assert pv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1.h5")


def test_read_only_manager_beside_the_writer(tmp_path):
    ckpt, w, e, step = make()
    writer = pv.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    reader_ckpt, _w2, _e2, step2 = make()
    reader = pv.CheckpointManager(reader_ckpt, tmp_path, read_only=True)  # no lock taken
    assert reader.read_only and not writer.read_only
    assert reader.latest_checkpoint is None and reader.restore_or_initialize() is None
    for k in (1, 2, 3):
        set_values(w, e, step, k)
        writer.save()
        assert reader.latest_checkpoint == writer.latest_checkpoint  # follows the writer
        assert reader.restore_or_initialize() == writer.latest_checkpoint and int(step2) == k
    assert reader.checkpoints == writer.checkpoints
    with pytest.raises(pv.errors.ReadOnlyDirectoryError):
        reader.save()
    reader.close()
    writer.close()


# ----------------------------------------------------------------------------- failures
class Boom(OSError):
    pass


def failing_write_entry(monkeypatch, after: int) -> None:
    real = native._check_components
    count = [0]

    def write_entry(*args):
        count[0] += 1
        if count[0] > after:
            raise Boom(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(native, "_check_components", write_entry)
    # Every save prepared anew (a repeated save would be written from its cached metadata).
    monkeypatch.setattr(PlanCache, "get", lambda self, key: None)


def test_failed_save_raises_and_leaves_everything_intact(tmp_path, monkeypatch):
    ckpt, w, e, step = make()
    mgr = pv.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    for k in (1, 2):
        set_values(w, e, step, k)
        mgr.save()
    before = {f: (tmp_path / f).read_bytes() for f in listing(tmp_path)}
    set_values(w, e, step, 3)
    failing_write_entry(monkeypatch, after=2)
    with pytest.raises(OSError):  # CheckpointWriteError, an OSError with the errno
        mgr.save()
    assert {
        f: (tmp_path / f).read_bytes() for f in listing(tmp_path)
    } == before  # no temporary either
    assert int(ckpt.save_counter) == 2
    assert names(mgr.checkpoints) == ["ckpt-1.h5", "ckpt-2.h5"]
    monkeypatch.undo()
    assert os.path.basename(mgr.save()) == "ckpt-3.h5"
    mgr.close()
    ckpt2, _w2, _, step2 = make()
    ckpt2.restore(pv.latest_checkpoint(tmp_path)).assert_consumed()
    assert int(step2) == 3


@pytest.mark.parametrize("number", [-1, "seven", [1, 2]])
def test_refused_checkpoint_number_leaves_the_counter(tmp_path, number):
    ckpt, *_ = make()
    with pv.CheckpointManager(ckpt, tmp_path) as mgr:
        mgr.save()
        with pytest.raises((ValueError, TypeError)):
            mgr.save(checkpoint_number=number)
        assert int(ckpt.save_counter) == 1
        assert os.path.basename(mgr.save()) == "ckpt-2.h5"


def test_failed_state_write_keeps_the_old_state(tmp_path, monkeypatch):
    ckpt, *_ = make()
    mgr = pv.CheckpointManager(ckpt, tmp_path, max_to_keep=1)
    mgr.save()
    state = (tmp_path / manager.STATE_FILE).read_bytes()

    real_replace = os.replace

    def no_rename(src, dst):
        if os.path.basename(dst) == manager.STATE_FILE:
            raise Boom(5, "I/O error")
        real_replace(src, dst)

    monkeypatch.setattr(h5write.os, "replace", no_rename)
    with pytest.raises(OSError):  # CheckpointWriteError, an OSError with the errno
        mgr.save()
    monkeypatch.undo()
    assert (tmp_path / manager.STATE_FILE).read_bytes() == state
    assert names(mgr.checkpoints) == ["ckpt-1.h5"] and (tmp_path / "ckpt-1.h5").exists()
    assert not (tmp_path / "ckpt-2.h5").exists()  # taken back: everyone agrees on ckpt-1
    assert pv.latest_checkpoint(tmp_path) == mgr.latest_checkpoint
    assert not [f for f in listing(tmp_path) if ".tmp-" in f]
    assert int(ckpt.save_counter) == 1
    assert os.path.basename(mgr.save()) == "ckpt-2.h5"  # the next save goes through
    assert names(mgr.checkpoints) == ["ckpt-2.h5"] and not (tmp_path / "ckpt-1.h5").exists()
    mgr.close()


# ----------------------------------------------------------------------------- async saves
def test_async_save_writes_the_values_at_the_call(tmp_path):
    ckpt, w, e, step = make()
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=None, async_save=True) as mgr:
        paths = {}
        for k in range(1, 6):
            set_values(w, e, step, k)
            paths[k] = mgr.save()
            set_values(w, e, step, -100)  # training goes on before the write is done
            w.assign_add(np.ones((4, 3), np.float32))
    for k, path in paths.items():
        with h5io.H5Reader(path) as r:
            assert int(r["step"].component(0)) == k
            for i in range(2):
                np.testing.assert_array_equal(
                    r["model/w"].component(i), np.full((4, 3), k, np.float32)
                )
            np.testing.assert_array_equal(r["model/e"].value(), np.arange(12).reshape(6, 2) + k)


def test_async_save_racing_with_training_thread(tmp_path, monkeypatch):
    """Values change in another thread while the background write runs; the file has the call's."""
    ckpt, w, e, step = make()
    real = native._check_components
    writing = threading.Event()
    proceed = threading.Event()

    def slow_write_entry(*args):
        writing.set()
        proceed.wait(10)
        return real(*args)

    monkeypatch.setattr(native, "_check_components", slow_write_entry)
    stop = threading.Event()

    def train():
        k = 1000
        while not stop.is_set():
            k += 1
            set_values(w, e, step, k)

    with pv.CheckpointManager(ckpt, tmp_path) as mgr:
        set_values(w, e, step, 7)
        path = mgr.save(blocking=False)
        trainer = threading.Thread(target=train)
        trainer.start()
        assert writing.wait(10)
        time.sleep(0.05)
        proceed.set()
        mgr.wait()
        stop.set()
        trainer.join()
        assert mgr.latest_checkpoint == path
    with h5io.H5Reader(path) as r:
        assert int(r["step"].component(0)) == 7
        np.testing.assert_array_equal(r["model/w"].component(1), np.full((4, 3), 7, np.float32))
        np.testing.assert_array_equal(r["model/e"].value(), np.arange(12).reshape(6, 2) + 7)


def test_async_error_reaches_the_next_call(tmp_path, monkeypatch):
    ckpt, _w, _e, _step = make()
    mgr = pv.CheckpointManager(ckpt, tmp_path)
    mgr.save()
    failing_write_entry(monkeypatch, after=1)
    path = mgr.save(blocking=False)
    assert path.endswith("ckpt-2.h5")
    with pytest.raises(OSError):  # CheckpointWriteError, an OSError with the errno
        mgr.save()
    monkeypatch.undo()
    assert not os.path.exists(path) and names(mgr.checkpoints) == ["ckpt-1.h5"]
    assert int(ckpt.save_counter) == 1
    assert mgr.save(blocking=False).endswith("ckpt-2.h5")
    mgr.close()  # waits
    assert pv.latest_checkpoint(tmp_path).endswith("ckpt-2.h5")

    mgr = pv.CheckpointManager(ckpt, tmp_path)
    failing_write_entry(monkeypatch, after=0)
    mgr.save(blocking=False)
    with pytest.raises(OSError):  # CheckpointWriteError, an OSError with the errno
        mgr.close()  # the error surfaces at close too, and the lock is released anyway
    monkeypatch.undo()
    with pv.CheckpointManager(ckpt, tmp_path) as mgr:
        mgr.save(blocking=False)
        with pytest.raises(OSError):  # CheckpointWriteError, an OSError with the errno
            failing_write_entry(monkeypatch, after=0)
            mgr.save(blocking=False)
            mgr.restore_or_initialize()
        monkeypatch.undo()


def test_at_most_one_write_in_flight(tmp_path, monkeypatch):
    real = native.save_native
    active = [0]
    peak = [0]
    lock = threading.Lock()

    def counting_write_h5(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.02)
            return real(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr("parallelvars.checkpoint.checkpoint.save_native", counting_write_h5)
    ckpt, w, e, step = make()
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=None, async_save=True) as mgr:
        for k in range(6):
            set_values(w, e, step, k)
            mgr.save()
    assert peak[0] == 1
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".h5")]) == 6


def test_restore_waits_for_the_save_in_flight(tmp_path):
    ckpt, w, e, step = make()
    with pv.CheckpointManager(ckpt, tmp_path, async_save=True) as mgr:
        set_values(w, e, step, 5)
        mgr.save()
        set_values(w, e, step, 6)
        assert mgr.restore_or_initialize().endswith("ckpt-1.h5")
        assert int(step) == 5


def test_bad_arguments(tmp_path):
    ckpt, *_ = make()
    with pytest.raises(ValueError, match="max_to_keep"):
        pv.CheckpointManager(ckpt, tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="checkpoint_name"):
        pv.CheckpointManager(ckpt, tmp_path, checkpoint_name="a/b")
    with pytest.raises(TypeError):
        pv.CheckpointManager(object(), tmp_path)  # type: ignore[arg-type]
