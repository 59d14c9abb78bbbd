"""The optimizer base class: distributed apply, slots, non-slot variables, checkpoint hooks.

A step (``apply_gradients``) in a replica context goes through ``merge_call`` to
:meth:`Optimizer._distributed_apply`, which runs once in cross-replica context:

1. gradients that are ``None`` are dropped;
2. the rest are reduced with ``ReduceOp.SUM`` across replicas (``strategy.batch_reduce``);
3. slots are created next to their variables (a mirrored variable's slots are mirrored on the
   same devices, in the optimizer's shadow arenas, see :mod:`parallelvars.update_core`);
4. every variable is updated by the update core: dense gradients of variables sharing an arena
   in a few block-wise ufunc calls over all replicas at once, the rest one variable at a time;
5. the non-slot variables (the step count ``iterations``, Adam's beta powers) are updated once,
   through ``strategy.update_non_slot`` where the strategy has it;
6. ``global_step``, when given, is incremented.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np

from parallelvars import update_core
from parallelvars._storage import Arena, Placement
from parallelvars.enums import ReduceOp
from parallelvars.errors import ContextError, GradientError
from parallelvars.optimizers._sparse import IndexedSlices, sum_indexed_slices
from parallelvars.strategy import _context
from parallelvars.tracking import Module
from parallelvars.variables import ParallelVariable, ShardedVariable, _make_distributed_variable

__all__ = ["Optimizer"]

_tokens = itertools.count()
_PLAN_CACHE = 8


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name.startswith(("bfloat", "float"))



_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_shape_of = operator.attrgetter("shape")
_dtype_of = operator.attrgetter("dtype")
_NDARRAY_ONLY = {np.ndarray}


def _dense_checked(arr: np.ndarray, var: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``arr`` when it can be the dense gradient of ``var`` (its shape, a numeric dtype)."""
    if arr.shape != shape:
        raise GradientError("gradient of another shape", variable=var.name, expected=shape, found=arr.shape)
    if arr.dtype.kind not in "fiu" and not _is_float(arr.dtype):
        raise GradientError("gradient is not numeric", variable=var.name, expected="a float array", found=arr.dtype)
    return arr


