"""Work spread over threads (parallelvars._threads) and the restore that uses it."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import h5py
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parallelvars as pv
from parallelvars import _threads
from parallelvars.errors import ChecksumMismatchError


@pytest.fixture
def threaded(monkeypatch):
    """Force the threaded path, whatever the machine and the amount of work."""
    monkeypatch.setenv("PARALLELVARS_THREADS", "3")
    monkeypatch.setattr(_threads, "MIN_PARALLEL_BYTES", 0)


@given(st.lists(st.integers(0, 10**6), max_size=60), st.integers(1, 6))
def test_partition_is_contiguous_covering_and_bounded(weights, parts) -> None:
    ranges = _threads.partition(weights, parts)
    assert 1 <= len(ranges) <= max(1, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(weights)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(lo < hi for lo, hi in ranges) or weights == []


def test_partition_balances_equal_weights() -> None:
    assert _threads.partition([1] * 8, 2) == [(0, 4), (4, 8)]
    assert _threads.partition([1] * 9, 3) == [(0, 3), (3, 6), (6, 9)]
    assert _threads.partition([100, 1, 1, 1], 2) == [(0, 1), (1, 4)]


def test_every_call_runs_once_on_several_threads(threaded) -> None:
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def call(i: int):
        def run() -> None:
            time.sleep(0.002)
            with lock:
                seen.append((i, threading.get_ident()))

        return run

    _threads.run_partitioned([call(i) for i in range(12)], [1] * 12)
    assert sorted(i for i, _ in seen) == list(range(12))
    assert len({t for _, t in seen}) == 3


def test_the_earliest_error_wins_and_every_thread_has_finished(threaded) -> None:
    finished: list[int] = []

    def ok(i: int):
        def run() -> None:
            time.sleep(0.01)
            finished.append(i)

        return run

    def fail(i: int):
        def run() -> None:
            raise ValueError(f"call {i}")

        return run

    calls = [ok(0), ok(1), fail(2), ok(3), fail(4), ok(5), ok(6), ok(7), ok(8)]
    with pytest.raises(ValueError, match="call 2"):
        _threads.run_partitioned(calls, [1] * 9)
    # Ranges (0-2), (3-5), (6-8): the first stops at its error, the others ran to their end
    # (or their own error) before the call returned.
    assert sorted(finished) == [0, 1, 3, 6, 7, 8]


def test_nested_calls_run_inline(threaded) -> None:
    inner: list[int] = []

    def outer(i: int):
        def run() -> None:
            _threads.run_partitioned([lambda j=j: inner.append(j) for j in range(4)], [1] * 4)

        return run

    _threads.run_partitioned([outer(i) for i in range(3)], [1] * 3)  # would deadlock otherwise
    assert sorted(inner) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_thread_count_setting(monkeypatch) -> None:
    monkeypatch.setenv("PARALLELVARS_THREADS", "1")
    assert _threads.thread_count() == 1
    monkeypatch.setenv("PARALLELVARS_THREADS", "two")
    with pytest.raises(
        ValueError, match="PARALLELVARS_THREADS must be a whole number, found 'two'"
    ):
        _threads.thread_count()
    monkeypatch.delenv("PARALLELVARS_THREADS")
    assert 1 <= _threads.thread_count() <= 4


def _model(n: int = 12):
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.vars = [pv.Variable(np.full((64, 8), i, np.float32), name=f"v{i}") for i in range(n)]
    return m


def test_threaded_restore_restores_every_component(tmp_path, threaded) -> None:
    src = _model()
    path = pv.Checkpoint(model=src).write(tmp_path / "c.h5")
    dst = _model()
    for v in dst.vars:
        v.assign(np.full((64, 8), -1, np.float32))
    pv.Checkpoint(model=dst).restore(path).assert_consumed()
    for i, v in enumerate(dst.vars):
        for c in v.components:
            np.testing.assert_array_equal(c, np.full((64, 8), i, np.float32))


def test_threaded_restore_is_all_or_nothing(tmp_path, threaded) -> None:
    """A damaged component verified on another thread still stops every write."""
    path = pv.Checkpoint(model=_model()).write(tmp_path / "c.h5")
    with h5py.File(path, "r") as f:  # the last variable: checked by the last thread
        offset = int(f["model/vars/11/parallel_component_1"].id.get_offset())
    with open(path, "r+b") as f:
        f.seek(offset + 7)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))
    dst = _model()
    for v in dst.vars:
        v.assign(np.full((64, 8), -1, np.float32))
    # (its mirrored components are one dataset, stored once: either name is the damaged one's)
    with pytest.raises(
        ChecksumMismatchError, match=r"model/vars/11/(primary|parallel_component_1)"
    ):
        pv.Checkpoint(model=dst).restore(path)
    for v in dst.vars:
        for c in v.components:
            np.testing.assert_array_equal(c, np.full((64, 8), -1, np.float32))


def test_submit_or_run_uses_the_pool_and_runs_inline_once_it_takes_no_work() -> None:
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1)
    try:
        assert _threads.submit_or_run(pool, threading.current_thread).result() is not (
            threading.current_thread()
        )
    finally:
        pool.shutdown()
    # A pool that takes no more work (as every pool once the interpreter is exiting): the
    # call runs in this thread, its outcome in the future.
    assert _threads.submit_or_run(pool, threading.current_thread).result() is (
        threading.current_thread()
    )
    failed = _threads.submit_or_run(pool, int, "x")
    assert isinstance(failed.exception(), ValueError)


@pytest.mark.parametrize("helper", ["run_partitioned", "run_in_order"])
def test_an_interrupt_while_waiting_is_raised_only_once_every_thread_stopped(
    threaded, helper
) -> None:
    # A worker's call still running after the helper returned would write into memory its
    # caller has given back (a restore's staging buffers): the helper waits for it first.
    main = threading.main_thread()
    finished: list[int] = []
    started = threading.Event()

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    def call(i: int):
        def run() -> None:
            if threading.current_thread() is main:
                started.wait()  # (each thread takes one call)
                return
            started.set()
            time.sleep(0.1)  # (the calling thread is waiting on this one by now)
            signal.pthread_kill(main.ident, signal.SIGUSR1)
            time.sleep(0.2)
            finished.append(i)

        return run

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            if helper == "run_partitioned":
                _threads.run_partitioned([call(0), call(1)], [1, 1])
            else:
                _threads.run_in_order([call(0), call(1)])
        assert finished  # the worker's call ended before the interrupt was raised
    finally:
        signal.signal(signal.SIGUSR1, previous)
