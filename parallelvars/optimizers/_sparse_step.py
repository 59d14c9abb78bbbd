"""Sparse gradients of arena variables, every variable and replica of a group at once.

A step hands each variable one :class:`IndexedSlices` per replica (or, from a cross-replica
``distributed_apply``, one reduced slice). The per-variable meaning is: the replicas' slices
laid side by side in replica order (:func:`sum_indexed_slices`), deduplicated
(:meth:`IndexedSlices.deduplicate`: a variable without a repeated row keeps its values as
they are, one with a repeated row has every row summed from zero in occurrence order), then
the touched rows updated by the TF 1.x sparse formulas, or, where the formula touches every row
(``_sparse_as_dense``: Adam), the deduplicated rows made dense (zero plus each row) and the
variable updated as by a dense gradient.

:class:`SparseSteps` does the same for every variable of one arena and row width together
(a *group*): the indices and rows of all its variables and replicas are laid end to end, each
row is keyed by its flat position in the target (the arena row, or the dense gradient line
of the update core), one stable sort orders every key's occurrences as the per-variable sum
visits them, and repeated keys are summed in as many vectorised adds as a key repeats. Rows
are read and written through a strided *window* view of the target (row ``p`` of the window
is the ``width`` elements starting at element ``p``), so no per-element index array is made.

Slices whose values have another dtype than their variable (float32 rows for a bfloat16
variable, say) are summed as the per-variable path sums them: side by side and deduplicated in
their own dtype, then rounded once to the variable's (:meth:`Optimizer._compute` rounds the
rows, ``to_dense`` the line). A group is therefore variables of one arena, row width and
*values dtype*. A variable whose replicas' values differ in dtype is left to the per-variable
sum, which concatenates them into their promoted dtype (its reduced rows then come back here
as one slice, :meth:`Optimizer._sparse_batch`).

A training loop hands the same variables with slices of the same sizes every step: each
group keeps its layout, and, while the slices' sizes repeat, the keys' offsets and bounds.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from parallelvars import update_core

__all__ = ["SparseBatch", "SparseSteps", "dedupe_rows"]

# Groups kept per optimizer; a loop over more variable lists than this keeps the newest.
GROUP_CACHE = 32

_indices_of = operator.attrgetter("indices")
_values_of = operator.attrgetter("values")
_dense_shape_of = operator.attrgetter("dense_shape")
_dtype_of = operator.attrgetter("dtype")

# The values dtypes summed here when they are not the variable's own: those numpy (and
# ml_dtypes) add as IndexedSlices.deduplicate and to_dense add them. Another one (an integer
# gradient, float8) keeps the per-variable path unless it is the variable's dtype.
SUMMED_IN = frozenset(np.dtype(d) for d in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))


class Owner(Protocol):
    """What the sparse step asks of its optimizer."""

    _sparse_as_dense: bool

    def _info(self, var: Any) -> tuple[tuple[int, ...], np.dtype, bool]: ...

    def _create_slots(self, var_list: Sequence[Any]) -> None: ...

    def _plan(self, fast_vars: list[Any]) -> list[update_core.Run]: ...

    def _slot_specs(self) -> list[tuple[str, float]]: ...

    def _slot_arena(self, arena: Any, slot_name: str) -> Any: ...

    def _compute(
        self, var2d: np.ndarray, slots2d: list[np.ndarray], g: np.ndarray, hp: Any
    ) -> None: ...

    _kernel: update_core.Kernel

    def _scratch(self, dtype: np.dtype) -> update_core.UpdateScratch: ...


class RowScratch:
    """Reused arrays of a group's step: a sparse step over thousands of variables moves
    megabytes, and fresh arrays of that size cost page faults every step."""

    __slots__ = ("_arrays",)

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An array of ``shape`` and ``dtype`` (contents undefined), the same memory as the last
        call with ``name`` when it is large enough."""
        size = math.prod(shape)
        a = self._arrays.get(name)
        if a is None or a.dtype != dtype or a.shape[0] < size:
            a = self._arrays[name] = np.empty(max(size, 1), dtype)
        return a[:size].reshape(shape)


