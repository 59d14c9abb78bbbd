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
  arrive as flat buffers laid out like the runs (:class:`GradLayout`, :func:`pack_lines`, or
  the user's gradient buffers) or, for large variables, as the arrays themselves
  (:func:`apply_direct`); :func:`apply_blocked` adds them block by block, left to right in
  device order, right before the kernel uses the block, so the reduction makes no pass of its
  own over memory and gives the bits of the per-variable ``add_n`` sum.
* **Fallback.** Sharded variables (no stacked buffer), variables without an arena placement and
  float dtypes numpy has no fast loops for (bfloat16, float8: computed in float32 and cast back)
  take a per-variable path through the same kernel, so both paths share one formula.

When every row is computed, each row goes through the same correctly rounded ufuncs (add,
multiply, divide, sqrt, maximum) with the same operands, so replicas that start equal stay
bit-identical either way.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
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
    "apply_blocked",
    "apply_direct",
    "apply_lines",
    "apply_runs",
    "layout_lines",
    "pack_lines",
    "plan_runs",
    "row_view",
]

# Dtypes numpy has native loops for; everything else floating is computed in float32.
FAST_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))

# Bytes of one (rows, width) block of one operand. Adam touches five such blocks per step
# (variable, m, v and two scratch), ~640 KiB: well inside a 1-2 MiB L2 cache.
BLOCK_BYTES = 128 << 10
_MIN_BLOCK = 1024

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
    """Columns per block for ``rows`` rows of ``dtype``: a multiple of 64, at least 1024."""
    width = BLOCK_BYTES // max(1, rows * dtype.itemsize)
    return max(_MIN_BLOCK, width // 64 * 64)


class UpdateScratch:
    """The update core's preallocated scratch of one dtype: ``count`` ``(rows, width)`` and
    ``(1, width)`` arrays (not :class:`parallelvars._fileio.Scratch`, a writer's read buffer).

    Grows (reallocates) only when asked for more rows or columns than it holds, so a training
    loop allocates nothing after its first step.
    """

    def __init__(self, dtype: Any, count: int = 2) -> None:
        self.dtype = np.dtype(dtype)
        self.count = count
        self._rows: list[np.ndarray] = []
        self._line: list[np.ndarray] = []
        self._sum = np.empty((1, 0), self.dtype)
        self._shape = (0, 0)

    def sum_line(self, width: int) -> np.ndarray:
        """A ``(1, width)`` line apart from :meth:`take`'s: where replicas' gradients are summed."""
        if self._sum.shape[1] < width:
            self._sum = np.empty((1, width), self.dtype)
        return self._sum[:, :width]

    def take(self, rows: int, width: int) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        """Views ``(tmp, gtmp)`` of shapes ``(rows, width)`` and ``(1, width)``."""
        r0, w0 = self._shape
        if rows > r0 or width > w0:
            r0, w0 = max(rows, r0), max(width, w0)
            self._rows = [np.empty((r0, w0), self.dtype) for _ in range(self.count)]
            self._line = [np.empty((1, w0), self.dtype) for _ in range(self.count)]
            self._shape = (r0, w0)
        return (
            tuple(t[:rows, :width] for t in self._rows),
            tuple(t[:, :width] for t in self._line),
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
            g = scratch.sum_line(c1 - c0)
            np.add(grad[:, c0:c1], addends[0][:, c0:c1], out=g)
            for a in addends[1:]:
                np.add(g, a[:, c0:c1], out=g)
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
            # Casting to the variable's dtype here, once per parameter, not once per replica.
            if len(positions) == 1:
                np.copyto(line[start:end], grads[positions[0]].reshape(-1), casting="same_kind")
            else:  # axis=None flattens every gradient: one C call for the whole span
                parts = operator.itemgetter(*positions)(grads)
                try:  # gradients of the variables' dtype: numpy's quickest path, no casting
                    np.concatenate(parts, axis=None, out=line[start:end], casting="equiv")
                except TypeError:
                    np.concatenate(parts, axis=None, out=line[start:end], casting="same_kind")
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


def apply_direct(
    runs: Sequence[Run],
    parts: Sequence[Sequence[np.ndarray]],
    kernel: Kernel,
    hp: Any,
    scratch: Callable[[np.dtype], UpdateScratch],
) -> None:
    """:func:`apply_lines` with each replica's gradients as they are, one array per variable
    (indexed by the members' positions, of the variables' dtype): no packing copy, one
    :func:`apply_blocked` per variable. For large variables, where the per-variable calls cost
    little next to the arithmetic and a packing copy would be a pass over every gradient.
    The same bits as :func:`apply_lines` (the kernel is elementwise; the padding it skips
    keeps its value either way).
    """
    for run in runs:
        sc = scratch(run.arena.dtype)
        for pos, start, size in run.members:
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


def row_view(stacked: np.ndarray) -> np.ndarray:
    """A ``(n, size)`` view of an ``(n, *shape)`` buffer (a copy never: it must be written)."""
    out = stacked.reshape(stacked.shape[0], -1)
    if out.size and not np.shares_memory(out, stacked):
        raise InvalidArgumentError("the buffer is not contiguous; a 2-D view of it does not exist")
    return out
