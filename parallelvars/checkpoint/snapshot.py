"""The non-blocking save's snapshot: copies of every component that held together at one
moment (:func:`take_snapshot`), made by a plan of spans computed once per structure
(:class:`SnapshotPlan`), so training may change the variables while the copies are written.
A replica equal to its variable's first component (a mirrored variable's, the common case)
is not copied: it is compared with the first, and shares its copy, as the file stores it once.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import threading
from collections.abc import Sequence

import numpy as np

from parallelvars._fileio import MEMCMP, byte_view, same_bytes
from parallelvars._threads import run_partitioned
from parallelvars.checkpoint._gcfreeze import freeze_made_so_far, older_objects_frozen
from parallelvars.checkpoint.h5io.records import RecordList
from parallelvars.checkpoint.registry import SaveRecord
from parallelvars.errors import ConcurrentWriteError

__all__ = [
    "SNAPSHOT_ATTEMPTS",
    "SNAPSHOT_KEEP_BYTES",
    "Snapshot",
    "SnapshotPlan",
    "plan_replicas",
    "take_snapshot",
]

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
# Replicas are compared with their first components by runs of their base buffers (an arena
# row against row 0) of at most this many bytes: a comparison allocates nothing, so a run may
# be long; a run that differs is compared again replica by replica.
_RUN_MAX = 8 << 20
# Runs over the same first components are compared this many bytes at a time (each piece of
# the first components stays in the CPU cache while every replica row is compared with it).
_COMPARE_PIECE = 256 << 10


def _unchanged(live: np.ndarray, copied: np.ndarray) -> bool:
    """Whether ``live`` still holds exactly the bytes of ``copied`` (NaNs included)."""
    return same_bytes(live, copied)  # (bits: a strided component holding a NaN is unchanged)


def _address(a: np.ndarray) -> int:
    """Where ``a``'s bytes start (a ctypes view of a writable array: several times cheaper
    than ``__array_interface__``, which builds a dictionary; that for the others)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError):
        return int(a.__array_interface__["data"][0])


