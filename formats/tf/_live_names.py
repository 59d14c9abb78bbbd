"""A name-based TensorFlow checkpoint seen through the live model: what a restore of one
reads (:meth:`parallelvars.formats._source.ViewSource.for_root`).

A key that is a live variable's path stays; else the one live variable with that ``name``
takes it; TF1 optimizer slots (``<variable>/Adam``, ``<variable>/Adam_1``, ...) and Adam's beta
powers go to the one optimizer among the checkpoint's objects when its kind is the one that
wrote them (:mod:`._tf1` knows how TF1 names them). What cannot be told keeps its key and a
reason, listed by the load status.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from parallelvars.checkpoint.graph import build_object_graph, escape_name
from parallelvars.errors import MissingVariableError
from parallelvars.optimizers import Adagrad, Adam, Momentum, Optimizer, RMSProp

from .._staged import StagedEntry, reasons_of
from ._tf1 import TF1_NON_SLOTS, tf1_slots

__all__ = ["NamedSource", "by_live_names"]


class NamedSource(Mapping[str, StagedEntry]):
    """A name-based source under the live model's paths (see :func:`by_live_names`).

    Attributes:
        renames: our path -> the saved key, for the keys given another path.
        slots: our path -> ``(slot_of, slot_name)`` for the slots mapped onto an optimizer.
        reasons: saved key -> why it was not mapped.
    """

    def __init__(
        self,
        source: Any,  # a ViewSource of formats._source
        renames: dict[str, str],
        slots: dict[str, tuple[str, str]],
        reasons: dict[str, str],
    ) -> None:
        self.source = source
        self.path = source.path
        self.format = source.format
        self.object_graph = None
        self.renames = renames
        self.slots = slots
        self.reasons = reasons
        self._moved = set(renames.values())
        self._paths = [*renames, *(k for k in source if k not in self._moved)]

    def over(self, source: Any) -> NamedSource:
        """The same mapping over ``source`` (the file opened again)."""
        return NamedSource(source, self.renames, self.slots, self.reasons)

    def __getitem__(self, path: str) -> StagedEntry:
        key = self.renames.get(path)
        if key is None:
            if path in self._moved or path not in self.source:
                raise MissingVariableError("no such variable", file=self.path, variable=path)
            return self.source[path]
        entry = self.source[key]
        entry.path = path
        slot = self.slots.get(path)
        if slot is not None:
            entry.attrs["slot_of"], entry.attrs["slot_name"] = slot
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def stage(self, variables: Iterable[Any]) -> set[tuple[str, int]]:
        """The native reader's read-ahead (:meth:`H5Reader.stage`); another format reads each
        component when it is verified, so nothing is read ahead and nothing is verified here."""
        del variables
        return set()

    def unstage(self) -> None:
        """Nothing was read ahead (see :meth:`stage`)."""

    def unrestorable(self) -> dict[str, str]:
        """Saved keys no live object can take, with the reason (``reasons`` and
        :func:`~parallelvars.formats._source.reasons_of`)."""
        return reasons_of(self)

    def close(self) -> None:
        self.source.close()


def _tf1_kind(opt: Any) -> str | None:
    """The TF1 optimizer name whose update rule ``opt`` runs (the exact class only: AdamW
    is not TF1's Adam)."""
    kinds = {Adam: "Adam", Momentum: "Momentum", Adagrad: "Adagrad", RMSProp: "RMSProp"}
    return kinds.get(type(opt))


def by_live_names(source: Any, root: Any) -> Any:
    """``source`` seen through the live objects of ``root`` when it is a name-based TensorFlow
    checkpoint, else ``source`` itself.

    A key that is the path of a live variable keeps it; else the one live variable whose
    ``name`` is the key takes it (several: not mapped). A TF1 slot key (see
    :mod:`parallelvars.formats.tf._tf1`) becomes ``<optimizer>/slots/<variable path>/<slot>``
    of the one optimizer among ``root``'s objects, and Adam's ``beta1_power`` /
    ``beta2_power`` its counters, when that optimizer runs the TF1 rule that wrote them (the
    same class; for RMSProp, centered or not as the keys show) and the slot's variable was
    mapped. Anything else keeps its key, with the reason in ``reasons``.
    """
    if source.object_graph is not None:
        return source
    view = source.view
    if source.format != "tf" or (getattr(view, "metadata", None) or {}).get("tf_naming") != "name":
        return source
    graph = build_object_graph(root)
    live = {path: obj for _, obj, path in graph.variables()}
    by_name: dict[str, list[str]] = {}
    for path, obj in live.items():
        name = getattr(obj, "name", None)
        if isinstance(name, str) and name:
            by_name.setdefault(name, []).append(path)
    optimizers = [
        (graph.path_of(i), obj) for i, obj in enumerate(graph.objects) if isinstance(obj, Optimizer)
    ]
    keys = list(view)
    slots = tf1_slots(keys, {k: tuple(view[k].shape) for k in keys})
    renames: dict[str, str] = {}
    relations: dict[str, tuple[str, str]] = {}
    reasons: dict[str, str] = {}
    placed: dict[str, str] = {}  # saved key -> live path
    taken = {k for k in keys if k in live and k not in slots}
    for key in keys:
        if key in slots:
            continue
        if key in live:
            placed[key] = key
            continue
        named = [p for p in by_name.get(key, ()) if p not in taken]
        if len(named) == 1:
            placed[key] = named[0]
            renames[named[0]] = key
            taken.add(named[0])
        elif len(named) > 1:
            reasons[key] = (
                f"{len(named)} live variables are named {key!r} "
                f"({', '.join(sorted(named)[:3])}): which one it is cannot be told"
            )

    def optimizer_for(key: str, what: str, kind: str) -> tuple[str, Any] | None:
        if not optimizers:
            reasons[key] = f"{what}: no optimizer among the checkpoint's objects"
            return None
        if len(optimizers) > 1:
            paths = ", ".join(sorted(p for p, _ in optimizers)[:3])
            reasons[key] = (
                f"{what}: the checkpoint's objects hold {len(optimizers)} optimizers "
                f"({paths}); whose state it is cannot be told"
            )
            return None
        path, opt = optimizers[0]
        if _tf1_kind(opt) != kind:
            reasons[key] = f"{what}: the live optimizer {path!r} is {type(opt).__name__}"
            return None
        return path, opt

    for key, slot in slots.items():
        what = f"a TF1 {slot.optimizer} slot of {slot.variable!r}"
        if slot.slot_name is None:
            reasons[key] = slot.reason
            continue
        found = optimizer_for(key, what, slot.optimizer)
        if found is None:
            continue
        opt_path, opt = found
        if slot.optimizer == "RMSProp":
            centered = any(
                s.variable == slot.variable and s.slot_name == "mg" for s in slots.values()
            )
            if centered != bool(opt.centered):
                reasons[key] = (
                    f"{what}: saved {'centered' if centered else 'not centered'}, the live "
                    f"RMSProp is {'centered' if opt.centered else 'not centered'}"
                )
                continue
        var_path = placed.get(slot.variable)
        if var_path is None:
            reasons[key] = f"{what}: its variable matched no live variable by path or name"
            continue
        target = f"{opt_path}/slots/{var_path}/{escape_name(slot.slot_name)}"
        renames[target] = key
        relations[target] = (var_path, slot.slot_name)
    for kind, counters in TF1_NON_SLOTS.items():
        for key, counter in counters.items():
            if key not in view or key in placed:
                continue
            found = optimizer_for(key, f"TF1 {kind}'s {key}", kind)
            if found is not None:
                renames[f"{found[0]}/{escape_name(counter)}"] = key
    clash = set(renames) & (set(keys) - set(renames.values()))
    for path in clash:  # a new path that another key already has: neither is moved
        reasons[renames.pop(path)] = f"its live path {path!r} is another saved key"
        relations.pop(path, None)
    return NamedSource(source, renames, relations, reasons)
