"""The optimizer base class: distributed apply, slots, non-slot variables, checkpoint hooks.

A step (``apply_gradients``) in a replica context goes through ``merge_call`` to
:meth:`Optimizer._distributed_apply`, which runs once in cross-replica context:

1. gradients that are ``None`` are dropped;
2. the rest are reduced with ``ReduceOp.SUM`` across replicas. From ``apply_gradients``
   (:meth:`Optimizer._merged_apply`), dense gradients of arena variables take the fused path:
   each replica's are packed into flat buffers laid out like the arena (or written there by
   the user, :class:`GradientBuffers`), reduced across processes in one call per dtype, and
   added replica by replica inside the update core's blocks, in device order; everything else
   goes through ``strategy.batch_reduce``, one value per variable;
3. slots are created next to their variables, unless :meth:`Optimizer.build` or a restore
   made them before (a mirrored variable's slots are mirrored on the same devices, in the
   optimizer's shadow arenas, see :mod:`parallelvars.update_core`);
4. every variable is updated by the update core: dense gradients of variables sharing an arena
   in a few block-wise ufunc calls over all replicas at once, the rest one variable at a time;
5. the non-slot variables (the step count ``iterations``, Adam's beta powers) are updated once,
   through ``strategy.update_non_slot`` where the strategy has it;
6. ``global_step``, when given, is incremented.
"""

from __future__ import annotations

import inspect
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np

from parallelvars import update_core
from parallelvars._storage import Arena, Placement
from parallelvars.enums import ReduceOp
from parallelvars.errors import ContextError, GradientError, GradientTypeError
from parallelvars.optimizers._sparse import IndexedSlices, sum_indexed_slices
from parallelvars.strategy import _context
from parallelvars.strategy._values import PerReplica
from parallelvars.tracking import Module
from parallelvars.variables import ParallelVariable, ShardedVariable, _make_distributed_variable

__all__ = ["GradientBuffers", "Optimizer"]

_tokens = itertools.count()
_PLAN_CACHE = 8
# Gradients that are views of memory numpy does not own (a torch tensor's, a variable's
# interface) whose addresses the fused path checks against the step's buffers; more, and the
# step packs them first instead (a packed copy cannot change under the update).
_ADDRESS_CHECKS = 256


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name.startswith(("bfloat", "float"))


_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_shape_of = operator.attrgetter("shape")
_dtype_of = operator.attrgetter("dtype")
_base_of = operator.attrgetter("base")
_NDARRAY_ONLY = {np.ndarray}
_NONE_TYPE = type(None)


