"""Writing any neutral view as a TensorFlow checkpoint.

Object-based naming (the default) builds an object tree from the paths (children in the order
the paths first appear), numbers its nodes breadth first as TensorFlow does, and writes the
tensors in node order, then the object graph. Component 0 of an entry is saved as
``VARIABLE_VALUE`` and component i as ``parallel_component_i``, except for an on-read SUM or
MEAN entry of several parts: its aggregate (what TensorFlow reads a SyncOnRead variable as) is
``VARIABLE_VALUE`` and part i is ``parallel_component_i``, 0 included; a sharded entry is saved as one
partitioned (sliced) tensor; an optimizer slot (``attrs`` ``slot_of``/``slot_name`` at the path
``<optimizer>/slots/<variable>/<slot>``) as a legacy ``.OPTIMIZER_SLOT`` key listed in the
optimizer node's ``slot_variables``. Given the same tensors, the bytes are those TensorFlow
writes.

What TensorFlow's keys cannot say (a kind other than the one a reader infers, attributes such as
``devices`` or ``aggregation``) goes into one JSON string tensor under
``_PARALLELVARS_METADATA``, written only when some entry needs it.

Name-based naming (``names="slash"``, or ``naming="name"``) saves each entry under its path,
with no object graph. TF1 naming (``names="tf1"``) saves each entry under the key a
``tf.compat.v1.train.Saver`` gives it, so that TF 1.x's optimizers find their state: a variable
under its name, ``V/Adam``, ``V/Adam_1`` for Adam's slots of ``V``, ``beta1_power`` ...
(:func:`._tf1.tf1_keys`, the inverse of the reader's mapping).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from parallelvars import _spans
from parallelvars._fileio import Scratch
from parallelvars._geometry import shard_bounds
from parallelvars.checkpoint.entry import (
    COMPONENT_REFUSALS,
    ForwardingEntry,
    ReadAhead,
    check_entry,
    in_file,
)
from parallelvars.checkpoint.registry import COMPONENT_PREFIX
from parallelvars.errors import (
    DtypeMismatchError,
    InvalidArgumentError,
    InvalidEntryError,
    UnsupportedDtypeError,
)

from .._json import jsonable
from .._plan import _json_attrs, read_whole
from .._view import (
    Entry,
    aggregates,
    check_summary_layout,
    checked_summary,
    described_aggregate,
    refuse_summary_mismatch,
)
from ._bundle import BundleWriter
from ._dtypes import DT_STRING, tf_dtype
from ._graph import encode_node, encode_nodes
from ._keys import (
    ATTRIBUTES,
    GRAPH_KEY,
    METADATA_KEY,
    OPTIMIZER_SLOT,
    VARIABLE_VALUE,
    component_attribute,
    escape_local_name,
    slot_owner,
)
from ._proto import SliceSpec
from ._reader import FLOAT64_VALUE, METADATA_FORMAT, METADATA_VERSION, infer_sharding
from ._state import write_state
from ._tf1 import tf1_keys

__all__ = ["write_bundle"]

_CKPT_NUMBER = re.compile(r"^ckpt-(\d+)\.index$")


# One tensor to write: (attribute name, full name, checkpoint key as UTF-8 bytes, variable,
# component index, or -1 for slices, _AGG for an on-read aggregate)
_Tensor = tuple[str, str, bytes, "_Var", int]


@dataclass(slots=True)
class _Node:
    children: dict[str, _Node] = field(default_factory=dict)
    attributes: list[_Tensor] = field(default_factory=list)
    slot_variables: list[tuple[_Node, str, _Node]] = field(default_factory=list)
    id: int = -1


class _Var:
    """One variable to write: its layout, attributes and TensorFlow type, from its entry or
    from its view's summary (``summary`` True). A summarized variable holds no entry: while
    the run that writes its tensors is read, its components are the view's bulk read of them
    (``fetched``) or its entry made again (``entry``, checked against the summary), and both
    are let go after the run; so a conversion holds no entry per variable for its length.

    (Slotted: a write holds one per variable, 150,000 for 50,000 variables with Adam's slots.)
    """

    __slots__ = (
        "agg",
        "attrs",
        "dtype",
        "entry",
        "expressed",
        "fetched",
        "gather_dtype",
        "kind",
        "nbytes",
        "num_components",
        "path",
        "shape",
        "slices",
        "summary",
        "tf_type",
    )

    def __init__(
        self,
        path: str,
        entry: Entry | None,
        tf_type: int,
        layout: tuple[str, np.dtype, tuple[int, ...], int, int, Any],
    ) -> None:
        self.path, self.entry, self.tf_type = path, entry, tf_type
        kind, dtype, shape, n, nbytes, attrs = layout
        self.kind, self.dtype, self.shape, self.num_components = kind, dtype, shape, n
        self.nbytes, self.attrs = nbytes, attrs
        self.summary = entry is None
        self.expressed: frozenset[str] | set[str] = _NONE_EXPRESSED
        self.slices: list[SliceSpec] | None = None
        self.fetched: list[np.ndarray] | None = None
        self.agg = entry is not None and aggregates(entry)
        # The dtype its components are read into for a gathered write: numbers in this
        # machine's byte order, as the data files store them (None: none).
        self.gather_dtype: np.dtype | None = _gathered(dtype)

    def express(self, names: frozenset[str]) -> None:
        """Note attributes the keys or the tensors say (left out of the metadata record)."""
        self.expressed = self.expressed | names


_NONE_EXPRESSED: frozenset[str] = frozenset()
_SLOT_ATTRS = frozenset({"slot_of", "slot_name"})
_SHARD_ATTRS = frozenset({"shard_axis", "shard_offsets"})


def _names(path: str, index_path: str) -> list[str]:
    names = path.split("/")
    if not path or "" in names:
        raise InvalidEntryError(
            "a variable path needs non-empty names separated by single '/'",
            file=index_path,
            variable=path,
        )
    return names


def _esc(names: list[str]) -> str:
    # The names come from splitting a path at '/' (:func:`_names`): none holds one, so escaping
    # the joined path's dots escapes each name (``escape_local_name``) at once.
    return "/".join(names).replace(".", "..")


def _plan(path: str, entry: Entry | None, known: Any, index_path: str) -> _Var:
    """The plan of the variable at ``path``: from ``entry``, or (``entry`` None) from its
    view's summary ``known``, checked as ``check_entry`` checks an entry."""
    if entry is not None:
        check_entry(entry, index_path, variable=path)
        layout = (
            entry.kind,
            np.dtype(entry.dtype),
            tuple(int(d) for d in entry.shape),
            int(entry.num_components),
            int(entry.nbytes),
            entry.attrs or {},
        )
    else:
        kind, dtype, shape, n, nbytes, attrs = known
        layout = (kind, np.dtype(dtype), tuple(map(int, shape)), int(n), int(nbytes), attrs or {})
    attrs = layout[5]
    hint = attrs.get("tf_dtype")
    num = tf_dtype(layout[1], hint if isinstance(hint, str) else None)
    if num is None:
        raise UnsupportedDtypeError(
            "TensorFlow checkpoints cannot hold this dtype",
            file=index_path,
            variable=path,
            found=layout[1],
        )
    var = _Var(path, entry, num, layout)
    if isinstance(hint, str) and num != DT_STRING and hint.startswith("DT_Q"):
        var.express(frozenset({"tf_dtype"}))
    name = attrs.get("name")
    if isinstance(name, str) and name:
        var.express(_NAME_ATTR)
    if var.kind == "sharded":
        assert entry is not None  # (a sharded variable is planned from its entry)
        var.slices = _shard_specs(path, entry, index_path)
        var.express(_SHARD_ATTRS)
    return var


_NAME_ATTR = frozenset({"name"})


def _summarized(
    entries: Mapping[str, Entry], path: str, summary: Any, checked: bool, index_path: str
) -> Any:
    """The view's summary of ``path`` when the variable can be written from it without its
    entry held (a variable of numbers in this machine's byte order whose tensors are its
    components), its name and layout checked as ``check_entry`` checks them; else None (the
    variable is planned from its entry: a sharded one's slices, an on-read aggregate, a
    string tensor, a counter written as float32 need it)."""
    known = summary(path)
    if known is None:
        return None
    kind, dtype, shape, n, _, attrs = checked_summary(known, index_path, path)
    dtype = np.dtype(dtype)
    if (
        kind == "sharded"
        or _gathered(dtype) is None
        or described_aggregate(kind, n, attrs)
        or _float32_counter(path, dtype, shape)
    ):
        return None
    if not checked:
        check_summary_layout(path, kind, shape, n, attrs, index_path)
    return known


# Non-slot variables TensorFlow's optimizers keep in float32 (the dtype of the variables they
# train; TF 1.x ``AdamOptimizer`` refuses any other on restore): ours are float64.
_FLOAT32_COUNTERS = frozenset({"beta1_power", "beta2_power"})


def _float32_counter(path: str, dtype: Any, shape: Any) -> bool:
    """Whether the variable at ``path`` is one of those counters, a float64 scalar."""
    return (
        path.rsplit("/", 1)[-1] in _FLOAT32_COUNTERS
        and np.dtype(dtype) == np.float64
        and not tuple(shape)
    )


def _gathered(dtype: np.dtype) -> np.dtype | None:
    """The dtype a variable's components are read into for a gathered write: numbers in this
    machine's byte order, as the data files store them (None: none)."""
    return dtype if dtype.isnative and dtype.kind in "biufcV" and not dtype.hasobject else None


class _Float32Entry(ForwardingEntry):
    """A float64 entry written as the float32 TensorFlow keeps it (rounded to nearest)."""

    def __init__(self, source: Entry, *, file: str | None = None) -> None:
        super().__init__(source)
        self.dtype = np.dtype(np.float32)
        # The exact value, for our reader (TensorFlow never reads the metadata tensor): a
        # round trip through TF resumes bit-identically. JSON floats round-trip float64 exactly.
        value = np.asarray(source.value())
        if value.shape != () or value.dtype.newbyteorder("=") != np.float64:
            raise InvalidEntryError(
                "the value of a scalar float64 counter is not a float64 scalar",
                file=file,
                variable=source.path,
                expected="() float64",
                found=f"{value.shape} {value.dtype}",
            )
        self.attrs = {**self.attrs, FLOAT64_VALUE: float(value)}

    def _exact(self, i: int) -> np.ndarray:
        """Component ``i`` as the source declares it (float64), read through the source's
        checks: a component of another shape or dtype is refused, not broadcast or cast."""
        data = np.empty(self.source.component_shape(i), self.source.dtype)
        self.source.read_component_into(i, data)
        return data

    def component(self, i: int) -> np.ndarray:
        return self._exact(i).astype(np.float32)

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        self.check_out(i, out)
        out[...] = self._exact(i)  # float32, the one rounding this entry makes

    def value(self) -> np.ndarray:
        return np.asarray(self.source.value(), np.float32)


def _as_tf_stores(path: str, entry: Entry, file: str | None = None) -> Entry:
    """``entry`` in the dtype TensorFlow's optimizers read back: Adam's beta powers (a float64
    scalar named ``beta1_power``/``beta2_power``) as float32; every other entry as it is. A
    restore into our float64 counters takes the float32 value exactly."""
    if _float32_counter(path, entry.dtype, entry.shape):
        return _Float32Entry(entry, file=file)
    return entry


def _shard_specs(path: str, entry: Entry, index_path: str) -> list[SliceSpec]:
    """The slice of each shard (the entry's layout already checked by ``check_entry``)."""
    shape = tuple(int(d) for d in entry.shape)
    axis = int(entry.attrs["shard_axis"])
    offsets = [int(o) for o in entry.attrs["shard_offsets"]]
    ends = shard_bounds(offsets, shape[axis])[1:]
    # Every extent explicit, as TensorFlow's partitioned savers (ShardedVariable, SaveSliceInfo)
    # write them, so the slice keys and bytes match.
    return [
        tuple((start, end - start) if d == axis else (0, shape[d]) for d in range(len(shape)))
        for start, end in zip(offsets, ends, strict=True)
    ]


def _extra(var: _Var) -> dict[str, Any] | None:
    """The metadata record of ``var``: what a reader could not infer from the tensors."""
    n = var.num_components
    if var.slices is not None:
        axis = int(var.attrs["shard_axis"])
        inferred = infer_sharding(var.slices, var.shape)
        empty = any(spec[axis][1] == 0 for spec in var.slices)
        kind_read = "sharded" if inferred == (axis, list(range(n))) and not empty else "single"
    else:
        kind_read = "single" if n == 1 else "mirrored"
    record: dict[str, Any] = {}
    if var.kind != kind_read:
        record["kind"] = var.kind
        if var.kind == "sharded":  # the reader needs the split the slices cannot show
            var.expressed = var.expressed - _SHARD_ATTRS
    expressed = var.expressed
    # (as jsonable makes them; the filtered dict itself when it already is plain JSON)
    attrs = _json_attrs({k: v for k, v in var.attrs.items() if k not in expressed})
    if attrs:
        record["attrs"] = attrs
    return record or None


# The metadata document's JSON: keys sorted, no spaces (``json.dumps(doc, sort_keys=True,
# separators=(",", ":"))``, the same text whether a document is encoded whole or in parts).
_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode


def _record_texts(plans: list[_Var], keys: Mapping[str, str]) -> dict[str, str]:
    """Each variable's metadata record (:func:`_extra`) as its JSON text, by key; equal texts
    kept once (most variables of a checkpoint have the same few records: a text per
    variable, not a dict of its attributes)."""
    texts: dict[str, str] = {}
    out = {}
    for var in plans:
        record = _extra(var)
        if record is not None:
            text = _JSON(record)
            out[keys[var.path]] = texts.setdefault(text, text)
    return out


def _metadata_doc(records: Mapping[str, str], metadata: Mapping[str, Any]) -> bytes:
    """The metadata document (format, version, the records by key, the file's metadata) as
    UTF-8 JSON text: the text of encoding it whole, put together from the records' texts."""
    head = (
        f'{{"format":{_JSON(METADATA_FORMAT)},"metadata":{_JSON(jsonable(metadata))},"variables":{{'
    )
    body = ",".join(f"{_JSON(key)}:{text}" for key, text in sorted(records.items()))
    return f'{head}{body}}},"version":{_JSON(METADATA_VERSION)}}}'.encode()


def _component(var: _Var, i: int, index_path: str, key: str) -> np.ndarray:
    """Component ``i`` of ``var`` (``_AGG``: an on-read variable's aggregate), checked against
    the variable's shape and dtype; an error names the tensor ``key`` it was to be written as."""
    e = _made(var)
    if i == _AGG:
        value, want, what = np.asarray(e.value()), tuple(e.shape), "the aggregate"
    else:
        value, want, what = np.asarray(e.component(i)), e.component_shape(i), f"component {i}"
    if tuple(value.shape) != tuple(want):
        raise InvalidEntryError(
            f"{_in_tensor(key)}{what} has another shape than its variable",
            file=index_path,
            variable=var.path,
            expected=tuple(want),
            found=tuple(value.shape),
        )
    if var.tf_type != DT_STRING and value.dtype.newbyteorder("=") != np.dtype(e.dtype).newbyteorder(
        "="
    ):
        raise DtypeMismatchError(
            f"{_in_tensor(key)}{what} has another dtype than its variable",
            file=index_path,
            variable=var.path,
            expected=np.dtype(e.dtype),
            found=value.dtype,
        )
    return value


def _made(var: _Var) -> Entry:
    """The entry of ``var``: held, or made for the run being written (see :func:`_fetch`)."""
    assert var.entry is not None, "a summarized variable's entry is made for its run"
    return var.entry


def _in_tensor(key: str) -> str:
    """The tensor a component was to be written as, to begin an error's message with (after
    the file and the variable, as the TF reader names a bundle key)."""
    return f"tensor {key!r}: "


def _build_tree(plans: list[_Var], index_path: str) -> tuple[_Node, list[_Node]]:
    root = _Node()
    slot_nodes: list[_Node] = []

    def node_at(names: list[str]) -> _Node:
        node = root
        for n in names:
            node = node.children.setdefault(n, _Node())
        return node

    for var in plans:
        names = _names(var.path, index_path)
        attrs = var.attrs
        owner = slot_owner(var.path, attrs)
        if owner is not None:
            slot_of, slot_name = str(attrs["slot_of"]), str(attrs["slot_name"])
            opt_names = _names(owner, index_path)
            var_names = _names(slot_of, index_path)
            original, optimizer = node_at(var_names), node_at(opt_names)
            target = _Node()
            optimizer.slot_variables.append((original, slot_name, target))
            slot_nodes.append(target)
            prefix = f"{_esc(var_names)}/{OPTIMIZER_SLOT}/{_esc(opt_names)}/{escape_local_name(slot_name)}"
            var.express(_SLOT_ATTRS)
            attribute = VARIABLE_VALUE
        elif (
            len(names) >= 3
            and names[-2] == ATTRIBUTES
            and var.num_components == 1
            and var.kind != "sharded"
        ):
            target = node_at(names[:-2])
            prefix = _esc(names[:-2])
            attribute = names[-1]
        else:
            target = node_at(names)
            prefix = _esc(names)
            attribute = VARIABLE_VALUE
        name = attrs.get("name")
        full_name = name if isinstance(name, str) else ""
        head = f"{prefix}/{ATTRIBUTES}/".encode("utf-8", "surrogateescape")
        new: list[_Tensor]
        if var.slices is not None:
            new = [(attribute, full_name, head + _utf8(attribute), var, -1)]
        elif attribute != VARIABLE_VALUE:
            new = [(attribute, full_name, head + _utf8(attribute), var, 0)]
        elif var.agg:
            # VARIABLE_VALUE holds what TensorFlow reads a SyncOnRead variable as: the
            # aggregate; every part (0 included) goes under parallel_component_<i>.
            new = [(VARIABLE_VALUE, full_name, head + _VALUE_UTF8, var, _AGG)]
            new += [
                (a, "", head + _utf8(a), var, i)
                for i, a in ((i, f"{COMPONENT_PREFIX}{i}") for i in range(var.num_components))
            ]
        else:
            new = [
                (a, full_name if i == 0 else "", head + _utf8(a), var, i)
                for i, a in ((i, component_attribute(i)) for i in range(var.num_components))
            ]
        if target.attributes:
            taken = {a[0] for a in target.attributes}
            for a in new:
                if a[0] in taken:
                    raise InvalidEntryError(
                        f"two variables would be saved under the same key {_text(a[2])!r}",
                        file=index_path,
                        variable=var.path,
                    )
        target.attributes.extend(new)
    return root, slot_nodes


_VALUE_UTF8 = VARIABLE_VALUE.encode()


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _text(key: bytes) -> str:
    """A key as the text it was made from (its undecodable bytes kept as surrogates)."""
    return key.decode("utf-8", "surrogateescape")


def _number(root: _Node, slot_nodes: list[_Node]) -> list[_Node]:
    order: list[_Node] = []
    queue = deque([root])
    while queue:
        node = queue.popleft()
        node.id = len(order)
        order.append(node)
        queue.extend(node.children.values())
    for node in slot_nodes:
        node.id = len(order)
        order.append(node)
    return order


def _graph_bytes(order: list[_Node]) -> bytes:
    # has_checkpoint_values: nodes with tensors or slot variables, and their ancestors
    parents: dict[int, set[int]] = {}
    marked: set[int] = set()
    for node in order:
        if node.attributes or node.slot_variables:
            marked.add(node.id)
        for child in node.children.values():
            parents.setdefault(child.id, set()).add(node.id)
    todo = set(marked)
    while todo:
        nid = todo.pop()
        for p in parents.pop(nid, ()):
            if p not in marked:
                marked.add(p)
                todo.add(p)
    return encode_nodes(
        encode_node(
            [(c.id, name) for name, c in node.children.items()],
            [(a, full, key) for a, full, key, _, _ in node.attributes],
            [(o.id, s, t.id) for o, s, t in node.slot_variables],
            None,
            node.id in marked,
        )
        for node in order
    )


# The writer's naming by key style (``names=``).
_NAMING = {"tf": "object", "slash": "name", "tf1": "tf1"}

# The component number of an on-read entry's aggregate in the attribute lists (-1: slices).
_AGG = -2


def _write_var(w: BundleWriter, var: _Var, key: bytes, comp: int, index_path: str) -> None:
    text = _text(key)
    if comp >= 0 or comp == _AGG:
        w.add(key, _component(var, comp, index_path, text), dtype=var.tf_type)
        return
    assert var.slices is not None
    e = _made(var)
    axis = int(e.attrs["shard_axis"])
    # An empty shard has no slice (two of them could not have distinct keys); the metadata key
    # records the split then. With no non-empty shard the value itself is empty.
    parts = [(i, spec) for i, spec in enumerate(var.slices) if spec[axis][1] != 0]
    if not parts:
        w.add(key, np.empty(e.shape, e.dtype), dtype=var.tf_type)
    for i, spec in parts:
        w.add_slice(key, e.shape, spec, _component(var, i, index_path, text), dtype=var.tf_type)


def _read_checked(var: _Var, comp: int, key: bytes, out: np.ndarray, index_path: str) -> None:
    """Read component ``comp`` into ``out`` (the variable's shape and dtype): from its view's
    bulk read of it, or through its entry, which refuses a component of another shape or
    dtype than it declares (:meth:`Entry.read_component_into`); the error names what
    :func:`_component` names: the checkpoint being written, the variable, the tensor ``key``
    and expected versus found (:func:`in_file`)."""
    fetched = var.fetched
    if fetched is not None:
        data = fetched[comp]
        if data.shape != out.shape or data.dtype != out.dtype:
            raise InvalidEntryError(
                f"{_in_tensor(_text(key))}component {comp} was read with another shape or "
                "dtype than its variable",
                file=index_path,
                variable=var.path,
                expected=f"{out.shape} {out.dtype}",
                found=f"{data.shape} {data.dtype}",
            )
        np.copyto(out, data)
        return
    entry = _made(var)
    try:
        entry.read_component_into(comp, out)
    except COMPONENT_REFUSALS as e:
        if entry.kind != "sharded":
            # (``out`` has the variable's shape: a component of another shape is the one at
            # fault, which TensorFlow's layout cannot hold beside the others; our reader would
            # split such a checkpoint into separate variables)
            found = tuple(int(d) for d in entry.component_shape(comp))
            if found != tuple(out.shape):
                raise InvalidEntryError(
                    f"{_in_tensor(_text(key))}component {comp} has another shape than its variable",
                    file=index_path,
                    variable=var.path,
                    expected=tuple(out.shape),
                    found=found,
                ) from e
        named = in_file(e, index_path, prefix=_in_tensor(_text(key)), variable=var.path)
        if named is None:
            raise
        raise named from e


def _fetch(
    tensors: list[_Tensor], entries: Mapping[str, Entry], bulk: Any, index_path: str
) -> list[_Var]:
    """Give the summarized variables of one run what their tensors are read from: their
    components as the view reads them in bulk (``bulk_components``: a native file's index
    places, read in a few large reads and checked against their checksums) when all of a
    variable's tensors are in the run, else its entry made again (a variable the bulk read
    does not take, too: the general read names any damage), checked against the summary it
    was planned by; those variables, to be let go after the run."""
    count: dict[int, int] = {}
    taken: dict[int, _Var] = {}
    for t in tensors:
        var = t[3]
        if var.summary:
            taken[id(var)] = var
            count[id(var)] = count.get(id(var), 0) + 1
    if bulk is not None:
        of_path = {v.path: v for v in taken.values()}
        in_run = {v.path: (count[k], v.num_components) for k, v in taken.items()}
        for path, comps in read_whole(bulk, in_run):
            of_path[path].fetched = list(comps)
    for var in taken.values():
        if var.fetched is None:
            made = entries[var.path]
            refuse_summary_mismatch(
                made,
                var.kind,
                var.dtype,
                var.shape,
                var.num_components,
                var.attrs,
                index_path,
                var.path,
            )
            var.entry = made
    return list(taken.values())


def _write_vars(
    w: BundleWriter, todo: list[_Tensor], entries: Mapping[str, Entry], index_path: str
) -> None:
    """Write the tensors ``todo`` in order, in runs of at most ``BULK_BYTES``: each run's
    components read ahead in bulk from the files that hold them (its summarized variables'
    by :func:`_fetch`, the entries' by :class:`ReadAhead`), read back to back into one
    buffer and written with one call (:meth:`BundleWriter.add_run`); a string tensor, an
    aggregate or a sharded variable's slices go one by one, in their place. The data file's
    bytes and the index are those of writing each tensor alone."""
    # (each variable's bytes, as the runs are cut: the whole variable's per tensor)
    sizes = [t[3].nbytes if t[4] != _AGG else 0 for t in todo]
    scratch = Scratch()
    gather = not w.swaps
    # (a swapping writer writes each tensor alone, from its entry; components read in bulk
    # stand for an entry only where the view's summaries and entries come from one row: any
    # other view's entry is made and compared with the summary the variable was planned by)
    matched = bool(getattr(entries, "summaries_match_entries", False))
    bulk = getattr(entries, "bulk_components", None) if gather and matched else None
    with ReadAhead() as ahead:
        for run in _spans.batches(range(len(todo)), sizes, _spans.BULK_BYTES):
            tensors = [todo[k] for k in run]
            asked = _fetch(tensors, entries, bulk, index_path)
            ahead(t[3].entry for t in tensors if t[3].entry is not None)
            layout: list[tuple[int, int] | None] = []
            total = 0
            for t in tensors:
                var, comp = t[3], t[4]
                if not gather or comp < 0 or var.gather_dtype is None or var.tf_type == DT_STRING:
                    layout.append(None)
                    continue
                n = math.prod(var.shape) * var.gather_dtype.itemsize
                layout.append((total, n))
                total += n
            buf = scratch.array(np.dtype(np.uint8), (total,))
            pending: list[tuple[bytes, int, tuple[int, ...], int]] = []
            start = 0  # where the pending tensors begin in buf
            for t, place in zip(tensors, layout, strict=True):
                key, var, comp = t[2], t[3], t[4]
                if place is None:
                    if pending:
                        end = start + sum(p[3] for p in pending)
                        w.add_run(pending, buf[start:end])
                        pending, start = [], end
                    _write_var(w, var, key, comp, index_path)
                    continue
                pos, n = place
                dtype = cast(np.dtype, var.gather_dtype)
                _read_checked(
                    var, comp, key, buf[pos : pos + n].view(dtype).reshape(var.shape), index_path
                )
                pending.append((key, var.tf_type, var.shape, n))
            if pending:
                w.add_run(pending, buf[start:total])
            for var in asked:  # (held no longer than their run)
                var.entry = var.fetched = None


def _default_prefix(directory: str) -> str:
    numbers = [int(m.group(1)) for f in os.listdir(directory) if (m := _CKPT_NUMBER.match(f))]
    return os.path.join(directory, f"ckpt-{max(numbers, default=0) + 1}")


def write_bundle(
    path: str | os.PathLike[str],
    entries: Mapping[str, Entry],
    *,
    names: str | None = None,
    naming: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    update_state: bool = True,
) -> str:
    """Write ``entries`` as a TensorFlow checkpoint; returns the prefix written.

    Args:
        path: the prefix (``dir/ckpt-1`` writes ``dir/ckpt-1.index`` and
            ``dir/ckpt-1.data-00000-of-00001``); a trailing ``.index`` is dropped; an existing
            directory gets the next ``ckpt-N``.
        entries: any ``Mapping[str, Entry]`` (a view of another checkpoint, in-memory entries).
        names: the key style: ``"tf"`` (``tf.train.Checkpoint``'s object-based keys and
            object graph), ``"slash"`` (name-based: each entry under its path, no object
            graph) or ``"tf1"`` (name-based, under the keys ``tf.compat.v1.train.Saver`` and
            TF 1.x's optimizers use: each variable under its ``name``, ``V/Adam``,
            ``V/Adam_1``, ``beta1_power``, ...; one tensor per variable, so write
            ``components="logical"``). By default ``"slash"`` when ``entries`` is a view of a
            name-based TensorFlow checkpoint, else ``"tf"``.
        naming: the older spelling of ``names``: ``"object"`` is ``"tf"``, ``"name"`` is
            ``"slash"``.
        metadata: file-level metadata kept in the metadata key when it is written (by default
            the source view's own, less its ``tf_*`` keys).
        update_state: make this checkpoint the latest in the directory's ``checkpoint`` file.

    Raises:
        UnsupportedDtypeError: a dtype TensorFlow cannot hold.
        InvalidEntryError: an entry that cannot be saved (bad path, inconsistent components).
    """
    prefix = os.fspath(path)
    if os.path.isdir(prefix):
        prefix = _default_prefix(prefix)
    elif prefix.endswith(".index"):
        prefix = prefix[: -len(".index")]
    source_meta = dict(getattr(entries, "metadata", None) or {})
    if names is not None:
        if naming is not None:
            raise InvalidArgumentError("pass names= or its older spelling naming=, not both")
        naming = _NAMING.get(names)
        if naming is None:
            raise InvalidArgumentError(
                f"{prefix}: a TensorFlow checkpoint takes names='tf', 'slash' or 'tf1', "
                f"not {names!r}"
            )
    if naming is None:
        naming = "name" if source_meta.get("tf_naming") == "name" else "object"
    if naming not in ("object", "name", "tf1"):
        raise InvalidArgumentError(
            f"naming must be 'object' or 'name' (or names='tf1'), not {naming!r}"
        )
    if metadata is None:
        metadata = {k: v for k, v in source_meta.items() if not str(k).startswith("tf_")}
    index_path = prefix + ".index"

    # A view that describes its variables without making entries (``summary``: an index's
    # table) has most planned from that, their entries made only while their run is written
    # (see _Var); TF1 names are worked out from the entries themselves.
    summary = getattr(entries, "summary", None) if naming != "tf1" else None
    checked = bool(getattr(entries, "summaries_checked", False))
    plans = []
    for p in entries:
        known = None
        if summary is not None:
            known = _summarized(entries, p, summary, checked, index_path)
        entry = None if known is not None else _as_tf_stores(p, entries[p], index_path)
        plans.append(_plan(p, entry, known, index_path))
    keys = {var.path: var.path for var in plans}
    if naming == "tf1":
        keys = tf1_keys({var.path: _made(var) for var in plans}, index_path)
        for var in plans:  # what the key says, the metadata record need not
            if keys[var.path] != var.path and slot_owner(var.path, var.attrs) is not None:
                var.express(_SLOT_ATTRS)
    with BundleWriter(prefix) as w:
        if naming == "object":
            root, slot_nodes = _build_tree(plans, index_path)
            order = _number(root, slot_nodes)
            _write_vars(w, [t for node in order for t in node.attributes], entries, index_path)
            graph = np.array(_graph_bytes(order), dtype=object)
        else:
            for var in plans:
                if var.slices is None and var.num_components != 1:
                    raise InvalidEntryError(
                        "a name-based checkpoint holds one tensor per variable "
                        "(components='logical' writes one)",
                        file=index_path,
                        variable=var.path,
                        expected="1 component",
                        found=f"{var.num_components} ({var.kind})",
                    )
            _write_vars(
                w,
                [
                    ("", "", _utf8(keys[v.path]), v, -1 if v.slices is not None else 0)
                    for v in plans
                ],
                entries,
                index_path,
            )
        records = _record_texts(plans, keys)
        if naming == "object":
            w.add(GRAPH_KEY.encode(), graph)
        if records:
            w.add(METADATA_KEY.encode(), np.array(_metadata_doc(records, metadata), dtype=object))
    if update_state:
        write_state(os.path.dirname(prefix), prefix)
    return prefix
