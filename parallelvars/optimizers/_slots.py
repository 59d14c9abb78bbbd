"""Slots and non-slot variables: the state an optimizer keeps besides its hyperparameters.

Every trained variable has one slot variable per name the optimizer's rule asks for (Adam's
``m`` and ``v``), made next to it: a mirrored variable's slots are mirrored on the same devices,
at the same columns of the optimizer's shadow arenas (see :mod:`parallelvars.update_core`), so
one block of the update reads a variable and its slots at one offset; a sharded variable's
slots are sharded like it. The non-slot variables (the step count ``iterations``, Adam's beta
powers) are made once, on the strategy's non-slot devices.

State is made *staged* and then *attached*: what a step, :meth:`OptimizerState.build` or a
restore needs is made first, every value a restore left pending for it is checked, and only
then does the optimizer own it, so a mismatch leaves the optimizer as it was. The checkpoint
hooks (``_checkpoint_slots``, ``_lookup_slot``, ``_checkpoint_stage``, see
:class:`~parallelvars.tracking.Trackable`) read and make this state for the checkpoint.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from parallelvars._creation import _make_distributed_variable
from parallelvars._storage import Arena, Placement
from parallelvars.errors import GradientError
from parallelvars.strategy import _context
from parallelvars.tracking import Module
from parallelvars.variables import ParallelVariable, RankShardedVariable, ShardedVariable

__all__ = ["OptimizerState"]

_tokens = itertools.count()


class OptimizerState(Module):
    """The slots and non-slot variables of an optimizer, and the checkpoint hooks over them.

    :class:`~parallelvars.optimizers.Optimizer` derives from it; a rule gives
    :meth:`_slot_specs` and, for non-slot variables besides ``iterations``,
    :meth:`_create_extra_non_slots` (which calls :meth:`_add_non_slot`).

    Args:
        name: the optimizer's name (non-slot variables are named ``{name}/{variable}``).
    """

    def __init__(self, name: str) -> None:
        self._pv_name = name
        self._pv_token = next(_tokens)
        self._pv_slots: dict[str, dict[int, tuple[Any, Any]]] = {}
        self._pv_non_slot_names: list[str] = []
        self.iterations: ParallelVariable | None = None
        # Non-slot variables being made by _stage_non_slots (name -> variable), else None.
        self._pv_staging: dict[str, Any] | None = None

    # ------------------------------------------------------------------ to override
    def _slot_specs(self) -> list[tuple[str, float]]:
        """``(slot name, initial value)`` pairs, in the kernel's slot order."""
        return []

    def _create_extra_non_slots(self, device: Any) -> None:
        """Create non-slot variables besides ``iterations`` (on ``device``)."""

    def _info(self, var: Any) -> tuple[tuple[int, ...], np.dtype, bool]:
        """``(shape, dtype, on the fast path)`` of a variable this optimizer can train.

        Raises:
            GradientError: a variable it cannot train.
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ public API
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

    # ------------------------------------------------------------------ making state
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
        if not var_list and children and self.iterations is None:
            # Slots made before the restore (``gradient_buffers()``): the counters are made
            # now all the same, for the variables those slots belong to.
            for var, _, _ in self._checkpoint_slots():
                if id(var) not in seen:
                    seen.add(id(var))
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
        if isinstance(var, RankShardedVariable):  # this process's shard, sharded like var
            return var.like(np.full(shape, init, var.dtype), name)
        pl = var.placement
        if isinstance(var, ShardedVariable) and pl is None:
            # A sharded variable made around an array of its own: so is its slot.
            return ShardedVariable(
                np.full(shape, init, var.dtype),
                device=var.device,
                name=name,
                shard_axis=var.shard_axis,
                trainable=False,
            )
        if pl is None:  # pragma: no cover - float variables always get an arena
            raise GradientError("variable has no arena placement", variable=var.name)
        shadow = self._slot_arena(pl.arena, slot_name)
        # Fill the alignment padding after the variable too: a run covering it then sees a
        # positive accumulator there, never 0 / 0.
        end = shadow.end_of(pl.offset, pl.size)
        shadow.buffer[:, pl.offset : end] = init
        if isinstance(var, ShardedVariable):
            # Sharded like the variable, its full value at the same columns of the shadow.
            return ShardedVariable(
                shadow.view(pl.offset, shape)[0],
                device=var.device,
                name=name,
                shard_axis=var.shard_axis,
                trainable=False,
                placement=Placement(shadow, pl.offset, pl.size),
            )
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