def _INDEXED_SLICES_FREE(grads: list[Any]) -> bool:
    return IndexedSlices not in set(map(type, grads))

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
            0 on the first) returning one.
        name: the optimizer's name (used to name slot variables).
    """

    _sparse_as_dense: ClassVar[bool] = False

    def __init__(self, learning_rate: float | Callable[[int], float], name: str) -> None:
        if not callable(learning_rate):
            learning_rate = float(learning_rate)
        self._pv_learning_rate = learning_rate
        self._pv_name = name
        self._pv_token = next(_tokens)
        self._pv_slots: dict[str, dict[int, tuple[Any, Any]]] = {}
        self._pv_plans: dict[tuple[int, ...], tuple[tuple[Any, ...], list[update_core.Run]]] = {}
        self._pv_scratch: dict[np.dtype, update_core.Scratch] = {}
        self._pv_info: dict[int, tuple[Any, tuple[tuple[int, ...], np.dtype, bool]]] = {}
        self._pv_known: dict[tuple[int, ...], tuple[Any, ...]] = {}
        self._pv_shapes: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        self._pv_split: dict[tuple[int, ...], tuple[Any, ...]] = {}
        self._pv_non_slot_names: list[str] = []
        # Mirrored variables: compute the primary row and copy it (see update_core). False
        # computes every replica's row, for comparison.
        self._pv_replicate_mirrored = True
        self.iterations: ParallelVariable | None = None

    # ------------------------------------------------------------------ public API
    @property
    def name(self) -> str:
        return self._pv_name

    @property
    def learning_rate(self) -> float | Callable[[int], float]:
        return self._pv_learning_rate

    def apply_gradients(
        self, grads_and_vars: Iterable[tuple[Any, Any]], global_step: Any = None
    ) -> None:
        """Apply one step of gradients to their variables.

        In a replica context (inside ``strategy.run``, or outside every strategy) the call goes
        through ``merge_call``: every replica's gradients are summed and every variable is
        updated once. Gradients that are ``None`` are skipped.

        Args:
            grads_and_vars: ``(gradient, variable)`` pairs; a gradient is an array of the
                variable's shape, an :class:`~parallelvars.IndexedSlices`, or ``None``.
            global_step: an integer variable to increment by one after the update.

        Raises:
            ContextError: in a cross-replica context (inside ``strategy.scope()`` but not in a
                replica function); call :meth:`distributed_apply` there.
            GradientError: no gradient at all, or a gradient that does not fit its variable.
        """
        # Filter before merging, so every replica hands merge_call the same variables.
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        mode = _context.current_mode()
        if mode.replica_context is None:
            raise ContextError(
                f"optimizer {self._pv_name!r}: apply_gradients() was called in a cross-replica "
                f"context of {mode.strategy!r}; call it inside strategy.run(...), or use "
                "optimizer.distributed_apply(strategy, grads_and_vars) with reduced gradients"
            )
        mode.replica_context.merge_call(self._distributed_apply, args=(pairs, global_step, True))

    def distributed_apply(
        self, strategy: Any, grads_and_vars: Iterable[tuple[Any, Any]], global_step: Any = None
    ) -> None:
        """:meth:`apply_gradients` for a cross-replica context: the gradients are already merged."""
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        self._distributed_apply(strategy, pairs, global_step)

    def get_slot(self, var: Any, name: str) -> ParallelVariable | None:
        """The slot ``name`` of ``var``, or ``None`` before the first step (or if it has none)."""
        entry = self._pv_slots.get(name, {}).get(id(var))
        return None if entry is None or entry[0] is not var else entry[1]

    def get_slot_names(self) -> list[str]:
        """The names of the slots this optimizer has created, sorted."""
        return sorted(self._pv_slots)

    @property
    def non_slot_variables(self) -> list[ParallelVariable]:
        """The step count and any other state shared by all variables (e.g. beta powers)."""
        return [getattr(self, n) for n in self._pv_non_slot_names]

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
        if getattr(self, name, None) is not None:
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
        self._pv_non_slot_names.append(name)
        setattr(self, name, var)  # tracked; a pending restore fills it here

    def _create_non_slots(self, strategy: Any, var_list: Sequence[Any]) -> None:
        if self.iterations is not None:
            return
        device = var_list[0].device
        non_slot_devices = getattr(strategy, "non_slot_devices", None)
        if non_slot_devices is not None and not getattr(strategy, "_is_default", False):
            from parallelvars.devices import ParallelDevice

            found = non_slot_devices(var_list)
            device = found if isinstance(found, ParallelDevice) else ParallelDevice(list(found))
        self._add_non_slot("iterations", 0, np.int64, device)
        self._create_extra_non_slots(device)

    def _create_slots(self, var_list: Sequence[Any]) -> None:
        for slot_name, init in self._slot_specs():
            table = self._pv_slots.setdefault(slot_name, {})
            for var in var_list:
                entry = table.get(id(var))
                if entry is not None and entry[0] is var:
                    continue
                slot = self._make_slot(var, slot_name, init)
                table[id(var)] = (var, slot)
                self._maybe_restore_slot(var, slot_name, slot)

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

    def _scratch(self, dtype: np.dtype) -> update_core.Scratch:
        s = self._pv_scratch.get(dtype)
        if s is None:
            s = self._pv_scratch[dtype] = update_core.Scratch(dtype)
        return s

    # ------------------------------------------------------------------ the step
    def _reduce(self, strategy: Any, pairs: list[tuple[Any, Any]], from_replicas: bool) -> list[Any]:
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
            reduced = batch_reduce(ReduceOp.SUM, [(pairs[i][0], pairs[i][1]) for i in dense])
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
        if not isinstance(g, IndexedSlices) and isinstance(getattr(g, "values", None), (tuple, list)):
            g = g.values[0]
        if isinstance(g, IndexedSlices):
            if not shape:
                raise GradientError("a scalar variable cannot take a sparse gradient", variable=var.name)
            if g.dense_shape is not None and g.dense_shape != shape:
                raise GradientError(
                    "sparse gradient for another shape", variable=var.name, expected=shape, found=g.dense_shape
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
        arr = g if type(g) is np.ndarray else np.asarray(g.read_value() if isinstance(g, ParallelVariable) else g)
        return _dense_checked(arr, var, shape)

    def _distributed_apply(
        self,
        strategy: Any,
        grads_and_vars: list[tuple[Any, Any]],
        global_step: Any = None,
        from_replicas: bool = False,
    ) -> None:
        """The cross-replica step; the target of ``merge_call`` (``from_replicas`` then).

        ``grads_and_vars`` holds no ``None`` gradient (the public entry points filter them).
        The per-variable bookkeeping of a step is done with C-level passes (``map``,
        ``itemgetter``) once the variable list is known, so that thousands of small variables
        cost little more than their arithmetic.
        """
        pairs = grads_and_vars
        if not pairs:
            raise GradientError(
                f"optimizer {self._pv_name!r}: no gradients provided for any variable",
                hint="every gradient was None",
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
            raise GradientError("a variable appears twice in one step", variable=getattr(dup, "name", None))
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
        self._create_non_slots(strategy, var_list)
        assert self.iterations is not None
        hp = self._hyper(int(self.iterations.read_value()))
        self._update(var_list, grads, hp)

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
                fast = [info(v)[2] for v in var_list]  # one pass: the split is linear in the variables
                fast_idx = tuple(i for i, f in enumerate(fast) if f)
                split = (tuple(var_list), fast_idx, tuple(i for i, f in enumerate(fast) if not f))
                if len(self._pv_split) >= _PLAN_CACHE:
                    self._pv_split.pop(next(iter(self._pv_split)))
                self._pv_split[key] = split
            _, fast_idx, slow_idx = split
            for i in slow_idx:
                self._update_one(var_list[i], grads[i], hp)
            fast_vars = var_list if len(fast_idx) == len(var_list) else [var_list[i] for i in fast_idx]
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
            update_core.apply_runs(runs, fast_grads, self._kernel, hp, self._scratch)

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
            update_core.row_view(sv), [update_core.row_view(s) for s in ss], np.asarray(g).reshape(1, -1), hp
        )

    def _compute(self, var2d: np.ndarray, slots2d: list[np.ndarray], g: np.ndarray, hp: Any) -> None:
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
