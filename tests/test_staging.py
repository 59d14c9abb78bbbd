"""The staging memory a restore's checked bytes wait in (parallelvars.checkpoint.h5io.staging):
kept faulted in from one restore to the next, within a size and an idle time, never raising a
restore's peak, never seen by the variables."""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import parallelvars as pv
from parallelvars.checkpoint import sources
from parallelvars.checkpoint.h5io import H5Reader, staging
from parallelvars.checkpoint.h5io import read as read_module


@pytest.fixture(autouse=True)
def _empty_pool() -> Any:
    staging.release()
    yield
    staging.release()


def _whole(buf: np.ndarray) -> np.ndarray:
    return buf if buf.base is None else buf.base


def test_a_buffer_given_back_is_taken_again_by_the_next_restore() -> None:
    first = staging.take(3 << 20)
    assert first.size == 3 << 20 and first.dtype == np.uint8
    staging.give(first)
    assert staging.kept_bytes() >= 3 << 20
    again = staging.take(1 << 20)  # smaller: the kept buffer serves it
    assert _whole(again) is _whole(first) and again.size == 1 << 20
    assert staging.kept_bytes() == 0  # taken: not kept while in use
    staging.give(again)
    staging.give(again)  # (given twice: kept once)
    assert staging.kept_bytes() == _whole(first).size


def test_a_larger_need_frees_the_kept_buffers_before_it_allocates() -> None:
    """The pool never raises a restore's peak: buffers too small for it are freed first."""
    small = staging.take(1 << 20)
    staging.give(small)
    big = staging.take(64 << 20)
    assert staging.kept_bytes() == 0
    assert _whole(big) is not _whole(small)
    staging.give(big)
    assert staging.kept_bytes() == _whole(big).size


def test_kept_within_the_size_bound_and_freed_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "KEEP_BYTES", 4 << 20)
    staging.give(staging.take(8 << 20))  # past the bound: freed
    assert staging.kept_bytes() == 0
    monkeypatch.setattr(staging, "IDLE_SECONDS", 0.05)
    staging.give(staging.take(2 << 20))
    assert staging.kept_bytes() > 0
    deadline = time.monotonic() + 30
    while staging.kept_bytes() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert staging.kept_bytes() == 0
    monkeypatch.setattr(staging, "IDLE_SECONDS", 0)  # 0: nothing kept
    staging.give(staging.take(2 << 20))
    assert staging.kept_bytes() == 0


def test_foreign_arrays_are_not_kept() -> None:
    staging.give(np.zeros(1 << 20, np.float32))
    staging.give(np.zeros((4, 1 << 18), np.uint8))
    assert staging.kept_bytes() == 0
    # 1-D uint8 but not made by take(): a read-only view of bytes, another owner's memory
    read_only = np.frombuffer(bytes(6 << 20), np.uint8)
    staging.give(read_only)
    staging.give(np.zeros(6 << 20, np.uint8))
    staging.give(np.zeros(8 << 20, np.uint8)[: 6 << 20])
    assert staging.kept_bytes() == 0
    taken = staging.take(5 << 20)
    assert taken.flags.writeable


def test_a_kernel_refusing_the_page_advice_still_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """madvise(MADV_NOHUGEPAGE) fails with EINVAL where the kernel has no transparent huge
    pages, and the populate call may fail too: both are preferences, so new staging memory is
    made without them and the restore reads the right values."""
    import errno
    import mmap

    class Refusing(mmap.mmap):
        def madvise(self, *args: Any) -> None:
            raise OSError(errno.EINVAL, "Invalid argument")

    def populate(address: int, size: int) -> bool:
        raise OSError(errno.EINVAL, "Invalid argument")

    fake = type(mmap)("mmap")
    fake.__dict__.update(vars(mmap))
    fake.mmap = Refusing  # type: ignore[attr-defined]
    monkeypatch.setattr(staging, "mmap", fake)
    monkeypatch.setattr(staging, "_populate", populate)
    buf = staging.take(3 << 20)
    assert buf.size == 3 << 20 and buf.flags.writeable
    staging.release()
    path = tmp_path / "a.h5"
    pv.Checkpoint(model=_model(1, 1 << 18)).write(path)
    live = _model(0, 1 << 18)
    pv.Checkpoint(model=live).restore(path).assert_consumed()
    for v, want in zip(live.vs, _model(1, 1 << 18).vs, strict=True):
        for c, w in zip(v.components, want.components, strict=True):
            np.testing.assert_array_equal(c, w)


def _model(seed: int, n: int = 1 << 16, dtype: Any = np.float32) -> pv.Module:
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.vs = [pv.Variable(np.arange(n, dtype=dtype) + seed + k, name=f"v{k}") for k in range(3)]
    return m


