"""How TensorFlow names saved tensors, and how those names map to our object paths.

An object-based key is ``<escaped local names joined by "/">/.ATTRIBUTES/<attribute>``, where
each local name is escaped (``.`` -> ``..``, ``/`` -> ``.S``) so that ``.ATTRIBUTES`` and
``.OPTIMIZER_SLOT`` can never be mistaken for a name. A legacy optimizer slot is saved as
``<variable path>/.OPTIMIZER_SLOT/<optimizer path>/<slot name>/.ATTRIBUTES/VARIABLE_VALUE``.

Our mapping:

====================================================  ======================================
TensorFlow key                                        our path, component
====================================================  ======================================
``model/w/.ATTRIBUTES/VARIABLE_VALUE``                ``model/w``, 0 (the primary)
``model/w/.ATTRIBUTES/parallel_component_2``          ``model/w``, 2
``w/.OPTIMIZER_SLOT/opt/m/.ATTRIBUTES/VARIABLE_VALUE`` ``opt/slots/w/m`` (slot_of ``w``, slot_name ``m``)
``layer/.ATTRIBUTES/OBJECT_CONFIG_JSON``              ``layer/.ATTRIBUTES/OBJECT_CONFIG_JSON``, 0
``dense/kernel`` (name-based, no ``.ATTRIBUTES``)     ``dense/kernel``, 0
====================================================  ======================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from parallelvars.checkpoint.graph import escape_name, unescape_name
from parallelvars.checkpoint.registry import COMPONENT_PREFIX, component_name, extra_component_index

from .._names import ATTRIBUTES, OPTIMIZER_SLOT, SLOTS, VARIABLE_VALUE

__all__ = [
    "GRAPH_KEY",
    "METADATA_KEY",
    "ATTRIBUTES",
    "OPTIMIZER_SLOT",
    "VARIABLE_VALUE",
    "SLOTS",
    "escape_local_name",
    "unescape_local_name",
    "component_attribute",
    "ParsedKey",
    "parse_key",
    "slot_owner",
    "slot_path",
]

GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
#: Our own key: a scalar string tensor holding JSON for what TensorFlow's keys cannot say.
METADATA_KEY = "_PARALLELVARS_METADATA"

# TensorFlow's escaping of one local name (``.`` -> ``..``, ``/`` -> ``.S``) is the one our
# checkpoints use: a single implementation, in the core.
escape_local_name = escape_name
unescape_local_name = unescape_name

_SEP = "/" + ATTRIBUTES + "/"
#: The component number :func:`parse_key` gives ``parallel_component_0``: part 0 of an on-read
#: variable whose ``VARIABLE_VALUE`` holds the aggregate (our writer's layout for them).
PART_ZERO = -2


def component_attribute(i: int) -> str:
    """``VARIABLE_VALUE`` for component 0, ``parallel_component_<i>`` for the others."""
    return VARIABLE_VALUE if i == 0 else component_name(i)


@dataclass(frozen=True)
class ParsedKey:
    """What an object-based key says."""

    path: str
    component: int
    slot_of: str | None = None
    slot_name: str | None = None


def slot_path(optimizer: str, variable: str, slot_name: str) -> str:
    """Our path of a slot variable: ``<optimizer>/slots/<variable>/<slot name>``."""
    return f"{optimizer}/{SLOTS}/{variable}/{slot_name}"


def slot_owner(path: str, attrs: Mapping[str, Any]) -> str | None:
    """The optimizer's path when the entry at ``path`` with ``attrs`` is a slot
    (``attrs`` ``slot_of``/``slot_name`` and ``path`` is their :func:`slot_path`), else None."""
    slot_of, slot_name = attrs.get("slot_of"), attrs.get("slot_name")
    if not (isinstance(slot_of, str) and isinstance(slot_name, str) and slot_of and slot_name):
        return None
    suffix = f"/{SLOTS}/{slot_of}/{slot_name}"
    if "/" in slot_name or not path.endswith(suffix) or len(path) <= len(suffix):
        return None
    return path[: -len(suffix)]


def _join(names: list[str]) -> str:
    return "/".join(unescape_local_name(n) for n in names)


def parse_key(key: str) -> ParsedKey | None:
    """Map an object-based key to our path and component; None for any other key."""
    i = key.find(_SEP)
    if i <= 0:
        return None
    obj, attribute = key[:i], key[i + len(_SEP) :]
    names = obj.split("/")
    if not attribute or "" in names:
        return None
    if attribute == VARIABLE_VALUE:
        component = 0
    elif attribute == f"{COMPONENT_PREFIX}0":
        component = PART_ZERO
    else:
        index = extra_component_index(attribute)
        component = -1 if index is None else index
    slot_of = slot_name = None
    if OPTIMIZER_SLOT in names:
        j = names.index(OPTIMIZER_SLOT)
        var, rest = names[:j], names[j + 1 :]
        if not var or len(rest) < 2 or OPTIMIZER_SLOT in rest:
            return None
        slot_of, slot_name = _join(var), unescape_local_name(rest[-1])
        path = slot_path(_join(rest[:-1]), slot_of, slot_name)
    else:
        path = _join(names)
    if component == -1:  # another attribute (a config string, a table's keys): its own entry
        path = f"{path}/{ATTRIBUTES}/{attribute}"
        component = 0
    return ParsedKey(path, component, slot_of, slot_name)
