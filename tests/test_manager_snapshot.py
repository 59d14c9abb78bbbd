"""The non-blocking save's snapshot: components copied and compared by span of their base
buffers (arenas), with a change in a span checked component by component."""

from __future__ import annotations

import os
import sys
import threading
import time

import h5py
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import parallelvars as pv
from parallelvars.checkpoint import h5io
from parallelvars.checkpoint import snapshot as snapshot_module
from parallelvars.checkpoint.registry import SaveRecord
from parallelvars.checkpoint.snapshot import SnapshotPlan, take_snapshot
from parallelvars.errors import ConcurrentWriteError

CREATED = 1_700_000_000.0


@pytest.fixture
def fixed_clock(monkeypatch):
    """Every save records the same ``created`` time, so two ways of writing can be compared."""
    monkeypatch.setattr(time, "time", lambda: CREATED)


def interleaved(n: int, size: int = 5):
    """``2n`` float32 variables of ``size`` elements allocated alternately into one arena: the
    checkpoint saves the even ones, the odd ones (the same arena, between them) are not."""
    with pv.MirroredStrategy(2).scope():
        every = [pv.Variable(np.full(size, i, np.float32), name=f"v{i}") for i in range(2 * n)]
    model = pv.Module()
    model.saved = every[0::2]
    return pv.Checkpoint(model=model), every[0::2], every[1::2]


def stored(path: str) -> dict[str, list[np.ndarray]]:
    with h5io.H5Reader(path) as r:
        return {
            name: [r[name].component(i) for i in range(r[name].num_components)]
            for name in r
            if name != "save_counter"
        }


def plan_of(ckpt) -> SnapshotPlan:
    records = ckpt._gather(False)[0]
    ckpt._snapshot(records)
    return ckpt._pv_snapshot_plan[1]


def test_saved_variables_of_an_arena_are_copied_as_a_few_spans():
    ckpt, saved, unsaved = interleaved(50)
    plan = plan_of(ckpt)
    assert not plan.singles[:-1]  # only save_counter's own arena may be alone
    # One span for the arena's row 0 (the replicas of row 1 are not copied: compared), and
    # save_counter's own: not one per component.
    assert len(plan.spans) <= 2 < len(saved)
    assert len(plan.runs) == 1 and not plan.lone  # row 1 against row 0: one comparison
    # The unsaved variables between the saved ones are copied with them, in the spans, and
    # compared with them in the run.
    spans = [(s[0].__array_interface__["data"][0], s[0].nbytes) for s in plan.spans if s[0].size]
    runs = [(r[0].__array_interface__["data"][0], r[0].nbytes) for r in plan.runs]
    for v in unsaved[:-1]:  # (the last one is after them)
        address = [c.__array_interface__["data"][0] for c in v.components]
        assert any(lo <= address[0] < lo + n for lo, n in spans)
        assert any(lo <= address[1] < lo + n for lo, n in runs)


def test_spans_leave_wide_gaps_out_and_stay_small():
    ckpt, saved, unsaved = interleaved(300, size=1024)  # 4 KiB each, 2.4 MB of a 32 MB arena
    with pv.MirroredStrategy(2).scope():
        big = pv.Variable(np.ones(1 << 19, np.float32), name="big")  # 2 MiB, the same arena
    ckpt.model.big = big
    plan = plan_of(ckpt)
    spans = [(live.size, members) for live, _, members in plan.spans]
    assert all(n <= snapshot_module._SPAN_MAX or len(m) == 1 for n, m in spans)
    (i,) = [i for i, c in enumerate(plan.flat) if c is big.components[0]]
    assert [i] in [m for _, m in spans]  # larger than a span: a span of its own
    nbytes = lambda vs: sum(v.components[0].nbytes for v in vs)  # noqa: E731  (row 0's)
    copied = sum(n for n, _ in spans)
    # The saved bytes and the unsaved variables between them: not the rows' unused ends.
    assert nbytes([*saved, big]) <= copied <= nbytes([*saved, *unsaved, big]) + 8


def write_before_each_comparison(monkeypatch, write) -> list[int]:
    """Run ``write(k)`` (k = 1, 2, ...) before each comparison of the snapshot: another thread
    writing after the copy and before its check, as it were. Returns the count, updated."""
    real = snapshot_module._unchanged
    calls = [0]

    def racing(live, copied):
        calls[0] += 1
        write(calls[0])
        return real(live, copied)

    monkeypatch.setattr(snapshot_module, "_unchanged", racing)
    return calls


