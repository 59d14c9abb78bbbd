"""The non-blocking save's snapshot: copies of every component that held together at one
moment (:func:`take_snapshot`), made by a plan of spans computed once per structure
(:class:`SnapshotPlan`), so training may change the variables while the copies are written.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Sequence

import numpy as np

from parallelvars._fileio import byte_view, same_bytes
from parallelvars.checkpoint.h5io.write import RecordList
from parallelvars.checkpoint.registry import SaveRecord
from parallelvars.errors import ConcurrentWriteError

__all__ = ["SNAPSHOT_ATTEMPTS", "SNAPSHOT_KEEP_BYTES", "Snapshot", "SnapshotPlan", "take_snapshot"]

SNAPSHOT_ATTEMPTS = 4
# Two components of one base buffer are copied in one span when at most this many bytes lie
# between them (padding, variables this checkpoint does not save): a span is one copy and one
# comparison, and copying a few KiB more costs less than another span does. Wider gaps (an
# arena row's unused end, large variables not saved) start a new span: never copied.
_SPAN_GAP = 4096
# A span ends before a component that would take it past this many bytes (a larger component
# is a span of its own): buffers of a few MiB at most are reused by the allocator from one save
# to the next, larger ones are mapped anew and their pages faulted in at every copy (8 MiB
# spans, a whole arena row, made the copy of 400 MB 1.5-2x slower than copying by component).
_SPAN_MAX = 1 << 20
_SPAN_ALIGN = 64  # a span's copy keeps its address modulo this: copies aligned like the live
# A structure's copies (at most this many bytes in all) are kept from one non-blocking save to
# the next and copied into again: the next save then reuses the records made over them, so its
# background write costs what a blocking save of the live variables costs, and the copy faults
# in no new pages. Larger snapshots are freed when their write ends.
SNAPSHOT_KEEP_BYTES = 1 << 30


def _unchanged(live: np.ndarray, copied: np.ndarray) -> bool:
    """Whether ``live`` still holds exactly the bytes of ``copied`` (NaNs included)."""
    if live.dtype.kind == "O" or not live.flags.c_contiguous:
        return bool(np.array_equal(live, copied))
    return same_bytes(live, copied)


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _root(a: np.ndarray) -> np.ndarray:
    """The array at the end of ``a``'s chain of bases (the one that holds its memory)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class SnapshotPlan:
    """How :func:`take_snapshot` copies the components of a list of records, made once per
    structure (the records of an unchanged object graph are the same, their component views
    too).

    Variables live side by side in arenas (``parallelvars._storage``): the C-contiguous
    components that share a base buffer are sorted by address and grouped into spans (see
    ``_SPAN_GAP``), each copied by one memcpy into a buffer of its own and compared in one
    pass; the copied components are views into it (one buffer per span, of at most
    ``_SPAN_MAX`` bytes unless one component is larger). Every other component (strided shards, object
    arrays, empty ones, buffers whose base is not a C-contiguous array) is copied by itself.

    Attributes:
        flat: every record's components in write order.
        spans: ``(live, address, components)``: a flat uint8 view of a span of a live base
            buffer, its address, and the numbers of the components in it.
        span_of: per component, the number of its span (-1: copied by itself).
        offsets: per component of a span, where it starts in the span.
        singles: the numbers of the components copied by themselves.
        starts: the number of each record's first component (then the total).
    """

    __slots__ = (
        "_kept",
        "_lock",
        "flat",
        "nbytes",
        "offsets",
        "singles",
        "span_of",
        "spans",
        "starts",
    )

    def __init__(self, records: Sequence[SaveRecord]) -> None:
        self.flat: list[np.ndarray] = [c for r in records for c in r.components]
        self.starts = list(itertools.accumulate((len(r.components) for r in records), initial=0))
        self.span_of = [-1] * len(self.flat)
        self.offsets = [0] * len(self.flat)
        self.singles: list[int] = []
        roots: dict[int, tuple[np.ndarray, int, list[tuple[int, int, int]]]] = {}
        for i, c in enumerate(self.flat):
            if (
                not isinstance(c, np.ndarray)
                or c.dtype.kind == "O"
                or not c.flags.c_contiguous
                or c.nbytes == 0
            ):
                self.singles.append(i)
                continue
            root = _root(c)
            group = roots.get(id(root))
            if group is None:
                if root.dtype.kind == "O" or not root.flags.c_contiguous:
                    self.singles.append(i)
                    continue
                group = roots[id(root)] = (root, _address(root), [])
            addr = _address(c)
            if not group[1] <= addr <= addr + c.nbytes <= group[1] + root.nbytes:
                self.singles.append(i)  # not inside its base's bytes: never seen, but no span
                continue
            group[2].append((addr, addr + c.nbytes, i))
        self.spans: list[tuple[np.ndarray, int, list[int]]] = []
        for root, base, members in roots.values():
            members.sort()
            whole = byte_view(root)
            run: list[tuple[int, int, int]] = []
            hi = 0
            for m in [*members, None]:
                if run and (m is None or m[0] - hi > _SPAN_GAP or m[1] - run[0][0] > _SPAN_MAX):
                    lo = run[0][0]
                    for addr, _, i in run:
                        self.span_of[i], self.offsets[i] = len(self.spans), addr - lo
                    self.spans.append((whole[lo - base : hi - base], lo, [e[2] for e in run]))
                    run = []
                if m is not None:
                    hi = max(hi, m[1]) if run else m[1]
                    run.append(m)
        self.nbytes = sum(live.size for live, _, _ in self.spans) + sum(
            self.flat[i].nbytes for i in self.singles
        )
        self._kept: _Copies | None = None
        self._lock = threading.Lock()

    def take(self) -> _Copies:
        """The copies of the last snapshot whose write has ended (kept by :meth:`give_back`),
        or new buffers (none kept, or they are in use by a write still running)."""
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            return kept
        spans = []
        for live, address, _members in self.spans:
            buffer = np.empty(live.size + _SPAN_ALIGN, np.uint8)
            start = (address - _address(buffer)) % _SPAN_ALIGN
            spans.append(buffer[start : start + live.size])
        singles = []
        for i in self.singles:
            c = np.asarray(self.flat[i])
            singles.append(np.empty(c.shape, c.dtype))
        return _Copies(spans, singles)

    def give_back(self, copies: _Copies) -> None:
        """Keep ``copies`` (their write has ended) for the next snapshot, when the structure's
        copies take at most ``SNAPSHOT_KEEP_BYTES``."""
        if self.nbytes <= SNAPSHOT_KEEP_BYTES:
            with self._lock:
                self._kept = copies

    def copy_of(self, span: np.ndarray, i: int) -> np.ndarray:
        """Component ``i``'s copy in the copy of its ``span``."""
        c = self.flat[i]
        return np.ndarray(c.shape, c.dtype, span, self.offsets[i])

    def path_of(self, records: Sequence[SaveRecord], i: int) -> str:
        return records[bisect.bisect_right(self.starts, i) - 1].path