def dedupe_rows(
    keys: np.ndarray,
    var_of: np.ndarray,
    totals: np.ndarray,
    values: np.ndarray,
    all_from_zero: bool = False,
    scratch: RowScratch | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``keys`` (in no particular order) and each one's summed row, with the bits
    of :meth:`IndexedSlices.deduplicate` applied per variable.

    ``keys[i]`` is occurrence ``i``'s row (distinct variables never share a key), ``var_of[i]``
    its variable, ``totals[k]`` the occurrences of variable ``k``, ``values`` one ``(n,
    width)`` row per occurrence (changed in place). A variable without a repeated key keeps
    its values as they are; one with a repeated key has each of its rows summed from zero in
    occurrence order (the order of ``np.add.at``). ``all_from_zero``: every row summed from
    zero (what making the rows dense adds anyway). ``scratch``: where the rows are made (the
    result may be a view of it).

    How: one stable sort puts each key's occurrences together in occurrence order; the keys
    are ranked by how often they occur, most first, and the rows laid out rank by rank
    (every key's first occurrence, then every second occurrence of the keys that have one,
    ...), so that each round of the sum is one contiguous add over a prefix of the keys.
    """
    n = keys.shape[0]
    zero = np.zeros((), values.dtype)
    if n == 0:
        return keys, values
    order = np.argsort(keys, kind="stable")
    ranked = keys[order]
    head = np.empty(n, bool)
    head[0] = True
    np.not_equal(ranked[1:], ranked[:-1], out=head[1:])
    first = np.flatnonzero(head)
    u = first.shape[0]
    if u == n:  # no key repeats: every variable keeps its values
        if all_from_zero:
            # Zero plus each row (addition commutes bit for bit: -0.0 becomes 0.0).
            np.add(values, zero, out=values)
        return keys, values
    sizes = np.diff(first, append=n)
    by_size = np.argsort(-sizes, kind="stable")
    place = np.empty(u, np.intp)
    place[by_size] = np.arange(u)
    key_of = np.cumsum(head) - 1  # each sorted occurrence's key number
    rank = np.arange(n) - first[key_of]
    # count[r]: the keys occurring more than r times (a prefix of by_size); start[r]: where
    # rank r's rows begin.
    at_least = np.bincount(sizes)[::-1].cumsum()[::-1]
    count = at_least[1:]
    start = np.zeros(count.shape[0], np.intp)
    np.cumsum(count[:-1], out=start[1:])
    perm = np.empty(n, np.intp)
    perm[start[rank] + place[key_of]] = order
    # mode="clip": the indices are in range, and take() with out= buffers its output otherwise.
    rows = np.take(
        values,
        perm,
        axis=0,
        out=scratch.get("rows", values.shape, values.dtype) if scratch is not None else None,
        mode="clip",
    )
    acc = rows[:u]
    if all_from_zero:
        np.add(acc, zero, out=acc)
    else:
        firsts = order[first[by_size]]
        repeated = np.bincount(var_of[firsts], minlength=totals.shape[0]) < totals
        np.add(acc, zero, out=acc, where=repeated[var_of[firsts]][:, None])
    for r in range(1, count.shape[0]):
        c = count[r]
        np.add(acc[:c], rows[start[r] : start[r] + c], out=acc[:c])
    return ranked[first[by_size]], acc


def _window(buffer: np.ndarray, width: int) -> np.ndarray:
    """A writable view of a C-contiguous ``(rows, n)`` buffer (or ``(n,)``) as
    ``(rows, n - width + 1, width)`` (``(n - width + 1, width)``): row ``p`` is elements
    ``[p, p + width)``. Rows overlap: written only at keys of distinct rows. (Made over the
    buffer's bits as unsigned integers: ``as_strided`` cannot name every dtype, float8's.)"""
    item = buffer.itemsize
    raw = buffer.view(np.dtype(f"u{item}"))
    if buffer.ndim == 1:
        shape: tuple[int, ...] = (buffer.shape[0] - width + 1, width)
        strides: tuple[int, ...] = (item, item)
    else:
        assert buffer.strides[1] == item
        shape = (buffer.shape[0], buffer.shape[1] - width + 1, width)
        strides = (buffer.strides[0], item, item)
    window = np.lib.stride_tricks.as_strided(raw, shape, strides, writeable=True)
    return window.view(buffer.dtype)


class _Group:
    """Variables of one arena and row width: their targets and a step's reusable offsets."""

    __slots__ = (
        "arena",
        "bound_of",
        "counts",
        "dense",
        "dtype",
        "members",
        "pick",
        "row_shape",
        "rows",
        "scratch",
        "shapes",
        "start_of",
        "starts",
        "summed_in",
        "totals",
        "var_of",
        "variables",
        "width",
        "windows",
    )

    def __init__(
        self,
        variables: list[Any],
        members: list[int],
        width: int,
        owner: Owner,
        summed_in: np.dtype,
    ) -> None:
        self.variables = variables
        self.members = members
        self.pick = operator.itemgetter(*members) if len(members) > 1 else None
        self.width = width
        self.scratch = RowScratch()
        info = [owner._info(v) for v in variables]
        self.shapes = [i[0] for i in info]
        self.dtype = info[0][1]
        # The dtype of the group's gradient values: rows are summed in it, then rounded once
        # to the variables' dtype when it is another.
        self.summed_in = summed_in
        self.row_shape = self.shapes[0][1:]
        self.rows = np.array([s[0] for s in self.shapes], np.uint64)
        self.arena = variables[0].placement.arena
        # Adam: the update core's runs and one zeroed gradient line laid out like them.
        self.dense: tuple[list[update_core.Run], update_core.GradLayout, dict[Any, Any]] | None
        self.dense = None
        if owner._sparse_as_dense:
            runs = owner._plan(variables)
            layout = update_core.layout_lines(runs)
            self.dense = (runs, layout, layout.buffers())
            self.starts = np.array([layout.views[k][1] for k in range(len(variables))], np.int64)
        else:
            self.starts = np.array([v.placement.offset for v in variables], np.int64)
        self.counts: np.ndarray | None = None
        self.var_of = self.start_of = self.totals = np.zeros(0, np.int64)
        self.bound_of = np.zeros(0, np.uint64)
        # The strided windows the step reads and writes rows through (see _window), made on
        # first use: the variable and slot arenas', or the dense gradient line's. The buffers
        # behind them are fixed for the group's life (an arena never reallocates).
        self.windows: list[np.ndarray] | None = None

    def targets(self, owner: Owner) -> list[np.ndarray]:
        """The windows of the buffers the group's rows go to (see :attr:`windows`)."""
        if self.windows is None:
            if self.dense is not None:
                self.windows = [_window(self.dense[2][self.dtype], self.width)]
            else:
                names = [n for n, _ in owner._slot_specs()]
                arena = self.arena
                buffers = [arena.buffer, *(owner._slot_arena(arena, n).buffer for n in names)]
                self.windows = [_window(b, self.width) for b in buffers]
        return self.windows

    def picked(self, grads: Sequence[Any]) -> Sequence[Any]:
        if self.pick is None:
            return [grads[self.members[0]]]
        return self.pick(grads)

    def offsets(self, counts: np.ndarray, replicas: int) -> bool:
        """Make the per-occurrence variable numbers, starts and bounds for ``counts`` (one per
        replica and variable, replica-major); False when they were made already."""
        if self.counts is not None and np.array_equal(self.counts, counts):
            return False
        n = len(self.variables)
        var_of = np.repeat(np.tile(np.arange(n, dtype=np.intp), replicas), counts)
        self.var_of = var_of
        self.start_of = self.starts[var_of]
        self.bound_of = self.rows[var_of]
        self.totals = counts.reshape(replicas, n).sum(axis=0)
        self.counts = counts
        return True


class SparseBatch:
    """One step's sparse gradients taken by :class:`SparseSteps`: their positions in the
    variable list, their variables, and per group the unique row keys and summed rows."""

    __slots__ = ("positions", "rows", "variables")

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.variables: list[Any] = []
        self.rows: list[tuple[_Group, np.ndarray, np.ndarray]] = []

    def __bool__(self) -> bool:
        return bool(self.positions)


class SparseSteps:
    """The vectorised sparse route of one optimizer (see the module's docstring)."""

    def __init__(self, owner: Owner) -> None:
        self._owner = owner
        # Per variable list (ids, checked by identity) and values dtypes: its groups.
        self._groups: dict[
            tuple[tuple[int, ...], tuple[np.dtype | None, ...]],
            tuple[tuple[Any, ...], list[_Group]],
        ] = {}

    def capable(self, var: Any) -> bool:
        """Whether ``var``'s sparse gradients can take this route: a float arena variable of
        at least one dimension with non-empty rows."""
        shape, _, fast = self._owner._info(var)
        return fast and var.placement is not None and len(shape) >= 1 and math.prod(shape) > 0

    def _groups_of(
        self, variables: list[Any], summed_in: tuple[np.dtype | None, ...]
    ) -> list[_Group]:
        """The groups of ``variables`` whose gradient values are summed in ``summed_in`` (one
        dtype for all, or one per variable; None: not taken here)."""
        key = (tuple(map(id, variables)), summed_in)
        found = self._groups.get(key)
        if found is not None and all(map(operator.is_, found[0], variables)):
            groups = found[1]
            if not self._owner._sparse_as_dense or all(
                g.dense is not None and self._owner._plan(g.variables) is g.dense[0] for g in groups
            ):
                return groups
        self._owner._create_slots(variables)
        by: dict[tuple[int, tuple[int, ...], np.dtype], list[int]] = {}
        for k, v in enumerate(variables):
            d = summed_in[0] if len(summed_in) == 1 else summed_in[k]
            if d is not None:
                by.setdefault((id(v.placement.arena), self._owner._info(v)[0][1:], d), []).append(k)
        groups = [
            _Group([variables[k] for k in members], members, math.prod(row), self._owner, d)
            for (_, row, d), members in by.items()
        ]
        if len(self._groups) >= GROUP_CACHE:
            self._groups.pop(next(iter(self._groups)))
        self._groups[key] = (tuple(variables), groups)
        return groups

    @staticmethod
    def _summed_in(slices: Sequence[Sequence[Any]]) -> tuple[np.dtype | None, ...]:
        """The dtype each variable's values are summed in: one for all when every slice's
        values have one dtype (the usual step: one check over all), else per variable, the
        dtype of its replicas' values, or None where they differ (the per-variable path
        concatenates them into a promoted dtype)."""
        dtypes = set(map(_dtype_of, map(_values_of, itertools.chain.from_iterable(slices))))
        if len(dtypes) == 1:
            return (next(iter(dtypes)),)
        per_variable: list[np.dtype | None] = []
        for parts in zip(*slices, strict=True):
            own = set(map(_dtype_of, map(_values_of, parts)))
            per_variable.append(next(iter(own)) if len(own) == 1 else None)
        return tuple(per_variable)

    def prepare(
        self, variables: list[Any], positions: Sequence[int], slices: Sequence[Sequence[Any]]
    ) -> SparseBatch:
        """Check and deduplicate the sparse gradients of ``variables`` (all :meth:`capable`):
        ``slices[r]`` holds replica ``r``'s :class:`IndexedSlices`, one per variable, replicas
        in the order the per-variable sum concatenates them. ``positions``: the variables'
        positions in the step's list.

        A group with a slice that fails a check (another dense shape, rows of another shape,
        an index out of range) is left out whole: the per-variable path raises its error, or
        takes it as it took it before; so are the variables whose values are not summed here
        (a dtype outside :data:`SUMMED_IN` that is not the variable's, replicas' values of
        several dtypes). Nothing is written here.
        """
        batch = SparseBatch()
        if not variables:
            return batch
        replicas = len(slices)
        for group in self._groups_of(variables, self._summed_in(slices)):
            summed_in = group.summed_in
            if summed_in != group.dtype and summed_in not in SUMMED_IN:
                continue
            gs = list(itertools.chain.from_iterable(map(group.picked, slices)))
            if list(map(_dense_shape_of, gs)) != group.shapes * replicas and not all(
                (s.dense_shape is None or s.dense_shape == shape)
                and s.values.shape[1:] == shape[1:]
                for s, shape in zip(gs, group.shapes * replicas, strict=True)
            ):
                continue
            vals = list(map(_values_of, gs))  # (of the dtype summed_in: see _summed_in)
            idx = list(map(_indices_of, gs))
            counts = np.fromiter(map(len, idx), np.intp, len(idx))
            group.offsets(counts, replicas)
            total = group.var_of.shape[0]
            sc = group.scratch
            index = np.concatenate(idx, out=sc.get("index", (total,), np.dtype(np.int64)))
            try:
                values = np.concatenate(
                    vals, out=sc.get("values", (total, *group.row_shape), summed_in)
                ).reshape(total, group.width)
            except ValueError:  # rows of another shape than the checked dense shape says
                continue
            if total and (index.view(np.uint64) >= group.bound_of).any():
                continue  # an index out of range (a negative one too, read unsigned)
            keys = np.multiply(index, group.width, out=sc.get("keys", (total,), index.dtype))
            keys += group.start_of
            unique, summed = dedupe_rows(
                keys, group.var_of, group.totals, values, group.dense is not None, sc
            )
            if summed_in != group.dtype:  # the sums rounded once to the variables' dtype
                rounded = sc.get("rounded", summed.shape, group.dtype)
                np.copyto(rounded, summed, casting="unsafe")
                summed = rounded
            batch.rows.append((group, unique, summed))
            batch.variables.extend(group.variables)
            batch.positions.extend(positions[k] for k in group.members)
        return batch

    def apply(self, batch: SparseBatch, hp: Any) -> None:
        """Update the batch's variables from their deduplicated rows."""
        owner = self._owner
        for group, keys, summed in batch.rows:
            if group.dense is not None:
                # As to_dense makes it: each row (zero plus the sum) into a zeroed line.
                runs, layout, bufs = group.dense
                flat = bufs[group.dtype]
                (window,) = group.targets(owner)
                window[keys] = summed
                update_core.apply_lines(runs, layout, [bufs], owner._kernel, hp, owner._scratch)
                if keys.shape[0] * group.width * 8 > flat.shape[0]:
                    flat.fill(0)  # most of the line: one pass
                else:
                    window[keys] = 0
                continue
            windows = group.targets(owner)
            rows = [w[:, keys].reshape(w.shape[0], -1) for w in windows]
            owner._compute(rows[0], rows[1:], summed.reshape(1, -1), hp)
            for w, r in zip(windows, rows, strict=True):
                w[:, keys] = r.reshape(w.shape[0], -1, group.width)