def test_writes_to_unsaved_variables_in_the_spans_do_not_fail_the_save(tmp_path, monkeypatch):
    ckpt, saved, unsaved = interleaved(20)

    def write(k: int) -> None:  # the unsaved variables, flat out
        for v in unsaved:
            v.assign(np.full(5, -k, np.float32))

    calls = write_before_each_comparison(monkeypatch, write)
    write_file = ckpt._prepare_write(copy=True)  # no ConcurrentWriteError: only gaps changed
    monkeypatch.undo()
    for v in saved:
        v.assign(np.full(5, 99, np.float32))  # after the snapshot: not in the file
    found = stored(write_file(str(tmp_path / "c.h5")))
    assert {k: [c.tolist() for c in cs] for k, cs in found.items()} == {
        f"model/saved/{j}": [[2.0 * j] * 5] * 2 for j in range(20)
    }
    assert calls[0] > 0
    assert all(c.tolist() == [-calls[0]] * 5 for v in unsaved for c in v.components)


def test_a_write_to_a_saved_variable_in_a_span_is_copied_again(tmp_path, monkeypatch):
    ckpt, saved, _unsaved = interleaved(20)

    def write(k: int) -> None:  # lands after the first copy, before its comparison
        if k == 1:
            saved[7].assign(np.full(5, -7, np.float32))

    write_before_each_comparison(monkeypatch, write)
    write_file = ckpt._prepare_write(copy=True)
    monkeypatch.undo()
    saved[7].assign(np.full(5, 99, np.float32))
    found = stored(write_file(str(tmp_path / "c.h5")))
    assert [c.tolist() for c in found["model/saved/7"]] == [[-7.0] * 5] * 2
    assert [c.tolist() for c in found["model/saved/6"]] == [[12.0] * 5] * 2


def test_spans_copied_and_checked_on_several_threads_still_catch_a_write(tmp_path, monkeypatch):
    # A long snapshot's spans are copied and checked against the live buffers on several
    # threads (run_partitioned): a write after a span's copy is found all the same, and the
    # span copied again.
    monkeypatch.setenv("PARALLELVARS_THREADS", "2")
    monkeypatch.setattr("parallelvars._threads.MIN_PARALLEL_BYTES", 0)
    ckpt, saved, _unsaved = interleaved(300, size=1024)  # several spans of at most 1 MiB
    plan = plan_of(ckpt)
    assert len(plan.spans) > 1
    (hold,) = [s[0] for s in plan.spans if np.shares_memory(s[0], saved[7].components[0])]
    real = snapshot_module._unchanged
    threads: set[str] = set()  # the threads that checked a span against its copy
    written: list[str] = []

    def racing(live, copied):
        if any(live is span[0] for span in plan.spans):
            threads.add(threading.current_thread().name)
            # (in the first check of the span holding saved[7]: after its copy, before the
            # comparison, on whichever thread checks it)
            if live is hold and not written:
                written.append(threading.current_thread().name)
                saved[7].assign(np.full(1024, -7, np.float32))
        return real(live, copied)

    monkeypatch.setattr(snapshot_module, "_unchanged", racing)
    write_file = ckpt._prepare_write(copy=True)
    assert len(threads) > 1  # (the parallel path was taken)
    assert len(written) == 1
    monkeypatch.undo()
    saved[7].assign(np.full(1024, 99, np.float32))
    found = stored(write_file(str(tmp_path / "c.h5")))
    assert [c.tolist() for c in found["model/saved/7"]] == [[-7.0] * 1024] * 2
    assert [c.tolist() for c in found["model/saved/6"]] == [[12.0] * 1024] * 2


def test_a_saved_variable_written_during_every_copy_refuses_the_save(tmp_path, monkeypatch):
    ckpt, saved, _unsaved = interleaved(20)
    with pv.CheckpointManager(ckpt, tmp_path) as mgr:
        write_before_each_comparison(
            monkeypatch, lambda k: saved[11].assign(np.full(5, k, np.float32))
        )
        with pytest.raises(ConcurrentWriteError, match="model/saved/11") as info:
            mgr.save(blocking=False)
        monkeypatch.undo()
        assert "4 attempts" in str(info.value)
        assert mgr.checkpoints == [] and int(ckpt.save_counter) == 0
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".h5")]