class _Copies:
    """One set of copy buffers of a :class:`SnapshotPlan` (a buffer per span, an array per
    component copied by itself) and the records made over them, once (the same buffers give
    the same records)."""

    __slots__ = ("records", "singles", "spans")

    def __init__(self, spans: list[np.ndarray], singles: list[np.ndarray]) -> None:
        self.spans = spans
        self.singles = singles
        self.records: RecordList | None = None


class Snapshot:
    """The copies of one moment taken by :func:`take_snapshot`; :meth:`records` makes the records
    that hold them (left to the thread that writes them: the calling thread only copies), and
    :meth:`release` hands the buffers back to the plan once the write has ended."""

    __slots__ = ("_copies", "_plan", "_records")

    def __init__(self, records: Sequence[SaveRecord], plan: SnapshotPlan, copies: _Copies) -> None:
        self._records, self._plan, self._copies = records, plan, copies

    def records(self) -> RecordList:
        """Records like the live ones (shared attributes) holding the copies.

        They have the live records' structure: they share a ``RecordList``'s structure token
        (and its key, once made), so a repeated save is written from its cached plan. Made once per set of buffers: copies kept
        from an earlier save come with their records (the same objects, so the writer's
        per-record work is not done again either).
        """
        made = self._copies.records
        if made is not None:
            return made
        plan, spans, records = self._plan, self._copies.spans, self._records
        singles = iter(self._copies.singles)
        copies = [
            next(singles) if n < 0 else np.ndarray(c.shape, c.dtype, spans[n], off)
            for c, n, off in zip(plan.flat, plan.span_of, plan.offsets, strict=True)
        ]
        out = RecordList(like=records if isinstance(records, RecordList) else None)
        starts = plan.starts
        for n, r in enumerate(records):
            copy = SaveRecord.__new__(SaveRecord)
            copy.__dict__.update(r.__dict__)  # what is not a component is the live record's
            copy.components = copies[starts[n] : starts[n + 1]]
            out.append(copy)
        self._copies.records = out
        return out

    def release(self) -> None:
        """The write of these copies has ended: the next snapshot may copy into them."""
        self._plan.give_back(self._copies)


