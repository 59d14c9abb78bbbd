"""CheckpointManager under faults: torn snapshots, exit with a save in flight, a full disk
while the state file is replaced, planted lock files, a damaged state file, read-only
directories and readers racing with retention."""

from __future__ import annotations

import errno
import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import parallelvars as pv
from parallelvars.checkpoint import checkpoint as checkpoint_module
from parallelvars.checkpoint import h5io, manager
from parallelvars.checkpoint import snapshot as snapshot_module
from parallelvars.checkpoint.graph import build_object_graph
from parallelvars.errors import (
    CheckpointLockedError,
    ConcurrentWriteError,
    ParallelVarsError,
    ReadOnlyDirectoryError,
)
from parallelvars.testing import manager_state as state_module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(n: int = 6):
    """A checkpoint of ``n`` variables of several kinds (mirrored, sharded, single)."""
    with pv.MirroredStrategy(2).scope():
        mirrored = [pv.Variable(np.zeros((64,), np.float64), name=f"m{i}") for i in range(n // 2)]
        sharded = [
            pv.Variable(np.zeros((8, 4), np.int64), name=f"s{i}", shard_axis=0)
            for i in range(n - n // 2)
        ]
    step = pv.Variable(np.int64(0), name="step")
    variables = [*mirrored, *sharded, step]
    model = pv.Module()
    model.mirrored, model.sharded = mirrored, sharded
    return pv.Checkpoint(model=model, step=step), variables


def set_all(variables, k: int) -> None:
    for v in variables:
        v.assign(np.full(np.shape(v), k, v.dtype))


def values_in(path: str) -> set[int]:
    """Every value of every component of every variable in a checkpoint (save_counter aside)."""
    out: set[int] = set()
    with h5io.H5Reader(path) as r:
        for name in r:
            if name == "save_counter":
                continue
            entry = r[name]
            for i in range(entry.num_components):
                out.update(int(x) for x in np.unique(entry.component(i)))
    return out


# ----------------------------------------------------------------------------- torn snapshots
class Writer:
    """A thread setting every variable, in order, to an increasing counter, flat out."""

    def __init__(self, variables) -> None:
        self.variables = variables
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        k = 0
        while not self.stop.is_set():
            k += 1
            set_all(self.variables, k)

    def __enter__(self) -> Writer:
        self.old_interval = sys.getswitchinterval()
        sys.setswitchinterval(2e-5)  # interleave the threads finely: tears are likely if possible
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        sys.setswitchinterval(self.old_interval)


def test_async_snapshots_under_a_writer_thread_are_consistent_or_refused(tmp_path, monkeypatch):
    ckpt, variables = make_model(40)
    where = {id(obj): p for _, obj, p in build_object_graph(ckpt).variables()}
    taken: list[dict[str, list[np.ndarray]]] = []

    def keep(path, records, **kwargs):  # the snapshot as the writer receives it
        taken.append({r.path: list(r.components) for r in records})
        return path

    monkeypatch.setattr(checkpoint_module, "save_native", keep)
    refused = 0
    with Writer(variables):
        for _ in range(300):
            try:
                ckpt._prepare_write(copy=True)(str(tmp_path / "unused.h5"))
            except ConcurrentWriteError:
                refused += 1
    assert len(taken) + refused == 300 and taken
    for snap in taken:
        assert_one_moment_values([snap[where[id(v)]] for v in variables])
    monkeypatch.undo()

    # The same end to end: non-blocking saves committed while the writer runs. The variables
    # start again from 0, below the new writer's counter (the last writer left them at its own
    # count: a save during the new writer's first pass would otherwise see 1s before them).
    set_all(variables, 0)
    committed, refused = [], 0
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=None) as mgr, Writer(variables):
        for _ in range(20):
            try:
                committed.append(mgr.save(blocking=False))
            except ConcurrentWriteError as exc:
                assert isinstance(exc, ParallelVarsError) and isinstance(exc, RuntimeError)
                refused += 1
            mgr.wait()
        assert mgr.checkpoints == committed
    assert len(committed) + refused == 20
    for path in committed:
        assert_one_moment(path, ckpt, variables)


def assert_one_moment_values(per_variable: list[list[np.ndarray]]) -> None:
    """Values of the variables in the writer's order, as they were at one moment of a writer
    that sets them in that order to a counter: every variable holds one value on all its
    components, and along the order the values are k + 1 up to where it had got, then k."""
    seq = []
    for components in per_variable:
        found = {int(x) for c in components for x in np.unique(c)}
        assert len(found) == 1, found
        seq.append(found.pop())
    assert all(a >= b for a, b in itertools.pairwise(seq)) and seq[0] - seq[-1] <= 1, str(seq)


def assert_one_moment(path: str, ckpt, variables) -> None:
    where = {id(obj): p for _, obj, p in build_object_graph(ckpt).variables()}
    with h5io.H5Reader(path) as r:
        per_variable = []
        for v in variables:
            entry = r[where[id(v)]]
            per_variable.append([entry.component(i) for i in range(entry.num_components)])
    assert_one_moment_values(per_variable)


def test_snapshot_copies_again_when_a_write_lands_between_the_passes(tmp_path, monkeypatch):
    ckpt, variables = make_model(2)
    set_all(variables, 1)
    real = snapshot_module._unchanged
    calls = [0]

    def racing(live, copied):
        calls[0] += 1
        if calls[0] == 1:
            set_all(variables, 2)  # a writer thread lands after the copy, before the check
        return real(live, copied)

    monkeypatch.setattr(snapshot_module, "_unchanged", racing)
    write = ckpt._prepare_write(copy=True)
    set_all(variables, 3)  # after the snapshot: not in the file
    monkeypatch.undo()
    assert calls[0] > len(variables)  # compared twice: the first pass found the change
    assert values_in(write(str(tmp_path / "snap.h5"))) == {2}


def test_snapshot_refused_when_writes_never_stop(tmp_path, monkeypatch):
    ckpt, variables = make_model(2)
    k = [0]
    real = snapshot_module._unchanged

    def always_racing(live, copied):
        k[0] += 1
        set_all(variables, k[0])
        return real(live, copied)

    with pv.CheckpointManager(ckpt, tmp_path) as mgr:
        mgr.save()
        monkeypatch.setattr(snapshot_module, "_unchanged", always_racing)
        with pytest.raises(ConcurrentWriteError, match="non-blocking save"):
            mgr.save(blocking=False)
        monkeypatch.undo()
        assert int(ckpt.save_counter) == 1
        assert [os.path.basename(p) for p in mgr.checkpoints] == ["ckpt-1.h5"]
        assert mgr.save(blocking=False).endswith("ckpt-2.h5")  # writes stopped: it goes through
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".h5")) == [
        "ckpt-1.h5",
        "ckpt-2.h5",
    ]


