"""Name mapping between our slash paths and the key conventions of other formats.

Our tensor paths are slash-separated object paths (``"model/dense/kernel"``). Formats that
store a flat list of named tensors use one of three key styles, chosen with ``names=`` on the
writers and on :func:`~parallelvars.formats.convert`:

=================================  ===============================  ===========================  ==============================================================
what                               ``slash``                        ``dotted``                   ``tf``
=================================  ===============================  ===========================  ==============================================================
a variable ``model/dense/kernel``  ``model/dense/kernel``           ``model.dense.kernel``       ``model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE``
component ``i >= 1`` of ``m/w``    ``m/w/parallel_component_1``     ``m.w/parallel_component_1`` ``m/w/.ATTRIBUTES/parallel_component_1``
slot ``m`` of ``m/w`` held by      ``opt/slots/m/w/m``              ``opt.slots.m.w.m``          ``m/w/.OPTIMIZER_SLOT/opt/m/.ATTRIBUTES/VARIABLE_VALUE``
optimizer ``opt``
a path segment holding ``.``       ``a.b/c``                        ``a.b.c`` (ambiguous)        ``a..b/c`` (TF escapes ``.`` as ``..``)
=================================  ===============================  ===========================  ==============================================================

Rules:

* ``slash`` keeps our paths unchanged: the default for ``.npz`` and our HDF5 layout.
* ``dotted`` is the PyTorch ``state_dict`` convention (``layers.0.attn.q.weight``): the default
  for safetensors, so the Hugging Face world finds its usual names. A key is mapped back by
  replacing every ``.`` with ``/``; a path segment that itself holds a ``.`` therefore does not
  survive a plain round trip. Our writers record the exact path in their metadata whenever the
  key alone would not give it back, so our own readers still restore it.
* ``tf`` is TensorFlow's object-based checkpoint key: local names joined by ``/`` (with ``.``
  escaped as ``..`` and ``/`` as ``.S``), then ``/.ATTRIBUTES/VARIABLE_VALUE``. An optimizer
  slot (an entry with ``attrs["slot_of"]`` and ``attrs["slot_name"]``) gets TF's
  ``<variable>/.OPTIMIZER_SLOT/<optimizer>/<slot>`` key. A key without ``.ATTRIBUTES`` (a TF1
  name-based checkpoint, ``dense/kernel``) maps to itself.
* ``tf1`` is the key a ``tf.compat.v1.train.Saver`` gives a variable (its name, ``V/Adam``
  for a slot, ``beta1_power``): only the TensorFlow writer takes it, since a slot's key
  depends on the optimizer's other slots (:mod:`parallelvars.formats.tf._tf1`).
* Extra components (``i >= 1``) of a parallel variable are stored next to the primary under
  ``<primary key>/parallel_component_<i>`` (``slash``, ``dotted``) or TF's historical
  ``<path>/.ATTRIBUTES/parallel_component_<i>`` (``tf``). A plain consumer finds the primary
  under the variable's own name and can ignore the rest.
* An on-read variable (SUM or MEAN, several parts) stores its aggregate under the plain key,
  what a plain consumer and TensorFlow read as its value, and *every* part under
  ``parallel_component_<i>``, ``0`` included (:func:`part_key`).

Example:
    >>> to_key("layers/0/attn/q/weight", "dotted")
    'layers.0.attn.q.weight'
    >>> from_key("layers.0.attn.q.weight", "dotted")
    'layers/0/attn/q/weight'
    >>> to_key("model/w", "tf", component=2)
    'model/w/.ATTRIBUTES/parallel_component_2'
"""

from __future__ import annotations

from parallelvars.checkpoint.graph import escape_name, unescape_name
from parallelvars.checkpoint.registry import (
    COMPONENT_PREFIX,
    component_name,
    extra_component_index,
)
from parallelvars.errors import InvalidArgumentError

__all__ = [
    "NAME_STYLES",
    "check_names",
    "component_key",
    "from_key",
    "parse_component_key",
    "part_key",
    "to_key",
]

NAME_STYLES: tuple[str, ...] = ("slash", "dotted", "tf")

# TensorFlow's object-based key table, the one formats/tf/ uses as well:
# ``<escaped object path>/.ATTRIBUTES/<attribute>``; a legacy optimizer slot is keyed
# ``<variable>/.OPTIMIZER_SLOT/<optimizer>/<slot>``.
ATTRIBUTES = ".ATTRIBUTES"
OPTIMIZER_SLOT = ".OPTIMIZER_SLOT"
VARIABLE_VALUE = "VARIABLE_VALUE"
#: The path segment between an optimizer and its slot variables in our paths.
SLOTS = "slots"


def check_names(names: str) -> str:
    """``names`` when it is a known style; ``ValueError`` otherwise."""
    if names == "tf1":
        raise InvalidArgumentError(
            "names='tf1' are the keys of a TensorFlow 1.x Saver, whose optimizer slots are named "
            "by the whole checkpoint's layout: only a TensorFlow checkpoint (format 'tf') "
            "is written with them"
        )
    if names not in NAME_STYLES:
        raise InvalidArgumentError(
            f"unknown name style {names!r} (expected one of {', '.join(NAME_STYLES)})"
        )
    return names


def _segments(path: str) -> list[str]:
    return [s for s in path.split("/") if s != ""]


