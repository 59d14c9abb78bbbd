"""How ``tf.compat.v1.train.Saver`` names an optimizer's state in a name-based checkpoint.

A TF1 optimizer makes each slot of a variable ``V`` under the scope ``V/<optimizer name>``,
which TensorFlow makes unique by appending ``_1``, ``_2``, ... to the second, third slot of the
same variable (``slot_creator.create_slot``); the default optimizer names and the order in which
each creates its slots give (``training/adam.py``, ``momentum.py``, ``adagrad.py``,
``rmsprop.py``):

==============  ==============================================  ===========================
optimizer       keys of variable ``V``                          our slot names
==============  ==============================================  ===========================
Adam            ``V/Adam``, ``V/Adam_1``                        ``m``, ``v``
Momentum        ``V/Momentum``                                  ``momentum``
Adagrad         ``V/Adagrad``                                   ``accumulator``
RMSProp         ``V/RMSProp``, ``V/RMSProp_1``                  ``rms``, ``momentum``
RMSProp         ``V/RMSProp``, ``_1``, ``_2`` (``centered``)    ``rms``, ``mg``, ``momentum``
==============  ==============================================  ===========================

Adam's non-slot variables are ``beta1_power`` and ``beta2_power`` (float32, ``beta^t`` for the
next step ``t``, as ours). An optimizer given another name, or a second optimizer of the same
name in the graph (its slots continue the numbering), is not recognised: its keys stay as they
are. Nothing here knows the live model; :mod:`._live_names` maps these keys
onto it at restore time.

Writing (``names="tf1"``, :func:`tf1_keys`) is the inverse of the same table: a variable goes
under its ``name`` (what a Saver keys it by: ``var.op.name``), or its path when it has none;
the slots of a variable, by the set of our slot names, under the optimizer and order of the
table's row (``m``, ``v`` -> ``V/Adam``, ``V/Adam_1``); Adam's beta powers under
``beta1_power``/``beta2_power``; the optimizer's other state (its step count, which TF1 keeps
in no optimizer variable) under its path. A set of slots in no row (Adam's ``vhat``, another optimizer's
slots) or the slots of several optimizers are refused: TF1 would not name them so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from parallelvars.errors import InvalidEntryError

from ._keys import slot_owner

__all__ = [
    "TF1_NON_SLOTS",
    "TF1_OPTIMIZERS",
    "Tf1Slot",
    "name_based_state",
    "tf1_keys",
    "tf1_slots",
]

#: The default TF1 optimizer names whose slot keys are recognised.
TF1_OPTIMIZERS = ("Adam", "Momentum", "Adagrad", "RMSProp")

#: Non-slot variables by optimizer name: saved key -> our counter's name.
TF1_NON_SLOTS: dict[str, dict[str, str]] = {
    "Adam": {"beta1_power": "beta1_power", "beta2_power": "beta2_power"}
}

# Slot names by optimizer and number of slot keys of one variable.
_LAYOUTS: dict[tuple[str, int], tuple[str, ...]] = {
    ("Adam", 2): ("m", "v"),
    ("Momentum", 1): ("momentum",),
    ("Adagrad", 1): ("accumulator",),
    ("RMSProp", 2): ("rms", "momentum"),
    ("RMSProp", 3): ("rms", "mg", "momentum"),
}

_SLOT_KEY = re.compile(r"^(.+)/(" + "|".join(TF1_OPTIMIZERS) + r")(?:_([1-9][0-9]*))?$")


@dataclass(frozen=True)
class Tf1Slot:
    """A name-based key recognised as a TF1 optimizer slot.

    Attributes:
        variable: the key of the variable it serves.
        optimizer: the TF1 optimizer's default name (``"Adam"``, ...).
        slot_name: our slot name, or None when the variable's slot keys do not form one of
            the layouts above (then ``reason`` says why).
        reason: why it does not map, or "".
    """

    variable: str
    optimizer: str
    slot_name: str | None
    reason: str = ""


def tf1_slots(keys: Iterable[str], shapes: dict[str, tuple[int, ...]]) -> dict[str, Tf1Slot]:
    """The keys of a name-based checkpoint that are TF1 optimizer slots: ``V/<optimizer>`` or
    ``V/<optimizer>_<k>`` where ``V`` is another key of the same shape (``shapes`` maps every
    key to its shape)."""
    keys = list(keys)
    present = set(keys)
    found: dict[tuple[str, str], dict[int, str]] = {}
    for key in keys:
        m = _SLOT_KEY.match(key)
        if m is None or m.group(1) not in present or shapes.get(m.group(1)) != shapes.get(key):
            continue
        index = int(m.group(3) or 0)
        found.setdefault((m.group(1), m.group(2)), {})[index] = key
    out: dict[str, Tf1Slot] = {}
    for (variable, optimizer), by_index in found.items():
        layout = _LAYOUTS.get((optimizer, len(by_index)))
        if layout is None or sorted(by_index) != list(range(len(by_index))):
            reason = (
                f"TF1 {optimizer} slot keys of {variable!r} in no layout TF1's {optimizer} "
                f"writes ({', '.join(sorted(by_index.values()))})"
            )
            for key in by_index.values():
                out[key] = Tf1Slot(variable, optimizer, None, reason)
            continue
        for index, key in by_index.items():
            out[key] = Tf1Slot(variable, optimizer, layout[index])
    return out


def name_based_state(view: Mapping[str, Any]) -> tuple[dict[str, Tf1Slot], list[str]]:
    """The TF1 optimizer state a name-based TensorFlow view holds: its slot keys and the
    non-slot keys present (``beta1_power``, ...); nothing for any other view."""
    if getattr(view, "format", None) != "tf" or getattr(view, "object_graph", None) is not None:
        return {}, []
    if (getattr(view, "metadata", None) or {}).get("tf_naming") != "name":
        return {}, []
    keys = list(view)
    slots = tf1_slots(keys, {k: tuple(view[k].shape) for k in keys})
    counters = [k for names in TF1_NON_SLOTS.values() for k in names if k in view]
    return slots, counters


# The TF1 optimizer and its slot order by the set of our slot names of one variable: the
# inverse of _LAYOUTS (no two rows hold the same set).
_BY_SLOT_NAMES: dict[frozenset[str], tuple[str, tuple[str, ...]]] = {
    frozenset(layout): (optimizer, layout) for (optimizer, _), layout in _LAYOUTS.items()
}


def _slot_key(variable_key: str, optimizer: str, index: int) -> str:
    return f"{variable_key}/{optimizer}" + (f"_{index}" if index else "")


def tf1_keys(entries: Mapping[str, Any], file: str) -> dict[str, str]:
    """The key a ``tf.compat.v1.train.Saver`` gives each of ``entries`` (path -> key), so that
    TF1's optimizer finds its slots and non-slot variables (see the module docstring).

    Raises:
        InvalidEntryError: slots TF1 would not name so (no row of the table, several
            optimizers, a slot whose variable is not written), or two entries under one key.
    """

    def fail(message: str, variable: str, **kw: Any) -> InvalidEntryError:
        return InvalidEntryError(f"TF1 names: {message}", file=file, variable=variable, **kw)

    keys: dict[str, str] = {}
    slots: dict[str, dict[str, str]] = {}  # variable path -> {slot name: slot path}
    owners: dict[str, str] = {}  # optimizer path -> one of its slots' paths
    for path, entry in entries.items():
        owner = slot_owner(path, entry.attrs)
        if owner is not None:
            slots.setdefault(str(entry.attrs["slot_of"]), {})[str(entry.attrs["slot_name"])] = path
            owners.setdefault(owner, path)
            continue
        name = entry.attrs.get("name")
        keys[path] = name if isinstance(name, str) and name else path
    if len(owners) > 1:
        raise fail(
            "a TF1 graph names the slots of one optimizer by its default name; these are of "
            f"{len(owners)} optimizers",
            owners[sorted(owners)[1]],
            expected="one optimizer",
            found=", ".join(sorted(owners)),
        )
    for owner in owners:  # state TF1 has no place for (a step count): under its path
        keys.update([(path, path) for path in keys if path.startswith(owner + "/")])
    kinds: set[str] = set()
    for variable, by_name in slots.items():
        first = next(iter(by_name.values()))
        row = _BY_SLOT_NAMES.get(frozenset(by_name))
        if row is None:
            raise fail(
                "these slots are no TF1 optimizer's",
                first,
                expected=" or ".join(", ".join(layout) for layout in _LAYOUTS.values()),
                found=", ".join(sorted(by_name)),
            )
        optimizer, layout = row
        kinds.add(optimizer)
        if variable not in keys:
            raise fail("the slot's variable is not written", first, expected=variable)
        for index, slot_name in enumerate(layout):
            keys[by_name[slot_name]] = _slot_key(keys[variable], optimizer, index)
    if len(kinds) > 1:
        raise fail(
            "the slots are of several TF1 optimizers",
            next(iter(owners.values())),
            found=", ".join(sorted(kinds)),
        )
    if kinds and owners:
        (owner,) = owners
        for key, counter in TF1_NON_SLOTS.get(next(iter(kinds)), {}).items():
            path = f"{owner}/{counter}"
            if path in entries:
                keys[path] = key
    seen: dict[str, str] = {}
    for path, key in keys.items():
        if key in seen:
            raise fail(
                f"{seen[key]!r} and {path!r} would be saved under the same key {key!r}",
                path,
            )
        seen[key] = path
    return keys