def take_snapshot(records: Sequence[SaveRecord], plan: SnapshotPlan | None = None) -> Snapshot:
    """Copies of every record's components that held together at one moment.

    Double collect: copy every component, then compare every live buffer with its copy. If
    none differs, each buffer held its copied bytes from its copy to its comparison, and all
    those intervals contain the moment between the last copy and the first comparison: the
    copies are the values of that one moment (the guard of a blocking save's second checksum,
    over the whole set instead of one buffer at a time). Otherwise copy again, up to
    ``SNAPSHOT_ATTEMPTS`` times, then refuse: a save never holds a mix of old and new values.
    Bytes are compared, so a writer that changes a buffer and puts back exactly the bytes it
    replaced, both between that buffer's copy and its comparison, goes unseen.

    Components are copied and compared by span of their base buffers (``plan``, made here
    when not given): a span that differs is compared again component by component, since its
    bytes between the components (padding, variables not saved) may change; only a change of
    a component counts.

    Raises:
        ConcurrentWriteError: variables kept changing in another thread during every attempt.
    """
    if plan is None:
        plan = SnapshotPlan(records)
    flat = plan.flat
    changed = ""
    copies = plan.take()
    spans, singles = copies.spans, copies.singles
    for _ in range(SNAPSHOT_ATTEMPTS):
        for (live, _, _), span in zip(plan.spans, spans, strict=True):
            np.copyto(span, live)
        for i, single in zip(plan.singles, singles, strict=True):
            np.copyto(single, flat[i])
        changed = ""
        for (live, _, members), span in zip(plan.spans, spans, strict=True):
            if _unchanged(live, span):
                continue
            i = next((i for i in members if not _unchanged(flat[i], plan.copy_of(span, i))), -1)
            if i >= 0:
                changed = plan.path_of(records, i)
                break
        if not changed:
            i = next(
                (
                    i
                    for i, c in zip(plan.singles, singles, strict=True)
                    if not _unchanged(flat[i], c)
                ),
                -1,
            )
            changed = plan.path_of(records, i) if i >= 0 else ""
        if not changed:
            return Snapshot(records, plan, copies)
    plan.give_back(copies)
    raise ConcurrentWriteError(
        "changed while a non-blocking save copied the variables",
        variable=changed,
        expected="no writes during the copy",
        found=f"writes during each of {SNAPSHOT_ATTEMPTS} attempts",
        hint="call save() from the thread that updates the variables, or pause the other writers while it runs",
    )