def test_a_thread_writing_unsaved_variables_of_the_arena_never_refuses_a_save(tmp_path):
    # End to end with a real writer thread (the deterministic tests above pin the logic down):
    # variables of 4 KiB, so a span's copy takes long enough for the writer to run in between.
    ckpt, _saved, unsaved = interleaved(100, size=1024)
    stop = threading.Event()

    def run() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            for v in unsaved:
                v.assign(np.full(1024, -k, np.float32))

    old = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)  # interleave the threads finely
    thread = threading.Thread(target=run)
    thread.start()
    try:
        with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=None) as mgr:
            paths = [mgr.save(blocking=False) for _ in range(10)]  # none refused
            mgr.wait()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)
    for path in paths:
        found = stored(path)
        for j in range(100):
            assert all((c == 2.0 * j).all() for c in found[f"model/saved/{j}"])


def strided_model():
    with pv.MirroredStrategy(2).scope():
        m = pv.Module()
        m.cols = pv.Variable(np.arange(24, dtype=np.float32).reshape(4, 6), shard_axis=1)
        m.rows = pv.Variable(np.arange(16, dtype=np.float64).reshape(8, 2), shard_axis=0)
        m.mirrored = pv.Variable(np.linspace(0, 1, 7), name="mirrored")
        m.empty = pv.Variable(np.zeros((0, 3), np.float32), name="empty")
    m.scalar = pv.Variable(np.int64(5), name="scalar")
    return m


def test_strided_shards_and_non_contiguous_components_are_copied_right(tmp_path):
    m = strided_model()
    ckpt = pv.Checkpoint(model=m)
    records = ckpt._gather(False)[0]
    assert any(not c.flags.c_contiguous for r in records for c in r.components)
    expected = {r.path: [np.array(c) for c in r.components] for r in records}
    snap = ckpt._snapshot(records)
    for v in (m.cols, m.rows, m.mirrored, m.scalar):
        v.assign(np.zeros(np.shape(v), v.dtype))  # after the snapshot
    copied = snap.records()
    assert copied.structure() is records.structure()  # kept, not computed again
    for r in copied:
        want = expected[r.path]
        assert len(r.components) == len(want)
        for c, w in zip(r.components, want, strict=True):
            assert c.shape == w.shape and c.dtype == w.dtype
            np.testing.assert_array_equal(c, w)
    found = stored(ckpt._prepare_write()(str(tmp_path / "zeros.h5")))
    assert all(not c.any() for cs in found.values() for c in cs)


def attr_value(v) -> object:
    a = np.asarray(v)
    return (a.dtype.str, a.shape, a.tolist() if a.dtype.kind == "O" else a.tobytes())


def dump(path: str) -> dict:
    """Every dataset's bytes, dtype and shape and every attribute of a file (h5py)."""
    out: dict = {}
    with h5py.File(path, "r") as f:

        def visit(name, obj):
            attrs = {k: attr_value(v) for k, v in obj.attrs.items()}
            if isinstance(obj, h5py.Dataset):
                out[name] = (obj.dtype.str, obj.shape, obj[()].tobytes(), attrs)
            else:
                out[name] = attrs

        visit("/", f)
        f.visititems(visit)
    return out


@pytest.mark.parametrize("repeated", [False, True])
def test_a_non_blocking_save_writes_the_file_of_a_blocking_save(
    tmp_path, fixed_clock, monkeypatch, repeated
):
    ckpt, saved, _unsaved = interleaved(30)
    ckpt.model.strided = strided_model()
    cache = ckpt._pv_plans
    real_get, found = cache.get, []
    monkeypatch.setattr(cache, "get", lambda key: found.append(real_get(key)) or found[-1])
    with pv.CheckpointManager(ckpt, tmp_path / "async", max_to_keep=None) as mgr:
        if repeated:
            mgr.save(blocking=False)
            mgr.wait()
        for j, v in enumerate(saved):
            v.assign(np.full(5, j + 0.5, np.float32))
        path = mgr.save(blocking=False)
        for v in saved:
            v.assign(np.zeros(5, np.float32))  # while the save is in flight: not in its file
        mgr.wait()
    # The copies keep their records' structure: the second save reuses the cached metadata.
    assert (found[-1] is not None) == repeated
    for j, v in enumerate(saved):
        v.assign(np.full(5, j + 0.5, np.float32))
    blocking = ckpt.write(tmp_path / "blocking.h5")  # the same save_counter, values and clock
    assert dump(path) == dump(blocking)
    with open(path, "rb") as a, open(blocking, "rb") as b:
        assert a.read() == b.read()


