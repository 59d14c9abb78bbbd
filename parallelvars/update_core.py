"""The update core: one optimizer step over the stacked buffers of many variables at once.

Pure numpy, no compiled code. An optimizer supplies a *kernel*: a function that updates, in
place and with ``out=`` ufunc calls only, a ``(rows, width)`` block of a variable and of its
slots from a ``(1, width)`` block of the gradient (the reduced gradient is one value that every
replica row receives, so numpy broadcasts it). This module decides which memory the kernel sees:

* **Runs.** Variables of one dtype and component count share an arena (see
  :mod:`parallelvars._storage`); a variable at columns ``[offset, offset + size)`` of the arena
  has its slots at the same columns of the optimizer's shadow arenas. Variables that follow each
  other in an arena, separated only by alignment padding, form a *run*: one ``(n, lo:hi)`` slab
  in the variable arena and in every slot arena. The gradients of a run are staged into one
  zero-padded ``(1, hi - lo)`` line, so the padding columns see a zero gradient and zero (or
  positive, for accumulators) slot values and stay exactly as they are: no NaN can arise there.
  A column that belongs to a variable *not* being updated is never inside a run.
* **Blocks.** A run is walked in column blocks sized so that one block of every operand and the
  scratch stay in the CPU's L2 cache; each ufunc call then streams cache-resident memory, and a
  step over a whole model is ``kernel calls x blocks``, not ``variables x components``.
* **Mirrored rows.** The components of a mirrored variable are equal by construction (every
  write reaches all of them) and so are its slots'; for such runs the kernel computes row 0 of
  each block and the block is copied to the other rows while it is in cache. The arithmetic is
  then done once per parameter instead of once per replica, which is what lets a CPU beat a
  per-component loop (numpy's ufuncs are compute-bound on cache-resident blocks). Variables
  whose components may differ (``independent`` kind) have every row computed.
* **Replicas' gradients.** Inside ``strategy.run`` each replica has its own gradients. They
  arrive as the arrays themselves (:func:`apply_gathered`: each block's gradients are gathered
  into a cache-resident line right before the kernel uses the block, large variables' arrays
  are read in place) or as flat buffers laid out like the runs (:class:`GradLayout`: the
  user's gradient buffers, an all-reduced buffer, or :func:`pack_lines`); the replicas are
  added block by block, left to right in device order, right before the kernel uses the
  block, so the reduction makes no pass of its own over memory and gives the bits of the
  per-variable ``add_n`` sum.
* **Sharded variables.** Their shards are views of one full array (see
  :class:`parallelvars.variables.ShardedVariable`), and so are their slots'; :func:`flat_run`
  makes that array a one-row run (:class:`FlatArena`), so each replica's shard is updated from
  its slice of the reduced gradient in the same blocks, with the same calls, as arena rows.
* **Narrow floats.** Float dtypes numpy has no fast loops for (bfloat16, float8) are computed in
  float32 block by block and rounded once (see :class:`UpdateScratch`), on every path.

When every row is computed, each row goes through the same correctly rounded ufuncs (add,
multiply, divide, sqrt, maximum) with the same operands, so replicas that start equal stay
bit-identical either way.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parallelvars._storage import Arena
from parallelvars.errors import GradientError, InvalidArgumentError

__all__ = [
    "FAST_DTYPES",
    "Kernel",
    "Run",
    "UpdateScratch",
    "GradLayout",
    "GatherPlan",
    "apply_blocked",
    "apply_gathered",
    "apply_lines",
    "apply_runs",
    "FlatArena",
    "flat_run",
    "overlaps",
    "layout_lines",
    "pack_lines",
    "plan_gather",
    "plan_runs",
    "row_view",
]

# Dtypes numpy has native loops for; everything else floating is computed in float32.
FAST_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))

# Bytes of one (rows, width) block of one float32 or float64 operand (see block_width). A
# float32 Adam block touches five such blocks (variable, m, v and two scratch, 640 KiB) and,
# in the in-run step, a line of the replicas' gradients and their sum (~900 KiB in all):
# inside a 1-2 MiB L2 cache. A dtype computed in float32 (bfloat16, float8; float16 blocks
# are sized by its own 2 bytes) has blocks of twice float32's width: its variable, m and v
# are 128 KiB each again, but their float32 copies, the float32 scratch and the float32
# lines of the gradients' sum are 256 KiB each, ~2.5-3 MiB in all, past L2 and inside L3;
# halving the calls per parameter outweighs that (block_width; bench_train_step's bf16 rows).
BLOCK_BYTES = 128 << 10
_MIN_BLOCK = 1024
# The bytes per element a block of a dtype computed in float32 is sized by (see block_width).
_NARROW_ITEMSIZE = 2
# Scratch views an UpdateScratch keeps (see UpdateScratch._views); more, and it starts over.
_VIEW_CACHE = 64

Kernel = Callable[
    [
        np.ndarray,
        tuple[np.ndarray, ...],
        np.ndarray,
        Any,
        tuple[np.ndarray, ...],
        tuple[np.ndarray, ...],
    ],
    None,
]
"""``kernel(var, slots, grad, hp, tmp, gtmp)``: update ``var`` and ``slots`` in place.