def to_key(
    path: str,
    names: str = "slash",
    *,
    component: int = 0,
    slot_of: str | None = None,
    slot_name: str | None = None,
) -> str:
    """The key of component ``component`` of the variable at ``path`` in style ``names``.

    Args:
        path: our slash-separated tensor path.
        names: ``"slash"``, ``"dotted"`` or ``"tf"``.
        component: 0 for the primary, ``i >= 1`` for ``parallel_component_<i>``.
        slot_of: for an optimizer slot, the path of the variable it serves (``tf`` style only).
        slot_name: for an optimizer slot, the slot's name (``tf`` style only).
    """
    check_names(names)
    if component < 0:
        raise InvalidArgumentError(
            f"variable {path!r}: component index must be >= 0, got {component}"
        )
    if names == "slash":
        key = path
    elif names == "dotted":
        key = ".".join(_segments(path))
    else:
        key = _tf_object_path(path, slot_of, slot_name)
        attribute = VARIABLE_VALUE if component == 0 else component_name(component)
        return f"{key}/{ATTRIBUTES}/{attribute}"
    return key if component == 0 else f"{key}/{component_name(component)}"


def component_keys(
    path: str,
    names: str,
    count: int,
    *,
    slot_of: str | None = None,
    slot_name: str | None = None,
) -> list[str]:
    """The keys of components ``0 .. count-1`` of the variable at ``path``: each
    ``to_key(path, names, component=i, ...)``, the path's part worked out once."""
    # (the slash style's key is the path itself: no slot or name check to make)
    key = path if names == "slash" else to_key(path, names, slot_of=slot_of, slot_name=slot_name)
    if count <= 1:
        return [key][:count]
    if names == "tf":
        stem = key[: -len(VARIABLE_VALUE)]
        return [key, *(stem + component_name(i) for i in range(1, count))]
    return [key, *(f"{key}/{component_name(i)}" for i in range(1, count))]


def _tf_object_path(path: str, slot_of: str | None, slot_name: str | None) -> str:
    segs = _segments(path)
    if slot_of and slot_name:
        # Our slot path is "<optimizer>/slots/<variable>/<slot>"; TF keys the slot under the
        # variable: "<variable>/.OPTIMIZER_SLOT/<optimizer>/<slot>".
        tail = [SLOTS, *_segments(slot_of), slot_name]
        if len(segs) > len(tail) and segs[-len(tail) :] == tail:
            optimizer = segs[: -len(tail)]
            return "/".join(
                [escape_name(s) for s in _segments(slot_of)]
                + [OPTIMIZER_SLOT]
                + [escape_name(s) for s in optimizer]
                + [escape_name(slot_name)]
            )
    return "/".join(escape_name(s) for s in segs)


def component_key(path: str, index: int, names: str = "slash", **slot: str | None) -> str:
    """Shorthand for ``to_key(path, names, component=index, ...)``."""
    return to_key(path, names, component=index, **slot)


def part_key(path: str, index: int, names: str = "slash", **slot: str | None) -> str:
    """The key of part ``index`` of an on-read variable whose plain key holds the aggregate:
    ``parallel_component_<index>`` for every part, ``0`` included.

    Example:
        >>> part_key("m/n", 0, "dotted")
        'm.n/parallel_component_0'
        >>> part_key("m/n", 0, "tf")
        'm/n/.ATTRIBUTES/parallel_component_0'
    """
    if index != 0:
        return to_key(path, names, component=index, **slot)
    key = to_key(path, names, component=1, **slot)
    return key[: -len("1")] + "0"


def from_key(key: str, names: str = "slash") -> str:
    """Our path for the primary key ``key`` of style ``names`` (the inverse of :func:`to_key`).

    A component key (``.../parallel_component_<i>``) is not special here: it maps to a path
    ending in ``parallel_component_<i>``; use :func:`parse_component_key` to split it.
    """
    check_names(names)
    if names == "slash":
        return key
    if names == "dotted":
        head, sep, tail = key.partition(f"/{COMPONENT_PREFIX}")
        path = head.replace(".", "/")
        return f"{path}{sep}{tail}" if sep else path
    parts = key.split("/")
    if ATTRIBUTES not in parts:
        return key  # TF1 name-based key: already a slash path
    at = parts.index(ATTRIBUTES)
    obj = parts[:at]
    attribute = "/".join(parts[at + 1 :])
    if OPTIMIZER_SLOT in obj:
        s = obj.index(OPTIMIZER_SLOT)
        variable, rest = obj[:s], obj[s + 1 :]
        if len(rest) >= 2:
            optimizer, slot = rest[:-1], rest[-1]
            obj = [*optimizer, SLOTS, *variable, slot]
    path = "/".join(unescape_name(s) for s in obj)
    if attribute == VARIABLE_VALUE:
        return path
    return f"{path}/{attribute}"


def parse_component_key(key: str, names: str = "slash") -> tuple[str, int]:
    """Split ``key`` into (our path of the variable, component index).

    Example:
        >>> parse_component_key("m.w/parallel_component_3", "dotted")
        ('m/w', 3)
        >>> parse_component_key("m/w/.ATTRIBUTES/VARIABLE_VALUE", "tf")
        ('m/w', 0)
    """
    check_names(names)
    if names == "tf":
        head, sep, attribute = key.rpartition(f"/{ATTRIBUTES}/")
        index = extra_component_index(attribute) if sep else None
        if index is not None:
            return from_key(f"{head}/{ATTRIBUTES}/{VARIABLE_VALUE}", "tf"), index
        return from_key(key, "tf"), 0
    head, sep, last = key.rpartition("/")
    index = extra_component_index(last) if sep else None
    if index is not None:
        return from_key(head, names), index
    return from_key(key, names), 0