def test_snapshot_of_records_that_are_not_a_record_list(tmp_path):
    base = np.arange(40, dtype=np.float32)
    records = [
        SaveRecord(kind="single", components=[base[0:10]], shape=(10,), path="a"),
        SaveRecord(kind="single", components=[base[20:30]], shape=(10,), path="b"),
    ]
    copied = take_snapshot(records).records()
    base[:] = -1
    assert [r.path for r in copied] == ["a", "b"]
    assert copied[0].components[0].tolist() == list(range(10))
    assert copied[1].components[0].tolist() == list(range(20, 30))


@st.composite
def views_of_one_buffer(draw):
    """A base buffer and views of it: contiguous slices (possibly overlapping, reshaped,
    reinterpreted as another dtype), strided ones, and arrays of their own."""
    size = draw(st.integers(64, 20_000))
    base = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(
        0, 256, size, dtype=np.uint8
    )
    views = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["slice", "float", "strided", "own", "empty"]))
        a = draw(st.integers(0, size - 8))
        b = draw(st.integers(a, min(size, a + 4000)))
        if kind == "slice":
            views.append(base[a:b])
        elif kind == "float":
            n = (b - a) // 4
            views.append(base[a : a + 4 * n].view(np.float32).reshape(n, 1))
        elif kind == "strided":
            views.append(base[a:b:3])
        elif kind == "own":
            views.append(base[a:b].copy())
        else:
            views.append(base[a:a])
    return base, views


@settings(max_examples=60, deadline=None)
@given(views_of_one_buffer())
def test_snapshot_copies_any_views_of_a_buffer(case):
    base, views = case
    records = [
        SaveRecord(kind="single", components=[v], shape=v.shape, path=f"v{i}")
        for i, v in enumerate(views)
    ]
    want = [v.tobytes() for v in views]
    copied = take_snapshot(records).records()
    base[:] = 0
    for r, v, w in zip(copied, views, want, strict=True):
        (c,) = r.components
        assert c.shape == v.shape and c.dtype == v.dtype and c.flags.c_contiguous
        assert c.tobytes() == w


def kept_copies(ckpt):
    plan = ckpt._pv_snapshot_plan
    return None if plan is None else plan[1]._kept


def test_copies_are_kept_for_the_next_save_and_hold_each_saves_values(tmp_path):
    ckpt, saved, _unsaved = interleaved(30)
    ckpt.model.strided = strided_model()  # components copied one by one are kept too
    paths, records = [], []
    with pv.CheckpointManager(ckpt, tmp_path, max_to_keep=None) as mgr:
        for k in range(4):
            for v in saved:
                v.assign(np.full(5, k, np.float32))
            paths.append(mgr.save(blocking=False))
            for v in saved:
                v.assign(np.full(5, -1, np.float32))  # while the write runs: not in the file
            mgr.wait()
            kept = kept_copies(ckpt)
            assert kept is not None and kept.records is not None
            records.append(kept.records)
        # Later saves copy into the first one's buffers and write its records again.
        assert all(r is records[0] for r in records)
    assert kept_copies(ckpt) is None  # closing the manager frees them
    for k, path in enumerate(paths):
        found = stored(path)
        assert all((c == k).all() for j in range(30) for c in found[f"model/saved/{j}"])
        cols = np.arange(24, dtype=np.float32).reshape(4, 6)
        np.testing.assert_array_equal(found["model/strided/cols"][1], cols[:, 3:])


def test_copies_still_being_written_are_never_copied_into(tmp_path):
    ckpt, saved, _unsaved = interleaved(10)
    first = ckpt._prepare_write(copy=True)  # its copies are in use until it has written
    for v in saved:
        v.assign(np.full(5, 7, np.float32))
    second = ckpt._prepare_write(copy=True)  # other buffers
    found = stored(first(str(tmp_path / "first.h5")))
    assert all((c == 2 * j).all() for j in range(10) for c in found[f"model/saved/{j}"])
    found = stored(second(str(tmp_path / "second.h5")))
    assert all((c == 7).all() for j in range(10) for c in found[f"model/saved/{j}"])