def _root(a: np.ndarray) -> np.ndarray:
    """The array at the end of ``a``'s chain of bases (the one that holds its memory)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _plain(c: object) -> bool:
    """An array a span or a run can hold: C-contiguous bytes (not objects), not empty."""
    return (
        isinstance(c, np.ndarray) and c.dtype.kind != "O" and c.flags.c_contiguous and c.nbytes > 0
    )


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

    The components 1.. of a variable that is not sharded, of its first component's shape and
    dtype, are *replicas*: not copied, but compared with the first component (twice, around
    nothing else: see :func:`take_snapshot`) and given its copy, so a mirrored model's
    snapshot holds each variable once, as its file does. Replicas are compared by runs of their
    base buffers (an arena row against row 0: one ``memcmp`` for many variables). The variables
    (numbers of records) in ``divergent`` were found with replicas unlike their first
    component (an on-read variable's, say): theirs are copied like any component.

    Attributes:
        flat: every record's components in write order.
        primary: per component, the component whose copy it shares (itself: its own copy).
        spans: ``(live, address, components)``: a flat uint8 view of a span of a live base
            buffer, its address, and the numbers of the components in it.
        span_of: per component, the number of its span (-1: copied by itself, or a replica).
        offsets: per component of a span, where it starts in the span.
        singles: the numbers of the components copied by themselves.
        runs: ``(replicas, firsts, members)``: flat uint8 views of a run of live replicas and of
            the first components' bytes at the same distance, and the replicas' numbers.
        lone: the replicas compared one by one (in no run).
        starts: the number of each record's first component (then the total).
        nbytes: the bytes a snapshot copies.
    """

    __slots__ = (
        "_kept",
        "_layout",
        "_lock",
        "_run_groups",
        "divergent",
        "flat",
        "lone",
        "nbytes",
        "offsets",
        "primary",
        "runs",
        "singles",
        "span_of",
        "spans",
        "starts",
    )

    def __init__(self, records: Sequence[SaveRecord], divergent: frozenset[int] = frozenset()):
        # (a few objects per component, kept with the structure: made with the older objects
        # out of the collector's walks, and kept out of them with those, see Snapshot.records)
        with older_objects_frozen():
            self._make(records, divergent)
            freeze_made_so_far()

    def _make(self, records: Sequence[SaveRecord], divergent: frozenset[int]) -> None:
        self.divergent = divergent
        self.flat: list[np.ndarray] = [c for r in records for c in r.components]
        self.starts = list(itertools.accumulate((len(r.components) for r in records), initial=0))
        flat = self.flat
        plain = [_plain(c) for c in flat]
        self.primary = primary = list(range(len(flat)))
        for n, r in enumerate(records):
            start, end = self.starts[n], self.starts[n + 1]
            if end - start < 2 or r.kind == "sharded" or n in divergent or not plain[start]:
                continue
            shape, dt = flat[start].shape, flat[start].dtype
            if all(
                plain[i] and flat[i].shape == shape and flat[i].dtype == dt
                for i in range(start + 1, end)
            ):
                primary[start + 1 : end] = [start] * (end - start - 1)
        self.span_of = [-1] * len(flat)
        self.offsets = [0] * len(flat)
        self.singles: list[int] = []
        self.lone: list[int] = []
        roots: dict[int, tuple[np.ndarray, int, list[tuple[int, int, int]]]] = {}
        pairs: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
        where: list[tuple[int, int] | None] = [None] * len(flat)  # (root's id, address)
        for i, c in enumerate(flat):
            j = primary[i]
            if not plain[i]:
                self.singles.append(i)
                continue
            root = _root(c)
            group = roots.get(id(root))
            if group is None:
                if root.dtype.kind == "O" or not root.flags.c_contiguous:
                    (self.lone if j != i else self.singles).append(i)
                    continue
                group = roots[id(root)] = (root, _address(root), [])
            addr = _address(c)
            if not group[1] <= addr <= addr + c.nbytes <= group[1] + root.nbytes:
                # (not inside its base's bytes: never seen, but neither a span nor a run)
                (self.lone if j != i else self.singles).append(i)
                continue
            if j == i:
                group[2].append((addr, addr + c.nbytes, i))
                where[i] = (id(root), addr)
                continue
            first = where[j]
            if first is None:  # (its first is copied by itself: compared one by one)
                self.lone.append(i)
                continue
            pairs.setdefault((id(root), first[0], addr - first[1]), []).append(
                (addr, addr + c.nbytes, i)
            )
        self.spans: list[tuple[np.ndarray, int, list[int]]] = []
        for root, base, members in roots.values():
            whole = byte_view(root)
            for lo, hi, run in _runs(members, _SPAN_MAX):
                for addr, _, i in run:
                    self.span_of[i], self.offsets[i] = len(self.spans), addr - lo
                self.spans.append((whole[lo - base : hi - base], lo, [e[2] for e in run]))
        self.runs: list[tuple[np.ndarray, np.ndarray, list[int]]] = []
        for (root_id, first_id, delta), members in pairs.items():
            root, base, _ = roots[root_id]
            first_root, first_base, _ = roots[first_id]
            whole, first_whole = byte_view(root), byte_view(first_root)
            for lo, hi, run in _runs(members, _RUN_MAX):
                self.runs.append(
                    (
                        whole[lo - base : hi - base],
                        first_whole[lo - delta - first_base : hi - delta - first_base],
                        [e[2] for e in run],
                    )
                )
        # the runs over the same bytes of the first components, compared together
        together: dict[tuple[int, int], list[int]] = {}
        for k, (_, firsts, _) in enumerate(self.runs):
            together.setdefault((_address(firsts), firsts.size), []).append(k)
        self._run_groups = list(together.values())
        self.nbytes = sum(live.size for live, _, _ in self.spans) + sum(
            self.flat[i].nbytes for i in self.singles
        )
        self._kept: _Copies | None = None
        self._layout = object()  # (copies are for this layout only: see share_less)
        if not hasattr(self, "_lock"):
            self._lock = threading.Lock()

    def replicas_differing(self) -> list[int]:
        """The replicas whose bytes differ from their first components' now (live both).

        The runs of every replica row over the same bytes of the first components (a model on
        4 devices: rows 1, 2 and 3 against row 0) are compared together, a piece of
        ``_COMPARE_PIECE`` bytes at a time: each piece of the first components is read from
        memory once and compared with every row while it is in the CPU cache."""
        flat, primary = self.flat, self.primary
        same = [True] * len(self.runs)
        runs = self.runs

        def compare(group: list[int]) -> None:
            if len(group) == 1 or MEMCMP is None:
                for k in group:
                    same[k] = _unchanged(runs[k][0], runs[k][1])
                return
            first = runs[group[0]][1]
            size, at = first.size, _address(first)
            rows = [(k, _address(runs[k][0])) for k in group]
            for start in range(0, size, _COMPARE_PIECE):
                n = min(_COMPARE_PIECE, size - start)
                for k, row in rows:
                    if same[k] and MEMCMP(row + start, at + start, n):
                        same[k] = False

        # (memcmp releases the GIL: long runs are compared on several cores)
        groups = self._run_groups
        run_partitioned(
            [functools.partial(compare, group) for group in groups],
            [sum(runs[k][0].size for k in group) for group in groups],
        )
        out = []
        for (_, _, members), equal in zip(self.runs, same, strict=True):
            if not equal:  # (a gap between them may differ: each checked)
                out += [i for i in members if not _unchanged(flat[i], flat[primary[i]])]
        out += [i for i in self.lone if not _unchanged(flat[i], flat[self.primary[i]])]
        return out

    def record_of(self, i: int) -> int:
        """The number of the record of component ``i``."""
        return bisect.bisect_right(self.starts, i) - 1

    def share_less(self, records: Sequence[SaveRecord], divergent: set[int]) -> None:
        """Make the plan again with the replicas of the records ``divergent`` copied (see
        :func:`take_snapshot`); copies of the old layout are no longer kept or taken back."""
        with older_objects_frozen():
            self._make(records, self.divergent | frozenset(divergent))
            freeze_made_so_far()

    def take(self) -> _Copies:
        """The copies of the last snapshot whose write has ended (kept by :meth:`give_back`),
        or new buffers (none kept, or they are in use by a write still running)."""
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is not None and kept.plan is self._layout:
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
        return _Copies(spans, singles, self._layout)

    def give_back(self, copies: _Copies) -> None:
        """Keep ``copies`` (their write has ended) for the next snapshot, when the structure's
        copies take at most ``SNAPSHOT_KEEP_BYTES``."""
        if self.nbytes <= SNAPSHOT_KEEP_BYTES and copies.plan is self._layout:
            with self._lock:
                self._kept = copies

    def drop_kept(self) -> None:
        """Free the copies kept for the next snapshot (it allocates them again)."""
        with self._lock:
            self._kept = None

    def copy_of(self, span: np.ndarray, i: int) -> np.ndarray:
        """Component ``i``'s copy in the copy of its ``span``."""
        c = self.flat[i]
        return np.ndarray(c.shape, c.dtype, span, self.offsets[i])

    def path_of(self, records: Sequence[SaveRecord], i: int) -> str:
        return records[self.record_of(i)].path