def _takes_an_argument(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` can be called with one positional argument (a learning-rate schedule of
    the step), rather than with none (TensorFlow's callable learning rate)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: assume a schedule
        return True
    try:
        sig.bind(0)
    except TypeError:
        return False
    return True


def _dense_checked(arr: np.ndarray, var: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``arr`` when it can be the dense gradient of ``var`` (its shape, a numeric dtype)."""
    # The dtype first: a string or an object is a TypeError (as in TensorFlow), not a shape error.
    if arr.dtype.kind not in "fiu" and not _is_float(arr.dtype):
        raise GradientTypeError(
            "gradient is not numeric", variable=var.name, expected="a float array", found=arr.dtype
        )
    if arr.shape != shape:
        raise GradientError(
            "gradient of another shape", variable=var.name, expected=shape, found=arr.shape
        )
    return arr


def _INDEXED_SLICES_FREE(grads: list[Any]) -> bool:
    return IndexedSlices not in set(map(type, grads))


def _may_alias(
    plan: update_core.GatherPlan, owner_ids: frozenset[int], grads: Sequence[Sequence[Any]]
) -> bool:
    """Whether a gradient array may share memory with a variable or slot the step writes.

    The gathered step reads gradients while it writes: such a gradient would be read changed.
    An array owning its memory (``base`` None), or a view of another array that owns its
    memory and is not one of the step's buffers, cannot; the few others (views of a torch
    tensor, of a variable through ``np.asarray``) have their addresses checked, or, when
    there are many, the answer is yes and the step packs them first.
    """
    unknown: list[Any] = []
    for gs in grads:
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
    return bool(unknown) and update_core.overlaps(plan, unknown)


class _ReplicaGradients:
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


def _same_variables(parts: Sequence[_ReplicaGradients], known: tuple[Any, ...]) -> bool:
    """Whether every replica's variables are ``known``, in order (one identity pass per list;
    replicas that hand in the same list object, as a shared ``zip(grads, variables)`` does,
    share it)."""
    checked: list[Any] = []
    for p in parts:
        vs = p.variables
        if any(vs is c for c in checked):
            continue
        if len(vs) != len(known) or not all(map(operator.is_, vs, known)):
            return False
        checked.append(vs)
    return True


_LIST_ITERATORS: tuple[type, ...] = (type(iter([])), type(iter(())))


def _zipped_lists(grads_and_vars: Any) -> tuple[Sequence[Any], Sequence[Any]] | None:
    """The two sequences behind ``zip(grads, variables)``, when it is one over two lists or
    tuples of one length not yet iterated, without making its pairs; else ``None``.

    What ``zip`` hands out is read through its pickling state (``__reduce__``, as ``copy`` and
    ``pickle`` read it), and the zip is then left exhausted, as iterating it would leave it.
    """
    if type(grads_and_vars) is not zip:
        return None
    try:
        iterators = grads_and_vars.__reduce__()[1]
        if len(iterators) != 2 or not all(type(it) in _LIST_ITERATORS for it in iterators):
            return None
        states = [it.__reduce__() for it in iterators]
        if not all(len(st) == 3 and st[2] == 0 for st in states):
            return None  # already partly iterated
        grads, variables = (st[1][0] for st in states)
        if len(grads) != len(variables):
            return None  # zip's own answer: the shorter length, or strict's error
        for it, seq in zip(iterators, (grads, variables), strict=True):
            it.__setstate__(len(seq))
    except (AttributeError, TypeError, IndexError, ValueError):
        return None
    return grads, variables


class _FusedPlan:
    """The fused path of one variable list: which positions may take it, and their checks."""

    __slots__ = ("candidates", "dtypes", "pick", "shapes")

    def __init__(
        self, candidates: tuple[int, ...], dtypes: list[np.dtype], shapes: list[tuple[int, ...]]
    ) -> None:
        self.candidates = candidates
        self.dtypes = dtypes
        self.shapes = shapes
        self.pick: Callable[[Sequence[Any]], Any] = (
            operator.itemgetter(*candidates)
            if len(candidates) > 1
            else (lambda seq: [seq[i] for i in candidates])
        )


class _FusedLines:
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

    __slots__ = ("_gather", "dtypes", "key", "layout", "runs", "staging")

    def __init__(self, key: tuple[int, ...], runs: list[update_core.Run], replicas: int) -> None:
        self.key = key
        self.runs = runs
        self.layout = update_core.layout_lines(runs)
        # Packing targets, made on first use (gathered steps and gradient buffers need none).
        self.staging: list[dict[np.dtype, np.ndarray] | None] = [None] * replicas
        self._gather: tuple[update_core.GatherPlan, frozenset[int]] | None = None
        # The variables' dtypes, by position (the gradients a gather reads must have them).
        self.dtypes: list[np.dtype] = []

    def gather(self) -> tuple[update_core.GatherPlan, frozenset[int]]:
        """The gather plan and the ids of the buffers the step writes, made on first use."""
        if self._gather is None:
            plan = update_core.plan_gather(self.runs)
            owners = {id(r.arena.buffer) for r in self.runs}
            owners.update(id(s.base) for r in self.runs for s in r.slot_slabs)
            self._gather = (plan, frozenset(owners))
        return self._gather

    def packed(self, replica: int) -> dict[np.dtype, np.ndarray]:
        target = self.staging[replica]
        if target is None:
            target = self.staging[replica] = self.layout.buffers()
        return target


class _BufferPairs(list[tuple[Any, Any]]):
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
        return _BufferPairs(self._pairs[r], self, r)

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


class Optimizer(Module):
    """Base class of the optimizers: subclasses give slots, hyperparameters and a kernel.

    Subclasses define:

    * ``_slot_specs()``: ``(slot name, initial value)`` pairs, in the kernel's slot order;
    * ``_hyper(step)``: the step's hyperparameters (a namespace of Python floats);
    * ``_kernel``: a :data:`parallelvars.update_core.Kernel`;
    * ``_sparse_as_dense``: True when the formula touches every row even for a sparse gradient
      (Adam's moments decay everywhere), so sparse gradients are made dense first;
    * optionally ``_create_extra_non_slots(device)`` and ``_finish_extra()``.

    Args:
        learning_rate: a float, or a callable of the step (the number of steps already applied,
            0 on the first) returning one; a callable of no argument (TensorFlow's callable
            hyperparameter) is called at every step.
        name: the optimizer's name (used to name slot variables).
    """

    _sparse_as_dense: ClassVar[bool] = False

    def __init__(
        self, learning_rate: float | Callable[[int], float] | Callable[[], float], name: str
    ) -> None:
        if not callable(learning_rate):
            learning_rate = float(learning_rate)
        elif not _takes_an_argument(learning_rate):
            # TensorFlow's callable hyperparameters take no argument: call it every step.
            schedule: Any = learning_rate
            learning_rate = lambda step: schedule()  # noqa: E731
        self._pv_learning_rate: float | Callable[[int], float] = learning_rate  # type: ignore[assignment]
        self._pv_name = name
        self._pv_token = next(_tokens)
        self._pv_slots: dict[str, dict[int, tuple[Any, Any]]] = {}
        self._pv_plans: dict[tuple[int, ...], tuple[tuple[Any, ...], list[update_core.Run]]] = {}
        self._pv_scratch: dict[np.dtype, update_core.UpdateScratch] = {}
        self._pv_info: dict[int, tuple[Any, tuple[tuple[int, ...], np.dtype, bool]]] = {}
        self._pv_known: dict[tuple[int, ...], tuple[Any, ...]] = {}
        self._pv_shapes: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        self._pv_split: dict[tuple[int, ...], tuple[Any, ...]] = {}
        self._pv_non_slot_names: list[str] = []
        # Mirrored variables: compute the primary row and copy it (see update_core). False
        # computes every replica's row, for comparison.
        self._pv_replicate_mirrored = True
        # The fused path of apply_gradients, per variable list (all, then the fused subset).
        self._pv_fused: dict[tuple[int, ...], tuple[tuple[Any, ...], _FusedPlan]] = {}
        self._pv_lines: dict[tuple[int, ...], tuple[tuple[Any, ...], Any]] = {}
        self._pv_gradbufs: dict[tuple[int, ...], GradientBuffers] = {}
        self._pv_plan_lines: dict[int, _LinesCache] = {}
        # The last variable list whose every gradient took the fused path, with its plans.
        self._pv_steady: tuple[tuple[Any, ...], tuple[int, ...], _FusedPlan, _LinesCache] | None = (
            None
        )
        self.iterations: ParallelVariable | None = None
        # Non-slot variables being made by _stage_non_slots (name -> variable), else None.
        self._pv_staging: dict[str, Any] | None = None

    # ------------------------------------------------------------------ public API
    @property
    def name(self) -> str:
        return self._pv_name

    @property
    def learning_rate(self) -> float | Callable[[int], float]:
        return self._pv_learning_rate

    def compute_gradients(
        self, loss_fn: Callable[[], Sequence[Any]], var_list: Sequence[Any]
    ) -> list[tuple[Any, Any]]:
        """Gradients from any autodiff, scaled for the strategy's loss reduction.

        ``loss_fn()`` returns one gradient per variable of ``var_list`` (numpy, or arrays of
        torch / jax that convert with ``np.asarray``; ``None`` for no gradient). When the loss
        reduction is ``MEAN`` (the default, see :func:`~parallelvars.loss_reduction`) and several
        replicas are in sync, the gradients are scaled by ``1 / num_replicas``, as the seed's
        ``compute_gradients`` scales a "mean" loss by ``1 / num_towers``: the replicas'
        gradients are then summed by :meth:`apply_gradients` into the gradient of the global mean.
        The loss reduction is read after ``loss_fn`` ran, so ``loss_fn`` may set it.

        Returns:
            ``(gradient, variable)`` pairs for :meth:`apply_gradients`.

        Raises:
            GradientError: ``loss_fn`` returned another number of gradients than variables.
        """
        from parallelvars.strategy._host import scale_loss_for_replicas

        variables = list(var_list)
        grads = list(loss_fn())
        if len(grads) != len(variables):
            raise GradientError(
                f"optimizer {self._pv_name!r}: compute_gradients() needs one gradient per variable",
                expected=f"{len(variables)} gradients",
                found=f"{len(grads)} gradients",
            )
        return list(zip(scale_loss_for_replicas(grads), variables, strict=True))

    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Any, Any]],
        global_step: Any = None,
        name: str | None = None,
    ) -> None:
        """Apply one step of gradients to their variables.

        In a replica context (inside ``strategy.run``, or outside every strategy) the call goes
        through ``merge_call``: every replica's gradients are summed and every variable is
        updated once. Gradients that are ``None`` are skipped.

        Args:
            grads_and_vars: ``(gradient, variable)`` pairs; a gradient is an array of the
                variable's shape, an :class:`~parallelvars.IndexedSlices`, or ``None``.
            global_step: an integer variable to increment by one after the update.
            name: accepted for code ported from TensorFlow (an op name there); unused.

        Raises:
            ContextError: in a cross-replica context (inside ``strategy.scope()`` but not in a
                replica function); call :meth:`distributed_apply` there.
            GradientError: no gradient at all, or a gradient that does not fit its variable
                (a non-numeric gradient: :class:`~parallelvars.errors.GradientTypeError`, also
                a ``TypeError``).
        """
        # Gradients that are None are dropped: here, or for zip(grads, variables), in the merge.
        if type(grads_and_vars) is _BufferPairs and grads_and_vars.intact():
            bufs, r = grads_and_vars.owner, grads_and_vars.replica
            mine = _ReplicaGradients(bufs._views[r], bufs.variables, grads_and_vars)
        else:
            lists = _zipped_lists(grads_and_vars)
            mine = (
                _ReplicaGradients(*lists)
                if lists is not None
                else _ReplicaGradients(pairs=[(g, v) for g, v in grads_and_vars if g is not None])
            )
        mode = _context.current_mode()
        if mode.replica_context is None:
            raise ContextError(
                f"optimizer {self._pv_name!r}: apply_gradients() was called in a cross-replica "
                f"context of {mode.strategy!r}; call it inside strategy.run(...), or use "
                "optimizer.distributed_apply(strategy, grads_and_vars) with reduced gradients"
            )
        mode.replica_context.merge_call(self._merged_apply, args=(mine, global_step))

    def gradient_buffers(self, var_list: Sequence[Any]) -> GradientBuffers:
        """Flat gradient buffers for ``var_list``, one per replica, with a view per variable.

        Gradients written into ``buffers.views()`` inside a replica function and passed as they
        are (``opt.apply_gradients(buffers.grads_and_vars())``) reach the update without a
        packing copy; see :class:`GradientBuffers`. Calling this again with the same variables
        gives the same buffers.

        Raises:
            GradientError: a variable that is not a float16/32/64 variable with an arena
                placement (sharded, bfloat16, ...): give those gradients as plain arrays.
        """
        var_list = list(var_list)
        key = tuple(map(id, var_list))
        found = self._pv_gradbufs.get(key)
        if found is not None and all(map(operator.is_, found.variables, var_list)):
            return found
        if len(set(key)) != len(key):
            raise GradientError("a variable appears twice in the gradient buffers' list")
        for v in var_list:
            if not self._info(v)[2]:
                raise GradientError(
                    "gradient buffers hold float16/32/64 variables with an arena placement",
                    variable=v.name,
                    expected="a mirrored or single-device float variable",
                    found=f"{type(v).__name__} of {v.dtype}",
                )
        strategy = _context.current_mode().strategy
        self._create_slots(var_list)
        runs = self._plan(var_list)
        layout = update_core.layout_lines(runs)
        bufs = GradientBuffers(var_list, layout, strategy._local_replica_count())
        self._pv_gradbufs[key] = bufs
        return bufs

    def _merged_apply(self, strategy: Any, grads: Any, global_step: Any) -> None:
        """The target of ``apply_gradients``' merge_call: the fused path where it applies.

        Dense gradients of a float16/32/64 variable with an arena placement, of the variable's
        dtype and shape, take the fused path: the update core reads each local replica's
        gradients as they are, block by block (or the user's :class:`GradientBuffers`, or, over
        several processes, flat buffers all-reduced in one call per dtype), and adds the local
        replicas in device order as it updates. Every other gradient (sparse, another dtype,
        one object shared by every replica, sharded or bfloat16 variables) goes through
        ``batch_reduce`` as before, in the same step. Gradients that are ``None`` are dropped.

        A training loop hands the same variables every step: then one identity pass per
        replica over the variables finds the step's plan, and the gradients are checked with
        a few C-level passes.
        """
        parts: Sequence[_ReplicaGradients] = (
            grads.values if isinstance(grads, PerReplica) else (grads,)
        )
        if not all(type(p) is _ReplicaGradients for p in parts):
            raise GradientError("apply_gradients: merge_call arguments of another kind")
        order = strategy._fused_sum_order() if hasattr(strategy, "_fused_sum_order") else None
        fusable = (
            order is not None and len(parts) == len(order) and getattr(strategy, "fusion", True)
        )
        steady = self._pv_steady
        if (
            order is not None
            and fusable
            and steady is not None
            and _same_variables(parts, steady[0])
        ):
            known, known_key, known_plan, known_lines = steady
            user = self._pv_gradbufs.get(known_key) if self._pv_gradbufs else None
            if (
                user is not None
                and len(user) == len(parts) == strategy.num_replicas_in_sync  # one process
                and all(p.grads is user._views[r] for r, p in enumerate(parts))
            ):
                # Every replica handed in its gradient buffers' own views (grads_and_vars()
                # unchanged): of the variables' dtypes and shapes by construction, summed as
                # the buffers they are.
                bufs = [user._buffers[r] for r in order]
                self._distributed_apply(
                    strategy,
                    [],
                    global_step,
                    True,
                    _FusedLines(list(known), known_lines.runs, known_lines.layout, bufs),
                )
                return
            if len(known_plan.candidates) == len(known) and all(
                len(p.grads) == len(known) for p in parts
            ):
                # (A None gradient is not an array: it fails the check and takes the general path.)
                listed = [p.grads for p in parts]
                fused, listed = self._fused_positions(known_plan, parts, len(known), listed)
                if len(fused) == len(known):
                    self._distributed_apply(
                        strategy,
                        [],
                        global_step,
                        True,
                        self._pack(known, fused, listed, parts, order, strategy, known_lines),
                    )
                    return
        # The general path: drop None gradients, as each replica would have before merging.
        parts = [
            p
            if _NONE_TYPE not in set(map(type, p.grads))
            else _ReplicaGradients(pairs=[(g, v) for g, v in p.pairs if g is not None])
            for p in parts
        ]
        var_list = list(parts[0].variables)
        key = tuple(map(id, var_list))
        if not fusable or any(tuple(map(id, p.variables)) != key for p in parts[1:]):
            merged = (
                strategy._merge_args([p.pairs for p in parts])
                if hasattr(strategy, "_merge_args")
                else parts[0].pairs
            )
            self._distributed_apply(strategy, merged, global_step, True)
            return
        assert order is not None
        plan = self._fused_plan(key, var_list)
        fused, picked = self._fused_positions(plan, parts, len(var_list))
        if not fused:
            merged = strategy._merge_args([p.pairs for p in parts])
            self._distributed_apply(strategy, merged, global_step, True)
            return
        lines = self._pack(
            var_list, fused, picked if fused == plan.candidates else None, parts, order, strategy
        )
        if len(fused) == len(var_list):
            rest: Any = []
            # The next step with these variables starts from here.
            self._pv_steady = (tuple(var_list), key, plan, self._pv_lines[key][1])
        else:
            keep = set(fused)
            others = [i for i in range(len(var_list)) if i not in keep]
            rest = strategy._merge_args([[p.pairs[i] for i in others] for p in parts])
        self._distributed_apply(strategy, rest, global_step, True, lines)

    def _fused_plan(self, key: tuple[int, ...], var_list: list[Any]) -> _FusedPlan:
        cached = self._pv_fused.get(key)
        if cached is not None and all(map(operator.is_, cached[0], var_list)):
            return cached[1]
        candidates: list[int] = []
        # A repeated variable is the per-variable path's error to raise.
        for i, v in enumerate(var_list if len(set(key)) == len(key) else ()):
            try:
                info = self._info(v)
            except GradientError:  # raised again, in its place, by the per-variable path
                continue
            if info[2]:
                candidates.append(i)
        plan = _FusedPlan(
            tuple(candidates),
            [self._info(var_list[i])[1] for i in candidates],
            [self._info(var_list[i])[0] for i in candidates],
        )
        if len(self._pv_fused) >= _PLAN_CACHE:
            self._pv_fused.pop(next(iter(self._pv_fused)))
        self._pv_fused[key] = (tuple(var_list), plan)
        return plan

    @staticmethod
    def _fused_positions(
        plan: _FusedPlan,
        parts: Sequence[_ReplicaGradients],
        count: int,
        listed: list[Any] | None = None,
    ) -> tuple[tuple[int, ...], list[Any]]:
        """The positions whose gradients take the fused path this step, and each replica's
        gradients at the candidate positions.

        A gradient qualifies when every replica gave a plain array of the variable's dtype and
        shape and not every replica gave the same object (one shared value keeps the meaning
        ``batch_reduce`` gives it). The common case is checked with C-level passes.
        ``listed``: each replica's gradients, already listed (every position a candidate).
        """
        cand = plan.candidates
        if not cand:
            return (), []
        if listed is not None:
            picked = listed  # every position a candidate, each replica's gradients listed
        elif len(cand) == count:
            picked = [p.grads for p in parts]
        else:
            picked = [plan.pick(p.grads) for p in parts]
        if all(
            set(map(type, g)) == _NDARRAY_ONLY
            and list(map(_dtype_of, g)) == plan.dtypes
            and all(map(operator.eq, map(_shape_of, g), plan.shapes))
            for g in picked
        ) and (len(parts) == 1 or not any(map(operator.is_, picked[0], picked[1]))):
            return cand, picked
        out = []
        for k, pos in enumerate(cand):
            gs = [g[k] for g in picked]
            if all(
                type(g) is np.ndarray and g.dtype == plan.dtypes[k] and g.shape == plan.shapes[k]
                for g in gs
            ) and not (len(gs) > 1 and all(g is gs[0] for g in gs)):
                out.append(pos)
        return tuple(out), picked

    def _pack(
        self,
        var_list: Sequence[Any],
        fused: tuple[int, ...],
        picked: list[Any] | None,
        parts: Sequence[_ReplicaGradients],
        order: tuple[int, ...],
        strategy: Any,
        lines: _LinesCache | None = None,
    ) -> _FusedLines:
        """Each local replica's fused gradients, in summing order: as they are (gathered block
        by block inside the update), as the user's gradient buffers, or packed into flat
        buffers (reduced across processes where the strategy spans several). ``picked``: each
        replica's gradients at the fused positions, when already listed; ``lines``: the cache
        of the fused variables, when known (a steady step)."""
        fvars = list(var_list) if len(fused) == len(var_list) else [var_list[i] for i in fused]
        if lines is None:
            fkey = tuple(map(id, fvars))
            cached = self._pv_lines.get(fkey)
            if cached is None or not all(map(operator.is_, cached[0], fvars)):
                self._create_slots(fvars)
                if len(self._pv_lines) >= _PLAN_CACHE:
                    self._pv_lines.pop(next(iter(self._pv_lines)))
                cached = (tuple(fvars), _LinesCache(fkey, self._plan(fvars), len(parts)))
                self._pv_lines[fkey] = cached
            lines = cached[1]
        runs, layout = lines.runs, lines.layout
        pick = (
            (lambda seq: seq)
            if len(fused) == len(var_list)
            else (lambda seq: [seq[i] for i in fused])
        )
        grads = [picked[r] if picked is not None else pick(parts[r].grads) for r in order]
        cross_process = len(parts) == 1 and strategy.num_replicas_in_sync > 1
        if not cross_process:
            user = self._pv_gradbufs.get(lines.key) if self._pv_gradbufs else None
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
                return _FusedLines(fvars, runs, layout, bufs)
            plan, owner_ids = lines.gather()
            if not _may_alias(plan, owner_ids, grads):
                return _FusedLines(fvars, runs, layout, [], plan, grads)
        bufs = []
        for r, g in zip(order, grads, strict=True):
            target = lines.packed(r)
            update_core.pack_lines(runs, layout, g, target)
            bufs.append(target)
        if cross_process:
            # The other replicas are other processes: one all-reduce per dtype buffer, in a
            # fixed dtype order so that every process makes the same calls.
            bufs = [{dt: strategy._allreduce_flat(bufs[0][dt]) for dt in layout.sizes}]
        return _FusedLines(fvars, runs, layout, bufs)

    def distributed_apply(
        self, strategy: Any, grads_and_vars: Iterable[tuple[Any, Any]], global_step: Any = None
    ) -> None:
        """:meth:`apply_gradients` for a cross-replica context: the gradients are already merged."""
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        self._distributed_apply(strategy, pairs, global_step)

    def build(self, var_list: Sequence[Any]) -> None:
        """Create the slots of every variable of ``var_list`` and the non-slot variables
        (``iterations``, Adam's beta powers) now, not at the first step (Keras 3's name).

        Values a restore left pending for them (a checkpoint restored before the optimizer had
        these variables) are filled in: right after ``build`` a status's
        ``assert_consumed()`` passes, and a saved slot or counter that does not fit (another
        shape, another dtype) raises here, naming the file, the variable, what was expected
        and what was found. All or nothing: after an error nothing was created, and the next
        ``build`` or step raises the same error. A step counter saved with another dtype is
        converted where every value converts exactly (TensorFlow's float32 beta powers), without
        ``allow_cast``. Calling ``build`` again, or with more variables, makes only what is
        missing. Call it in the strategy's scope, as the step would run.

        Args:
            var_list: the variables this optimizer will train.

        Raises:
            GradientError: a variable the optimizer cannot train (not a float variable made by
                ``pv.Variable``, an ON_READ variable) or listed twice.
            ShapeMismatchError, DtypeMismatchError: a pending restored value does not fit.

        Example:
            >>> import numpy as np, parallelvars as pv
            >>> w = pv.Variable(np.ones(2, np.float32), name="w")
            >>> opt = pv.optimizers.Adam(0.1)
            >>> opt.build([w])
            >>> int(opt.iterations), opt.get_slot(w, "m").tolist()
            (0, [0.0, 0.0])
        """
        var_list = list(var_list)
        key = tuple(map(id, var_list))
        if len(set(key)) != len(key):
            raise GradientError("a variable appears twice in build()'s list")
        for v in var_list:
            self._info(v)
        self._build_state(_context.current_mode().strategy, var_list, non_slots=True)

    def get_slot(self, var: Any, name: str) -> ParallelVariable | None:
        """The slot ``name`` of ``var``, or ``None`` before :meth:`build` or the first step
        (or if it has none); a restore that brings ``var``'s slots makes them at once."""
        entry = self._pv_slots.get(name, {}).get(id(var))
        return None if entry is None or entry[0] is not var else entry[1]

    def get_slot_names(self) -> list[str]:
        """The names of the slots this optimizer has created, sorted."""
        return sorted(self._pv_slots)

    @property
    def non_slot_variables(self) -> list[ParallelVariable]:
        """The step count and any other state shared by all variables (e.g. beta powers)."""
        return [getattr(self, n) for n in self._pv_non_slot_names]

    @property
    def variables(self) -> list[ParallelVariable]:
        """Every variable of the optimizer's state: the non-slot ones, then every slot (by slot
        name, then in the order the variables were first trained), as TensorFlow's
        ``Optimizer.variables()`` lists them."""
        return [*self.non_slot_variables, *(slot for _, _, slot in self._checkpoint_slots())]

    # ------------------------------------------------------------------ checkpoint hooks
    def _checkpoint_slots(self) -> list[tuple[Any, str, Any]]:
        return [
            (var, name, slot)
            for name in sorted(self._pv_slots)
            for var, slot in self._pv_slots[name].values()
        ]

    def _lookup_slot(self, variable: Any, slot_name: str) -> Any:
        return self.get_slot(variable, slot_name)

    # ------------------------------------------------------------------ to override
    def _slot_specs(self) -> list[tuple[str, float]]:
        return []

    def _hyper(self, step: int) -> SimpleNamespace:
        return SimpleNamespace(lr=self._lr(step))

    @staticmethod
    def _kernel(
        var: np.ndarray,
        slots: tuple[np.ndarray, ...],
        g: np.ndarray,
        hp: Any,
        tmp: tuple[np.ndarray, ...],
        gtmp: tuple[np.ndarray, ...],
    ) -> None:
        raise NotImplementedError

    def _create_extra_non_slots(self, device: Any) -> None:
        """Create non-slot variables besides ``iterations`` (on ``device``)."""

    def _finish_extra(self) -> None:
        """Update the extra non-slot variables once per step."""

    # ------------------------------------------------------------------ helpers
    def _lr(self, step: int) -> float:
        lr = self._pv_learning_rate
        return float(lr(step)) if callable(lr) else lr

    def _add_non_slot(self, name: str, value: Any, dtype: Any, device: Any) -> None:
        """Make the non-slot variable ``name`` on ``device`` (once); from
        ``_create_extra_non_slots``, inside :meth:`_stage_non_slots`, which attaches it."""
        staging = self._pv_staging
        if getattr(self, name, None) is not None or staging is None or name in staging:
            return
        kwargs: dict[str, Any] = dict(
            initial_value=np.asarray(value, dtype), name=f"{self._pv_name}/{name}", trainable=False
        )
        strategy = _context.current_mode().strategy
        if not strategy._is_default and hasattr(strategy, "colocate_vars_with"):
            # Through the strategy, so it knows the variable as one of its own.
            from parallelvars.variables import Variable

            with strategy.colocate_vars_with(tuple(device.components)):
                var = Variable(**kwargs)
        else:
            var = _make_distributed_variable(device, **kwargs)
        # A counter restores from another dtype where its values convert exactly (TensorFlow
        # keeps beta powers in float32).
        var._self_exact_cast = True
        staging[name] = var

    def _stage_non_slots(self, strategy: Any, var_list: Sequence[Any]) -> dict[str, Any]:
        """The non-slot variables (``iterations`` and the subclass's), made but not attached."""
        if self.iterations is not None:
            return {}
        from parallelvars.devices import ParallelDevice

        non_slot_devices = getattr(strategy, "non_slot_devices", None)
        if non_slot_devices is not None and not getattr(strategy, "_is_default", False):
            found = non_slot_devices(var_list)
            device = found if isinstance(found, ParallelDevice) else ParallelDevice(list(found))
        else:
            device = var_list[0].device if var_list else ParallelDevice(1)
        self._pv_staging = {}
        try:
            self._add_non_slot("iterations", 0, np.int64, device)
            self._create_extra_non_slots(device)
            return self._pv_staging
        finally:
            self._pv_staging = None

    def _stage_slots(
        self, var_list: Sequence[Any]
    ) -> dict[tuple[int, str], tuple[Any, str, ParallelVariable]]:
        """The slots ``var_list`` lacks, made but not attached."""
        made: dict[tuple[int, str], tuple[Any, str, ParallelVariable]] = {}
        for slot_name, init in self._slot_specs():
            table = self._pv_slots.get(slot_name, {})
            for var in var_list:
                entry = table.get(id(var))
                key = (id(var), slot_name)
                if (entry is not None and entry[0] is var) or key in made:
                    continue
                made[key] = (var, slot_name, self._make_slot(var, slot_name, init))
        return made

    def _attach(
        self,
        slots: dict[tuple[int, str], tuple[Any, str, ParallelVariable]],
        non_slots: dict[str, Any],
    ) -> None:
        """Make staged slots and non-slot variables the optimizer's own."""
        for var, slot_name, slot in slots.values():
            self._pv_slots.setdefault(slot_name, {})[id(var)] = (var, slot)
        deferred = self.__dict__.get("_pv_deferred") or {}
        for name, var in non_slots.items():
            stale = deferred.pop(name, None)  # a later restore already gave it its value
            if stale is not None:
                stale.discard()
            object.__setattr__(self, name, var)
            self._pv_non_slot_names.append(name)

    def _build_state(self, strategy: Any, var_list: Sequence[Any], *, non_slots: bool) -> None:
        """Make what ``var_list`` lacks (slots; with ``non_slots`` the step counters), fill it
        from pending restores, and attach it: all or nothing.

        Every pending value is checked (shape, dtype, checksum) before anything is written or
        attached; a mismatch raises and leaves the optimizer, and the pending restores, as they
        were, so the next build or step raises the same clear error again.
        """
        slots = self._stage_slots(var_list)
        made = self._stage_non_slots(strategy, var_list) if non_slots else {}
        if not slots and not made:
            return
        notes: list[tuple[dict[Any, Any], Any, Any, Any]] = []
        slot_notes = self.__dict__.get("_pv_deferred_slot_map")
        if slot_notes:
            for key, (_, _, slot) in slots.items():
                if key in slot_notes:
                    notes.append((slot_notes, key, slot_notes[key], slot))
        child_notes = self.__dict__.get("_pv_deferred")
        if child_notes:
            for name, var in made.items():
                if name in child_notes:
                    notes.append((child_notes, name, child_notes[name], var))
        commits = [pending.plan(obj) for _, _, pending, obj in notes]  # raises before writing
        for (table, key, _, _), commit in zip(notes, commits, strict=True):
            del table[key]
            commit()
        self._attach(slots, made)

    def _create_non_slots(self, strategy: Any, var_list: Sequence[Any]) -> None:
        if self.iterations is not None:
            return
        self._build_state(strategy, var_list, non_slots=True)

    def _create_slots(self, var_list: Sequence[Any]) -> None:
        self._build_state(None, var_list, non_slots=False)

    def _checkpoint_stage(
        self, slots: list[tuple[Any, str]], children: list[str]
    ) -> tuple[dict[tuple[int, str], Any], dict[str, Any], Callable[[], None] | None]:
        """A restore that brings slots of variables it matched makes them now, with the step
        counters when the file has them (see :meth:`Trackable._checkpoint_stage`)."""
        var_list: list[Any] = []
        seen: set[int] = set()
        for var, _ in slots:
            if id(var) in seen:
                continue
            seen.add(id(var))
            try:
                self._info(var)
            except GradientError:
                continue  # not a variable this optimizer trains: its slots stay unmatched
            var_list.append(var)
        if not var_list:
            return {}, {}, None
        made_slots = self._stage_slots(var_list)  # every slot of each: a variable's set is whole
        made: dict[str, Any] = {}
        if self.iterations is None and children:
            strategy = _context.current_mode().strategy
            # Outside a multi-process strategy's scope its process-local variables cannot get
            # counters of their own kind: the first step (in the scope) makes them.
            if not (strategy._is_default and any(v._self_global for v in var_list)):
                made = self._stage_non_slots(strategy, var_list)
                if not set(children) & set(made):
                    made = {}  # the file has no counters: the first step makes them

        def attach() -> None:
            self._attach(made_slots, made)

        return {k: v[2] for k, v in made_slots.items()}, made, attach

    def _slot_arena(self, arena: Arena, slot_name: str) -> Arena:
        return arena.shadow(("optimizer-slot", self._pv_token, slot_name))

    def _make_slot(self, var: Any, slot_name: str, init: float) -> ParallelVariable:
        name = f"{var.name}/{slot_name}"
        shape = tuple(var.shape)
        if isinstance(var, ShardedVariable):
            return ShardedVariable(
                np.full(shape, init, var.dtype),
                device=var.device,
                name=name,
                shard_axis=var.shard_axis,
                trainable=False,
            )
        pl = var.placement
        if pl is None:  # pragma: no cover - float variables always get an arena
            raise GradientError("variable has no arena placement", variable=var.name)
        shadow = self._slot_arena(pl.arena, slot_name)
        # Fill the alignment padding after the variable too: a run covering it then sees a
        # positive accumulator there, never 0 / 0.
        end = shadow.end_of(pl.offset, pl.size)
        shadow.buffer[:, pl.offset : end] = init
        return ParallelVariable(
            shadow.view(pl.offset, shape),
            device=var.device,
            name=name,
            kind=var.kind,
            synchronization=var.synchronization,
            aggregation=var.aggregation,
            trainable=False,
            placement=Placement(shadow, pl.offset, pl.size),
        )

    def _scratch(self, dtype: np.dtype) -> update_core.UpdateScratch:
        s = self._pv_scratch.get(dtype)
        if s is None:
            s = self._pv_scratch[dtype] = update_core.UpdateScratch(dtype)
        return s

    # ------------------------------------------------------------------ the step
    def _reduce(
        self, strategy: Any, pairs: list[tuple[Any, Any]], from_replicas: bool
    ) -> list[Any]:
        """SUM every gradient across replicas.

        ``from_replicas``: the pairs were merged from every replica's ``apply_gradients``, so a
        plain value is one that every replica gave and counts once per replica. Otherwise (a
        cross-replica ``distributed_apply``) plain values are already reduced and only
        per-replica values are summed.
        """
        batch_reduce = getattr(strategy, "batch_reduce", None)
        n = int(getattr(strategy, "num_replicas_in_sync", 1))
        plain_ok = batch_reduce is None or not (from_replicas and n > 1)
        grads = list(map(_first, pairs))
        if plain_ok and set(map(type, grads)) == _NDARRAY_ONLY:
            return grads  # already one value per variable: nothing to sum
        out: list[Any] = [None] * len(pairs)
        dense: list[int] = []
        for i, (g, _) in enumerate(pairs):
            if type(g) is np.ndarray and plain_ok:  # the common case, kept cheap
                out[i] = g
                continue
            parts = getattr(g, "values", None)
            per_replica = not isinstance(g, IndexedSlices) and isinstance(parts, (tuple, list))
            if isinstance(g, IndexedSlices):
                out[i] = sum_indexed_slices([g] * n) if from_replicas and n > 1 else g
            elif per_replica and parts and isinstance(parts[0], IndexedSlices):
                out[i] = sum_indexed_slices(list(parts))
            elif batch_reduce is None or not (per_replica or (from_replicas and n > 1)):
                out[i] = g
            else:
                dense.append(i)
        if dense and batch_reduce is not None:
            local = len(getattr(strategy, "worker_devices", ())) or 1
            values = []
            for i in dense:
                g = pairs[i][0]
                if from_replicas and n > 1 and not isinstance(g, PerReplica):
                    # The same object from every replica (merge_call keeps it one value): each
                    # replica gave it, so it is summed once per replica, in device order, exactly
                    # as equal separate arrays are (and as sparse gradients are above).
                    g = PerReplica([g] * local)
                values.append((g, pairs[i][1]))
            reduced = batch_reduce(ReduceOp.SUM, values)
            for i, r in zip(dense, reduced, strict=True):
                out[i] = r
        return out

    def _info(self, var: Any) -> tuple[tuple[int, ...], np.dtype, bool]:
        """``(shape, dtype, on the fast path)`` of a variable, validated once and cached."""
        entry = self._pv_info.get(id(var))
        if entry is not None and entry[0] is var:
            return entry[1]
        if not isinstance(var, ParallelVariable):
            raise GradientError(
                "optimizers update variables made by pv.Variable",
                expected="a ParallelVariable",
                found=type(var).__name__,
            )
        if var.kind == "on_read":
            raise GradientError(
                "an ON_READ variable cannot be trained (its replicas hold parts of a value)",
                variable=var.name,
            )
        dtype = np.dtype(var.dtype)
        if not _is_float(dtype):
            raise GradientError(
                "optimizers update floating-point variables only",
                variable=var.name,
                expected="a float dtype",
                found=dtype,
            )
        fast = (
            not isinstance(var, ShardedVariable)
            and var.placement is not None
            and dtype in update_core.FAST_DTYPES
        )
        info = (tuple(var.shape), dtype, fast)
        self._pv_info[id(var)] = (var, info)
        return info

    def _check(self, g: Any, var: Any) -> Any:
        shape = self._info(var)[0]
        if type(g) is np.ndarray:  # the common case, kept cheap
            return _dense_checked(g, var, shape)
        # A reduced gradient may come back wrapped (a mirrored value): its primary is the value.
        if not isinstance(g, IndexedSlices) and isinstance(
            getattr(g, "values", None), (tuple, list)
        ):
            g = g.values[0]
        if isinstance(g, IndexedSlices):
            if not shape:
                raise GradientError(
                    "a scalar variable cannot take a sparse gradient", variable=var.name
                )
            if g.dense_shape is not None and g.dense_shape != shape:
                raise GradientError(
                    "sparse gradient for another shape",
                    variable=var.name,
                    expected=shape,
                    found=g.dense_shape,
                )
            if tuple(g.values.shape[1:]) != shape[1:]:
                raise GradientError(
                    "sparse gradient rows have another shape",
                    variable=var.name,
                    expected=shape[1:],
                    found=tuple(g.values.shape[1:]),
                )
            if g.indices.size and (g.indices.min() < 0 or g.indices.max() >= shape[0]):
                raise GradientError(
                    "sparse gradient index out of range",
                    variable=var.name,
                    expected=f"0 <= index < {shape[0]}",
                    found=f"{int(g.indices.min())}..{int(g.indices.max())}",
                )
            g = g.deduplicate()
            if self._sparse_as_dense:
                return g.to_dense(shape)
            return g
        arr = (
            g
            if type(g) is np.ndarray
            else np.asarray(g.read_value() if isinstance(g, ParallelVariable) else g)
        )
        return _dense_checked(arr, var, shape)

    def _distributed_apply(
        self,
        strategy: Any,
        grads_and_vars: list[tuple[Any, Any]],
        global_step: Any = None,
        from_replicas: bool = False,
        fused: _FusedLines | None = None,
    ) -> None:
        """The cross-replica step; the target of ``merge_call`` (``from_replicas`` then).

        ``grads_and_vars`` holds no ``None`` gradient (the public entry points filter them).
        The per-variable bookkeeping of a step is done with C-level passes (``map``,
        ``itemgetter``) once the variable list is known, so that thousands of small variables
        cost little more than their arithmetic. ``fused``: more variables of the step, whose
        gradients are flat buffers (see :meth:`_merged_apply`).
        """
        pairs = grads_and_vars
        if not pairs:
            if fused is not None:
                self._create_non_slots(strategy, fused.variables)
                assert self.iterations is not None
                hp = self._hyper(int(self.iterations.read_value()))
                self._apply_fused(fused, hp)
                self._step_done(strategy, global_step)
                return
            raise GradientError(
                f"optimizer {self._pv_name!r}: no gradients provided for any variable",
                hint="every gradient was None, or no (gradient, variable) pair was given",
            )
        var_list = list(map(_second, pairs))
        # A training loop hands the same variables every step: check them and their slots once.
        key = tuple(map(id, var_list))
        known = self._pv_known.get(key)
        steady = known is not None and all(map(operator.is_, known, var_list))
        if not steady and len(set(key)) != len(key):
            seen: set[int] = set()
            for dup in var_list:  # the first variable seen before
                if id(dup) in seen:
                    break
                seen.add(id(dup))
            raise GradientError(
                "a variable appears twice in one step", variable=getattr(dup, "name", None)
            )
        reduced = self._reduce(strategy, pairs, from_replicas)
        shapes = self._pv_shapes.get(key) if steady else None
        if (
            shapes is not None
            and set(map(type, reduced)) == _NDARRAY_ONLY
            and all(dt.kind in "fiu" for dt in set(map(_dtype_of, reduced)))
            and list(map(_shape_of, reduced)) == shapes
        ):
            grads = reduced  # the steady state: plain arrays of the known shapes
        else:
            grads = [self._check(g, v) for g, v in zip(reduced, var_list, strict=True)]
        if not steady:
            self._create_slots(var_list)
            if len(self._pv_known) >= _PLAN_CACHE:
                self._pv_shapes.pop(next(iter(self._pv_known)), None)
                self._pv_known.pop(next(iter(self._pv_known)))
            self._pv_known[key] = tuple(var_list)
            self._pv_shapes[key] = [self._info(v)[0] for v in var_list]
        self._create_non_slots(
            strategy, var_list if fused is None else [*fused.variables, *var_list]
        )
        assert self.iterations is not None
        hp = self._hyper(int(self.iterations.read_value()))
        if fused is not None:
            self._apply_fused(fused, hp)
        self._update(var_list, grads, hp)
        self._step_done(strategy, global_step)

    def _apply_fused(self, fused: _FusedLines, hp: Any) -> None:
        if fused.gather is not None:
            assert fused.arrays is not None
            update_core.apply_gathered(fused.gather, fused.arrays, self._kernel, hp, self._scratch)
            return
        update_core.apply_lines(
            fused.runs, fused.layout, fused.parts, self._kernel, hp, self._scratch
        )

    def _step_done(self, strategy: Any, global_step: Any) -> None:
        update_non_slot = getattr(strategy, "update_non_slot", None)
        if update_non_slot is not None:
            update_non_slot(self.iterations, self._finish)
        else:
            self._finish()
        if global_step is not None:
            global_step.assign_add(1)

    def _finish(self) -> None:
        assert self.iterations is not None
        self.iterations.assign_add(1)
        self._finish_extra()

    def _update(self, var_list: list[Any], grads: list[Any], hp: Any) -> None:
        if _INDEXED_SLICES_FREE(grads):
            # No sparse gradient: which variables take the fast path depends on them alone.
            key = tuple(map(id, var_list))
            split = self._pv_split.get(key)
            if split is None or not all(map(operator.is_, split[0], var_list)):
                info = self._info
                fast = [
                    info(v)[2] for v in var_list
                ]  # one pass: the split is linear in the variables
                fast_idx = tuple(i for i, f in enumerate(fast) if f)
                split = (tuple(var_list), fast_idx, tuple(i for i, f in enumerate(fast) if not f))
                if len(self._pv_split) >= _PLAN_CACHE:
                    self._pv_split.pop(next(iter(self._pv_split)))
                self._pv_split[key] = split
            _, fast_idx, slow_idx = split
            for i in slow_idx:
                self._update_one(var_list[i], grads[i], hp)
            fast_vars = (
                var_list if len(fast_idx) == len(var_list) else [var_list[i] for i in fast_idx]
            )
            fast_grads = grads if len(fast_idx) == len(var_list) else [grads[i] for i in fast_idx]
        else:
            fast_vars, fast_grads = [], []
            info = self._info
            for v, g in zip(var_list, grads, strict=True):
                if info(v)[2] and type(g) is not IndexedSlices:
                    fast_vars.append(v)
                    fast_grads.append(g)
                else:
                    self._update_one(v, g, hp)
        if fast_vars:
            runs = self._plan(fast_vars)
            lines = self._plan_lines(fast_vars, runs)
            if list(map(_dtype_of, fast_grads)) == lines.dtypes:
                plan, owner_ids = lines.gather()
                if not _may_alias(plan, owner_ids, [fast_grads]):
                    # No staging line: each block's gradients are gathered into cache.
                    update_core.apply_gathered(plan, [fast_grads], self._kernel, hp, self._scratch)
                    return
            update_core.apply_runs(runs, fast_grads, self._kernel, hp, self._scratch)

    def _plan_lines(self, fast_vars: list[Any], runs: list[update_core.Run]) -> _LinesCache:
        """The gather plan of ``runs`` (those of ``fast_vars``), made once per plan."""
        found = self._pv_plan_lines.get(id(runs))
        if found is not None and found.runs is runs:
            return found
        lines = _LinesCache((), runs, 0)
        lines.dtypes = [self._info(v)[1] for v in fast_vars]
        if len(self._pv_plan_lines) >= _PLAN_CACHE:
            self._pv_plan_lines.pop(next(iter(self._pv_plan_lines)))
        self._pv_plan_lines[id(runs)] = lines
        return lines

    def _plan(self, fast_vars: list[Any]) -> list[update_core.Run]:
        key = (*map(id, fast_vars), self._pv_replicate_mirrored)
        cached = self._pv_plans.get(key)
        if cached is not None and all(map(operator.is_, cached[0], fast_vars)):
            return cached[1]
        names = [n for n, _ in self._slot_specs()]
        runs = update_core.plan_runs(
            [
                (i, v.placement, self._pv_replicate_mirrored and v.kind in ("mirrored", "single"))
                for i, v in enumerate(fast_vars)
            ],
            lambda arena: [self._slot_arena(arena, n) for n in names],
        )
        if len(self._pv_plans) >= _PLAN_CACHE:
            self._pv_plans.pop(next(iter(self._pv_plans)))
        self._pv_plans[key] = (tuple(fast_vars), runs)
        return runs

    def _update_one(self, var: Any, g: Any, hp: Any) -> None:
        """The per-variable path: sharded variables, exotic float dtypes, sparse rows."""
        names = [n for n, _ in self._slot_specs()]
        slots = [self.get_slot(var, n) for n in names]

        def stack(v: Any) -> np.ndarray:  # (r, *shape) with every component as a row
            return v.__wrapped__[None] if isinstance(v, ShardedVariable) else v.stacked

        sv = stack(var)
        ss = [stack(s) for s in slots]
        r = sv.shape[0]
        if isinstance(g, IndexedSlices):
            idx = g.indices
            rows_v = sv[:, idx].reshape(r, -1)
            rows_s = [s[:, idx].reshape(r, -1) for s in ss]
            line = g.values.reshape(1, -1)
            self._compute(rows_v, rows_s, line, hp)
            sv[:, idx] = rows_v.reshape(sv[:, idx].shape)
            for s, rs in zip(ss, rows_s, strict=True):
                s[:, idx] = rs.reshape(s[:, idx].shape)
            return
        self._compute(
            update_core.row_view(sv),
            [update_core.row_view(s) for s in ss],
            np.asarray(g).reshape(1, -1),
            hp,
        )

    def _compute(
        self, var2d: np.ndarray, slots2d: list[np.ndarray], g: np.ndarray, hp: Any
    ) -> None:
        dt = var2d.dtype
        if dt in update_core.FAST_DTYPES:
            line = g.astype(dt, copy=False) if g.dtype != dt else g
            update_core.apply_blocked(self._kernel, var2d, slots2d, line, hp, self._scratch(dt))
            return
        # numpy has no fast loops for bfloat16 / float8: compute in float32, store back.
        f32 = np.dtype(np.float32)
        v32 = var2d.astype(f32)
        s32 = [s.astype(f32) for s in slots2d]
        update_core.apply_blocked(self._kernel, v32, s32, g.astype(f32), hp, self._scratch(f32))
        var2d[...] = v32.astype(dt)
        for s, s_ in zip(slots2d, s32, strict=True):
            s[...] = s_.astype(dt)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._pv_name!r}>"