``var`` and every slot are ``(rows, width)``; ``grad`` is ``(1, width)`` or ``(rows, width)``;
``hp`` holds the step's hyperparameters as Python floats; ``tmp`` are ``(rows, width)`` and
``gtmp`` ``(1, width)`` scratch arrays of the variable's dtype, free to overwrite.
"""


def block_width(rows: int, dtype: np.dtype) -> int:
    """Columns per block for ``rows`` rows of ``dtype``: a multiple of 64, at least 1024.

    A dtype computed in float32 (see :class:`UpdateScratch`) gets blocks twice as wide as
    float32's: each of its blocks costs about twice as many calls (the widening, the rounding
    of every addition of a replica's gradient, the rounding back), a fixed cost per block
    that wider blocks spread over more parameters (``bench/bench_train_step.py``'s bf16 rows:
    200 variables of 50,000, two blocks each before, one now)."""
    itemsize = dtype.itemsize if dtype in FAST_DTYPES else _NARROW_ITEMSIZE
    width = BLOCK_BYTES // max(1, rows * itemsize)
    return max(_MIN_BLOCK, width // 64 * 64)


class UpdateScratch:
    """The update core's preallocated scratch of one dtype: ``count`` ``(rows, width)`` and
    ``(1, width)`` arrays (not :class:`parallelvars._fileio.Scratch`, a writer's read buffer).

    Grows (reallocates) only when asked for more rows or columns than it holds, so a training
    loop allocates nothing after its first step.

    A dtype numpy has no fast loops for (bfloat16, float8: not in :data:`FAST_DTYPES`) is
    computed in float32: ``wide`` is then the float32 scratch its kernels run in, and
    :meth:`widened` the float32 copies of a block's variable, slots and gradient.
    """

    def __init__(self, dtype: Any, count: int = 2) -> None:
        self.dtype = np.dtype(dtype)
        self.count = count
        self._rows: list[np.ndarray] = []
        self._line: list[np.ndarray] = []
        self._sum = np.empty((1, 0), self.dtype)
        self._gather = np.empty((2, 0), self.dtype)
        self._shape = (0, 0)
        self.wide = None if self.dtype in FAST_DTYPES else UpdateScratch(np.float32, count)
        self._widened: list[np.ndarray] = []
        self._adds = np.empty((3, 0), np.float32)
        self.add_wide = self.dtype.name == "bfloat16"
        # Views handed out before, by request: a step asks for the same few shapes block after
        # block, and making a view costs as much as a ufunc call on a block's line.
        self._views: dict[tuple[Any, ...], Any] = {}

    def _remembered(self, key: tuple[Any, ...], views: Any) -> Any:
        if len(self._views) >= _VIEW_CACHE:
            self._views.clear()
        self._views[key] = views
        return views

    def add_lines(
        self, shape: tuple[int, ...]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Two float32 arrays ``x``, ``y`` of ``shape`` (of one line) and a uint32 one, apart
        from :meth:`widened`'s, and ``x``'s bits as uint32: where :func:`_sum` adds in
        float32."""
        key = ("add", shape)
        found = self._views.get(key)
        if found is not None:
            return found
        size = math.prod(shape)
        if self._adds.shape[1] < size:
            self._adds = np.empty((3, size), np.float32)
            self._views.clear()
        return self._remembered(
            key,
            (
                self._adds[0, :size].reshape(shape),
                self._adds[1, :size].reshape(shape),
                self._adds[2, :size].view(np.uint32).reshape(shape),
                self._adds[0, :size].view(np.uint32).reshape(shape),
            ),
        )

    def widened(self, k: int, rows: int, width: int) -> np.ndarray:
        """A float32 ``(rows, width)`` array ``k``, apart from the others and from ``wide``'s."""
        while len(self._widened) <= k:
            self._widened.append(np.empty((0, 0), np.float32))
        a = self._widened[k]
        if a.shape[0] < rows or a.shape[1] < width:
            a = self._widened[k] = np.empty(
                (max(rows, a.shape[0]), max(width, a.shape[1])), np.float32
            )
            self._views.clear()
        return a[:rows, :width]

    def widened_all(self, count: int, rows: int, width: int) -> tuple[np.ndarray, ...]:
        """:meth:`widened` ``0 .. count - 1``, as one tuple."""
        key = ("widened", count, rows, width)
        found = self._views.get(key)
        if found is not None:
            return found
        views = tuple(self.widened(k, rows, width) for k in range(count))
        return self._remembered(key, views)

    def sum_line(self, width: int) -> np.ndarray:
        """A ``(1, width)`` line apart from :meth:`take`'s: where replicas' gradients are summed."""
        if self._sum.shape[1] < width:
            self._sum = np.empty((1, width), self.dtype)
        return self._sum[:, :width]

    def gather_line(self, width: int, k: int) -> np.ndarray:
        """A ``(width,)`` line ``k`` (0 or 1), apart from the others: where a block's gradients
        are copied when they cannot be joined as bytes (see :func:`apply_gathered`)."""
        if self._gather.shape[1] < width:
            self._gather = np.empty((2, width), self.dtype)
        return self._gather[k, :width]

    def take(self, rows: int, width: int) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        """Views ``(tmp, gtmp)`` of shapes ``(rows, width)`` and ``(1, width)``."""
        key = ("take", rows, width)
        found = self._views.get(key)
        if found is not None:
            return found
        r0, w0 = self._shape
        if rows > r0 or width > w0:
            r0, w0 = max(rows, r0), max(width, w0)
            self._rows = [np.empty((r0, w0), self.dtype) for _ in range(self.count)]
            self._line = [np.empty((1, w0), self.dtype) for _ in range(self.count)]
            self._shape = (r0, w0)
            self._views.clear()
        return self._remembered(
            key,
            (
                tuple(t[:rows, :width] for t in self._rows),
                tuple(t[:, :width] for t in self._line),
            ),
        )


def apply_blocked(
    kernel: Kernel,
    var: np.ndarray,
    slots: Sequence[np.ndarray],
    grad: np.ndarray,
    hp: Any,
    scratch: UpdateScratch,
    replicate: bool = False,
    addends: Sequence[np.ndarray] = (),
) -> None:
    """Apply ``kernel`` to 2-D ``var`` / ``slots`` / ``grad`` in cache-sized column blocks.

    With ``replicate`` (rows known to be equal: a mirrored variable and its slots), the kernel
    computes row 0 of each block and the block is copied to the other rows while it is still
    in cache: the arithmetic is done once per parameter, the memory written once per replica.

    ``addends``: more ``(1, total)`` gradient lines of ``var``'s dtype. The gradient the kernel
    sees is then ``((grad + addends[0]) + addends[1]) + ...``, summed block by block while the
    block is in cache: the left-to-right order of :func:`parallelvars.strategy._reduce.add_n`,
    so the bits are those of a separate reduction, without its pass over memory.
    """
    rows, total = var.shape
    once = replicate and rows > 1
    # The kernel's operands are one row high when computing once: wider blocks, fewer calls.
    width = block_width(1 if once else rows, var.dtype)
    for c0 in range(0, total, width):
        c1 = min(total, c0 + width)
        if addends:
            g = _sum(
                grad[:, c0:c1],
                functools.partial(_columns, addends, c0, c1),
                scratch.sum_line(c1 - c0),
                scratch,
            )
            _apply_block(kernel, var, slots, g, hp, scratch, once, c0, c1)
            continue
        _apply_block(kernel, var, slots, grad[:, c0:c1], hp, scratch, once, c0, c1)


def _apply_block(
    kernel: Kernel,
    var: np.ndarray,
    slots: Sequence[np.ndarray],
    g: np.ndarray,
    hp: Any,
    scratch: UpdateScratch,
    once: bool,
    c0: int,
    c1: int,
) -> None:
    """The kernel over columns ``[c0, c1)``; ``g`` is that block of the gradient."""
    if scratch.wide is not None:
        _apply_block_wide(kernel, var, slots, g, hp, scratch, once, c0, c1)
        return
    rows = var.shape[0]
    if once:
        tmp, gtmp = scratch.take(1, c1 - c0)
        v0 = var[:1, c0:c1]
        s0 = tuple(s[:1, c0:c1] for s in slots)
        kernel(v0, s0, g, hp, tmp, gtmp)
        np.copyto(var[1:, c0:c1], v0)
        for s, top in zip(slots, s0, strict=True):
            np.copyto(s[1:, c0:c1], top)
        return
    tmp, gtmp = scratch.take(rows, c1 - c0)
    kernel(var[:, c0:c1], tuple(s[:, c0:c1] for s in slots), g, hp, tmp, gtmp)


def _sum(
    first: np.ndarray,
    more: Callable[[], Iterable[np.ndarray]],
    out: np.ndarray,
    scratch: UpdateScratch,
) -> np.ndarray:
    """``((first + m0) + m1) + ...`` (``more()`` gives the ``m``), each addition rounded to
    ``out``'s dtype, as ``add_n`` adds: the sum, in ``out`` or, for bfloat16, in a float32
    line of the scratch that holds it exactly (what :func:`_apply_block_wide` widens it to).

    bfloat16 adds as its own addition does (both operands widened exactly, added in float32,
    rounded once to nearest even), with numpy's fast float32 loops: the running sum stays in
    float32, rounded to bfloat16's precision after each addition by integer arithmetic on its
    bits (the rounding of the float32 -> bfloat16 cast, without its slower loop and the
    widening back). float8's own addition does not round that way at its range's edges, and
    keeps its ufunc."""
    if scratch.add_wide:
        x, y, bits, xbits = scratch.add_lines(out.shape)
        np.copyto(x, first, casting="unsafe")
        for m in more():
            np.copyto(y, m, casting="unsafe")
            np.add(x, y, out=x)
            _round_to_bfloat16(xbits, bits)
        # The minimum is NaN exactly when the line holds one (a vectorised pass, cheaper
        # than a sum's), and only NaN differs from itself.
        low = np.minimum.reduce(x, axis=None)
        if low == low:
            return x
        # Which NaN a sum of two NaNs keeps differs between loops: the narrow ufunc decides.
    it = iter(more())
    np.add(first, next(it), out=out)
    for m in it:
        np.add(out, m, out=out)
    return out


def _columns(lines: Sequence[np.ndarray], c0: int, c1: int) -> Iterator[np.ndarray]:
    """Columns ``[c0, c1)`` of each ``(1, n)`` line."""
    return (a[:, c0:c1] for a in lines)


def _gathered_each(
    parts: Sequence[Sequence[np.ndarray]],
    pick: Callable[[Sequence[np.ndarray]], tuple[Any, ...]],
    dtype: np.dtype,
    line: np.ndarray,
) -> Iterator[np.ndarray]:
    """Each part's arrays ``pick`` names, joined in turn (into ``line``: one at a time)."""
    return (_gathered(pick(p), dtype, line) for p in parts)


def _round_to_bfloat16(u: np.ndarray, bits: np.ndarray) -> None:
    """Round float32 values, given as their bits ``u`` (uint32), in place to the nearest
    bfloat16 value (ties to even), as the float32 -> bfloat16 cast rounds finite and infinite
    values (NaN is the caller's). ``bits``: a uint32 scratch of ``u``'s shape."""
    np.right_shift(u, 16, out=bits)
    np.bitwise_and(bits, 1, out=bits)
    np.add(bits, 0x7FFF, out=bits)
    np.add(u, bits, out=u)
    np.bitwise_and(u, 0xFFFF0000, out=u)


def _apply_block_wide(
    kernel: Kernel,
    var: np.ndarray,
    slots: Sequence[np.ndarray],
    g: np.ndarray,
    hp: Any,
    scratch: UpdateScratch,
    once: bool,
    c0: int,
    c1: int,
) -> None:
    """:func:`_apply_block` for a dtype computed in float32 (bfloat16, float8): the block's
    variable, slots and gradient are widened exactly to float32, updated there, and the
    variable and slots rounded once back into their dtype (to every row: equal rows give equal
    results). Elementwise, so the bits do not depend on the block: those of widening a whole
    variable, as the per-variable path does."""
    assert scratch.wide is not None
    rows = 1 if once else var.shape[0]
    w = c1 - c0
    n = len(slots) + 1
    wide = scratch.widened_all(n, rows, w)
    blocks = [var[:rows, c0:c1], *(s[:rows, c0:c1] for s in slots)]
    for wa, a in zip(wide, blocks, strict=True):
        np.copyto(wa, a, casting="unsafe")
    if g.dtype == np.float32:
        wg = g  # a sum of replicas' gradients, widened already (see _sum)
    else:
        wg = scratch.widened(n, g.shape[0], w)
        np.copyto(wg, g, casting="unsafe")
    tmp, gtmp = scratch.wide.take(rows, w)
    kernel(wide[0], wide[1:], wg, hp, tmp, gtmp)
    # Rounded once per computed row; equal rows are then copied in the narrow dtype.
    for a, wa in zip(blocks, wide, strict=True):
        np.copyto(a, wa, casting="unsafe")
    if once:
        for a in (var, *slots):
            np.copyto(a[1:, c0:c1], a[:1, c0:c1])


@dataclass
class Run:
    """Variables laid out back to back in one arena: one ``(n, lo:hi)`` slab everywhere.

    Attributes:
        arena: the variables' arena.
        lo, hi: the covered columns.
        members: ``(position in the variable list, start column - lo, size)`` per variable.
        var_slab: ``arena.buffer[:, lo:hi]``.
        slot_slabs: the same columns of each slot arena, in the optimizer's slot order.
        grad_line: ``(1, hi - lo)`` staging line for the gradients, zero in the padding.
        replicate: the rows are equal (mirrored variables): compute row 0, copy to the rest.
    """

    arena: Arena
    lo: int
    hi: int
    members: list[tuple[int, int, int]]
    var_slab: np.ndarray
    slot_slabs: tuple[np.ndarray, ...] = ()
    grad_line: np.ndarray = field(default_factory=lambda: np.zeros((1, 0)))
    replicate: bool = False
    # Spans of members packed back to back: (start column - lo, end, positions); their
    # gradients are staged with one np.concatenate each.
    segments: list[tuple[int, int, list[int]]] = field(default_factory=list)


def plan_runs(
    placements: Sequence[tuple[int, Any]] | Sequence[tuple[int, Any, bool]],
    slot_arenas: Callable[[Arena], Sequence[Arena]],
) -> list[Run]:
    """Group variables into runs.

    Args:
        placements: ``(position, placement)`` or ``(position, placement, replicate)`` for each
            variable on the fast path; ``replicate`` marks variables whose components are kept
            equal (mirrored), which never share a run with the others.
        slot_arenas: for a variable arena, the optimizer's slot arenas (its shadows), in slot
            order.

    Returns:
        The runs, each covering only the given variables and the alignment padding between
        them.
    """
    by_arena: dict[tuple[int, bool], list[tuple[int, Any]]] = {}
    arenas: dict[int, Arena] = {}
    for item in placements:
        pos, pl = item[0], item[1]
        replicate = bool(item[2]) if len(item) > 2 else False
        by_arena.setdefault((id(pl.arena), replicate), []).append((pos, pl))
        arenas[id(pl.arena)] = pl.arena
    runs: list[Run] = []
    for (key, replicate), items in by_arena.items():
        arena = arenas[key]
        items.sort(key=lambda item: item[1].offset)
        groups: list[list[tuple[int, Any]]] = []
        for pos, pl in items:
            if groups:
                prev = groups[-1][-1][1]
                if pl.offset == prev.offset and pl.size == prev.size:
                    raise GradientError("the same variable appears twice in one update")
                if pl.offset == arena.end_of(prev.offset, prev.size):
                    groups[-1].append((pos, pl))
                    continue
            groups.append([(pos, pl)])
        shadows = tuple(slot_arenas(arena))
        for group in groups:
            lo = group[0][1].offset
            hi = group[-1][1].offset + group[-1][1].size
            runs.append(
                Run(
                    arena=arena,
                    lo=lo,
                    hi=hi,
                    members=[(pos, pl.offset - lo, pl.size) for pos, pl in group],
                    var_slab=arena.buffer[:, lo:hi],
                    slot_slabs=tuple(s.buffer[:, lo:hi] for s in shadows),
                    grad_line=np.zeros((1, hi - lo), arena.dtype),
                    replicate=replicate,
                    segments=_segments([(pos, pl.offset - lo, pl.size) for pos, pl in group]),
                )
            )
    return runs


class FlatArena:
    """One C-contiguous array seen as a one-row arena: ``buffer`` is its ``(1, size)`` view.

    Where a sharded variable's update reads and writes: its shards are views of this array, so
    a run over it updates every shard (each from its slice of the gradient) in one pass of
    blocks, as a run over arena rows does.
    """

    n = 1

    def __init__(self, array: np.ndarray) -> None:
        flat = array.reshape(1, -1)
        if flat.size and not np.shares_memory(flat, array):
            raise InvalidArgumentError(
                "the array is not contiguous; a flat view of it does not exist"
            )
        self.array = array
        self.buffer = flat
        self.dtype = array.dtype

    def end_of(self, offset: int, size: int) -> int:
        return offset + size


def flat_run(position: int, array: np.ndarray, slot_arrays: Sequence[np.ndarray]) -> Run:
    """The run of one variable held as one full array (a sharded variable) and its slots, each
    a full array of the same shape (see :class:`FlatArena`)."""
    arena = FlatArena(array)
    size = arena.buffer.shape[1]
    member = [(position, 0, size)]
    return Run(
        arena=arena,  # type: ignore[arg-type]
        lo=0,
        hi=size,
        members=member,
        var_slab=arena.buffer,
        slot_slabs=tuple(FlatArena(s).buffer for s in slot_arrays),
        grad_line=np.zeros((1, size), arena.dtype),
        replicate=False,
        segments=_segments(member),
    )


def buffer_ids(runs: Sequence[Run], sizes: Collection[int] | None = None) -> frozenset[int]:
    """The ids of every array object that holds memory a step over ``runs`` writes: the arenas'
    and slot arenas' buffers and the arrays they are views of; with ``sizes``, only those of
    one of these numbers of elements (the only ones an array of a variable's shape can be)."""
    ids: set[int] = set()
    for run in runs:
        for a in (run.arena.buffer, *run.slot_slabs):
            held: np.ndarray | None = a
            while held is not None:
                if sizes is None or getattr(held, "size", None) in sizes:
                    ids.add(id(held))
                held = held.base
    return frozenset(ids)


def _segments(members: list[tuple[int, int, int]]) -> list[tuple[int, int, list[int]]]:
    out: list[tuple[int, int, list[int]]] = []
    for pos, start, size in members:
        if out and out[-1][1] == start:
            out[-1][2].append(pos)
            out[-1] = (out[-1][0], start + size, out[-1][2])
        else:
            out.append((start, start + size, [pos]))
    return out


def apply_runs(
    runs: Sequence[Run],
    grads: Sequence[np.ndarray],
    kernel: Kernel,
    hp: Any,
    scratch: Callable[[np.dtype], UpdateScratch],
) -> None:
    """One step over every run: stage the gradients, then walk the slabs in blocks.

    Args:
        runs: from :func:`plan_runs`.
        grads: dense gradients indexed by the members' positions, each of its variable's size.
        kernel: the optimizer's kernel.
        hp: the step's hyperparameters.
        scratch: the scratch for a dtype.
    """
    for run in runs:
        line = run.grad_line[0]
        for start, end, positions in run.segments:
            # Casting to the variable's dtype here, once per parameter, not once per replica:
            # the gradients are checked numbers and the variables floats, so each cast rounds
            # (to nearest even) as astype does, bfloat16 to float16 included (which numpy does
            # not call same_kind; optimizers._checks.castable).
            if len(positions) == 1:
                np.copyto(line[start:end], grads[positions[0]].reshape(-1), casting="unsafe")
            else:  # axis=None flattens every gradient: one C call for the whole span
                parts = operator.itemgetter(*positions)(grads)
                try:  # gradients of the variables' dtype: numpy's quickest path, no casting
                    np.concatenate(parts, axis=None, out=line[start:end], casting="equiv")
                except TypeError:
                    np.concatenate(parts, axis=None, out=line[start:end], casting="unsafe")
        apply_blocked(
            kernel,
            run.var_slab,
            run.slot_slabs,
            run.grad_line,
            hp,
            scratch(run.arena.dtype),
            run.replicate,
        )


@dataclass
class GradLayout:
    """The gradient lines of a list of runs laid end to end: one flat buffer per dtype.

    Run ``k``'s line is ``buffer[spans[k][1] : spans[k][1] + run.hi - run.lo]`` of the buffer
    of dtype ``spans[k][0]``: the arena's own layout over the run's columns, alignment padding
    included (kept zero), so a reduced buffer is the update's gradient with no gather.

    Attributes:
        sizes: elements of the buffer of each dtype, dtypes in a fixed (sorted) order.
        spans: ``(dtype, start)`` of each run's line.
        views: ``(dtype, start, size)`` of each variable, by its position in the runs.
    """

    sizes: dict[np.dtype, int]
    spans: list[tuple[np.dtype, int]]
    views: dict[int, tuple[np.dtype, int, int]]

    def buffers(self) -> dict[np.dtype, np.ndarray]:
        """Fresh zeroed buffers of this layout."""
        return {dt: np.zeros(n, dt) for dt, n in self.sizes.items()}


def layout_lines(runs: Sequence[Run]) -> GradLayout:
    """Lay the runs' gradient lines end to end, one flat buffer per dtype."""
    sizes: dict[np.dtype, int] = {}
    spans: list[tuple[np.dtype, int]] = []
    views: dict[int, tuple[np.dtype, int, int]] = {}
    for run in runs:
        dt = np.dtype(run.arena.dtype)
        start = sizes.get(dt, 0)
        spans.append((dt, start))
        sizes[dt] = start + run.hi - run.lo
        for pos, off, size in run.members:
            views[pos] = (dt, start + off, size)
    ordered = {dt: sizes[dt] for dt in sorted(sizes, key=lambda d: d.str)}
    return GradLayout(ordered, spans, views)


def pack_lines(
    runs: Sequence[Run],
    layout: GradLayout,
    grads: Sequence[np.ndarray],
    out: dict[np.dtype, np.ndarray],
) -> None:
    """Copy dense gradients (indexed by the members' positions, each of its variable's dtype)
    into buffers of ``layout``.

    One ``np.concatenate`` per span of variables packed back to back; the padding between
    spans is left as it is (zero in buffers made by :meth:`GradLayout.buffers`). No casting
    (``casting="equiv"``, which is also numpy's quickest path for many small arrays): a
    gradient of another dtype raises ``TypeError``.
    """
    for run, (dt, start) in zip(runs, layout.spans, strict=True):
        buf = out[dt]
        for s0, s1, positions in run.segments:
            if len(positions) == 1:
                np.copyto(
                    buf[start + s0 : start + s1], grads[positions[0]].reshape(-1), casting="equiv"
                )
            else:
                np.concatenate(
                    operator.itemgetter(*positions)(grads),
                    axis=None,
                    out=buf[start + s0 : start + s1],
                    casting="equiv",
                )


def apply_lines(
    runs: Sequence[Run],
    layout: GradLayout,
    parts: Sequence[dict[np.dtype, np.ndarray]],
    kernel: Kernel,
    hp: Any,
    scratch: Callable[[np.dtype], UpdateScratch],
) -> None:
    """One step over every run whose gradient is the sum of ``parts``, buffers of ``layout``.

    The parts are added left to right (``parts[0] + parts[1] + ...``) block by block inside
    :func:`apply_blocked`, so the reduction costs no pass of its own over memory.
    """
    for run, (dt, start) in zip(runs, layout.spans, strict=True):
        lines = [p[dt][start : start + run.hi - run.lo].reshape(1, -1) for p in parts]
        apply_blocked(
            kernel,
            run.var_slab,
            run.slot_slabs,
            lines[0],
            hp,
            scratch(run.arena.dtype),
            run.replicate,
            lines[1:],
        )


@dataclass
class GatherPlan:
    """How :func:`apply_gathered` walks a list of runs, made once per list by :func:`plan_gather`.

    Attributes:
        runs: the runs.
        walks: per run, ``(direct, blocks)``: the members (``(position, start - lo, size)``)
            large enough to be read in place, and the blocks ``(c0, c1, pick)`` of small
            members: columns ``[c0, c1)`` of the run, whose gradients ``pick(grads)`` (a tuple,
            zero padding arrays included) laid end to end are the block's gradient line.
        tail: the zero padding arrays, appended (in this order) to a replica's gradient list
            before ``pick`` is applied; ``pick`` reaches them by negative index.
        owners: the buffers a step writes (the runs' arenas and slot arenas), as address ranges
            ``(start, end)``: a gradient inside one would be read after the step changed it.
    """

    runs: list[Run]
    walks: list[tuple[list[tuple[int, int, int]], list[tuple[int, int, Callable[[Any], Any]]]]]
    tail: list[np.ndarray]
    owners: list[tuple[int, int]]


def plan_gather(runs: Sequence[Run]) -> GatherPlan:
    """Cut every run into cache-sized blocks of whole small members, for :func:`apply_gathered`.

    A member of at least half a block is read in place (no copy). Small members are grouped,
    in column order, into blocks of at most one block width; the alignment padding between two
    members of a block is a zero array in the block's list, so the block's gradient line is
    zero there, as a packed line is.
    """
    pads: dict[tuple[np.dtype, int], int] = {}
    tail: list[np.ndarray] = []
    walks = []
    owners: dict[int, tuple[int, int]] = {}
    for run in runs:
        dt = np.dtype(run.arena.dtype)
        for buf in (
            run.arena.buffer,
            *(s.base if s.base is not None else s for s in run.slot_slabs),
        ):
            lo, hi = np.lib.array_utils.byte_bounds(buf)
            owners[lo] = (lo, hi)
        rows = run.var_slab.shape[0]
        width = block_width(1 if run.replicate and rows > 1 else rows, dt)
        direct: list[tuple[int, int, int]] = []
        groups: list[list[tuple[int, int, int]]] = [[]]
        for member in run.members:
            _, start, size = member
            if 2 * size >= width:
                direct.append(member)
                groups.append([])
                continue
            group = groups[-1]
            if group and start + size - group[0][1] > width:
                groups.append(group := [])
            group.append(member)
        blocks: list[tuple[int, int, Callable[[Any], Any]]] = []
        for group in groups:
            if len(group) == 1:
                direct.append(group[0])
            elif group:
                picks: list[int] = []
                end = group[0][1]
                for pos, start, size in group:
                    if start > end:  # alignment padding: a zero array of its length
                        key = (dt, start - end)
                        if key not in pads:
                            pads[key] = len(tail)
                            tail.append(np.zeros(start - end, dt))
                        picks.append(-1 - pads[key])
                    picks.append(pos)
                    end = start + size
                blocks.append((group[0][1], end, operator.itemgetter(*picks)))
        walks.append((direct, blocks))
    # Negative indices count from the end: the list handed to pick is grads + tail reversed.
    return GatherPlan(list(runs), walks, tail[::-1], sorted(owners.values()))


def overlaps(plan: GatherPlan, arrays: Sequence[np.ndarray]) -> bool:
    """Whether any of ``arrays`` shares memory with a buffer the step writes (``plan.owners``)."""
    owners = plan.owners
    for a in arrays:
        lo, hi = np.lib.array_utils.byte_bounds(a)
        for o0, o1 in owners:
            if lo < o1 and o0 < hi:
                return True
    return False


def _gathered(items: tuple[Any, ...], dtype: np.dtype, line: np.ndarray) -> np.ndarray:
    """The arrays ``items`` (of ``dtype``, sizes summing to ``len(line)``) laid end to end.

    ``bytes.join`` copies C-contiguous arrays with one ``memcpy`` each, several times quicker
    than ``np.concatenate`` per array; it refuses any other layout (``TypeError``), which is then
    flattened by numpy into ``line``. Either way the values are the arrays' C-order elements.
    """
    try:
        return np.frombuffer(b"".join(items), dtype)
    except TypeError:
        np.concatenate(items, axis=None, out=line, casting="equiv")
        return line


def apply_gathered(
    plan: GatherPlan,
    parts: Sequence[Sequence[np.ndarray]],
    kernel: Kernel,
    hp: Any,
    scratch: Callable[[np.dtype], UpdateScratch],
) -> None:
    """One step over every run of ``plan`` whose gradient is the sum of the ``parts``.

    ``parts``: each replica's gradients, in summing order, as lists indexed by the members'
    positions (arrays of the variables' dtype and size, each replica its own). No flat buffer
    and no pass of its own over memory: a block's gradients are joined into a cache-resident
    line per replica right before the kernel uses the block, and added left to right
    (``parts[0] + parts[1] + ...``), the bits of :func:`apply_lines` over packed buffers; a
    large member's arrays are added block by block in place, as in :func:`apply_blocked`.

    The gradients are read while the step writes the variables and slots: none of them may
    share memory with those (see :func:`overlaps`).
    """
    exts = [[*p, *plan.tail] for p in parts] if plan.tail else parts
    for run, (direct, blocks) in zip(plan.runs, plan.walks, strict=True):
        dt = run.arena.dtype
        sc = scratch(dt)
        for pos, start, size in direct:
            lines = [p[pos].reshape(1, -1) for p in parts]
            cols = slice(start, start + size)
            apply_blocked(
                kernel,
                run.var_slab[:, cols],
                tuple(s[:, cols] for s in run.slot_slabs),
                lines[0],
                hp,
                sc,
                run.replicate,
                lines[1:],
            )
        if not blocks:
            continue
        once = run.replicate and run.var_slab.shape[0] > 1
        first, rest = exts[0], exts[1:]
        for c0, c1, pick in blocks:
            w = c1 - c0
            g = _gathered(pick(first), dt, sc.gather_line(w, 0))
            if rest:
                g = _sum(
                    g,
                    functools.partial(_gathered_each, rest, pick, dt, sc.gather_line(w, 1)),
                    sc.sum_line(w)[0],
                    sc,
                )
            _apply_block(
                kernel, run.var_slab, run.slot_slabs, g.reshape(1, w), hp, sc, once, c0, c1
            )


def row_view(stacked: np.ndarray) -> np.ndarray:
    """A ``(n, size)`` view of an ``(n, *shape)`` buffer (a copy never: it must be written)."""
    out = stacked.reshape(stacked.shape[0], -1)
    if out.size and not np.shares_memory(out, stacked):
        raise InvalidArgumentError("the buffer is not contiguous; a 2-D view of it does not exist")
    return out