def plan_replicas(records: RecordList, *, chosen_from: RecordList | None = None) -> None:
    """At each save of live ``records``: from their second save on, give them the plan their
    replicas are compared by (``RecordList.replicas``, read by the writer:
    ``h5raw.component_bytes._replica_plan``); a first save compares them one by one (making
    the plan costs more, once).

    A snapshot's copies get none (their replicas are their first component's copy, and a plan
    would keep the copies alive after the write): ``records`` made ``like=`` other records
    are copies, unless ``chosen_from`` names the records they were chosen from (a rank's share
    of a collective save's records, always made ``like=`` them), whose flag decides then."""
    if (records if chosen_from is None else chosen_from).copied:
        return
    if records.replicas is None:
        records.replicas = False
    elif records.replicas is False:
        records.replicas = SnapshotPlan(records)


def _runs(
    members: list[tuple[int, int, int]], most: int
) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """``(lo, hi, members)``: the ``(start, end, number)`` ranges of one base buffer sorted and
    grouped into runs: a gap wider than ``_SPAN_GAP``, or a run past ``most`` bytes, starts the
    next (a range larger than ``most`` is a run of its own)."""
    members.sort()
    out: list[tuple[int, int, list[tuple[int, int, int]]]] = []
    run: list[tuple[int, int, int]] = []
    hi = 0
    for m in [*members, None]:
        if run and (m is None or m[0] - hi > _SPAN_GAP or m[1] - run[0][0] > most):
            out.append((run[0][0], hi, run))
            run = []
        if m is not None:
            hi = max(hi, m[1]) if run else m[1]
            run.append(m)
    return out


class _Copies:
    """One set of copy buffers of a :class:`SnapshotPlan` (a buffer per span, an array per
    component copied by itself) and the records made over them, once (the same buffers give
    the same records)."""

    __slots__ = ("plan", "records", "singles", "spans")

    def __init__(self, spans: list[np.ndarray], singles: list[np.ndarray], plan: object) -> None:
        self.spans = spans
        self.singles = singles
        self.plan = plan  # the layout they are for
        self.records: RecordList | None = None