# ----------------------------------------------------------------------------- exit in flight
EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import parallelvars as pv
    from parallelvars.checkpoint.h5raw import native
    from parallelvars.testing import PlanCache

    directory, mode = sys.argv[1], sys.argv[2]
    with pv.MirroredStrategy(2).scope():
        w = pv.Variable(np.zeros((256, 64), np.float32), name="w")
    step = pv.Variable(np.int64(0), name="step")
    ckpt = pv.Checkpoint(w=w, step=step)
    mgr = pv.CheckpointManager(ckpt, directory)
    w.assign(np.ones((256, 64), np.float32)); step.assign(1)
    mgr.save()
    real = native._check_components

    def slow(*args):
        time.sleep(0.05)  # the write is still running when the main thread ends
        if mode == "fail":
            raise OSError(28, "No space left on device")
        return real(*args)

    native._check_components = slow
    PlanCache.get = lambda self, key: None  # prepared anew, which checks each entry
    w.assign(np.full((256, 64), 2, np.float32)); step.assign(2)
    mgr.save(blocking=False)
    w.assign(np.full((256, 64), 3, np.float32)); step.assign(3)  # after the snapshot
    if mode == "raise":
        raise SystemExit(0)
    # no close(), no wait(): the interpreter exits with the save in flight
    """
)


@pytest.mark.parametrize(
    "runs", [pytest.param(1, id="once"), pytest.param(3, id="repeated", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("mode", ["exit", "raise", "fail"])
def test_exit_with_a_save_in_flight(tmp_path, mode, runs):
    script = tmp_path / "run.py"
    script.write_text(EXIT_SCRIPT)
    for run in range(runs):  # (the race of exit and the writer: once by default, -m slow 3x)
        d = tmp_path / f"ckpts-{run}"
        proc = subprocess.run(
            [sys.executable, str(script), str(d), mode],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            # A helper thread for the writer even on one core: the save hands it work (the
            # final writeback hint) after concurrent.futures stopped taking new work.
            env=dict(os.environ, PARALLELVARS_THREADS="2"),
        )
        assert proc.returncode == 0, proc.stderr
        w = pv.Variable(np.zeros((256, 64), np.float32), name="w")
        step = pv.Variable(np.int64(0), name="step")
        reader = pv.Checkpoint(w=w, step=step)
        latest = pv.latest_checkpoint(d)
        reader.restore(latest).assert_consumed()
        if mode == "fail":
            assert "failed at exit and was not committed" in proc.stderr
            assert "No space left on device" in proc.stderr and latest.endswith("ckpt-1.h5")
            assert int(step) == 1 and float(np.asarray(w)[0, 0]) == 1.0
            assert not (d / "ckpt-2.h5").exists()
        else:
            assert proc.stderr == ""
            assert latest.endswith("ckpt-2.h5")  # committed, with the values at the call
            assert int(step) == 2 and float(np.asarray(w)[0, 0]) == 2.0
            state = json.loads((d / manager.STATE_FILE).read_text())
            assert state["latest"] == "ckpt-2.h5"
        assert not [f for f in os.listdir(d) if ".tmp-" in f]


ATEXIT_SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import numpy as np
    import parallelvars as pv

    directory = sys.argv[1]
    w = pv.Variable(np.zeros((512, 256), np.float32), name="w")
    mgr = pv.CheckpointManager(pv.Checkpoint(w=w), directory)

    def save_at_exit():
        w.assign(np.full((512, 256), 5, np.float32))
        print("saving", mgr.save(blocking=False), flush=True)

    atexit.register(save_at_exit)
    """
)