@pytest.mark.parametrize("path_taken", ["bulk", "general"])
def test_restores_reuse_their_staging_and_the_variables_never_share_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path_taken: str
) -> None:
    """A restore leaves its staging buffers in the pool and the next one takes them; the
    restored values are copies (writing over the pool's memory changes no variable). The
    bulk path's buffer and the general path's slots (here: a cast) are both staging."""
    dtype = np.float32 if path_taken == "bulk" else np.float64
    cast = path_taken == "general"
    path = tmp_path / "a.h5"
    pv.Checkpoint(model=_model(1)).write(path)
    live = _model(0, dtype=dtype)
    pv.Checkpoint(model=live).restore(path, allow_cast=cast).assert_consumed()
    kept = list(staging._kept)
    assert kept and staging.kept_bytes() >= 3 * (1 << 18)  # three datasets, stored once
    taken: list[np.ndarray] = []
    take = staging.take
    monkeypatch.setattr(staging, "take", lambda n: taken.append(take(n)) or taken[-1])
    other = _model(0, dtype=dtype)
    pv.Checkpoint(model=other).restore(path, allow_cast=cast).assert_consumed()
    assert taken and all(any(_whole(t) is k for k in kept) for t in taken)
    expected = [[c.astype(dtype) for c in v.components] for v in _model(1).vs]
    for buf in staging._kept:
        buf[:] = 0xFF
    for model in (live, other):
        for v, want in zip(model.vs, expected, strict=True):
            for c, w in zip(v.components, want, strict=True):
                np.testing.assert_array_equal(c, w)


def test_a_restore_asks_for_the_file_ahead_and_a_command_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore's reader asks the kernel for the file's tail (the index, the columns) and its
    first RESTORE_READ_AHEAD bytes before it opens the file; a reader opened for a command
    asks for nothing up front."""
    path = tmp_path / "a.h5"
    pv.Checkpoint(model=_model(1, 1 << 20)).write(path)
    size = os.path.getsize(path)
    monkeypatch.setattr(read_module, "RESTORE_READ_AHEAD", 1 << 20)
    asked: list[tuple[int, int]] = []
    fadvise = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append((offset, length))
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    H5Reader(path).close()
    assert asked == []
    sources.open_source(str(path)).close()
    assert asked == [(size - (1 << 20), 1 << 20), (0, 1 << 20)]


@pytest.mark.parametrize("path_taken", ["bulk", "general"])
@pytest.mark.parametrize("where", ["check", "commit"])
def test_a_failed_or_interrupted_restore_frees_its_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path_taken: str, where: str
) -> None:
    """A restore that fails or is interrupted does not give its staging memory to the pool: a
    thread of it may still be writing there, and the next restore would take those bytes as
    checked."""
    from parallelvars.checkpoint import matching
    from parallelvars.testing import restore_rules as _restore

    dtype = np.float32 if path_taken == "bulk" else np.float64
    cast = path_taken == "general"
    path = tmp_path / "a.h5"
    pv.Checkpoint(model=_model(1)).write(path)

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    # (the checks spread over threads; the copies into the variables, the same)
    monkeypatch.setattr(matching if where == "check" else _restore, "run_partitioned", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pv.Checkpoint(model=_model(0, dtype=dtype)).restore(path, allow_cast=cast)
    assert staging.kept_bytes() == 0
    monkeypatch.undo()
    pv.Checkpoint(model=_model(0, dtype=dtype)).restore(path, allow_cast=cast)
    assert staging.kept_bytes() > 0  # (a restore that succeeds keeps it)


def test_a_small_need_does_not_take_the_buffer_a_larger_one_will_need() -> None:
    """A restore takes its bulk buffer, then its staged components' one: taking the large kept
    buffer for the small first need would make the second allocate again (the peak rising by
    the large buffer). A kept buffer is taken only when at most twice the need."""
    mib = 1 << 20
    small, large = staging.take(20 * mib), staging.take(100 * mib)
    staging.give(small)
    staging.give(large)
    first = staging.take(30 * mib)  # (the small kept buffer is too small: freed)
    assert _whole(first) is not _whole(large) and _whole(first) is not _whole(small)
    second = staging.take(90 * mib)
    assert _whole(second) is _whole(large)
    assert staging.kept_bytes() == 0


def test_an_idle_time_past_the_longest_wait_keeps_the_freeing_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An IDLE_SECONDS longer than a lock can wait (threading.TIMEOUT_MAX) must not end the
    thread that frees the kept buffers: later, shorter idle times still free them."""
    monkeypatch.setattr(staging, "IDLE_SECONDS", threading.TIMEOUT_MAX * 4)
    staging.give(staging.take(2 << 20))
    time.sleep(0.2)  # (the freeing thread waits on that deadline now)
    monkeypatch.setattr(staging, "IDLE_SECONDS", 0.05)
    staging.give(staging.take(2 << 20))
    deadline = time.monotonic() + 10
    while staging.kept_bytes() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert staging.kept_bytes() == 0
    assert staging._reaper is not None and staging._reaper.is_alive()