class Snapshot:
    """The copies of one moment taken by :func:`take_snapshot`; :meth:`records` makes the records
    that hold them (left to the thread that writes them: the calling thread only copies), and
    :meth:`release` hands the buffers back to the plan once the write has ended."""

    __slots__ = ("_copies", "_layout", "_plan", "_records")

    def __init__(self, records: Sequence[SaveRecord], plan: SnapshotPlan, copies: _Copies) -> None:
        self._records, self._plan, self._copies = records, plan, copies
        # (the layout of these copies, kept should the plan be made again meanwhile)
        self._layout = (
            plan.flat,
            plan.span_of,
            plan.offsets,
            plan.primary,
            plan.singles,
            plan.starts,
        )

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
        # (a few objects per component that live as long as the copies are kept: made with
        # the older objects out of the collector's walks, and kept out of them with those, so
        # that they do not bring on a full collection of the whole program at the next call)
        with older_objects_frozen():
            out = self._copies.records = self._made()
            freeze_made_so_far()
        return out

    def _made(self) -> RecordList:
        spans, records = self._copies.spans, self._records
        flat, span_of, offsets, primary, single_ids, starts = self._layout
        singles_at = dict(zip(single_ids, self._copies.singles, strict=True))
        copies: list[np.ndarray] = []
        for i, (c, n, off, j) in enumerate(zip(flat, span_of, offsets, primary, strict=True)):
            if j != i:  # a replica: its first component's copy (the same array)
                copies.append(copies[j])
            elif n < 0:
                copies.append(singles_at[i])
            else:
                copies.append(np.ndarray(c.shape, c.dtype, spans[n], off))
        out = RecordList(like=records if isinstance(records, RecordList) else None)
        for n, r in enumerate(records):
            copy = SaveRecord.__new__(SaveRecord)
            copy.__dict__.update(r.__dict__)  # what is not a component is the live record's
            copy.components = copies[starts[n] : starts[n + 1]]
            out.append(copy)
        return out

    def release(self) -> None:
        """The write of these copies has ended: the next snapshot may copy into them."""
        self._plan.give_back(self._copies)


def _spans_unchanged(
    live_spans: Sequence[tuple[np.ndarray, int, list[int]]],
    copies: Sequence[np.ndarray],
    weights: Sequence[int],
) -> list[bool]:
    """For each span of the live buffers, whether it still holds its copy's bytes (compared on
    several cores for a long snapshot: :func:`run_partitioned`)."""
    same = [True] * len(copies)

    def check(k: int) -> None:
        same[k] = _unchanged(live_spans[k][0], copies[k])

    run_partitioned([functools.partial(check, k) for k in range(len(copies))], weights)
    return same


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

    Replicas (see :class:`SnapshotPlan`) are not copied: after the copies, every replica is
    compared with its live first component twice, then the first components with their copies.
    The firsts held their copied bytes from their copies to their comparisons, so both replica
    comparisons saw those bytes; each replica held them from its first comparison to its second,
    and every interval contains the moment between the two passes. A replica found unlike its
    first in the first pass (a divergent variable, not a change: its bytes are saved apart in
    the file too) takes its variable out of the sharing for good (the plan is made again, not
    an attempt); one found unlike it only in the second is a change, and the attempt is made
    again.

    Components are copied and compared by span of their base buffers (``plan``, made here
    when not given): a span that differs is compared again component by component, since its
    bytes between the components (padding, variables not saved) may change; only a change of
    a component counts.

    Raises:
        ConcurrentWriteError: variables kept changing in another thread during every attempt.
    """
    if plan is None:
        plan = SnapshotPlan(records)
    changed = ""
    copies = plan.take()
    attempts = 0
    while attempts < SNAPSHOT_ATTEMPTS:
        flat, spans, singles = plan.flat, copies.spans, copies.singles
        # (np.copyto and memcmp release the GIL: a long snapshot is copied and checked on
        # several cores, as the replicas are compared)
        weights = [live.size for live, _, _ in plan.spans]
        run_partitioned(
            [
                functools.partial(np.copyto, span, live)
                for (live, _, _), span in zip(plan.spans, spans, strict=True)
            ],
            weights,
        )
        for i, single in zip(plan.singles, singles, strict=True):
            np.copyto(single, flat[i])
        differ = plan.replicas_differing()
        if differ:
            plan.share_less(records, {plan.record_of(i) for i in differ})
            copies = plan.take()  # (the layout changed: new buffers)
            continue
        differ = plan.replicas_differing()
        changed = plan.path_of(records, differ[0]) if differ else ""
        if not changed:
            same = _spans_unchanged(plan.spans, spans, weights)
            for (_, _, members), span, equal in zip(plan.spans, spans, same, strict=True):
                if equal:
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
        attempts += 1
    plan.give_back(copies)
    raise ConcurrentWriteError(
        "changed while a non-blocking save copied the variables",
        variable=changed,
        expected="no writes during the copy",
        found=f"writes during each of {SNAPSHOT_ATTEMPTS} attempts",
        hint="call save() from the thread that updates the variables, or pause the other writers while it runs",
    )