def test_copies_are_kept_after_a_failed_write_and_a_refused_snapshot(tmp_path, monkeypatch):
    ckpt, saved, _unsaved = interleaved(10)
    write_file = ckpt._prepare_write(copy=True)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError):
        write_file(str(tmp_path / "file" / "c.h5"))  # a file where its folder should be
    assert kept_copies(ckpt) is not None
    write_before_each_comparison(monkeypatch, lambda k: saved[3].assign(np.full(5, k, np.float32)))
    with pytest.raises(ConcurrentWriteError):
        ckpt._prepare_write(copy=True)
    monkeypatch.undo()
    assert kept_copies(ckpt) is not None


def test_copies_larger_than_the_limit_are_freed_after_their_write(tmp_path, monkeypatch):
    ckpt, _saved, _unsaved = interleaved(10)
    monkeypatch.setattr(snapshot_module, "SNAPSHOT_KEEP_BYTES", 0)
    ckpt._prepare_write(copy=True)(str(tmp_path / "c.h5"))
    assert kept_copies(ckpt) is None
    monkeypatch.undo()
    ckpt._prepare_write(copy=True)(str(tmp_path / "d.h5"))
    assert kept_copies(ckpt) is not None


# ------------------------------------------------------------------ replicas: compared, not copied
def test_a_mirrored_snapshot_copies_each_variable_once(tmp_path, fixed_clock):
    ckpt, saved, _unsaved = interleaved(30)
    ckpt.model.strided = strided_model()  # shards (copied) and one-off arrays beside them
    records = ckpt._gather(False)[0]
    plan = SnapshotPlan(records)
    copied = take_snapshot(records, plan).records()
    for r in copied:
        if r.kind == "mirrored" and r.components[0].size:  # each replica: the first's copy
            assert all(c is r.components[0] for c in r.components)
    shards = [c for r in records if r.kind == "sharded" for c in r.components]
    firsts = sum(r.components[0].nbytes for r in records if r.kind != "sharded")
    assert plan.nbytes <= firsts + sum(c.nbytes for c in shards) + 8 * 4096  # (gaps)
    for v in saved:
        v.assign(np.zeros(5, np.float32))  # after the snapshot: not in its file
    from parallelvars.checkpoint.h5raw.native import save_native

    snap_file = save_native(str(tmp_path / "snap.h5"), copied)
    for j, v in enumerate(saved):
        v.assign(np.full(5, 2.0 * j, np.float32))
    live_file = save_native(str(tmp_path / "live.h5"), records)
    assert dump(snap_file) == dump(live_file)


def test_divergent_replicas_are_copied_apart_and_saved_apart(tmp_path):
    with pv.MirroredStrategy(3).scope():
        m = pv.Module()
        m.w = [pv.Variable(np.full(4, i, np.float32), name=f"w{i}") for i in range(6)]
        m.r = pv.Variable(np.zeros(4, np.float32), name="r", synchronization="on_read")
    m.r.components[2][:] = 5.0  # an on-read variable whose replicas differ
    ckpt = pv.Checkpoint(model=m)
    records = ckpt._gather(False)[0]
    plan = SnapshotPlan(records)
    (n,) = [n for n, r in enumerate(records) if r.path == "model/r"]
    assert plan.primary[plan.starts[n] + 2] == plan.starts[n]  # (shared, until seen unequal)
    copied = take_snapshot(records, plan).records()
    assert plan.divergent == {n}  # made again, once: its replicas are copied from now on
    assert plan.primary[plan.starts[n] + 2] == plan.starts[n] + 2
    m.r.components[2][:] = 7.0  # after the snapshot
    assert [c.tolist() for c in copied[n].components] == [[0.0] * 4, [0.0] * 4, [5.0] * 4]
    for r in copied:
        if r.path != "model/r":
            assert all(c is r.components[0] for c in r.components)
    path = ckpt._prepare_write(copy=True)(str(tmp_path / "c.h5"))
    found = stored(path)
    assert [c.tolist() for c in found["model/r"]] == [[0.0] * 4, [0.0] * 4, [7.0] * 4]
    assert [c.tolist() for c in found["model/w/3"]] == [[3.0] * 4] * 3


