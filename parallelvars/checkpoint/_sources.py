"""What ``Checkpoint.restore`` reads: our HDF5 layout, or any other format we read.

A native checkpoint is read by :class:`~parallelvars.checkpoint.h5io.H5Reader`. Any other
format (a TensorFlow prefix or directory, safetensors, a shard set's index, npz, a Keras
``.weights.h5`` or ``.keras``) is opened through :mod:`parallelvars.formats` (imported only
then: the core does not need the adapters) and its entries are shown to the restore rules
as stored variables (:class:`StagedEntry`).

All or nothing holds for both. A native file has a checksum per component, verified before
the first value is written. Another format's reader checks what it can (sizes against the
file at opening, checksums where the format has them) as it reads; so the check pass of a
restore reads every component of another format into memory and the apply pass copies from
there: nothing is written until everything was read. The cost is one copy of the restored
values held at once.

A name-based TensorFlow checkpoint (``tf.compat.v1.train.Saver``: no object graph, keys are
variable names) is seen through the live model (:func:`by_live_names`): a key that is a live
variable's path stays; else the one live variable with that ``name`` takes it; TF1 optimizer
slots (``<variable>/Adam``, ``<variable>/Adam_1``, ...) and Adam's beta powers go to the one
optimizer among the checkpoint's objects when its kind is the one that wrote them. What cannot
be told keeps its key and a reason, listed by the load status.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from parallelvars.checkpoint._foreign import foreign_kind
from parallelvars.checkpoint.entry import Entry
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.errors import MissingVariableError, NotACheckpointError, ParallelVarsError

__all__ = ["NamedSource", "StagedEntry", "ViewSource", "by_live_names", "open_source", "reasons_of"]


class StagedEntry(Entry):
    """An entry of another format's view as a restore reads it.

    :meth:`verify` reads component ``i`` (the format's own checks run then) and keeps it;
    :meth:`read_component_into` copies it into place and lets it go.
    """

    def __init__(self, entry: Any) -> None:
        self._entry = entry
        self.path: str = entry.path
        self.kind: str = entry.kind
        self.dtype = np.dtype(entry.dtype)
        self.shape = tuple(int(s) for s in entry.shape)
        self.num_components = int(entry.num_components)
        self.attrs: dict[str, Any] = dict(entry.attrs or {})
        self._staged: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def component_shape(self, i: int) -> tuple[int, ...]:
        return tuple(int(s) for s in self._entry.component_shape(i))

    def component_nbytes(self, i: int) -> int:
        return int(self._entry.component_nbytes(i))

    @property
    def nbytes(self) -> int:
        return sum(self.component_nbytes(i) for i in range(self.num_components))

    def verify(self, i: int) -> None:
        """Read component ``i`` now (raising whatever the format finds wrong) and keep it."""
        data = self._entry.component(i)
        with self._lock:
            self._staged[i] = data

    def component(self, i: int) -> np.ndarray:
        """Component ``i``: the copy :meth:`verify` kept (handed over, not kept twice), else
        read now."""
        with self._lock:
            data = self._staged.pop(i, None)
        return self._entry.component(i) if data is None else data

    def read_component_into(self, i: int, out: np.ndarray, *, cast: bool = False) -> None:
        """Copy component ``i`` into ``out``: its shape, and its dtype unless ``cast`` (the
        restore rules checked both against the entry before planning this read)."""
        del cast  # a dtype other than the entry's reaches here only when casting is allowed
        with self._lock:
            data = self._staged.pop(i, None)
        if data is None:
            data = self._entry.component(i)
        if out.dtype == data.dtype:
            np.copyto(out, data)
        else:
            out[...] = data.astype(out.dtype)


class ViewSource(Mapping[str, StagedEntry]):
    """A view of another format as a restore reads it: staged entries and the native graph
    the file carries (``object_graph``; None when it carries none)."""

    def __init__(self, path: str, format: str) -> None:
        from parallelvars.formats import open_checkpoint
        from parallelvars.formats._graph import carried_graph

        self.path = path
        self.format = format
        self.view = open_checkpoint(path, format=format)
        self.object_graph = carried_graph(self.view)

    def __getitem__(self, key: str) -> StagedEntry:
        return StagedEntry(self.view[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.view)

    def __len__(self) -> int:
        return len(self.view)

    def stage(self, variables: Iterable[Any]) -> set[tuple[str, int]]:
        """The native reader's read-ahead (:meth:`H5Reader.stage`); another format reads each
        component when it is verified, so nothing is read ahead and nothing is verified here."""
        del variables
        return set()

    def unstage(self) -> None:
        """Nothing was read ahead (see :meth:`stage`)."""

    def close(self) -> None:
        self.view.close()

    def __del__(self) -> None:
        # A restore with pending slots keeps its source open until they are created; one that
        # never is closes with the source (as H5Reader does).
        with contextlib.suppress(Exception):
            self.close()


def _detected(path: str) -> str | None:
    """The format detection gives ``path`` when it is one we read other than our own, else None."""
    from parallelvars.formats import detect_format

    try:
        name = detect_format(path)
    except ParallelVarsError:
        return None
    return None if name == "hdf5" else name


def open_source(path: str) -> H5Reader | ViewSource:
    """Open ``path`` for a restore: an :class:`H5Reader`, or a :class:`ViewSource` for a file of
    another format we read. What is neither raises the native reader's error (which
    ``Checkpoint.restore`` completes with a hint where one helps)."""
    kind = foreign_kind(path)  # a coarse look at the name and first bytes: no import
    if kind is not None and kind != "hdf5":
        name = _detected(path)
        if name is not None:
            return ViewSource(path, name)
    try:
        return H5Reader(path, map_file=True)
    except NotACheckpointError:
        name = _detected(path) if kind == "hdf5" else None  # a Keras file under a plain name
        if name is None:
            raise
    return ViewSource(path, name)


class NamedSource(Mapping[str, StagedEntry]):
    """A name-based source under the live model's paths (see :func:`by_live_names`).

    Attributes:
        renames: our path -> the saved key, for the keys given another path.
        slots: our path -> ``(slot_of, slot_name)`` for the slots mapped onto an optimizer.
        reasons: saved key -> why it was not mapped.
    """

    def __init__(
        self,
        source: ViewSource,
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

    def over(self, source: ViewSource) -> NamedSource:
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

    def close(self) -> None:
        self.source.close()


def _tf1_kind(opt: Any) -> str | None:
    """The TF1 optimizer name whose update rule ``opt`` runs (the exact class only: AdamW
    is not TF1's Adam)."""
    from parallelvars.optimizers import Adagrad, Adam, Momentum, RMSProp

    kinds = {Adam: "Adam", Momentum: "Momentum", Adagrad: "Adagrad", RMSProp: "RMSProp"}
    return kinds.get(type(opt))


def by_live_names(source: H5Reader | ViewSource, root: Any) -> H5Reader | ViewSource | NamedSource:
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
    if not isinstance(source, ViewSource) or source.object_graph is not None:
        return source
    view = source.view
    if source.format != "tf" or (getattr(view, "metadata", None) or {}).get("tf_naming") != "name":
        return source
    from parallelvars.checkpoint.graph import build_object_graph, escape_name
    from parallelvars.formats.tf._tf1 import TF1_NON_SLOTS, tf1_slots
    from parallelvars.optimizers import Optimizer

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


_KERAS_VARIABLES = re.compile(r"^(?:(.*)/)?_variables/[0-9]+$")


def reasons_of(source: Mapping[str, Any]) -> dict[str, str]:
    """Why some saved values of ``source`` cannot restore anywhere, by path: what a
    :class:`NamedSource` could not map, and a Keras 3 optimizer's state in a TensorFlow
    checkpoint (an object with ``_variables/<i>`` children; its ``_iterations`` and
    ``_learning_rate`` too)."""
    out = dict(getattr(source, "reasons", None) or {})
    if getattr(source, "format", None) != "tf":
        return out
    owners = {m.group(1) or "" for path in source if (m := _KERAS_VARIABLES.match(path))}
    for path in source:
        parent, _, name = path.rpartition("/")
        counter = parent in owners and name in ("_iterations", "_learning_rate")
        if path not in out and (counter or _KERAS_VARIABLES.match(path)):
            out[path] = KERAS_OPTIMIZER_REASON
    return out


#: Why a Keras 3 optimizer's state in a TensorFlow checkpoint is not restored.
KERAS_OPTIMIZER_REASON = (
    "a Keras 3 optimizer's state (its variables saved by position, no beta powers): not "
    "mapped onto our optimizers"
)
