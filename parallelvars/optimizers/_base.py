"""The optimizer: one step from every replica's gradients to every variable, in order.

A step (``apply_gradients``) in a replica context goes through ``merge_call`` to
:meth:`Optimizer._merged_apply`, which runs once in cross-replica context and goes through:

1. **drop None**: gradients that are ``None`` are dropped;
2. **reduce**: the rest are summed across replicas. Dense gradients of arena variables take the
   fused path (:mod:`parallelvars.optimizers._fused`): they are not reduced here but added
   replica by replica inside the update core's blocks, in device order (those of another
   dtype summed in their dtype and cast once per dtype); sparse ones of arena variables are
   deduplicated and applied a group at a time (:mod:`parallelvars.optimizers._sparse_step`);
   everything else goes through ``strategy.batch_reduce``, one value per variable
   (:meth:`Optimizer._reduce`);
3. **slots**: slots are created next to their variables, unless :meth:`Optimizer.build` or a
   restore made them before (:mod:`parallelvars.optimizers._slots`);
4. **update**: every variable is updated by the update core: variables sharing an arena in a few
   block-wise ufunc calls over all replicas at once, the rest one variable at a time
   (:meth:`Optimizer._update_one`);
5. **non-slots**: the non-slot variables (the step count ``iterations``, Adam's beta powers) are
   updated once, through ``strategy.update_non_slot`` where the strategy has it, and
   ``global_step``, when given, is incremented.

A cross-replica :meth:`Optimizer.distributed_apply` takes gradients already merged and goes
through the same steps.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np

from parallelvars import update_core
from parallelvars.enums import ReduceOp
from parallelvars.errors import ContextError, GradientError
from parallelvars.optimizers._checks import _is_float, check_gradient, check_replica_shapes
from parallelvars.optimizers._fused import (
    PLAN_CACHE,
    BufferPairs,
    FusedLines,
    FusedTransport,
    GradientBuffers,
    ReplicaGradients,
    unzipped,
)
from parallelvars.optimizers._slots import OptimizerState
from parallelvars.optimizers._sparse import IndexedSlices, sum_indexed_slices
from parallelvars.optimizers._sparse_step import SparseBatch
from parallelvars.strategy import _context
from parallelvars.strategy._values import PerReplica
from parallelvars.variables import ParallelVariable, ShardedVariable

__all__ = ["GradientBuffers", "Optimizer"]


_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_shape_of = operator.attrgetter("shape")
_dtype_of = operator.attrgetter("dtype")
_NDARRAY_ONLY = {np.ndarray}


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


def _INDEXED_SLICES_FREE(grads: list[Any]) -> bool:
    return IndexedSlices not in set(map(type, grads))


class Optimizer(OptimizerState):
    """Base class of the optimizers: subclasses give slots, hyperparameters and a kernel.

    A step is ``opt.apply_gradients(zip(grads, variables))`` (any iterable of pairs) or, without
    a pair per variable, ``opt.apply(grads, variables)``, in a replica function or outside
    every strategy; ``opt.distributed_apply(strategy, pairs)`` in a cross-replica context.

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
        super().__init__(name)
        if not callable(learning_rate):
            learning_rate = float(learning_rate)
        elif not _takes_an_argument(learning_rate):
            # TensorFlow's callable hyperparameters take no argument: call it every step.
            schedule: Any = learning_rate
            learning_rate = lambda step: schedule()  # noqa: E731
        self._pv_learning_rate: float | Callable[[int], float] = learning_rate  # type: ignore[assignment]
        self._pv_plans: dict[tuple[int, ...], tuple[tuple[Any, ...], list[update_core.Run]]] = {}
        self._pv_scratch: dict[np.dtype, update_core.UpdateScratch] = {}
        self._pv_info: dict[int, tuple[Any, tuple[tuple[int, ...], np.dtype, bool]]] = {}
        self._pv_known: dict[tuple[int, ...], tuple[Any, ...]] = {}
        self._pv_shapes: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        self._pv_split: dict[tuple[int, ...], tuple[Any, ...]] = {}
        # Mirrored variables: compute the primary row and copy it (see update_core). False
        # computes every replica's row, for comparison.
        self._pv_replicate_mirrored = True
        # The fused path of apply_gradients and the gather plans of the dense update.
        self._pv_transport = FusedTransport(self)

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
        updated once. Gradients that are ``None`` are skipped. :meth:`apply` takes the
        gradients and the variables as two lists instead, without making pairs.

        Args:
            grads_and_vars: ``(gradient, variable)`` pairs (a list, ``zip(grads, variables)``,
                any iterable); a gradient is an array of the variable's shape, an
                :class:`~parallelvars.IndexedSlices`, or ``None``.
            global_step: an integer variable to increment by one after the update.
            name: accepted for code ported from TensorFlow (an op name there); unused.

        Raises:
            ContextError: in a cross-replica context (inside ``strategy.scope()`` but not in a
                replica function); call :meth:`distributed_apply` there.
            GradientError: no gradient at all, or a gradient that does not fit its variable
                (a non-numeric gradient: :class:`~parallelvars.errors.GradientTypeError`, also
                a ``TypeError``).
        """
        if type(grads_and_vars) is BufferPairs and grads_and_vars.intact():
            mine = grads_and_vars.replica_gradients()  # gradient buffers' views, as they are
        else:
            # zip(grads, variables) of two lists: the lists themselves, sliced (no Python step
            # per variable) unless a gradient is None.
            lists = unzipped(grads_and_vars)
            if lists is not None and type(None) not in set(map(type, lists[0])):
                mine = ReplicaGradients(*lists)
            else:
                # Two lists, no pair kept: iterating a zip hands out one reused tuple.
                grads: list[Any] = []
                variables: list[Any] = []
                add_grad, add_var = grads.append, variables.append
                for g, v in grads_and_vars if lists is None else zip(*lists, strict=True):
                    if g is not None:
                        add_grad(g)
                        add_var(v)
                mine = ReplicaGradients(grads, variables)
        self._apply_in_replica("apply_gradients", mine, global_step)

    def apply(
        self, grads: Sequence[Any], trainable_variables: Sequence[Any], global_step: Any = None
    ) -> None:
        """:meth:`apply_gradients` with the gradients and the variables as two lists (Keras 3's
        ``apply``): ``opt.apply(grads, variables)`` is
        ``opt.apply_gradients(zip(grads, variables))`` without making a pair per variable,
        which a step over thousands of small variables notices.

        The lists are read during the call and never changed; a ``None`` gradient skips its
        variable.

        Args:
            grads: one gradient per variable (an array, an :class:`~parallelvars.IndexedSlices`,
                or ``None``).
            trainable_variables: the variables, in the order of ``grads``.
            global_step: an integer variable to increment by one after the update.

        Raises:
            GradientError: not one gradient per variable; and as :meth:`apply_gradients`.
            ContextError: as :meth:`apply_gradients`.

        Example:
            >>> import numpy as np, parallelvars as pv
            >>> w = pv.Variable(np.ones(2, np.float32))
            >>> pv.optimizers.SGD(0.5).apply([np.ones(2, np.float32)], [w])
            >>> w.tolist()
            [0.5, 0.5]
        """
        if type(grads) not in (list, tuple):
            grads = list(grads)
        if type(trainable_variables) not in (list, tuple):
            trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise GradientError(
                f"optimizer {self._pv_name!r}: apply() needs one gradient per variable",
                expected=f"{len(trainable_variables)} gradients",
                found=f"{len(grads)} gradients",
            )
        self._apply_in_replica("apply", ReplicaGradients(grads, trainable_variables), global_step)

    def _apply_in_replica(self, method: str, mine: ReplicaGradients, global_step: Any) -> None:
        mode = _context.current_mode()
        if mode.replica_context is None:
            raise ContextError(
                f"optimizer {self._pv_name!r}: {method}() was called in a cross-replica "
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
            GradientError: a variable the update core does not run over (a sharded variable
                whose full array is not contiguous): give those gradients as plain arrays.
            ContextError: the first call for variables on several devices made outside the
                strategy's scope (its buffers would have one replica's part).
        """
        replicas = _context.current_mode().strategy._local_replica_count()
        return self._pv_transport.buffers_for(list(var_list), replicas)

    def _merged_apply(self, strategy: Any, grads: Any, global_step: Any) -> None:
        """The target of ``apply_gradients``' merge_call: the step, with the fused path.

        Dense gradients of a float variable (any width) with an arena placement, of the variable's
        dtype and shape, take the fused path (see :mod:`parallelvars.optimizers._fused`): the
        update core reads each local replica's gradients as they are, block by block (or the
        user's :class:`GradientBuffers`, or, over several processes, flat buffers all-reduced
        in one call per dtype), and adds the local replicas in device order as it updates.
        One array object that every replica gives is a term once per replica, on either path.
        Dense gradients of another dtype are summed in it and cast once per dtype; sparse
        gradients of arena variables take the vectorised sparse route. The rest (see
        docs/training.md) goes through ``batch_reduce``, in the same step.
        """
        parts: Sequence[ReplicaGradients] = (
            grads.values if isinstance(grads, PerReplica) else (grads,)
        )
        if not all(type(p) is ReplicaGradients for p in parts):
            raise GradientError("apply_gradients: merge_call arguments of another kind")
        transport = self._pv_transport
        # A training loop: the variables of the last step, every gradient on the fused path.
        steady = transport.steady(strategy, parts)
        if steady is not None:
            self._distributed_apply(strategy, [], global_step, True, [steady])
            return
        parts = [p.without_none() for p in parts]  # as each replica would have before merging
        rest, fused, sparse = transport.split(strategy, parts)
        self._distributed_apply(strategy, rest, global_step, True, fused, sparse)

    def distributed_apply(
        self, strategy: Any, grads_and_vars: Iterable[tuple[Any, Any]], global_step: Any = None
    ) -> None:
        """:meth:`apply_gradients` for a cross-replica context: the gradients are already merged."""
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        self._distributed_apply(strategy, pairs, global_step)

    # ------------------------------------------------------------------ to override
    # (and _slot_specs, _create_extra_non_slots: see OptimizerState)
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

    def _finish_extra(self) -> None:
        """Update the extra non-slot variables once per step."""

    # ------------------------------------------------------------------ helpers
    def _lr(self, step: int) -> float:
        lr = self._pv_learning_rate
        return float(lr(step)) if callable(lr) else lr

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
        mixed: dict[int, PerReplica] = {}
        for i, (g, _) in enumerate(pairs):
            if type(g) is np.ndarray and plain_ok:  # the common case, kept cheap
                out[i] = g
                continue
            parts = getattr(g, "values", None)
            per_replica = not isinstance(g, IndexedSlices) and isinstance(parts, (tuple, list))
            if isinstance(g, IndexedSlices):
                out[i] = sum_indexed_slices([g] * n) if from_replicas and n > 1 else g
            elif (
                per_replica
                and parts
                and isinstance(parts[0], IndexedSlices)
                and all(isinstance(p, IndexedSlices) for p in parts)
            ):
                if getattr(strategy, "_reduces_sparse", False):  # gathered across processes
                    dense.append(i)
                else:
                    out[i] = sum_indexed_slices(list(parts), getattr(pairs[i][1], "name", None))
            elif per_replica and parts and any(isinstance(p, IndexedSlices) for p in parts):
                # The replicas disagree about the form (some sparse, some dense): the sparse
                # ones, checked, are made dense and all are summed as dense values, as
                # TensorFlow's add_n makes such a mix dense.
                var = pairs[i][1]
                shape = self._info(var)[0]
                check_replica_shapes(parts, var, shape)
                made = [
                    check_gradient(p, var, shape, True) if isinstance(p, IndexedSlices) else p
                    for p in parts
                ]
                mixed[i] = PerReplica(made)
                dense.append(i)
            elif batch_reduce is None or not (per_replica or (from_replicas and n > 1)):
                out[i] = g
            else:
                if per_replica:  # each replica's value checked: a sum would broadcast
                    var = pairs[i][1]
                    check_replica_shapes(parts, var, self._info(var)[0])
                dense.append(i)
        if dense and batch_reduce is not None:
            local = len(getattr(strategy, "worker_devices", ())) or 1
            values = []
            for i in dense:
                g = mixed.get(i, pairs[i][0])
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
        # Arena variables (sharded ones too: their full value is an arena row), and sharded
        # ones made around a contiguous array of their own (see update_core.flat_run).
        fast = var.placement is not None or (
            isinstance(var, ShardedVariable) and var.__wrapped__.flags.c_contiguous
        )
        info = (tuple(var.shape), dtype, fast)
        self._pv_info[id(var)] = (var, info)
        return info

    def _check(self, g: Any, var: Any) -> Any:
        return check_gradient(g, var, self._info(var)[0], self._sparse_as_dense)

    def _distributed_apply(
        self,
        strategy: Any,
        grads_and_vars: list[tuple[Any, Any]],
        global_step: Any = None,
        from_replicas: bool = False,
        fused: Sequence[FusedLines] = (),
        sparse: SparseBatch | None = None,
    ) -> None:
        """The cross-replica step; the target of ``merge_call`` (``from_replicas`` then).

        ``grads_and_vars`` holds no ``None`` gradient (the public entry points filter them).
        The per-variable bookkeeping of a step is done with C-level passes (``map``,
        ``itemgetter``) once the variable list is known, so that thousands of small variables
        cost little more than their arithmetic. ``fused``: more variables of the step, whose
        gradients are flat buffers or arrays summed inside the update (see
        :meth:`_merged_apply`); ``sparse``: more, whose
        sparse gradients are checked and deduplicated already.
        """
        pairs = grads_and_vars
        transport = self._pv_transport
        if not pairs and not fused and sparse is None:
            raise GradientError(
                f"optimizer {self._pv_name!r}: no gradients provided for any variable",
                hint="every gradient was None, or no (gradient, variable) pair was given",
            )
        var_list: list[Any] = []
        dense: tuple[list[Any], list[Any]] = ([], [])
        rows: SparseBatch | None = None
        if pairs:
            var_list, dense, rows = self._checked(strategy, pairs, from_replicas)
        if self.iterations is None:  # the first step: the counters, on the variables' devices
            self._create_non_slots(
                strategy,
                [
                    *(v for f in fused for v in f.variables),
                    *(sparse.variables if sparse is not None else ()),
                    *var_list,
                ],
            )
        assert self.iterations is not None
        hp = self._hyper(int(self.iterations.read_value()))
        for f in fused:
            transport.apply(f, self._kernel, hp, self._scratch)
        if sparse is not None:
            transport.sparse.apply(sparse, hp)
        if dense[0]:
            self._update(*dense, hp)
        if rows:
            transport.sparse.apply(rows, hp)
        self._step_done(strategy, global_step)

    def _checked(
        self, strategy: Any, pairs: list[tuple[Any, Any]], from_replicas: bool
    ) -> tuple[list[Any], tuple[list[Any], list[Any]], SparseBatch | None]:
        """The step's variables; those the update takes one reduced and checked gradient each
        of, with their gradients; and the sparse gradients of arena variables, checked and
        deduplicated together (None when there is none). Makes the slots a new list lacks.

        Raises:
            GradientError: a variable appears twice, or a gradient does not fit its variable.
        """
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
        # Sparse gradients of arena variables: checked, deduplicated and applied together.
        rows = None if _INDEXED_SLICES_FREE(reduced) else self._sparse_batch(var_list, reduced)
        shapes = self._pv_shapes.get(key) if steady else None
        if (
            shapes is not None
            and set(map(type, reduced)) == _NDARRAY_ONLY
            and all(dt.kind in "fiu" for dt in set(map(_dtype_of, reduced)))
            and list(map(_shape_of, reduced)) == shapes
        ):
            dense = (var_list, reduced)  # the steady state: plain arrays of the known shapes
        elif rows:
            taken = set(rows.positions)
            rest = [i for i in range(len(var_list)) if i not in taken]
            dense = (
                [var_list[i] for i in rest],
                [self._check(reduced[i], var_list[i]) for i in rest],
            )
        else:
            dense = (var_list, list(map(self._check, reduced, var_list)))
        if not steady:
            self._create_slots(var_list)
            if len(self._pv_known) >= PLAN_CACHE:
                self._pv_shapes.pop(next(iter(self._pv_known)), None)
                self._pv_known.pop(next(iter(self._pv_known)))
            self._pv_known[key] = tuple(var_list)
            self._pv_shapes[key] = [self._info(v)[0] for v in var_list]
        return var_list, dense, rows

    def _sparse_batch(self, var_list: list[Any], reduced: list[Any]) -> SparseBatch | None:
        """The reduced sparse gradients of arena variables, checked and deduplicated a group at
        a time (see :mod:`parallelvars.optimizers._sparse_step`); None when there is none.

        A gradient that fails a check stays out with its group (the per-variable check raises
        its error, before any update).
        """
        sparse = self._pv_transport.sparse
        positions = [
            i
            for i, (g, v) in enumerate(zip(reduced, var_list, strict=True))
            if type(g) is IndexedSlices and sparse.capable(v)
        ]
        if not positions:
            return None
        batch = sparse.prepare(
            [var_list[i] for i in positions], positions, [[reduced[i] for i in positions]]
        )
        return batch if batch else None

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
                if len(self._pv_split) >= PLAN_CACHE:
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
            self._pv_transport.apply_dense(fast_vars, fast_grads, self._kernel, hp, self._scratch)

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
                if v.placement is not None
            ],
            lambda arena: [self._slot_arena(arena, n) for n in names],
        )
        # Sharded variables made around an array of their own: that array, with their slots'.
        for i, v in enumerate(fast_vars):
            if v.placement is None:
                slots = [self.get_slot(v, n) for n in names]
                runs.append(
                    update_core.flat_run(
                        i, v.__wrapped__, [s.__wrapped__ for s in slots if s is not None]
                    )
                )
        if len(self._pv_plans) >= PLAN_CACHE:
            self._pv_plans.pop(next(iter(self._pv_plans)))
        self._pv_plans[key] = (tuple(fast_vars), runs)
        return runs

    def _update_one(self, var: Any, g: Any, hp: Any) -> None:
        """The per-variable path: sparse rows, and variables the update core cannot run over
        (a sharded variable whose full array is not contiguous)."""
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
        # The gradient is rounded to the variable's dtype first, on every path; bfloat16 and
        # float8 are then computed in float32 block by block (see update_core.UpdateScratch).
        dt = var2d.dtype
        line = g.astype(dt, copy=False) if g.dtype != dt else g
        update_core.apply_blocked(self._kernel, var2d, slots2d, line, hp, self._scratch(dt))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._pv_name!r}>"