def test_a_replica_written_between_its_two_comparisons_is_copied_again(tmp_path, monkeypatch):
    """A replica unlike its first only in the second comparison is a write, not a divergent
    variable: the attempt is made again, and the snapshot holds one moment."""
    ckpt, saved, _unsaved = interleaved(20)
    records = ckpt._gather(False)[0]
    plan = SnapshotPlan(records)
    real = SnapshotPlan.replicas_differing
    passes = [0]

    def racing(self):
        passes[0] += 1
        if passes[0] == 2:  # between the two passes: a mirrored update, replica by replica
            saved[4].components[1][:] = -4.0  # only row 1 so far
            out = real(self)
            saved[4].components[0][:] = -4.0  # then row 0
            return out
        return real(self)

    monkeypatch.setattr(SnapshotPlan, "replicas_differing", racing)
    copied = take_snapshot(records, plan).records()
    monkeypatch.undo()
    assert passes[0] == 4 and not plan.divergent  # an attempt again, the plan kept
    (r,) = [r for r in copied if r.path == "model/saved/4"]
    assert [c.tolist() for c in r.components] == [[-4.0] * 5] * 2


def test_a_replica_that_keeps_changing_refuses_the_save(monkeypatch):
    ckpt, saved, _unsaved = interleaved(10)
    records = ckpt._gather(False)[0]
    plan = SnapshotPlan(records)
    real = SnapshotPlan.replicas_differing
    calls = [0]

    def racing(self):
        calls[0] += 1
        if calls[0] % 2 == 0:  # every second pass sees row 1 written, row 0 not yet
            saved[2].components[1][:] = calls[0]
            out = real(self)
            saved[2].components[0][:] = calls[0]
            return out
        return real(self)

    monkeypatch.setattr(SnapshotPlan, "replicas_differing", racing)
    with pytest.raises(ConcurrentWriteError, match="model/saved/2"):
        take_snapshot(records, plan)


def test_a_strided_shard_holding_a_nan_is_snapshotted(tmp_path):
    """The snapshot's check that a copy still matches its live component compares bits: a
    strided shard holding a NaN is unchanged, not a concurrent write."""
    m = strided_model()
    m.cols.assign(np.where(np.arange(24).reshape(4, 6) % 5 == 0, np.nan, 1.0).astype(np.float32))
    ckpt = pv.Checkpoint(model=m)
    records = ckpt._gather(False)[0]
    assert any(
        not c.flags.c_contiguous and np.isnan(c).any()
        for r in records
        for c in r.components
        if c.dtype.kind == "f"
    )
    copied = ckpt._snapshot(records).records()
    for r, c in zip(records, copied, strict=True):
        for live, kept in zip(r.components, c.components, strict=True):
            assert np.asarray(live).tobytes() == np.asarray(kept).tobytes()


def test_one_plan_serves_the_snapshot_and_the_blocking_saves_replicas(tmp_path) -> None:
    """The records' replicas plan (made at their second blocking save) is the one a
    non-blocking save copies by, and the other way round; closing the manager frees the
    copies it kept (the plan itself stays with the records)."""
    for blocking_first in (True, False):
        ckpt, saved, _ = interleaved(20, size=3000)
        records = ckpt._gather(False)[0]
        if blocking_first:
            ckpt.write(tmp_path / "a.h5")
            ckpt.write(tmp_path / "b.h5")
            assert isinstance(records.replicas, SnapshotPlan)
        with pv.CheckpointManager(ckpt, tmp_path / f"m{blocking_first}", max_to_keep=1) as mgr:
            mgr.save(blocking=False)
            mgr.wait()
            plan = ckpt._pv_snapshot_plan[1]
            assert records.replicas is plan and plan._kept is not None
            saved[3].assign(np.full(3000, -3, np.float32))
            path = ckpt.write(tmp_path / f"c{blocking_first}.h5")  # compared by that plan
        assert plan._kept is None
        back, got, _ = interleaved(20, size=3000)
        back.restore(path).assert_consumed()
        assert got[3].numpy()[0] == -3 and got[4].numpy()[0] == 8


def test_replica_rows_over_the_same_firsts_are_compared_together() -> None:
    """On 4 devices the runs of rows 1-3 over the same first components are compared piece by
    piece together: a replica differing in any row, in any piece, is found (and only it)."""
    with pv.MirroredStrategy(4).scope():
        vs = [pv.Variable(np.full(40_000, i, np.float32), name=f"v{i}") for i in range(12)]
    model = pv.Module()
    model.vs = vs
    ckpt = pv.Checkpoint(model=model)
    records = ckpt._gather(False)[0]
    plan = SnapshotPlan(records)
    assert any(len(g) == 3 for g in plan._run_groups)  # (rows 1, 2 and 3 together)
    assert plan.replicas_differing() == []
    vs[1].components[3][5] = -1.0  # early in the runs
    vs[10].components[2][39_999] = -1.0  # far past the first piece
    found = sorted(plan.replicas_differing())
    paths = {plan.path_of(records, i) for i in found}
    assert paths == {"model/vs/1", "model/vs/10"}
    assert [
        plan.flat[i] is vs[1].components[3] or plan.flat[i] is vs[10].components[2] for i in found
    ] == [True, True]


