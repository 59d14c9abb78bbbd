"""The fused-gradient transport: every replica's dense gradients into the update core, unreduced.

Inside ``strategy.run`` each replica calls ``apply_gradients``; ``merge_call`` hands the
optimizer one :class:`ReplicaGradients` per replica. Reducing them variable by variable
(``batch_reduce``) would cost a Python call and an array per variable; instead, the gradients
that qualify are handed to the update core as :class:`FusedLines`, and the core adds the
replicas block by block, in device order, right before its kernel uses each block (see
:mod:`parallelvars.update_core`): the same bits as the per-variable sum, without a pass of its
own over memory.

A gradient qualifies when its variable is a float variable (float16/32/64, bfloat16,
float8) with an arena placement or a sharded one (its full array is a one-row run: see
:func:`update_core.flat_run`; the optimizer's ``_info`` says so) and every replica gave a plain array of the variable's dtype
and shape (one array object that several replicas gave is a term of the sum once per replica
that gave it, as the per-variable sum counts it; an object that is not an array, a torch
tensor or a Python number say, is read with ``np.asarray`` first, as that sum reads it). Its replicas' arrays reach the core in one of
three forms:

* as they are, gathered block by block inside the update (:func:`update_core.apply_gathered`),
  unless an array may share memory with what the step writes (:func:`_may_alias`);
* as the user's :class:`GradientBuffers` (written in place by the gradient code);
* packed into flat buffers laid out like the arena (:func:`update_core.pack_lines`), all-reduced
  in one call per dtype where the strategy spans several processes.

Arrays of a candidate's shape and of one other numeric dtype in every replica are summed in
that dtype and cast once per dtype (:meth:`FusedTransport._pack_cast`); sparse gradients of
arena variables go to :mod:`parallelvars.optimizers._sparse_step`. Over several processes
both cross them in one collective per dtype for all of them (an all-reduce of the cast
buffers, a gather of the sparse slices) before the same steps. Everything else goes back
to the optimizer as ``(gradient, variable)`` pairs merged across replicas, for the
per-variable reduce. :class:`FusedTransport` is the interface: the optimizer
asks it to :meth:`~FusedTransport.split` a step, to :meth:`~FusedTransport.apply` the fused
part, and to :meth:`~FusedTransport.apply_dense` reduced gradients of arena variables. A
training loop hands the same variables every step; the transport keeps, per variable list, what
it learned (which positions are candidates, their runs and layout, packing targets), so a
steady step is checked with a few C-level passes.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from parallelvars import update_core
from parallelvars.errors import ContextError, GradientError
from parallelvars.optimizers._checks import castable
from parallelvars.optimizers._sparse import IndexedSlices
from parallelvars.optimizers._sparse_step import SparseBatch, SparseSteps
from parallelvars.strategy import _context
from parallelvars.strategy._values import PerReplica
from parallelvars.variables import RankShardedVariable

__all__ = ["FusedLines", "FusedTransport", "GradientBuffers", "ReplicaGradients"]

# Plans and caches kept per variable list; a loop over more lists than this keeps the newest.
PLAN_CACHE = 8
# Gradients that are views of memory numpy does not own (a torch tensor's, a variable's
# interface) whose addresses the fused path checks against the step's buffers; more, and the
# step packs them first instead (a packed copy cannot change under the update).
_ADDRESS_CHECKS = 256

_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_shape_of = operator.attrgetter("shape")
_dtype_of = operator.attrgetter("dtype")
_base_of = operator.attrgetter("base")
_NDARRAY_ONLY = {np.ndarray}
_SLICES_ONLY = {IndexedSlices}
_ARRAYS_OR_SLICES = {np.ndarray, IndexedSlices}

Info = tuple[tuple[int, ...], np.dtype, bool]


def _cross_process(strategy: Any, parts: Sequence[Any]) -> bool:
    """Whether the step's other replicas are other processes (one local replica of several
    in sync: the strategy's ``_allreduce_flat`` then sums flat buffers across them)."""
    return len(parts) == 1 and strategy.num_replicas_in_sync > 1


def _read_as_array(x: Any) -> Any:
    """``x`` as the per-variable sum reads it (``np.asarray``); arrays and sparse gradients
    as they are, and so are lists, tuples and dicts (structures to ``merge_call``, which the
    per-variable path regroups element by element) and objects numpy cannot read (the
    per-variable path reports them)."""
    if type(x) is np.ndarray or isinstance(x, (IndexedSlices, list, tuple, dict)):
        return x
    try:
        return np.asarray(x)
    except Exception:  # raised again, as the per-variable path's error
        return x


def _items(seq: Sequence[Any], positions: Sequence[int]) -> list[Any]:
    """``[seq[i] for i in positions]``, with one C-level call."""
    if len(positions) == 1:
        return [seq[positions[0]]]
    return list(operator.itemgetter(*positions)(seq))


