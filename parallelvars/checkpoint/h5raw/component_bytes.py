"""A save's component bytes: which components of a variable share one dataset (a mirrored
variable's replicas, compared byte for byte), their checksums, and the gathered writes that put
them in a file (on a helper thread while the saving thread makes the metadata).

:mod:`.native` plans and writes whole files; it calls these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import crc32c as _crc32c
import numpy as np

from parallelvars._fileio import (
    IOV_MAX,
    WRITEBACK_STEP,
    byte_view,
    checksum,
    pwritev_all,
    same_bytes,
    start_writeback,
)
from parallelvars._threads import submit_or_run, thread_count
from parallelvars.checkpoint.h5raw.generate import FilePlan


def _shared(components: Sequence[np.ndarray], crcs: list[int]) -> list[int]:
    """For each component, the first earlier one with the same checksum, shape and bytes (or
    itself): which components of a variable whose components are not all equal (see
    :func:`_checksummed`, which finds the common case of all equal first) share a dataset."""
    out: list[int] = []
    for i, c in enumerate(components):
        j = next(
            (
                k
                for k in out[:i]
                if out[k] == k
                and crcs[k] == crcs[i]
                and components[k].shape == c.shape
                and components[k].dtype == c.dtype
                and same_bytes(components[k], c)
            ),
            i,
        )
        out.append(j)
    return out


def _write_components(
    fd: int, plan: FilePlan, items: list[Any], comps: list[list[np.ndarray]]
) -> None:
    """Every component with data at its offset (see :func:`_batches`)."""
    _write_batches(fd, _batches(plan, items, comps))


#: The most bytes one gathered write takes (Linux writes at most about 2 GiB in one call; a
#: larger component is written alone, its short writes resumed by ``pwritev_all``).
_GATHER_BYTES = 1 << 30


def _batches(
    plan: FilePlan, items: list[Any], comps: list[list[np.ndarray]]
) -> list[tuple[int, list[Any], int]]:
    """The gathered writes ``(offset, buffers, size)`` of every component with data, in file
    order: neighbours (at most :data:`IOV_MAX` buffers and :data:`_GATHER_BYTES` bytes) in one
    write, each buffer the array's own bytes (no copy). A gap of up to 64 bytes between two
    neighbours is written as zeros in the same write (so anything else placed in such a gap is
    written after these); a wider one ends the write, and is left as a hole.
    The plan lays the stored components out in order: a component at an offset not past the
    last one's is stored as another's dataset (not written again)."""
    placed: list[tuple[int, np.ndarray]] = []
    last = -1
    offsets = plan.offsets
    for e, cs in zip(items, comps, strict=True):
        for off, c in zip(offsets[e.path], cs, strict=True):
            if off is not None and off > last and c.nbytes:
                placed.append((off, c))
                last = off
    out: list[tuple[int, list[Any], int]] = []
    k = 0
    while k < len(placed):
        start = placed[k][0]
        buffers: list[Any] = []
        end = start
        while k < len(placed) and len(buffers) < IOV_MAX - 1:
            off, c = placed[k]
            if buffers and off + c.nbytes - start > _GATHER_BYTES:
                break
            if off != end:
                if off - end > 64:
                    break
                buffers.append(np.zeros(off - end, np.uint8))
            buffers.append(_raw(c))
            end = off + c.nbytes
            k += 1
        out.append((start, buffers, end - start))
    return out


def _write_batches(fd: int, batches: Sequence[tuple[int, list[Any], int]]) -> None:
    """Write :func:`_batches`' gathered writes, asking the kernel every ``WRITEBACK_STEP``
    bytes to start writing them to disk (:func:`~parallelvars._fileio.start_writeback`): the
    disk works while the save goes on, instead of all at its ``fsync``."""
    lo = hi = -1
    for start, buffers, size in batches:
        pwritev_all(fd, buffers, start, size)
        if lo < 0:
            lo = start
        hi = start + size
        if hi - lo >= WRITEBACK_STEP:
            start_writeback(fd, lo, hi - lo)
            lo = -1
    if lo >= 0:
        start_writeback(fd, lo, hi - lo)


class _DataWrite:
    """A save's component bytes (:func:`_batches`) being written on a helper thread while the
    saving thread makes the rest of the file (its metadata, the documents): the writes
    release the GIL, so the two overlap. With one core (:func:`~parallelvars._threads.thread_count`)
    they are written at once, in the calling thread. :meth:`wait` waits for the writes and
    raises their error; :meth:`join` only waits (before the descriptor closes, whatever
    happened)."""

    def __init__(self, fd: int, batches: list[tuple[int, list[Any], int]]) -> None:
        self._future: Future[None] | None = None
        if thread_count() < 2 or not batches:
            _write_batches(fd, batches)
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parallelvars-save")
        try:
            self._future = submit_or_run(pool, _write_batches, fd, batches)
        finally:
            pool.shutdown(wait=False)  # (its one worker ends with the writes)

    def join(self) -> None:
        if self._future is not None:
            futures.wait([self._future])

    def wait(self) -> None:
        self.join()
        if self._future is not None:
            self._future.result()


def _crc(c: np.ndarray) -> int:
    """``checksum(c)`` without making a view where the array exports its buffer itself."""
    if c.dtype.kind != "O":
        try:
            return int(_crc32c.crc32c(cast(Any, c)))
        except (ValueError, TypeError, BufferError):  # (extension dtypes: no buffer format)
            pass
    return checksum(c)


def _raw(c: np.ndarray) -> Any:
    """A C-contiguous array's bytes as a flat byte buffer ``pwritev`` takes (only arrays with
    data are written)."""
    try:
        return memoryview(cast(Any, c)).cast("B")
    except (ValueError, TypeError, BufferError):
        return byte_view(c)


def _contiguous(c: Any) -> np.ndarray:
    """``c`` as a C-contiguous array (a 0-d one stays 0-d: ``np.ascontiguousarray`` makes it 1-d)."""
    a = np.asarray(c)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _checksummed(
    items: Sequence[Any], share_equal: bool
) -> tuple[list[list[np.ndarray]], list[list[int]], list[list[int] | None], tuple[Any, ...]]:
    """Each entry's components (C-contiguous), their checksums, which components share
    a dataset (:func:`_shared`; None: each its own) and the sharing pattern of every entry.

    A component whose bytes equal the first component's (a mirrored variable's, the common
    case) takes the first one's checksum: comparing the bytes is needed to share them anyway,
    and the checksum of equal bytes is the same."""
    comps: list[list[np.ndarray]] = []
    crcs: list[list[int]] = []
    shared: list[list[int] | None] = []
    pattern: list[Any] = []
    plan = _replica_plan(items) if share_equal else None
    equal: Callable[[int], bool] = lambda n: False  # noqa: E731
    if plan is not None:
        differ = {plan.record_of(i) for i in plan.replicas_differing()}
        if differ:  # (divergent from now on: compared one by one, not in the runs)
            plan.share_less(items, differ)
        starts, primary = plan.starts, plan.primary
        equal = lambda n: (  # noqa: E731
            n not in differ
            and starts[n + 1] - starts[n] > 1
            and primary[starts[n] + 1] != starts[n] + 1
        )
    for k, e in enumerate(items):
        if equal(k):  # replicas of the first, all equal to it: compared by their runs
            cs = list(e.components)
            comps.append(cs)
            crcs.append([_crc(cs[0])] * len(cs))
            shared.append([0] * len(cs))
            pattern.append((0,) * len(cs))
            continue
        cs = [_contiguous(c) for c in e.components]
        comps.append(cs)
        n = len(cs)
        if cs and cs[0].dtype.kind == "O":
            # byte strings: their values lay out the global heap, so they are part of what a
            # cached plan is found by (each component stored: none shares another's heap
            # objects)
            crcs.append([_crc(c) for c in cs])
            shared.append(None)
            pattern.append(("bytes", *(tuple(map(bytes, c.reshape(-1).tolist())) for c in cs)))
            continue
        if n < 2 or not share_equal or e.kind == "sharded":
            crcs.append([_crc(c) for c in cs])
            shared.append(None)
            pattern.append(None)
            continue
        first = cs[0]
        shape, dt = first.shape, first.dtype
        crc0 = _crc(first)
        same = True
        if first.nbytes <= 1 << 16:  # (small: one copy of the first, compared with each)
            raw = first.tobytes()
            for c in cs[1:]:
                if c is not first and not (
                    c.shape == shape and c.dtype == dt and c.tobytes() == raw
                ):
                    same = False
                    break
        else:
            for c in cs[1:]:
                if c is not first and not (
                    c.shape == shape and c.dtype == dt and same_bytes(first, c)
                ):
                    same = False
                    break
        if same:
            crcs.append([crc0] * n)
            shared.append([0] * n)
            pattern.append((0,) * n)
            continue
        cc = [crc0] + [_crc(c) for c in cs[1:]]
        crcs.append(cc)
        sh: list[int] | None = _shared(cs, cc)
        if sh == list(range(n)):
            sh = None
        shared.append(sh)
        pattern.append(None if sh is None else tuple(sh))
    return comps, crcs, shared, tuple(pattern)


def _replica_plan(items: Sequence[Any]) -> Any:
    """The plan of runs the replicas of ``items`` are compared by, when the records carry one
    (``RecordList.replicas``: a :class:`~parallelvars.checkpoint.snapshot.SnapshotPlan`, set
    by the checkpoint's writer from a structure's second save on): a mirrored model's
    replicas are then compared with their first components by one ``memcmp`` per run of an
    arena row, not one by one. None: compared one by one."""
    plan = getattr(items, "replicas", None)
    return None if plan is None or plan is False else plan
