"""A save's component bytes: which components of a variable share one dataset (a mirrored
variable's replicas, compared byte for byte), their checksums, and the gathered writes that put
them in a file (on a helper thread while the saving thread makes the metadata).

The writes go out in batches of at most :data:`_FUSE_BYTES`, and each batch's components are
checksummed just before their gathered write and checked again just after it, while the batch
is in the CPU cache (see :func:`_write_fused`): one pass from memory over the bytes for the
checksum, the write and the guard against another thread changing a buffer meanwhile, instead
of three. Two cases read bytes from memory a second time: a component larger than a batch
(written in pieces, then checksummed whole), and the earlier components of a variable whose
components go out in several batches (checked again once its last one is written).

:mod:`.native` plans and writes whole files; it calls these.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from operator import is_
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
from parallelvars.errors import ConcurrentWriteError

#: A checksum the writer fills in (:func:`_write_fused`) as it writes the component.
Checksums = list[list[int | None]]


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
    fd: int,
    plan: FilePlan,
    items: list[Any],
    comps: Sequence[Sequence[np.ndarray]],
    crcs: Checksums,
    file: str,
    batches: list[Batch] | None = None,
) -> list[Batch]:
    """Every component with data at its offset (see :func:`_batches`, :func:`_write_fused`;
    ``batches``: laid out by an earlier save of the same plan and arrays, see
    :func:`same_arrays`); returns the batches written."""
    if batches is None:
        batches = _batches(plan, items, comps)
    _write_fused(fd, batches, crcs, file, items)
    return batches


#: The most bytes one gathered write takes: a batch is checksummed, written and checked again
#: while it is in the CPU cache (a larger component is written alone, in pieces of this size).
_FUSE_BYTES = 1 << 21
_ZEROS = bytes(64)  # (what a gap of up to 64 bytes between two components is written as)

#: A gathered write: ``(offset, buffers, size, members)``, each member ``(offset, component,
#: entry number, component number, the buffer written: see _raw)``.
Member = tuple[int, np.ndarray, int, int, Any]
Batch = tuple[int, list[Any], int, list[Member]]


def same_arrays(batches: Sequence[Batch], comps: Sequence[Sequence[np.ndarray]]) -> bool:
    """Whether ``batches`` (laid out for the same plan) write exactly the arrays ``comps``
    holds (the same objects: a repeated save of the same records, whose component views do
    not change, writes through the batches of the last one)."""
    return all(comps[k][i] is c for b in batches for _, c, k, i, _ in b[3])


def _batches(
    plan: FilePlan, items: list[Any], comps: Sequence[Sequence[np.ndarray]]
) -> list[Batch]:
    """The gathered writes of every component with data, in file order: neighbours (at most
    :data:`IOV_MAX` buffers and :data:`_FUSE_BYTES` bytes) in one write, each buffer the
    array's own bytes (no copy). A gap of up to 64 bytes between two neighbours is written as
    zeros in the same write (so anything else placed in such a gap is written after these); a
    wider one ends the write, and is left as a hole. A component larger than
    :data:`_FUSE_BYTES` is a write of its own.
    The plan lays the stored components out in order: a component at an offset not past the
    last one's is stored as another's dataset (not written again)."""
    out: list[Batch] = []
    buffers: list[Any] = []
    members: list[Member] = []
    start = end = last = -1
    limit = IOV_MAX - 1
    offsets = plan.offsets
    # (one pass over the components, each batch ended as the next component does not fit it)
    for k, (e, cs) in enumerate(zip(items, comps, strict=True)):
        for i, (off, c) in enumerate(zip(offsets[e.path], cs, strict=True)):
            if off is None or off <= last:
                continue
            n = c.nbytes
            if not n:
                continue
            last = off
            if buffers and (
                off + n - start > _FUSE_BYTES or off - end > 64 or len(buffers) >= limit
            ):
                out.append((start, buffers, end - start, members))
                buffers, members = [], []
            if not buffers:
                start = end = off
            elif off != end:
                buffers.append(_ZEROS[: off - end])
            raw = _raw(c)
            buffers.append(raw)
            members.append((off, c, k, i, raw))
            end = off + n
    if buffers:
        out.append((start, buffers, end - start, members))
    return out


def _changed(file: str, items: Sequence[Any], k: int, i: int) -> ConcurrentWriteError:
    return ConcurrentWriteError(
        "changed while it was being saved",
        file=file,
        variable=f"{items[k].path}[{i}]",
        hint="write from a single thread, or save with blocking=False, which snapshots",
    )


def _write_fused(
    fd: int, batches: Sequence[Batch], crcs: Checksums, file: str, items: Sequence[Any]
) -> None:
    """Write :func:`_batches`' gathered writes, each component checksummed in the same pass.

    A batch's components are checksummed (unless ``crcs`` holds their checksums already),
    written in one ``pwritev``, then checksummed again while the batch is in the CPU cache: a
    buffer another thread changed from its first checksum to its second fails the save
    (:class:`~parallelvars.errors.ConcurrentWriteError`: the file would hold a mix of two
    values under a matching checksum). A component larger than a batch is checksummed and
    written in pieces, each while it is in the cache, then checksummed whole again: a piece
    changed after it was read shows then. A variable whose stored components go out in
    several batches (a sharded variable's shards, replicas that differ) has its earlier
    components checksummed once more after its last one is written: another thread assigning
    the variable between two of its batches would otherwise leave old and new components in
    the file, each under a matching checksum. The guard is per variable: two variables
    written in turn may each hold a different moment's value. The checksums found are put in
    ``crcs``.

    Every ``WRITEBACK_STEP`` bytes the kernel is asked to start writing them to disk
    (:func:`~parallelvars._fileio.start_writeback`): the disk works while the save goes on,
    instead of all at its ``fsync``."""
    lo = hi = -1
    crc = _crc32c.crc32c
    # (a record whose stored components go out in several batches: its members in the batches
    # written so far, checked again once its last component is written)
    spanning: list[Member] = []
    last = len(batches) - 1
    for n, (start, buffers, size, members) in enumerate(batches):
        if size > _FUSE_BYTES:  # (one component: in pieces)
            _, c, k, i, _ = members[0]
            data = memoryview(_flat(c))
            running = 0
            for at in range(0, size, _FUSE_BYTES):
                piece = data[at : at + _FUSE_BYTES]
                running = crc(piece, running)
                pwritev_all(fd, [piece], start + at, len(piece))
            known = crcs[k][i]
            if _crc(c) != running or (known is not None and known != running):
                raise _changed(file, items, k, i)
            crcs[k][i] = running
        else:
            # (each buffer exports its bytes: checksummed as it is, no view made)
            before = [crc(b) if crcs[k][i] is None else crcs[k][i] for _, _, k, i, b in members]
            pwritev_all(fd, buffers, start, size)
            for (_, _, k, i, b), value in zip(members, before, strict=True):
                if crc(b) != value:
                    raise _changed(file, items, k, i)
                crcs[k][i] = value
        ends = members[-1][2]
        goes_on = n < last and batches[n + 1][3][0][2] == ends
        if spanning:  # (this batch begins with the rest of that record)
            if goes_on and ends == spanning[0][2]:
                spanning.extend(members)  # (all of them its own)
            else:  # its last component written: its earlier ones must still hold those bytes
                for _, _, k, i, b in spanning:
                    if crc(b) != crcs[k][i]:
                        raise _changed(file, items, k, i)
                spanning = []
        if goes_on and not spanning:
            spanning = [m for m in members if m[2] == ends]
        if lo < 0:
            lo = start
        hi = start + size
        if hi - lo >= WRITEBACK_STEP:
            start_writeback(fd, lo, hi - lo)
            lo = -1
    if lo >= 0:
        start_writeback(fd, lo, hi - lo)


class _DataWrite:
    """A save's component bytes being written on a helper thread while the saving thread
    makes the rest of the file (its metadata, the documents): the helper lays out the gathered
    writes (:func:`_batches`) and writes them; the writes and the checksums release the GIL,
    so the two overlap. The checksums are filled into ``crcs`` as the bytes are written
    (:func:`_write_fused`): read them after :meth:`wait`. With one core
    (:func:`~parallelvars._threads.thread_count`) they are written at once, in the calling
    thread. :meth:`wait` waits for the writes and raises their error; :meth:`join` only waits
    (before the descriptor closes, whatever happened)."""

    def __init__(
        self,
        fd: int,
        plan: FilePlan,
        items: list[Any],
        comps: Sequence[Sequence[np.ndarray]],
        crcs: Checksums,
        file: str,
        batches: list[Batch] | None = None,
    ) -> None:
        self._future: Future[list[Batch]] | None = None
        self._batches: list[Batch] | None = None
        self._pool: ThreadPoolExecutor | None = None
        if thread_count() < 2:
            self._batches = _write_components(fd, plan, items, comps, crcs, file, batches)
            return
        pool = self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="parallelvars-save"
        )
        try:
            self._future = submit_or_run(
                pool, _write_components, fd, plan, items, comps, crcs, file, batches
            )
        finally:
            pool.shutdown(wait=False)  # (its one worker ends with the writes)

    def join(self) -> None:
        if self._future is not None:
            futures.wait([self._future])
        if self._pool is not None:  # (its thread has ended too when the save returns)
            self._pool.shutdown(wait=True)
            self._pool = None

    def wait(self) -> list[Batch]:
        """Wait for the writes, raise their error; the batches written."""
        self.join()
        if self._future is not None:
            self._batches = self._future.result()
        assert self._batches is not None
        return self._batches


def _crc(c: np.ndarray) -> int:
    """``checksum(c)`` without making a view where the array exports its buffer itself."""
    if c.dtype.kind != "O":
        try:
            return int(_crc32c.crc32c(cast(Any, c)))
        except (ValueError, TypeError, BufferError):  # (extension dtypes: no buffer format)
            pass
    return checksum(c)


def _raw(c: np.ndarray) -> Any:
    """A C-contiguous array with data as a flat buffer ``pwritev`` takes: the array itself (or
    a 1-d view of it) where its dtype exports a buffer (asked once per dtype), else a flat
    byte view of it."""
    exports = _EXPORTS.get(c.dtype)
    if exports is None:
        try:
            memoryview(cast(Any, np.zeros(1, c.dtype)))
            exports = True
        except (ValueError, TypeError, BufferError):
            exports = False
        _EXPORTS[c.dtype] = exports
    if not exports:
        return byte_view(c)
    return c if c.ndim == 1 else c.ravel()


_EXPORTS: dict[np.dtype, bool] = {}


def _flat(c: np.ndarray) -> Any:
    """A C-contiguous array's bytes as a flat byte buffer (sliced into pieces)."""
    try:
        return memoryview(cast(Any, c)).cast("B")
    except (ValueError, TypeError, BufferError):
        return byte_view(c)


def _contiguous(c: Any) -> np.ndarray:
    """``c`` as a C-contiguous array (a 0-d one stays 0-d: ``np.ascontiguousarray`` makes it 1-d)."""
    a = np.asarray(c)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


_COMPONENTS = operator.attrgetter("components")
#: Components of at most this many bytes are compared as copies (``tobytes``), larger ones in
#: place (``same_bytes``).
_SMALL = 1 << 16


def _checksummed(
    items: Sequence[Any], share_equal: bool, *, deferred: bool = False, compare: bool = True
) -> tuple[list[Sequence[np.ndarray]], Checksums, list[list[int] | None], tuple[Any, ...]]:
    """Each entry's components (C-contiguous), their checksums, which components share
    a dataset (:func:`_shared`; None: each its own) and the sharing pattern of every entry.

    With ``deferred``, a checksum the writer computes as it writes the component
    (:func:`_write_fused`) is left None here: only those that decide which components share a
    dataset are computed now; :func:`settle` fills the rest in after the write. A component
    whose bytes equal the first component's (a mirrored variable's, the common case) takes
    the first one's checksum: comparing the bytes is needed to share them anyway, and the
    checksum of equal bytes is the same.

    Without ``compare``, the replicas the records' plan compares by runs
    (:func:`_replica_plan`) are taken to be equal to their first components, as at the last
    save, and not compared here: the caller compares them while the bytes are written
    (:func:`replicas_diverged`) and saves again with ``compare`` if any differs.

    The entries are sorted out all at once (:func:`_sorted_out`: one tight pass, no object
    made per entry); only the others are looked at one by one (:func:`_entry`)."""
    plan = _replica_plan(items) if share_equal else None
    lives = list(map(_COMPONENTS, items))
    given: list[int] = []
    if plan is not None:
        differ = {plan.record_of(i) for i in plan.replicas_differing()} if compare else set()
        if differ:  # (divergent from now on: compared one by one, not in the runs)
            plan.share_less(items, differ)
        starts, primary = plan.starts, plan.primary
        given = [
            n
            for n in range(len(items))
            if n not in differ
            and starts[n + 1] - starts[n] > 1
            and primary[starts[n] + 1] != starts[n] + 1
        ]
    codes = _sorted_out(items, lives, share_equal, given)
    later: list[int | None] = [None]
    # (one list per count of replicas of the first, shared by the entries: read, never
    # changed, by the plan, the classes and settle; and one pattern per count)
    firsts = {n: [0] * n for n in set(codes) if n > 0}
    zeros = {n: (0,) * n for n in firsts}
    crcs: Checksums = list(map(operator.mul, itertools.repeat(later), map(len, lives)))
    shared: list[list[int] | None] = list(map(firsts.get, codes))
    pattern: list[Any] = list(map(zeros.get, codes))
    # (a variable's own tuple of components, as they are written: no list kept a record)
    comps: list[Sequence[np.ndarray]] = (
        lives
        if all(type(live) is tuple for live in lives)
        else [live if type(live) is tuple else list(live) for live in lives]
    )
    for k in itertools.compress(itertools.count(), map(operator.lt, codes, itertools.repeat(0))):
        comps[k], crcs[k], shared[k], pattern[k] = _entry(
            items[k], lives[k], share_equal, firsts, zeros
        )
    if not deferred:
        settle(crcs, shared, comps)
    return comps, crcs, shared, tuple(pattern)


def _sorted_out(
    items: Sequence[Any], lives: list[Sequence[Any]], share_equal: bool, given: list[int]
) -> list[int]:
    """What each entry's components are, in one pass of a few operations an entry: ``n``
    (the number of its components, at least 2): replicas of its first (the entries ``given``,
    which the records' plan compares by runs; or C-contiguous arrays of one shape, dtype and
    bytes, each of at most ``_SMALL`` bytes, of a variable not sharded, with
    ``share_equal``); 0: each its own (C-contiguous arrays, not byte strings, of an entry of
    one component, of a sharded variable or without ``share_equal``); -1: looked at alone
    (:func:`_entry`: anything else, replicas that differ too)."""
    codes = [-1] * len(lives)
    for k in given:
        codes[k] = len(lives[k])
    ndarray = np.ndarray
    small = _SMALL
    for k, live in enumerate(lives):
        n = len(live)
        if not n:
            continue
        first = live[0]
        if type(first) is not ndarray or not first.flags.c_contiguous or codes[k] >= 0:
            continue
        dt = first.dtype
        if dt.kind == "O":
            continue
        if n == 1:
            codes[k] = 0
        elif not share_equal or items[k].kind == "sharded":
            if all(
                type(c) is ndarray and c.flags.c_contiguous and c.dtype.kind != "O" for c in live
            ):
                codes[k] = 0
        elif first.nbytes <= small:
            shape = first.shape
            raw = first.tobytes()
            for c in live[1:]:
                if not (
                    type(c) is ndarray
                    and c.flags.c_contiguous
                    and c.shape == shape
                    and c.dtype == dt
                    and c.tobytes() == raw
                ):
                    break
            else:
                codes[k] = n
    return codes


def _entry(
    e: Any,
    live: Sequence[Any],
    share_equal: bool,
    firsts: dict[int, list[int]],
    zeros: dict[int, tuple[int, ...]],
) -> tuple[Sequence[np.ndarray], list[int | None], list[int] | None, Any]:
    """One entry of :func:`_checksummed` that :func:`_sorted_out` did not sort out: its
    components (C-contiguous), their checksums, their sharing and its part of the pattern."""
    n = len(live)
    # (a C-contiguous ndarray as it is, asked without a call)
    cs = [c if type(c) is np.ndarray and c.flags.c_contiguous else _contiguous(c) for c in live]
    # (a variable's own tuple of components, when each is as written: no list kept a record)
    comps = live if type(live) is tuple and all(map(is_, cs, live)) else cs
    if n and cs[0].dtype.kind == "O":
        # byte strings: their values lay out the global heap, so they are part of what a
        # cached plan is found by (each component stored: none shares another's heap objects)
        crcs: list[int | None] = [_crc(c) for c in cs]
        return (
            comps,
            crcs,
            None,
            ("bytes", *(tuple(map(bytes, c.reshape(-1).tolist())) for c in cs)),
        )
    if n < 2 or not share_equal or e.kind == "sharded":
        return comps, [None] * n, None, None
    first = cs[0]
    shape, dt = first.shape, first.dtype
    same = True
    if first.nbytes <= _SMALL:  # (small: one copy of the first, compared with each)
        raw = first.tobytes()
        for c in cs[1:]:
            if c is not first and not (c.shape == shape and c.dtype == dt and c.tobytes() == raw):
                same = False
                break
    else:
        for c in cs[1:]:
            if c is not first and not (c.shape == shape and c.dtype == dt and same_bytes(first, c)):
                same = False
                break
    if same:
        return comps, [None] * n, firsts.setdefault(n, [0] * n), zeros.setdefault(n, (0,) * n)
    crcs = [_crc(c) for c in cs]
    sh: list[int] | None = _shared(cs, cast(list[int], crcs))
    if sh == list(range(n)):
        sh = None
    return comps, crcs, sh, None if sh is None else tuple(sh)


def settle(
    crcs: Checksums, shared: Sequence[Sequence[int] | None], comps: Sequence[Sequence[np.ndarray]]
) -> list[list[int]]:
    """Fill in the checksums :func:`_checksummed` left to the writer and it did not compute:
    a component stored as another's dataset takes that one's, any other (not written: empty,
    or without an offset) its own. ``crcs``, complete."""
    for cc, sh, cs in zip(crcs, shared, comps, strict=True):
        if None in cc:
            first = cc[0]
            if first is not None and sh is not None and not any(sh):  # (replicas of the first)
                cc[:] = [first] * len(cc)
                continue
            for i, value in enumerate(cc):
                if value is None:
                    j = i if sh is None else sh[i]
                    cc[i] = cc[j] if j != i else _crc(cs[i])
    return cast(list[list[int]], crcs)


def _replica_plan(items: Sequence[Any]) -> Any:
    """The plan of runs the replicas of ``items`` are compared by, when the records carry one
    (``RecordList.replicas``: a :class:`~parallelvars.checkpoint.snapshot.SnapshotPlan`, set
    by the checkpoint's writer from a structure's second save on): a mirrored model's
    replicas are then compared with their first components by one ``memcmp`` per run of an
    arena row, not one by one. None: compared one by one."""
    plan = getattr(items, "replicas", None)
    return None if plan is None or plan is False else plan


def compares_later(items: Sequence[Any], share_equal: bool) -> bool:
    """Whether a save of ``items`` may compare their replicas while it writes the bytes
    (:func:`_checksummed` without ``compare``): the records carry a plan of runs."""
    return share_equal and _replica_plan(items) is not None


def replicas_diverged(items: Sequence[Any]) -> bool:
    """Whether a replica the records' plan compares by runs no longer holds its first
    component's bytes (the save that took them to be equal is made again, comparing first)."""
    plan = _replica_plan(items)
    return plan is not None and bool(plan.replicas_differing())


class Diverged(Exception):
    """A save that took the replicas to be equal found one that is not (internal: the save is
    made again, see :func:`_checksummed`)."""