def _resident(address: int, size: int) -> tuple[int, int]:
    """The resident bytes and the bytes in transparent huge pages of the mappings over
    ``[address, address + size)`` (from /proc/self/smaps; advice given over part of a mapping
    splits it in several)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    inside = False
    rss = huge = 0
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < address + size and hi > address
        elif inside and head == "Rss:":
            rss += int(line.split()[1]) << 10
        elif inside and head == "AnonHugePages:":
            huge += int(line.split()[1]) << 10
    return rss, huge


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_new_staging_memory_is_faulted_in_before_it_is_handed_out() -> None:
    """New staging memory arrives faulted in (madvise, not a page fault per page while the
    file's bytes are copied in), whichever page size the kernel gave faster. (40 MiB: past
    glibc's largest mmap threshold, so numpy's own memory would be a new, empty mapping.)"""
    buf = staging.take(40 << 20)
    rss, huge = _resident(buf.ctypes.data, buf.size)
    assert rss >= 40 << 20
    assert 0 <= huge <= rss


class _Clock:
    """A fake ``time`` for :func:`staging._fault_in`: each populate call costs what the test
    says, in the order it is made."""

    def __init__(self, costs: list[float]) -> None:
        self.now, self.costs, self.calls = 0.0, costs, []

    def perf_counter(self) -> float:
        return self.now

    def populate(self, address: int, size: int) -> bool:
        self.calls.append((address, size))
        self.now += self.costs[len(self.calls) - 1] if len(self.calls) <= len(self.costs) else 0
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise")
@pytest.mark.parametrize("slow_step", [None, 3])
def test_new_memory_takes_huge_pages_while_they_cost_less_than_small_ones(
    monkeypatch: pytest.MonkeyPatch, slow_step: int | None
) -> None:
    """Two steps in small pages set the reference; then huge pages one step at a time while
    each costs less per byte; from the first that does not, the rest in small pages at once.
    Every byte is faulted in exactly once."""
    import mmap

    size = 24 << 20
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = np.frombuffer(area, np.uint8).ctypes.data
    # small steps: 2 ms per step (the second is the reference: the faster); the head; then
    # huge steps of 0.1 ms, one of them 10 ms (slower per byte than the reference)
    costs = [0.004, 0.002, 0.0] + [0.0001] * 20
    if slow_step is not None:
        costs[3 + slow_step] = 0.010
    clock = _Clock(costs)
    advice: list[tuple[str, int, int]] = []
    advise = staging._advise

    def record(a: Any, name: str, start: int, length: int) -> bool:
        advice.append((name, start, length))
        return advise(a, name, start, length)

    monkeypatch.setattr(staging, "time", clock)
    monkeypatch.setattr(staging, "_populate", clock.populate)
    monkeypatch.setattr(staging, "_advise", record)
    assert staging._fault_in(area, address, size)
    spans = sorted((a - address, a - address + n) for a, n in clock.calls)
    assert spans[0][0] == 0 and spans[-1][1] == size
    assert all(b[0] == a[1] for a, b in itertools.pairwise(spans))  # no gap, no overlap
    first = staging._STEP - address % staging._STEP
    huge_from = first + 2 * staging._STEP
    assert advice[0] == ("MADV_HUGEPAGE", huge_from, size - huge_from)
    if slow_step is None:
        assert len(advice) == 1  # every later step in huge pages
        assert all(n <= staging._STEP for _, n in clock.calls)
    else:
        back = huge_from + (slow_step + 1) * staging._STEP
        assert advice[1:] == [("MADV_NOHUGEPAGE", back, size - back)]
        assert clock.calls[-1] == (address + back, size - back)  # the rest at once
    area.close()


def test_a_restore_asks_for_its_bulk_reads_before_it_takes_their_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bulk read asks the kernel for every span first and only then takes its staging
    memory: new memory is faulted in while the disk reads."""
    path = tmp_path / "a.h5"
    pv.Checkpoint(model=_model(1, 1 << 20)).write(path)
    events: list[str] = []
    fadvise, take = os.posix_fadvise, staging.take

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            events.append("ask")
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    monkeypatch.setattr(staging, "take", lambda n: events.append("take") or take(n))
    pv.Checkpoint(model=_model(0, 1 << 20)).restore(path).assert_consumed()
    # (the open's read-ahead asks twice; then the bulk read's spans, then its memory)
    assert events.count("take") == 1
    assert events.index("take") > 2 and events[events.index("take") - 1] == "ask"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise")
@pytest.mark.parametrize("small_advice", [True, False])
def test_a_kernel_without_populate_write_is_asked_once(
    monkeypatch: pytest.MonkeyPatch, small_advice: bool
) -> None:
    """Where MADV_POPULATE_WRITE fails (Linux before 5.14), new memory asks for it once and
    then faults its pages in by writing them: not twice more over the whole buffer."""
    calls: list[tuple[int, int]] = []

    def populate(address: int, size: int) -> bool:
        calls.append((address, size))
        return False

    advise = staging._advise

    def advice(area: Any, name: str, start: int, length: int) -> bool:
        return small_advice and advise(area, name, start, length)

    monkeypatch.setattr(staging, "_populate", populate)
    monkeypatch.setattr(staging, "_advise", advice)
    buf = staging._new(24 << 20)
    assert len(calls) == 1, calls
    rss, _ = _resident(buf.ctypes.data, buf.size)
    assert rss >= 24 << 20  # faulted in all the same