_SWEEP_DTYPES = [
    np.float32,
    ml_dtypes.bfloat16,
    np.float16,
    ml_dtypes.float8_e4m3fn,
    np.int8,
    np.int64,
    np.bool_,
]


def _sweep_model(devices: int):
    """Every kind (mirrored, on-read, sharded, single) of every fixed-size dtype, and bytes."""
    m = pv.Module()
    with pv.MirroredStrategy(devices).scope():
        m.mirrored = [
            pv.Variable(np.zeros(6, dt), name=f"m{k}") for k, dt in enumerate(_SWEEP_DTYPES)
        ]
        m.on_read = [
            pv.Variable(np.zeros(4, dt), synchronization="on_read", aggregation="sum")
            for dt in (np.float32, np.int64)
        ]
        m.sharded = [
            pv.Variable(np.zeros((6, 2), dt), name=f"s{k}", shard_axis=0)
            for k, dt in enumerate(_SWEEP_DTYPES)
        ]
    m.single = [pv.Variable(np.zeros(3, dt), name=f"x{k}") for k, dt in enumerate(_SWEEP_DTYPES)]
    m.text = pv.Variable(np.array([b"a", b"bc"], dtype=object), name="text")
    return m


def _set_values(m, step: int) -> None:
    """Values that differ from one step to the next; the first on-read variable's replicas
    differ from each other (as an on-read variable's may), so are saved apart."""
    for group in (m.mirrored, m.sharded, m.single):
        for v in group:
            shape = v.shape
            v.assign((np.arange(int(np.prod(shape))).reshape(shape) + step).astype(v.dtype))
    for c, comp in enumerate(m.on_read[0].components):
        comp[...] = step + c
    m.on_read[1].assign(np.full(4, step, np.int64))
    m.text.assign(np.array([b"a" * (step % 3 + 1), b"bc"], dtype=object))


def _components(m) -> dict[str, list[bytes]]:
    out = {}
    for name, group in (("m", m.mirrored), ("r", m.on_read), ("s", m.sharded), ("x", m.single)):
        for k, v in enumerate(group):
            out[f"{name}{k}"] = [np.ascontiguousarray(c).tobytes() for c in v.components]
    out["text"] = [bytes(b) for b in np.asarray(m.text.components[0]).ravel()]
    return out


@pytest.mark.parametrize("devices", [1, 3])
def test_every_kind_and_dtype_through_every_save(tmp_path, devices) -> None:
    """First, repeated, manager blocking and non-blocking saves (twice each) of every kind and
    dtype: each file restores the values of its moment, component by component, and the
    mirrored replicas of a repeated save are compared while written (a change of one between
    two saves is stored apart)."""
    m = _sweep_model(devices)
    ckpt = pv.Checkpoint(model=m)
    expected = {}
    step = 0

    def saved(path) -> None:
        expected[str(path)] = _components(m)

    for name in ("first", "repeated", "again"):
        step += 1
        _set_values(m, step)
        saved(ckpt.write(tmp_path / f"{name}.h5"))
    if devices > 1:  # a mirrored replica unlike its first: saved apart, never hidden
        step += 1
        _set_values(m, step)
        m.mirrored[0].components[1][2] = -7
        saved(ckpt.write(tmp_path / "diverged.h5"))
    with pv.CheckpointManager(ckpt, tmp_path / "mgr", max_to_keep=None) as mgr:
        for blocking in (True, True, False, False):
            step += 1
            _set_values(m, step)
            snap = _components(m)
            path = mgr.save(blocking=blocking)
            _set_values(m, step + 100)  # (after the call: not in a non-blocking save's file)
            mgr.wait()
            expected[path] = snap
    for path, values in expected.items():
        fresh = _sweep_model(devices)
        pv.Checkpoint(model=fresh).restore(path).assert_consumed()
        assert _components(fresh) == values, path
        with h5io.H5Reader(path) as r:
            assert r.verify_all() == []