def _distinct(lists: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
    """``lists`` less repeats of one list object (replicas handing in the same list)."""
    out: list[Sequence[Any]] = []
    for g in lists:
        if not any(g is seen for seen in out):
            out.append(g)
    return out


def _at(plan: _FusedPlan, picked: list[Any], positions: tuple[int, ...]) -> list[Any]:
    """Each replica's gradients (``picked``: at the plan's candidates) at ``positions``."""
    if positions == plan.candidates:
        return picked
    if plan.where is None:
        plan.where = {pos: k for k, pos in enumerate(plan.candidates)}
    ks = list(map(plan.where.__getitem__, positions))
    if len(ks) == 1:
        return [[g[ks[0]]] for g in picked]
    pick = operator.itemgetter(*ks)
    return [list(pick(g)) for g in picked]


class Owner(Protocol):
    """What the transport asks of its optimizer."""

    _pv_name: str  # named in the transport's errors

    def _info(self, var: Any) -> Info:
        """``(shape, dtype, on the fast path)`` of a variable it trains (raises otherwise)."""
        ...

    def _create_slots(self, var_list: Sequence[Any]) -> None:
        """Make the slots ``var_list`` lacks."""
        ...

    def _plan(self, fast_vars: list[Any]) -> list[update_core.Run]:
        """The update core's runs of ``fast_vars`` (arena variables) and their slots."""
        ...


class _Owners:
    """What a gathered step over some runs writes, as :func:`_may_alias` checks gradients
    against it: the gather plan, the ids of every array holding that memory, and those of
    them that an array of one of the variables' shapes can be (of a variable's size: the
    array a sharded variable is made around, say; usually none, and then the gradients' ids
    are not looked at)."""

    __slots__ = ("ids", "plan", "whole")

    def __init__(self, runs: Sequence[update_core.Run]) -> None:
        self.plan = update_core.plan_gather(runs)
        self.ids = update_core.buffer_ids(runs)
        sizes = {size for run in runs for _, _, size in run.members}
        self.whole = update_core.buffer_ids(runs, sizes)


def _may_alias(owners: _Owners, grads: Sequence[Sequence[Any]]) -> bool:
    """Whether a gradient array may share memory with a variable or slot the step writes.

    The gathered step reads gradients while it writes: such a gradient would be read changed.
    An array owning its memory (``base`` None), or a view of another array that owns its
    memory and is not one of the step's buffers, cannot; the few others (views of a torch
    tensor, of a variable through ``np.asarray``) have their addresses checked, or, when
    there are many, the answer is yes and the step packs them first. ``grads`` have their
    variables' shapes (checked before), so only a buffer of a variable's size can be one.
    """
    owner_ids, whole = owners.ids, owners.whole
    unknown: list[Any] = []
    for gs in _distinct(grads):
        if whole and not whole.isdisjoint(map(id, gs)):
            return True  # the very array a variable is held in (a sharded variable's)
        if all(map(operator.is_, map(_base_of, gs), itertools.repeat(None))):
            continue  # every array owns its memory: the common case, one C-level pass
        bases = list(map(_base_of, gs))
        odd = {
            id(b)
            for b in dict(zip(map(id, bases), bases, strict=True)).values()
            if b is not None
            and (type(b) is not np.ndarray or b.base is not None or id(b) in owner_ids)
        }
        if odd:
            unknown.extend(g for g in gs if g.base is not None and id(g.base) in odd)
            if len(unknown) > _ADDRESS_CHECKS:
                return True
    return bool(unknown) and update_core.overlaps(owners.plan, unknown)


def _pairs_at(part: ReplicaGradients, positions: Sequence[int]) -> list[tuple[Any, Any]]:
    """One replica's ``(gradient, variable)`` pairs at ``positions`` (a pair made for each of
    those only: a step with a few odd gradients among thousands pairs up those few)."""
    grads, variables = part.grads, part.variables
    return [(grads[i], variables[i]) for i in positions]


def _merged(
    strategy: Any, parts: Sequence[ReplicaGradients], positions: Sequence[int]
) -> list[tuple[Any, Any]]:
    """The pairs at ``positions``, merged across the local replicas as ``merge_call`` would
    merge them. Sparse gradients (every replica an :class:`IndexedSlices`) are merged here
    directly, one ``PerReplica`` (or the one object all gave) each, without the generic walk;
    the rest by the strategy (which, over several processes, has its own rules)."""
    if len(parts) < 2 or len(parts) != strategy.num_replicas_in_sync:
        return strategy._merge_args([_pairs_at(p, positions) for p in parts])
    grads = [p.grads for p in parts]
    sparse = [i for i in positions if all(type(g[i]) is IndexedSlices for g in grads)]
    if not sparse:
        return strategy._merge_args([_pairs_at(p, positions) for p in parts])
    taken = set(sparse)
    rest = [i for i in positions if i not in taken]
    merged = strategy._merge_args([_pairs_at(p, rest) for p in parts]) if rest else []
    variables = parts[0].variables
    out: dict[int, tuple[Any, Any]] = dict(zip(rest, merged, strict=True))
    for i in sparse:
        gs = [g[i] for g in grads]
        first = gs[0]
        out[i] = (first if all(g is first for g in gs) else PerReplica(gs), variables[i])
    return [out[i] for i in positions]


_SEQUENCE_ITERATORS: tuple[type, ...] = (type(iter([])), type(iter(())))


def unzipped(pairs: Any) -> tuple[Sequence[Any], Sequence[Any]] | None:
    """The gradients and the variables that ``pairs``, a ``zip`` of two lists or tuples (what
    ``apply_gradients(zip(grads, variables))`` hands in), would hand out: those sequences,
    or slices of them, with no pair and no Python step per variable. The zip and its iterators
    are left exactly as iterating it would leave them (each iterator at the same position).
    None for any other iterable, for a zip of one iterator with itself (``zip(it, it)``),
    and where iterating would raise (``zip(..., strict=True)`` of unequal lengths): the
    caller iterates it then.

    The zip and its iterators are read through their pickling state (``__reduce__``: the
    iterators of a zip, and the sequence and position of each), which changes nothing."""
    if type(pairs) is not zip:
        return None
    state: Any = pairs.__reduce__()
    iterators: tuple[Any, ...] = state[1]
    if len(iterators) != 2 or not all(type(it) in _SEQUENCE_ITERATORS for it in iterators):
        return None
    if iterators[0] is iterators[1]:
        return None  # zip(it, it), the grouper idiom: each step reads two from one iterator
    spans: list[tuple[Sequence[Any], int]] = []
    for it in iterators:
        # (iter, (sequence,), position); (iter, ((),)) once exhausted
        it_state: Any = it.__reduce__()
        seq = it_state[1][0]
        if type(seq) not in (list, tuple):
            return None  # a subclass may index otherwise than its iterator reads it
        spans.append((seq, it_state[2] if len(it_state) > 2 else len(seq)))
    (grads, g0), (variables, v0) = spans
    g_left, v_left = len(grads) - g0, len(variables) - v0
    n = min(g_left, v_left)
    strict = len(state) > 2 and bool(state[2])
    if strict and g_left != v_left:
        return None  # strict and unequal: zip raises its own error
    # Leave each iterator where iterating the zip would: it reads the gradient, then the
    # variable, and stops at the first iterator that runs out (that one is then exhausted,
    # and so is the second when strict, which checks it); a gradient read before the
    # variables ran out is consumed.
    g_it, v_it = iterators
    if g_left <= v_left:
        g_it.__setstate__(len(grads))
        next(g_it, None)
        v_it.__setstate__(v0 + n)
        if strict:
            next(v_it, None)
    else:
        g_it.__setstate__(g0 + n + 1)
        v_it.__setstate__(len(variables))
        next(v_it, None)
    # A whole sequence is handed on as it is (read, never changed, as apply() hands its
    # lists): replicas that zip one list of variables then share it (checked once a step).
    return (
        grads if g0 == 0 and n == len(grads) else grads[g0 : g0 + n],
        variables if v0 == 0 and n == len(variables) else variables[v0 : v0 + n],
    )


class ReplicaGradients:
    """One replica's gradients and variables, handed to ``merge_call`` as one value.

    ``merge_call`` groups the replicas' arguments element by element; wrapped, the pairs of a
    step cross the rendezvous as one object per replica and the optimizer reads them itself,
    as parallel sequences ``grads`` and ``variables`` (read, never changed) or as ``pairs``.
    Either form is made from the other on first use.
    """

    __slots__ = ("_grads", "_pairs", "_variables")

    def __init__(
        self,
        grads: Sequence[Any] | None = None,
        variables: Sequence[Any] | None = None,
        pairs: list[tuple[Any, Any]] | None = None,
    ) -> None:
        self._grads = grads
        self._variables = variables
        self._pairs = pairs

    @property
    def grads(self) -> Sequence[Any]:
        if self._grads is None:
            self._grads = list(map(_first, self.pairs))
        return self._grads

    @property
    def variables(self) -> Sequence[Any]:
        if self._variables is None:
            self._variables = list(map(_second, self.pairs))
        return self._variables

    @property
    def pairs(self) -> list[tuple[Any, Any]]:
        if self._pairs is None:
            assert self._grads is not None and self._variables is not None
            self._pairs = list(zip(self._grads, self._variables, strict=True))
        return self._pairs

    def without_none(self) -> ReplicaGradients:
        """These gradients less the ``None`` ones (itself when there is none)."""
        if type(None) not in set(map(type, self.grads)):
            return self
        return ReplicaGradients(pairs=[(g, v) for g, v in self.pairs if g is not None])


def _same_variables(parts: Sequence[ReplicaGradients], known: tuple[Any, ...]) -> bool:
    """Whether every replica's variables are ``known``, in order (one identity pass per list;
    replicas that hand in the same list object, as a shared ``variables`` list does, share
    it)."""
    checked: list[Any] = []
    for p in parts:
        vs = p.variables
        if any(vs is c for c in checked):
            continue
        if len(vs) != len(known) or not all(map(operator.is_, vs, known)):
            return False
        checked.append(vs)
    return True


class _FusedPlan:
    """The fused path of one variable list: which positions may take it, and their checks."""

    __slots__ = ("candidates", "dtypes", "mixed", "pick", "shapes", "sparse", "where")

    def __init__(
        self,
        candidates: tuple[int, ...],
        dtypes: list[np.dtype],
        shapes: list[tuple[int, ...]],
        sparse: tuple[int, ...] = (),
    ) -> None:
        self.candidates = candidates
        # The positions whose sparse gradients may take the vectorised sparse route.
        self.sparse = sparse
        # The last step whose candidates were all arrays of their variables' shapes, some of
        # another dtype: those dtypes, and the positions fused as they are and cast.
        self.mixed: tuple[list[np.dtype], tuple[int, ...], tuple[int, ...]] | None = None
        self.dtypes = dtypes
        self.shapes = shapes
        # Each candidate position's index among the candidates, made on first use.
        self.where: dict[int, int] | None = None
        self.pick: Callable[[Sequence[Any]], Any] = (
            operator.itemgetter(*candidates)
            if len(candidates) > 1
            else (lambda seq: _items(seq, candidates))
        )


class FusedLines:
    """Fused variables of a step, their runs, and the local gradient buffers to sum."""

    __slots__ = ("arrays", "gather", "layout", "parts", "runs", "variables")

    def __init__(
        self,
        variables: list[Any],
        runs: list[update_core.Run],
        layout: update_core.GradLayout,
        parts: list[dict[np.dtype, np.ndarray]],
        gather: update_core.GatherPlan | None = None,
        arrays: list[Any] | None = None,
    ) -> None:
        self.variables = variables
        self.runs = runs
        self.layout = layout
        self.parts = parts
        # Instead of parts: each replica's gradient arrays, gathered block by block.
        self.gather = gather
        self.arrays = arrays


class _LinesCache:
    """What the fused path keeps per variable list: runs, their layout, packing targets."""

    __slots__ = ("_cast", "_gather", "dtypes", "key", "layout", "runs", "staging")

    def __init__(self, key: tuple[int, ...], runs: list[update_core.Run], replicas: int) -> None:
        self.key = key
        self.runs = runs
        self.layout = update_core.layout_lines(runs)
        # Packing targets, made on first use (gathered steps and gradient buffers need none).
        self.staging: list[dict[np.dtype, np.ndarray] | None] = [None] * replicas
        self._gather: _Owners | None = None
        # Per gradient dtype: the cast route's buffers (see cast_buffers).
        self._cast: dict[np.dtype, Any] = {}
        # The variables' dtypes, by position (the gradients a gather reads must have them).
        self.dtypes: list[np.dtype] = []

    def gather(self) -> _Owners:
        """The gather plan and the buffers the step writes, made on first use."""
        if self._gather is None:
            self._gather = _Owners(self.runs)
        return self._gather

    def cast_buffers(
        self, dtype: np.dtype, replicas: int
    ) -> tuple[list[dict[np.dtype, np.ndarray]], dict[np.dtype, np.ndarray], dict[Any, Any]]:
        """Buffers of the layout for gradients of ``dtype`` (another than the variables'):
        one per replica and their sum, in ``dtype``, and the sum cast to the variables'
        dtypes; made on first use, zero in the padding."""
        found = self._cast.get(dtype)
        if found is None or len(found[0]) != replicas:
            sizes = self.layout.sizes
            found = (
                [{vdt: np.zeros(n, dtype) for vdt, n in sizes.items()} for _ in range(replicas)],
                {vdt: np.zeros(n, dtype) for vdt, n in sizes.items()},
                self.layout.buffers(),
            )
            self._cast[dtype] = found
        return found

    def packed(self, replica: int) -> dict[np.dtype, np.ndarray]:
        target = self.staging[replica]
        if target is None:
            target = self.staging[replica] = self.layout.buffers()
        return target


class BufferPairs(list[tuple[Any, Any]]):
    """The list :meth:`GradientBuffers.grads_and_vars` returns: a plain list of pairs that also
    says which buffers' views it holds, as long as it holds them (see :meth:`intact`)."""

    __slots__ = ("owner", "replica")

    def __init__(self, pairs: list[tuple[Any, Any]], owner: GradientBuffers, replica: int) -> None:
        super().__init__(pairs)
        self.owner = owner
        self.replica = replica

    def intact(self) -> bool:
        """Whether the list still holds exactly the pairs it was made with (nobody changed it)."""
        made = self.owner._pairs[self.replica]
        return len(self) == len(made) and all(map(operator.is_, self, made))

    def replica_gradients(self) -> ReplicaGradients:
        """The step's gradients: the buffers' views and variables, read without listing pairs."""
        bufs, r = self.owner, self.replica
        return ReplicaGradients(bufs._views[r], bufs.variables, self)


class GradientBuffers:
    """Flat gradient buffers laid out like the variables, one per local replica.

    Made by :meth:`Optimizer.gradient_buffers`. Each replica's buffer holds the gradients of
    every variable of the list back to back in the variables' own memory layout (one flat
    array per dtype), and :meth:`views` gives one writable array per variable, of the
    variable's shape, into that buffer. Code that writes its gradients into the views
    (``torch.from_numpy(view)``, ``np.matmul(..., out=view)``, ``view[...] = g``) and passes
    the views themselves to :meth:`Optimizer.apply_gradients` skips the packing copy: the
    replicas' buffers are summed and consumed by the update as they are.

    The buffers keep their contents between steps (nothing zeroes them); call :meth:`zero`
    where gradients are accumulated.
    """

    def __init__(
        self, variables: Sequence[Any], layout: update_core.GradLayout, replicas: int
    ) -> None:
        self.variables: tuple[Any, ...] = tuple(variables)
        self._layout = layout
        self._buffers = [layout.buffers() for _ in range(replicas)]
        self._views: list[list[np.ndarray]] = []
        for bufs in self._buffers:
            views = []
            for pos, var in enumerate(self.variables):
                dt, start, size = layout.views[pos]
                views.append(bufs[dt][start : start + size].reshape(tuple(var.shape)))
            self._views.append(views)
        # What grads_and_vars() hands out, made once: the same pairs every step.
        self._pairs = [list(zip(views, self.variables, strict=True)) for views in self._views]

    def __len__(self) -> int:
        return len(self._buffers)

    def _index(self, replica: int | None) -> int:
        if replica is None:
            ctx = _context.current_mode().replica_context
            if ctx is None:
                raise ContextError(
                    "GradientBuffers.views() without a replica number is called in a replica "
                    "function (inside strategy.run); pass replica= elsewhere"
                )
            count = ctx.strategy._local_replica_count()
            if count != len(self._buffers):
                raise ContextError(
                    f"these gradient buffers were made for {len(self._buffers)} replica(s), but this "
                    f"replica function runs under {ctx.strategy!r} with {count}: make them in its scope"
                )
            replica = ctx.replica_id_in_sync_group if count > 1 else 0
        if not 0 <= replica < len(self._buffers):
            raise ContextError(
                f"no gradient buffer for replica {replica} (expected 0 <= replica < {len(self._buffers)})"
            )
        return replica

    def views(self, replica: int | None = None) -> list[np.ndarray]:
        """One writable gradient array per variable, in order: the current replica's by default.

        A new list each call (of the same arrays), so that changing the list changes nothing
        that ``apply_gradients`` relies on.
        """
        return list(self._views[self._index(replica)])

    def grads_and_vars(self, replica: int | None = None) -> list[tuple[np.ndarray, Any]]:
        """``list(zip(views(replica), variables))``, ready for :meth:`Optimizer.apply_gradients`
        (which, handed this list unchanged, knows it holds the views without reading it)."""
        r = self._index(replica)
        return BufferPairs(self._pairs[r], self, r)

    def buffers(self, replica: int | None = None) -> dict[np.dtype, np.ndarray]:
        """The flat buffers (one per dtype) behind :meth:`views`."""
        return self._buffers[self._index(replica)]

    def zero(self) -> None:
        """Set every replica's gradients to zero."""
        for bufs in self._buffers:
            for b in bufs.values():
                b.fill(0)

    def __repr__(self) -> str:
        return (
            f"<GradientBuffers of {len(self.variables)} variables x {len(self._buffers)} replicas>"
        )


class FusedTransport:
    """The fused path of one optimizer: which gradients take it, and in what form.

    Args:
        owner: the optimizer (see :class:`Owner`).
    """

    def __init__(self, owner: Owner) -> None:
        self._owner = owner
        # Per variable list (all, then the fused subset), keyed by the variables' ids and
        # checked by identity: the candidate positions, and the runs with their layout.
        self.plans: dict[tuple[int, ...], tuple[tuple[Any, ...], _FusedPlan]] = {}
        self.lines: dict[tuple[int, ...], tuple[tuple[Any, ...], _LinesCache]] = {}
        self.gradient_buffers: dict[tuple[int, ...], GradientBuffers] = {}
        # The gather plans of apply_dense, per runs object.
        self._dense: dict[int, _LinesCache] = {}
        # Sparse gradients of arena variables, every replica's at once.
        self.sparse = SparseSteps(owner)  # type: ignore[arg-type]
        # The last variable list whose every gradient took the fused path, with its plans.
        self._steady: tuple[tuple[Any, ...], tuple[int, ...], _FusedPlan, _LinesCache] | None = None

    # ------------------------------------------------------------------ gradient buffers
    def buffers_for(self, var_list: list[Any], replicas: int) -> GradientBuffers:
        """The gradient buffers of ``var_list`` (made once per list; see
        :meth:`Optimizer.gradient_buffers`)."""
        key = tuple(map(id, var_list))
        found = self.gradient_buffers.get(key)
        if found is not None and all(map(operator.is_, found.variables, var_list)):
            return found
        if len(set(key)) != len(key):
            raise GradientError("a variable appears twice in the gradient buffers' list")
        spread = next((v for v in var_list if len(getattr(v, "components", ())) > 1), None)
        if replicas == 1 and spread is not None:
            # One replica's buffers for a variable on several devices fail at the first step,
            # far from here: say so now.
            raise ContextError(
                f"optimizer {self._owner._pv_name!r}: gradient_buffers() was called outside any "
                f"strategy's scope, for {spread.name!r} on {len(spread.components)} devices; "
                "call it inside strategy.scope(), where the buffers get one part per replica"
            )
        for v in var_list:
            if not self._owner._info(v)[2]:
                raise GradientError(
                    "gradient buffers hold float variables the update core runs over",
                    variable=v.name,
                    expected="a float variable with an arena placement or a contiguous full value",
                    found=f"{type(v).__name__} of {v.dtype}",
                )
        self._owner._create_slots(var_list)
        runs = self._owner._plan(var_list)
        layout = update_core.layout_lines(runs)
        bufs = GradientBuffers(var_list, layout, replicas)
        self.gradient_buffers[key] = bufs
        return bufs

    # ------------------------------------------------------------------ splitting a step
    def steady(self, strategy: Any, parts: Sequence[ReplicaGradients]) -> FusedLines | None:
        """The whole step on the fused path, when it hands the variables of the last step
        that was (a training loop): one identity pass per replica over the variables finds the
        plan, and the gradients are checked with a few C-level passes. Else None."""
        order = strategy._fused_sum_order()
        steady = self._steady
        if (
            order is None
            or len(parts) != len(order)
            or not getattr(strategy, "fusion", True)
            or steady is None
            or not _same_variables(parts, steady[0])
        ):
            return None
        known, known_key, known_plan, known_lines = steady
        user = self.gradient_buffers.get(known_key) if self.gradient_buffers else None
        if (
            user is not None
            and len(user) == len(parts) == strategy.num_replicas_in_sync  # one process
            and all(p.grads is user._views[r] for r, p in enumerate(parts))
        ):
            # Every replica handed in its gradient buffers' own views (grads_and_vars()
            # unchanged): of the variables' dtypes and shapes by construction, summed as
            # the buffers they are.
            bufs = [user._buffers[r] for r in order]
            return FusedLines(list(known), known_lines.runs, known_lines.layout, bufs)
        if len(known_plan.candidates) == len(known) and all(
            len(p.grads) == len(known) for p in parts
        ):
            # (A None gradient is not an array: it fails the check and takes the general path.)
            listed = [p.grads for p in parts]
            fused, listed, _ = self._positions(known_plan, parts, len(known), listed)
            if len(fused) == len(known):
                return self._pack(known, fused, listed, parts, order, strategy, known_lines)
        return None

    def split(
        self, strategy: Any, parts: Sequence[ReplicaGradients]
    ) -> tuple[list[tuple[Any, Any]], list[FusedLines], SparseBatch | None]:
        """The step's gradients (no ``None`` among them) as the pairs that take the per-variable
        path, merged across replicas, the fused dense rest (gradients of the variables' dtypes,
        then those cast, one :class:`FusedLines` per gradient dtype) and the sparse gradients
        of arena variables, checked and deduplicated (None when there is none)."""
        order = strategy._fused_sum_order()
        fusable = (
            order is not None and len(parts) == len(order) and getattr(strategy, "fusion", True)
        )
        var_list = list(parts[0].variables)
        key = tuple(map(id, var_list))
        if not fusable or any(tuple(map(id, p.variables)) != key for p in parts[1:]):
            return strategy._merge_args([p.pairs for p in parts]), [], None
        assert order is not None
        plan = self._plan_of(key, var_list)
        fused, picked, cast = self._positions(plan, parts, len(var_list))
        if (
            cast
            and len(parts) != strategy.num_replicas_in_sync
            and not _cross_process(strategy, parts)
        ):
            cast = ()  # neither every replica here nor one process's: the per-variable reduce
        sparse = self._sparse_of(strategy, plan, parts, var_list, fused)
        if not fused and not cast and sparse is None:
            return _merged(strategy, parts, range(len(var_list))), [], None
        lines = []
        if fused:
            lines.append(
                self._pack(var_list, fused, _at(plan, picked, fused), parts, order, strategy)
            )
            if len(fused) == len(var_list):
                # The next step with these variables starts from here.
                self._steady = (tuple(var_list), key, plan, self.lines[key][1])
                return [], lines, None
        if cast:
            lines.extend(
                self._pack_cast(var_list, cast, _at(plan, picked, cast), order, strategy, parts)
            )
        keep = {*fused, *cast, *(sparse.positions if sparse is not None else ())}
        others = sorted(set(range(len(var_list))).difference(keep))
        return (_merged(strategy, parts, others) if others else []), lines, sparse

    def _sparse_of(
        self,
        strategy: Any,
        plan: _FusedPlan,
        parts: Sequence[ReplicaGradients],
        var_list: list[Any],
        fused: tuple[int, ...],
    ) -> SparseBatch | None:
        """The positions where every local replica gave an :class:`IndexedSlices` for an
        arena variable, checked and deduplicated together (see :mod:`._sparse_step`); None when
        there is none. Over several processes every process's slices are gathered first, in
        rank order, with one collective per values dtype for all of them (the strategy's
        ``_allgather_sparse``, what its ``batch_reduce`` gathers them with one variable list
        at a time): the slices the per-variable path would deduplicate, so the same bits."""
        cand = plan.sparse
        cross = _cross_process(strategy, parts) and hasattr(strategy, "_allgather_sparse")
        if not cand or (len(parts) != strategy.num_replicas_in_sync and not cross):
            return None
        if fused:
            done = set(fused)
            cand = tuple(i for i in cand if i not in done)
        if len(cand) == len(var_list):
            slices = [p.grads for p in parts]
        elif not cand:
            return None
        else:
            pick = operator.itemgetter(*cand)
            slices = [pick(p.grads) if len(cand) > 1 else (p.grads[cand[0]],) for p in parts]
        if not all(set(map(type, s)) == _SLICES_ONLY for s in slices):
            keep = [k for k in range(len(cand)) if all(type(s[k]) is IndexedSlices for s in slices)]
            if not keep:
                return None
            cand = tuple(cand[k] for k in keep)
            slices = [[s[k] for k in keep] for s in slices]
        variables = list(var_list) if len(cand) == len(var_list) else [var_list[i] for i in cand]
        if cross:
            variables, cand, slices = self._gathered(strategy, plan, variables, cand, slices[0])
            if not cand:
                return None
        batch = self.sparse.prepare(variables, cand, slices)
        return batch if batch else None

    def _gathered(
        self,
        strategy: Any,
        plan: _FusedPlan,
        variables: list[Any],
        cand: tuple[int, ...],
        local: Sequence[IndexedSlices],
    ) -> tuple[list[Any], tuple[int, ...], list[Sequence[Any]]]:
        """This process's sparse gradients at ``cand`` (of ``variables``) and every other
        process's, gathered in rank order as one list of slices per variable (those whose
        values have the variable's dtype: the others keep the per-variable path)."""
        dtypes = dict(zip(plan.candidates, plan.dtypes, strict=True))
        keep = [k for k, s in enumerate(local) if s.values.dtype == dtypes[cand[k]]]
        if len(keep) != len(cand):
            variables = [variables[k] for k in keep]
            cand = tuple(cand[k] for k in keep)
            local = [local[k] for k in keep]
        if not cand:
            return variables, cand, []
        got = strategy._allgather_sparse([(s.indices, s.values) for s in local])
        return (
            variables,
            cand,
            [
                [
                    IndexedSlices(values, indices, s.dense_shape)
                    for s, (indices, values) in zip(local, got, strict=True)
                ]
            ],
        )

    def _plan_of(self, key: tuple[int, ...], var_list: list[Any]) -> _FusedPlan:
        cached = self.plans.get(key)
        if cached is not None and all(map(operator.is_, cached[0], var_list)):
            return cached[1]
        info_of = self._owner._info
        candidates: list[int] = []
        # A repeated variable is the per-variable path's error to raise.
        for i, v in enumerate(var_list if len(set(key)) == len(key) else ()):
            if isinstance(v, RankShardedVariable):
                # Sharded across processes: each rank holds another shard (some may be empty),
                # so whether a gradient fits would differ from rank to rank and the ranks would
                # call different collectives. The per-variable path reduces them alike.
                continue
            try:
                info = info_of(v)
            except GradientError:  # raised again, in its place, by the per-variable path
                continue
            if info[2]:
                candidates.append(i)
        plan = _FusedPlan(
            tuple(candidates),
            [info_of(var_list[i])[1] for i in candidates],
            [info_of(var_list[i])[0] for i in candidates],
            tuple(i for i in candidates if self.sparse.capable(var_list[i])),
        )
        if len(self.plans) >= PLAN_CACHE:
            self.plans.pop(next(iter(self.plans)))
        self.plans[key] = (tuple(var_list), plan)
        return plan

    @staticmethod
    def _positions(
        plan: _FusedPlan,
        parts: Sequence[ReplicaGradients],
        count: int,
        listed: list[Any] | None = None,
    ) -> tuple[tuple[int, ...], list[Any], tuple[int, ...]]:
        """The positions whose gradients take the fused path this step, each replica's
        gradients at the candidate positions, and the positions whose gradients are summed in
        their own dtype and cast once (see :meth:`_pack_cast`).

        A gradient qualifies when every replica gave a plain array of the variable's dtype and
        shape. One array object that several replicas (or all) gave is read once per replica
        that gave it: a term of the sum each time, the per-variable path's meaning (it sums a
        value every replica gave once per replica, in device order). Arrays of the variable's
        shape and of one other numeric dtype in every replica (one that casts to the
        variable's dtype as the update casts) are cast positions. The common cases are checked
        with C-level passes.
        ``listed``: each replica's gradients, already listed (every position a candidate).
        """
        cand = plan.candidates
        if not cand:
            return (), [], ()
        if listed is not None:
            picked = listed  # every position a candidate, each replica's gradients listed
        elif len(cand) == count:
            picked = [p.grads for p in parts]
        else:
            picked = [plan.pick(p.grads) for p in parts]
        # A list object several replicas hand in (the same gradients for all) is checked once.
        distinct = _distinct(picked)
        types = [set(map(type, g)) for g in distinct]
        if not all(t <= _ARRAYS_OR_SLICES for t in types):
            # Other objects (numpy scalars, what np.sum returns; Python numbers and lists;
            # torch or jax tensors): read with np.asarray, as the per-variable sum (add_n)
            # reads each, then fused like any array (of another dtype: the cast route).
            converted = {
                id(g): g if t <= _ARRAYS_OR_SLICES else list(map(_read_as_array, g))
                for g, t in zip(distinct, types, strict=True)
            }
            picked = [converted[id(g)] for g in picked]
            distinct = _distinct(picked)
            types = [set(map(type, g)) for g in distinct]
        if all(t == _NDARRAY_ONLY for t in types) and all(
            list(map(_shape_of, g)) == plan.shapes for g in distinct
        ):
            dtypes = [list(map(_dtype_of, g)) for g in distinct]
            if all(d == plan.dtypes for d in dtypes):
                return cand, picked, ()
            if plan.mixed is not None and all(d == plan.mixed[0] for d in dtypes):
                return plan.mixed[1], picked, plan.mixed[2]  # a loop of cast gradients
        if any(np.ndarray not in t for t in types):
            return (), picked, ()  # a replica gave no array at all (sparse gradients, say)
        # Position by position, with C-level passes per list of gradients (a step with one odd
        # gradient among thousands costs that gradient, not a Python step per position):
        # whether every replica gave an array of the variable's shape, all of one dtype.
        yes = itertools.repeat(True)
        fits: list[bool] | None = None
        first_dtypes: list[Any] = []
        for g in distinct:
            arrays = map(operator.is_, map(type, g), itertools.repeat(np.ndarray))
            shapes = map(getattr, g, itertools.repeat("shape"), itertools.repeat(None))
            shaped = map(operator.is_, map(operator.eq, shapes, plan.shapes), yes)
            mine = list(map(operator.and_, arrays, shaped))
            dts = list(map(getattr, g, itertools.repeat("dtype"), itertools.repeat(None)))
            if fits is None:
                fits, first_dtypes = mine, dts
                continue
            same = map(operator.is_, map(operator.eq, dts, first_dtypes), yes)
            fits = list(map(operator.and_, map(operator.and_, fits, mine), same))
        assert fits is not None
        own = list(map(operator.is_, map(operator.eq, first_dtypes, plan.dtypes), yes))
        out = list(itertools.compress(cand, map(operator.and_, fits, own)))
        other = map(operator.and_, fits, map(operator.not_, own))
        cast = [
            cand[k]
            for k in itertools.compress(range(len(cand)), other)
            if castable(first_dtypes[k], plan.dtypes[k])
        ]
        if cast and len(out) + len(cast) == len(cand):
            plan.mixed = (list(map(_dtype_of, picked[0])), tuple(out), tuple(cast))
        return tuple(out), picked, tuple(cast)

    def _lines_of(self, fvars: list[Any], replicas: int) -> _LinesCache:
        """The cache of the fused variables ``fvars``: their runs and layout, made once."""
        fkey = tuple(map(id, fvars))
        cached = self.lines.get(fkey)
        if cached is None or not all(map(operator.is_, cached[0], fvars)):
            self._owner._create_slots(fvars)
            if len(self.lines) >= PLAN_CACHE:
                self.lines.pop(next(iter(self.lines)))
            cached = (tuple(fvars), _LinesCache(fkey, self._owner._plan(fvars), replicas))
            self.lines[fkey] = cached
        return cached[1]

    def _pack_cast(
        self,
        var_list: Sequence[Any],
        cast: tuple[int, ...],
        chosen: list[Any],
        order: tuple[int, ...],
        strategy: Any,
        parts: Sequence[ReplicaGradients],
    ) -> list[FusedLines]:
        """The gradients at ``cast`` (arrays of another dtype than their variables'), with the
        per-variable meaning (the replicas summed in the gradients' dtype in device order, as
        ``add_n`` sums them, then cast to the variable's dtype as the update casts), done once
        per dtype over all of them: each replica's gradients packed into flat buffers of their
        dtype laid out like the arena, added buffer by buffer, the sum cast in one call. Over
        several processes the one local buffer of each dtype is all-reduced in rank order
        (``_allreduce_flat``: elementwise the sum ``batch_reduce`` makes of the same gradients)
        before the cast. ``chosen``: each local replica's gradients at ``cast``."""
        by_dtype: dict[np.dtype, list[int]] = {}
        for k, g in enumerate(chosen[0]):
            by_dtype.setdefault(g.dtype, []).append(k)
        cross = _cross_process(strategy, parts)
        out = []
        # In a fixed dtype order: over several processes every process makes the same calls.
        for dt in sorted(by_dtype, key=lambda d: d.str):
            ks = by_dtype[dt]
            cvars = [var_list[cast[k]] for k in ks]
            lines = self._lines_of(cvars, len(chosen))
            staging, total, final = lines.cast_buffers(dt, len(order))
            for r, target in zip(order, staging, strict=True):
                g = chosen[r]
                update_core.pack_lines(lines.runs, lines.layout, [g[k] for k in ks], target)
            first, *rest = staging
            for vdt, t in total.items():
                if cross:
                    summed = strategy._allreduce_flat(first[vdt])
                    np.copyto(final[vdt], summed, casting="unsafe")
                    continue
                if not rest:  # one replica: its gradients are the sum
                    np.copyto(final[vdt], first[vdt], casting="unsafe")
                    continue
                np.add(first[vdt], rest[0][vdt], out=t, casting="unsafe")
                for more in rest[1:]:
                    np.add(t, more[vdt], out=t, casting="unsafe")
                np.copyto(final[vdt], t, casting="unsafe")  # (castable: a rounding)
            out.append(FusedLines(cvars, lines.runs, lines.layout, [final]))
        return out

    def _pack(
        self,
        var_list: Sequence[Any],
        fused: tuple[int, ...],
        picked: list[Any] | None,
        parts: Sequence[ReplicaGradients],
        order: tuple[int, ...],
        strategy: Any,
        lines: _LinesCache | None = None,
    ) -> FusedLines:
        """Each local replica's fused gradients, in summing order: as they are (gathered block
        by block inside the update), as the user's gradient buffers, or packed into flat
        buffers (reduced across processes where the strategy spans several). ``picked``: each
        replica's gradients at the fused positions, when already listed; ``lines``: the cache
        of the fused variables, when known (a steady step)."""
        fvars = list(var_list) if len(fused) == len(var_list) else _items(var_list, fused)
        if lines is None:
            lines = self._lines_of(fvars, len(parts))
        runs, layout = lines.runs, lines.layout
        pick = (
            (lambda seq: seq) if len(fused) == len(var_list) else (lambda seq: _items(seq, fused))
        )
        grads = [picked[r] if picked is not None else pick(parts[r].grads) for r in order]
        cross_process = _cross_process(strategy, parts)
        if not cross_process:
            user = self.gradient_buffers.get(lines.key) if self.gradient_buffers else None
            if (
                user is not None
                and all(map(operator.is_, user.variables, fvars))
                and len(user) == len(parts)
                and all(
                    all(map(operator.is_, g, user._views[r]))
                    for g, r in zip(grads, order, strict=True)
                )
            ):
                # Written in place: the buffers are the packed gradients already.
                bufs = [user._buffers[r] for r in order]
                return FusedLines(fvars, runs, layout, bufs)
            owners = lines.gather()
            if not _may_alias(owners, grads):
                return FusedLines(fvars, runs, layout, [], owners.plan, grads)
        bufs = []
        for r, g in zip(order, grads, strict=True):
            target = lines.packed(r)
            update_core.pack_lines(runs, layout, g, target)
            bufs.append(target)
        if cross_process:
            # The other replicas are other processes: one all-reduce per dtype buffer, in a
            # fixed dtype order so that every process makes the same calls.
            bufs = [{dt: strategy._allreduce_flat(bufs[0][dt]) for dt in layout.sizes}]
        return FusedLines(fvars, runs, layout, bufs)

    # ------------------------------------------------------------------ applying
    @staticmethod
    def apply(
        fused: FusedLines,
        kernel: update_core.Kernel,
        hp: Any,
        scratch: Callable[[np.dtype], update_core.UpdateScratch],
    ) -> None:
        """Update the fused variables: the replicas' gradients are summed inside the core."""
        if fused.gather is not None:
            assert fused.arrays is not None
            update_core.apply_gathered(fused.gather, fused.arrays, kernel, hp, scratch)
            return
        update_core.apply_lines(fused.runs, fused.layout, fused.parts, kernel, hp, scratch)

    def apply_dense(
        self,
        fast_vars: list[Any],
        fast_grads: list[Any],
        kernel: update_core.Kernel,
        hp: Any,
        scratch: Callable[[np.dtype], update_core.UpdateScratch],
    ) -> None:
        """Update arena variables from one reduced dense gradient each: gathered into cache
        block by block where the gradients have the variables' dtypes and cannot alias what
        the step writes, else staged run by run."""
        runs = self._owner._plan(fast_vars)
        lines = self._dense_lines(fast_vars, runs)
        if list(map(_dtype_of, fast_grads)) == lines.dtypes:
            owners = lines.gather()
            if not _may_alias(owners, [fast_grads]):
                # No staging line: each block's gradients are gathered into cache.
                update_core.apply_gathered(owners.plan, [fast_grads], kernel, hp, scratch)
                return
        update_core.apply_runs(runs, fast_grads, kernel, hp, scratch)

    def _dense_lines(self, fast_vars: list[Any], runs: list[update_core.Run]) -> _LinesCache:
        """The gather plan of ``runs`` (those of ``fast_vars``), made once per plan."""
        found = self._dense.get(id(runs))
        if found is not None and found.runs is runs:
            return found
        lines = _LinesCache((), runs, 0)
        lines.dtypes = [self._owner._info(v)[1] for v in fast_vars]
        if len(self._dense) >= PLAN_CACHE:
            self._dense.pop(next(iter(self._dense)))
        self._dense[id(runs)] = lines
        return lines