def test_non_blocking_save_from_an_atexit_hook_is_written(tmp_path):
    """concurrent.futures takes no new work once the main thread has ended: a non-blocking save
    asked for by an atexit hook is written in that thread instead, and committed."""
    script = tmp_path / "run.py"
    script.write_text(ATEXIT_SCRIPT)
    d = tmp_path / "ckpts"
    proc = subprocess.run(
        [sys.executable, str(script), str(d)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=dict(os.environ, PARALLELVARS_THREADS="2"),
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split() == ["saving", str(d / "ckpt-1.h5")]
    w = pv.Variable(np.zeros((512, 256), np.float32), name="w")
    pv.Checkpoint(w=w).restore(pv.latest_checkpoint(d)).assert_consumed()
    assert float(np.asarray(w)[0, 0]) == 5.0
    assert not [f for f in os.listdir(d) if ".tmp-" in f]


RESTORE_AT_EXIT_SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import numpy as np
    import parallelvars as pv

    path = sys.argv[1]
    ws = [pv.Variable(np.full((1 << 20,), i, np.float32), name=f"w{i}") for i in range(8)]
    path = pv.Checkpoint(ws=ws).save(path)  # 32 MiB: a restore big enough to spread over threads

    def restore_at_exit():
        fresh = [pv.Variable(np.zeros((1 << 20,), np.float32), name=f"w{i}") for i in range(8)]
        pv.Checkpoint(ws=fresh).restore(path).assert_consumed()
        print("restored", [float(np.asarray(w)[-1]) for w in fresh], flush=True)

    atexit.register(restore_at_exit)
    """
)


def test_threaded_restore_from_an_atexit_hook(tmp_path):
    """A restore that spreads its reads over threads, asked for once the main thread has ended
    (an atexit hook), runs those reads in the calling thread instead of failing to schedule."""
    script = tmp_path / "run.py"
    script.write_text(RESTORE_AT_EXIT_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt.h5")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=dict(os.environ, PARALLELVARS_THREADS="2"),
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split("[")[1].split("]")[0].split(", ") == [f"{i}.0" for i in range(8)]


# ----------------------------------------------------------------------------- full disk
def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def basenames(paths):
    return [os.path.basename(p) for p in paths]


def test_state_write_failing_takes_the_save_back_then_recovers(tmp_path, monkeypatch):
    ckpt, variables = make_model(2)
    mgr = pv.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    for k in (1, 2):
        set_all(variables, k)
        mgr.save()
    set_all(variables, 3)
    monkeypatch.setattr(state_module, "atomic_write", no_space)
    with pytest.raises(OSError) as info:
        mgr.save()
    assert info.value.errno == errno.ENOSPC
    # The manager, the lock-free reader and the directory agree on the last good checkpoint.
    assert basenames(mgr.checkpoints) == ["ckpt-1.h5", "ckpt-2.h5"]
    assert mgr.latest_checkpoint == pv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2.h5")
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".h5")) == [
        "ckpt-1.h5",
        "ckpt-2.h5",
    ]
    assert int(ckpt.save_counter) == 2
    with pytest.raises(OSError):  # still full: fails the same clean way
        mgr.save(blocking=False)
        mgr.wait()
    monkeypatch.undo()  # space freed: the same manager goes on
    assert os.path.basename(mgr.save()) == "ckpt-3.h5"
    assert basenames(mgr.checkpoints) == ["ckpt-2.h5", "ckpt-3.h5"]
    mgr.close()
    assert json.loads((tmp_path / manager.STATE_FILE).read_text())["latest"] == "ckpt-3.h5"


def test_fresh_manager_after_a_failed_state_write(tmp_path, monkeypatch):
    ckpt, variables = make_model(2)
    mgr = pv.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    set_all(variables, 1)
    mgr.save()
    # The new file cannot be taken back either: it stays committed, and is adopted.
    monkeypatch.setattr(state_module, "atomic_write", no_space)
    real_unlink = os.unlink

    def stuck_unlink(path, *args, **kwargs):
        if str(path).endswith("ckpt-2.h5"):
            raise OSError(errno.EIO, "Input/output error")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(manager.os, "unlink", stuck_unlink)
    set_all(variables, 2)
    with pytest.raises(OSError):
        mgr.save()
    monkeypatch.undo()
    assert mgr.latest_checkpoint == pv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2.h5")
    assert int(ckpt.save_counter) == 2
    assert json.loads((tmp_path / manager.STATE_FILE).read_text())["latest"] == "ckpt-1.h5"  # stale
    mgr.close()
    monkeypatch.setattr(state_module, "atomic_write", no_space)
    with pv.CheckpointManager(
        make_model(2)[0], tmp_path, max_to_keep=2
    ) as fresh:  # opens while full
        assert basenames(fresh.checkpoints) == ["ckpt-1.h5", "ckpt-2.h5"]
    monkeypatch.undo()
    ckpt2, variables2 = make_model(2)
    with pv.CheckpointManager(ckpt2, tmp_path, max_to_keep=2) as fresh:  # rebuilds the state file
        state = json.loads((tmp_path / manager.STATE_FILE).read_text())
        assert state["latest"] == "ckpt-2.h5" and manager._read_state(str(tmp_path)) is not None
        fresh.restore_or_initialize()
        assert values_in(fresh.latest_checkpoint) == {2} and int(variables2[-1]) == 2
        assert os.path.basename(fresh.save()) == "ckpt-3.h5"
        assert basenames(fresh.checkpoints) == ["ckpt-2.h5", "ckpt-3.h5"]


# ----------------------------------------------------------------------------- lock file
@pytest.mark.skipif(not hasattr(os, "symlink") or sys.platform == "win32", reason="POSIX links")
def test_planted_lock_links_are_refused_and_their_targets_untouched(tmp_path):
    ckpt, _ = make_model(2)
    d = tmp_path / "ckpts"
    d.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("do not truncate me\n")
    (d / manager.LOCK_FILE).symlink_to(target)
    with pytest.raises(CheckpointLockedError, match="symbolic link") as info:
        pv.CheckpointManager(ckpt, d)
    assert isinstance(info.value, ParallelVarsError) and manager.LOCK_FILE in str(info.value)
    assert target.read_text() == "do not truncate me\n"

    os.unlink(d / manager.LOCK_FILE)  # a dangling link: nothing is created at its target
    (d / manager.LOCK_FILE).symlink_to(tmp_path / "created.txt")
    with pytest.raises(CheckpointLockedError):
        pv.CheckpointManager(ckpt, d)
    assert not (tmp_path / "created.txt").exists()

    os.unlink(d / manager.LOCK_FILE)  # a hard link to another file
    os.link(target, d / manager.LOCK_FILE)
    with pytest.raises(CheckpointLockedError, match="2 links"):
        pv.CheckpointManager(ckpt, d)
    assert target.read_text() == "do not truncate me\n"

    os.unlink(d / manager.LOCK_FILE)  # a FIFO: refused, never blocks
    os.mkfifo(d / manager.LOCK_FILE)
    with pytest.raises(CheckpointLockedError, match="not a regular file"):
        pv.CheckpointManager(ckpt, d)

    os.unlink(d / manager.LOCK_FILE)
    with pv.CheckpointManager(ckpt, d) as mgr:  # its own lock file again
        mgr.save()
    assert (d / manager.LOCK_FILE).read_text() == f"{os.getpid()}\n"


# ----------------------------------------------------------------------------- state checksum
def test_a_changed_digit_in_the_state_file_is_detected(tmp_path):
    ckpt, _ = make_model(2)
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=3) as mgr:
        for _ in range(3):
            mgr.save()
    state_path = tmp_path / manager.STATE_FILE
    good = state_path.read_text()
    state = json.loads(good)
    assert state["version"] == manager.STATE_VERSION and len(state["crc32c"]) == 8
    newest = str(tmp_path / "ckpt-3.h5")
    digits = [i for i, ch in enumerate(good) if ch.isdigit()]
    assert digits
    for i in digits:  # every single changed digit: not trusted, the files decide
        damaged = good[:i] + str((int(good[i]) + 1) % 10) + good[i + 1 :]
        state_path.write_text(damaged)
        # (A digit past a float's precision reads as the same number: the same content.)
        assert manager._read_state(str(tmp_path)) in (None, state), damaged
        assert pv.latest_checkpoint(tmp_path) == newest
    # The example of the fault: the newest record's number rolled back by one.
    state_path.write_text(good.replace('"number": 3', '"number": 2'))
    assert pv.latest_checkpoint(tmp_path) == newest
    with pv.CheckpointManager(make_model(2)[0], tmp_path, max_to_keep=3) as mgr:
        assert mgr.latest_checkpoint == newest
    assert manager._read_state(str(tmp_path)) is not None  # rebuilt on open
    assert json.loads(state_path.read_text())["latest"] == "ckpt-3.h5"


def test_a_damaged_state_file_never_leads_to_deletions(tmp_path):
    ckpt, _ = make_model(2)
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=None) as mgr:
        for _ in range(4):
            mgr.save()
    (tmp_path / manager.STATE_FILE).write_text("damaged")
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=2) as mgr:
        assert basenames(mgr.checkpoints) == ["ckpt-3.h5", "ckpt-4.h5"]
        mgr.save()
        assert basenames(mgr.checkpoints) == ["ckpt-4.h5", "ckpt-5.h5"]
    # ckpt-1 and ckpt-2 were not recorded by a trusted state: kept for good; ckpt-3 was.
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".h5")) == [
        "ckpt-1.h5",
        "ckpt-2.h5",
        "ckpt-4.h5",
        "ckpt-5.h5",
    ]


def test_state_files_without_a_checksum_are_still_read(tmp_path):
    ckpt, _ = make_model(2)
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=None) as mgr:
        mgr.save()
        mgr.save()
    state = json.loads((tmp_path / manager.STATE_FILE).read_text())
    del state["crc32c"]
    state["version"] = 1
    (tmp_path / manager.STATE_FILE).write_text(json.dumps(state))
    assert manager._read_state(str(tmp_path)) is not None
    state["version"] = 2  # the current version must carry its checksum
    (tmp_path / manager.STATE_FILE).write_text(json.dumps(state))
    assert manager._read_state(str(tmp_path)) is None
    (tmp_path / manager.STATE_FILE).write_text("[" * 100_000)  # deep nesting: just untrusted
    assert manager._read_state(str(tmp_path)) is None
    if hasattr(os, "mkfifo"):  # a FIFO in its place: never blocks, not trusted
        os.unlink(tmp_path / manager.STATE_FILE)
        os.mkfifo(tmp_path / manager.STATE_FILE)
        assert manager._read_state(str(tmp_path)) is None
    assert pv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2.h5")


def test_preserved_records_never_name_files_outside(tmp_path):
    ckpt, _ = make_model(2)
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=1) as mgr:
        mgr.save()
    outside = tmp_path.parent / f"{tmp_path.name}-outside.h5"
    outside.write_bytes(b"x")
    try:
        state = json.loads((tmp_path / manager.STATE_FILE).read_text())
        state["preserved"] = [{"file": f"../{outside.name}", "number": 0, "time": 0.0}]
        state["crc32c"] = manager._state_checksum(state)
        (tmp_path / manager.STATE_FILE).write_text(json.dumps(state))
        preserved = manager._reconcile(str(tmp_path), "ckpt", manager._read_state(str(tmp_path)))[1]
        assert preserved == []
    finally:
        outside.unlink()


# ----------------------------------------------------------------------------- read-only
def saved_directory(tmp_path):
    ckpt, variables = make_model(2)
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=None) as mgr:
        for k in (1, 2):
            set_all(variables, k)
            mgr.save()
    os.unlink(tmp_path / manager.LOCK_FILE)
    return {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}


def check_read_only_manager(tmp_path, before) -> None:
    ckpt, variables = make_model(2)
    mgr = pv.CheckpointManager(ckpt, tmp_path)
    assert mgr.read_only
    assert basenames(mgr.checkpoints) == ["ckpt-1.h5", "ckpt-2.h5"]
    assert mgr.latest_checkpoint == pv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2.h5")
    assert mgr.restore_or_initialize() == str(tmp_path / "ckpt-2.h5")
    assert int(variables[-1]) == 2
    mgr.restore(str(tmp_path / "ckpt-1.h5"))
    assert int(variables[-1]) == 1
    with pytest.raises(ReadOnlyDirectoryError, match="read-only") as info:
        mgr.save()
    assert isinstance(info.value, PermissionError) and isinstance(info.value, ParallelVarsError)
    assert int(ckpt.save_counter) == 1  # as restored from ckpt-1: the refused save took nothing
    mgr.close()
    assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)} == before


@pytest.mark.skipif(
    sys.platform == "win32" or os.geteuid() == 0, reason="chmod does not restrict root"
)
def test_read_only_directory_by_permissions(tmp_path):
    before = saved_directory(tmp_path)
    os.chmod(tmp_path, 0o555)
    try:
        check_read_only_manager(tmp_path, before)
    finally:
        os.chmod(tmp_path, 0o755)


def test_read_only_directory_reported_by_access(tmp_path, monkeypatch):
    before = saved_directory(tmp_path)
    real_access = os.access
    monkeypatch.setattr(
        manager.os,
        "access",
        lambda p, mode, **kw: (
            False if os.fspath(p) == str(tmp_path) else real_access(p, mode, **kw)
        ),
    )
    check_read_only_manager(tmp_path, before)


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_read_only_file_system_found_at_the_lock(tmp_path, monkeypatch, code):
    before = saved_directory(tmp_path)
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if os.path.basename(os.fspath(path)) == manager.LOCK_FILE:
            raise OSError(code, os.strerror(code))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(manager.os, "open", refusing_open)
    check_read_only_manager(tmp_path, before)


# ----------------------------------------------------------------------------- retention races
def test_readers_racing_with_retention_never_see_a_vanished_file(tmp_path, monkeypatch):
    """Stress: a writer keeping one checkpoint saves flat out while readers poll. Each reader
    naps after its directory listings (a loaded machine), so that retention often deletes a
    listed file before the reader looks at it."""
    reader_threads: set[int] = set()
    real_listdir = os.listdir

    def loaded_listdir(path=".") -> list[str]:
        names = real_listdir(path)
        if threading.get_ident() in reader_threads:
            time.sleep(0.002)
        return names

    monkeypatch.setattr(os, "listdir", loaded_listdir)
    ckpt, variables = make_model(2)
    writer_mgr = pv.CheckpointManager(ckpt, tmp_path, max_to_keep=1)
    set_all(variables, 1)
    writer_mgr.save()
    stop = threading.Event()
    errors: list[BaseException] = []
    restored = [0]

    def write() -> None:
        k = 1
        while not stop.is_set():
            k += 1
            set_all(variables, k)
            writer_mgr.save()

    def read() -> None:
        reader_ckpt, reader_vars = make_model(2)
        reader = pv.CheckpointManager(reader_ckpt, tmp_path, read_only=True)
        reader_threads.add(threading.get_ident())
        try:
            while not stop.is_set():
                latest = pv.latest_checkpoint(tmp_path)
                assert latest is not None
                path = reader.restore_or_initialize()
                assert path is not None
                assert len({int(np.asarray(v).reshape(-1)[0]) for v in reader_vars}) == 1
                restored[0] += 1
        except BaseException as exc:
            errors.append(exc)
            stop.set()
        finally:
            reader.close()

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    stop.wait(2.0)
    stop.set()
    for t in threads:
        t.join()
    writer_mgr.close()
    assert not errors, errors[0]
    assert restored[0] > 0


def test_restore_skips_a_checkpoint_deleted_while_it_opens(tmp_path, monkeypatch):
    ckpt, variables = make_model(2)
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=None) as mgr:
        for k in (1, 2):
            set_all(variables, k)
            mgr.save()
    reader_ckpt, reader_vars = make_model(2)
    reader = pv.CheckpointManager(reader_ckpt, tmp_path, read_only=True)
    real_restore = pv.Checkpoint.restore

    def vanishing(self, path, **kwargs):
        if os.fspath(path).endswith("ckpt-2.h5") and os.path.exists(path):
            os.unlink(path)  # retention in another process, between listing and opening
        return real_restore(self, path, **kwargs)

    monkeypatch.setattr(pv.Checkpoint, "restore", vanishing)
    assert reader.restore_or_initialize() == str(tmp_path / "ckpt-1.h5")
    assert int(reader_vars[-1]) == 1
    os.unlink(tmp_path / "ckpt-1.h5")
    assert reader.restore_or_initialize() is None  # nothing left: initialise
    reader.close()


def _readers(tmp_path, reader, reader_vars):
    """Each lock-free way to find the newest checkpoint: name -> a call returning its path."""

    def restored() -> str | None:
        path = reader.restore_or_initialize()
        if path is not None:
            assert len({int(np.asarray(v).reshape(-1)[0]) for v in reader_vars}) == 1
        return path

    return {
        "latest_checkpoint": lambda: pv.latest_checkpoint(tmp_path),
        "latest_checkpoint_named": lambda: pv.latest_checkpoint(tmp_path, "ckpt"),
        "manager.latest_checkpoint": lambda: reader.latest_checkpoint,
        "manager.checkpoints": lambda: (reader.checkpoints or [None])[-1],
        "restore_or_initialize": restored,
    }


READERS = list(_readers(None, None, None))


@pytest.mark.parametrize("state", ["kept", "missing"])
@pytest.mark.parametrize("saves", [1, 2])
@pytest.mark.parametrize("how", READERS)
def test_a_listing_gone_stale_under_retention_is_taken_again(
    tmp_path, monkeypatch, how, saves, state
):
    """The writer commits and deletes between a reader's directory listing and its look at the
    files listed: the reader looks again, it never reports "no checkpoint" nor a vanished file."""
    ckpt, variables = make_model(2)
    writer = pv.CheckpointManager(ckpt, tmp_path, max_to_keep=1)
    set_all(variables, 1)
    writer.save()
    if state == "missing":
        os.unlink(tmp_path / manager.STATE_FILE)  # scanned: every file listed is adopted
    reader_ckpt, reader_vars = make_model(2)
    reader = pv.CheckpointManager(reader_ckpt, tmp_path, read_only=True)
    call = _readers(tmp_path, reader, reader_vars)[how]
    real_listdir = os.listdir
    stale = [3]  # the first listings the reader takes all go stale before it looks at them
    busy = [False]
    k = [1]

    def listdir_then_save(path=".") -> list[str]:
        names = real_listdir(path)
        if stale[0] and not busy[0] and os.fspath(path) == str(tmp_path):
            stale[0] -= 1
            busy[0] = True
            try:
                for _ in range(saves):
                    k[0] += 1
                    set_all(variables, k[0])
                    writer.save()
            finally:
                busy[0] = False
            if state == "missing":
                os.unlink(tmp_path / manager.STATE_FILE)
        return names

    monkeypatch.setattr(os, "listdir", listdir_then_save)
    path = call()
    monkeypatch.undo()
    assert path is not None
    assert os.path.isfile(path)
    assert stale[0] == 0  # every stale listing was taken again: the last one shows the newest
    assert path == str(tmp_path / f"ckpt-{k[0]}.h5")
    if how == "restore_or_initialize":
        assert int(reader_vars[-1]) == int(os.path.basename(path)[5:-3])
    reader.close()
    writer.close()


@pytest.mark.parametrize("how", READERS)
def test_readers_at_every_step_of_a_save(tmp_path, monkeypatch, how):
    """Stop the writer before and after each rename and deletion of a save (the state file
    mid-replacement included): every reader finds the previous or the new checkpoint, whole."""
    ckpt, variables = make_model(2)
    writer = pv.CheckpointManager(ckpt, tmp_path, max_to_keep=1)
    set_all(variables, 1)
    writer.save()
    reader_ckpt, reader_vars = make_model(2)
    reader = pv.CheckpointManager(reader_ckpt, tmp_path, read_only=True)
    call = _readers(tmp_path, reader, reader_vars)[how]
    seen: list[tuple[str, str]] = []

    def check(step: str) -> None:
        path = call()
        assert path is not None, step
        assert os.path.isfile(path), step
        if how == "restore_or_initialize":
            assert int(reader_vars[-1]) == int(os.path.basename(path)[5:-3])
        seen.append((step, os.path.basename(path)))

    def hooked(real, label):
        def step(*args, **kwargs):
            target = os.path.basename(os.fspath(args[-1] if label == "replace" else args[0]))
            check(f"before {label} {target}")
            out = real(*args, **kwargs)
            check(f"after {label} {target}")
            return out

        return step

    monkeypatch.setattr(os, "replace", hooked(os.replace, "replace"))
    monkeypatch.setattr(os, "unlink", hooked(os.unlink, "unlink"))
    for k in (2, 3):
        set_all(variables, k)
        writer.save()
    monkeypatch.undo()
    steps = [s for s, _ in seen]
    # The order that keeps a committed checkpoint at every moment: the new file, then the
    # state naming it, then the deletion of the old one.
    assert steps[:6] == [
        "before replace ckpt-2.h5",
        "after replace ckpt-2.h5",
        "before replace checkpoint.json",
        "after replace checkpoint.json",
        "before unlink ckpt-1.h5",
        "after unlink ckpt-1.h5",
    ]
    assert dict(seen)["after replace ckpt-2.h5"] == "ckpt-2.h5"
    assert seen[-1][1] == "ckpt-3.h5"
    reader.close()
    writer.close()


@pytest.mark.parametrize("how", READERS)
def test_a_state_gone_stale_before_the_listing_is_read_again(tmp_path, monkeypatch, how):
    """Between a reader's reading of the state and its listing, the writer saves a lower number
    (an explicit ``checkpoint_number``) and retention deletes the one the state named: the
    reader reads the state again rather than find nothing it knows."""
    ckpt, variables = make_model(2)
    writer = pv.CheckpointManager(ckpt, tmp_path, max_to_keep=1)
    set_all(variables, 5)
    writer.save(checkpoint_number=5)
    reader_ckpt, reader_vars = make_model(2)
    reader = pv.CheckpointManager(reader_ckpt, tmp_path, read_only=True)
    call = _readers(tmp_path, reader, reader_vars)[how]
    real_listdir = os.listdir
    pending = [True]

    def save_then_listdir(path=".") -> list[str]:
        if pending[0] and os.fspath(path) == str(tmp_path):
            pending[0] = False
            set_all(variables, 3)
            writer.save(checkpoint_number=3)
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", save_then_listdir)
    path = call()
    monkeypatch.undo()
    assert not pending[0]
    assert path == str(tmp_path / "ckpt-3.h5")
    if how == "restore_or_initialize":
        assert int(reader_vars[-1]) == 3
    reader.close()
    writer.close()


def test_a_checkpoint_deleted_by_hand_costs_readers_one_more_look(tmp_path, monkeypatch):
    """A file the state lists, deleted otherwise than by retention: the state read again is
    unchanged, so the listing stands (no retry loop), and the next newest is found."""
    ckpt, variables = make_model(2)
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=3) as writer:
        for k in (1, 2, 3):
            set_all(variables, k)
            writer.save()
    os.unlink(tmp_path / "ckpt-3.h5")
    reads = [0]
    real_read_state = state_module._read_state

    def counted(directory: str):
        reads[0] += 1
        return real_read_state(directory)

    monkeypatch.setattr(state_module, "_read_state", counted)
    assert pv.latest_checkpoint(tmp_path, "ckpt") == str(tmp_path / "ckpt-2.h5")
    assert reads[0] == 2
    reader_ckpt, reader_vars = make_model(2)
    with pv.CheckpointManager(reader_ckpt, tmp_path, read_only=True) as reader:
        assert reader.restore_or_initialize() == str(tmp_path / "ckpt-2.h5")
        assert int(reader_vars[-1]) == 2
