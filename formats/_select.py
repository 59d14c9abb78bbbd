"""What an export carries: path patterns and the model-only selection of ``convert``.

A checkpoint holds more than a model: the optimizer's state (slots such as Adam's ``m`` and
``v``, its step count and beta powers) and the checkpoint's own bookkeeping (``save_counter``,
a root ``step``). A library that loads a model strictly (torch ``load_state_dict(strict=True)``,
Keras ``load_weights``, ``transformers`` ``from_pretrained``) refuses every key it does not
know, so an export for it keeps the model's tensors only.

Which entries are optimizer state is read from what the file says, not guessed from names
where it can be helped:

* an entry with a ``slot_of`` attribute is an optimizer slot;
* in a carried object graph, a node with slot relations is an optimizer: every variable under
  its path is the optimizer's (its counters too);
* without a graph (a file another library wrote): the subtree of a root child named
  ``optimizer`` (our convention and Keras's and TensorFlow's), TensorFlow 1.x's root
  ``beta1_power``/``beta2_power``/``global_step``;
* the checkpoint's bookkeeping: the root ``save_counter`` and a scalar root ``step``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from parallelvars._aggregate import has_logical_value, no_value_error, rule_for
from parallelvars.checkpoint.entry import ForwardingEntry
from parallelvars.errors import InvalidArgumentError

from ._view import DictView, Entry

__all__ = ["BOOKKEEPING", "describe_left_out", "exported", "optimizer_paths", "select_entries"]

# Attributes that describe how a value is spread over devices; a logical copy drops them.
_PARALLEL_ATTRS = frozenset(
    {"devices", "shard_axis", "shard_offsets", "aggregation", "synchronization"}
)

# Root entries that count saves or steps rather than hold a model's weights.
BOOKKEEPING = frozenset({"save_counter", "step", "global_step"})
# Root entries TensorFlow 1.x optimizers keep outside any scope (Adam's beta powers).
_TF1_NON_SLOTS = frozenset({"beta1_power", "beta2_power"})
_OPTIMIZER_ROOTS = ("optimizer",)


def _graph_optimizer_prefixes(graph: Any) -> list[str]:
    """The path prefixes of the optimizers of a native object graph (nodes with slots)."""
    if not isinstance(graph, Mapping) or not isinstance(graph.get("nodes"), list):
        return []
    nodes = graph["nodes"]
    # Each node's first path from the root (breadth-first, as the graph was built).
    paths: dict[int, str] = {0: ""}
    queue = [0]
    while queue:
        nid = queue.pop(0)
        try:
            children = nodes[nid].get("children") or []
        except (IndexError, AttributeError, TypeError):
            continue
        for pair in children:
            try:
                name, child = pair
            except (TypeError, ValueError):
                continue
            if isinstance(child, int) and child not in paths:
                paths[child] = f"{paths[nid]}/{name}" if paths[nid] else str(name)
                queue.append(child)
    prefixes = []
    for nid, node in enumerate(nodes):
        if isinstance(node, Mapping) and node.get("slots") and nid in paths and paths[nid]:
            prefixes.append(paths[nid])
    return prefixes


def optimizer_paths(entries: Mapping[str, Any]) -> dict[str, str]:
    """``key -> why it is not a model weight`` for every optimizer or bookkeeping entry."""
    graph = getattr(entries, "object_graph", None)
    prefixes = _graph_optimizer_prefixes(graph) or list(_OPTIMIZER_ROOTS)
    out: dict[str, str] = {}
    for key, entry in entries.items():
        attrs = getattr(entry, "attrs", None) or {}
        under = any(key == p or key.startswith(p + "/") for p in prefixes)
        if key in BOOKKEEPING:
            out[key] = "checkpoint bookkeeping"
        elif "slot_of" in attrs or under or key in _TF1_NON_SLOTS:
            out[key] = "optimizer state"
    return out


def _matches(key: str, patterns: Iterable[str]) -> bool:
    """Whether ``key`` matches a glob pattern, or lies under a path a pattern matches."""
    return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(key, p + "/*") for p in patterns)


def select_entries(
    entries: Mapping[str, Any],
    *,
    only: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    model_only: bool = False,
    target: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The keys an export keeps, in order, and ``key -> reason`` for each it leaves out.

    Args:
        entries: the source view.
        only: glob patterns (``model/*``, ``model/dense``: a pattern also selects what lies
            under a path it matches); when given, only matching keys are kept.
        exclude: glob patterns of keys to leave out.
        model_only: leave out optimizer state and the checkpoint's bookkeeping, less what
            the ``target`` format's library has a place for: a TensorFlow checkpoint keeps the
            root ``save_counter``, which ``tf.train.Checkpoint`` has and whose
            ``assert_consumed`` counts.
        target: the format written (see ``model_only``).

    Raises:
        InvalidArgumentError: a pattern is empty, or the selection keeps nothing.
    """
    for pattern in [*(only or ()), *(exclude or ())]:
        if not isinstance(pattern, str) or not pattern:
            raise InvalidArgumentError(
                f"a path pattern must be a non-empty string, got {pattern!r}"
            )
    left: dict[str, str] = {}
    extra = optimizer_paths(entries) if model_only else {}
    if target == "tf":
        extra.pop("save_counter", None)
    kept = []
    for key in entries:
        if key in extra:
            left[key] = extra[key]
        elif only and not _matches(key, only):
            left[key] = "not selected by --only"
        elif exclude and _matches(key, exclude):
            left[key] = "excluded by --exclude"
        else:
            kept.append(key)
    if not kept and len(entries):
        path = getattr(entries, "path", "<memory>")
        raise InvalidArgumentError(
            f"{path}: the selection leaves no variable to write "
            f"(only={list(only or [])}, exclude={list(exclude or [])}, model_only={model_only})"
        )
    return kept, left


def describe_left_out(left: Mapping[str, str], limit: int = 6) -> list[str]:
    """One note line per reason: how many entries it left out and the first few keys."""
    by_reason: dict[str, list[str]] = {}
    for key, reason in left.items():
        by_reason.setdefault(reason, []).append(key)
    lines = []
    for reason, keys in by_reason.items():
        shown = ", ".join(keys[:limit]) + (", ..." if len(keys) > limit else "")
        lines.append(
            f"left out {len(keys)} entr{'y' if len(keys) == 1 else 'ies'} ({reason}): {shown}"
        )
    return lines


class _PrimaryEntry(ForwardingEntry):
    """A single-component copy of an entry: its logical value (the primary of a mirrored
    variable, the aggregate of an on-read one, the stitched shards of a sharded one)."""

    def __init__(self, source: Entry) -> None:
        super().__init__(source)
        self.kind = "single"
        self.num_components = 1
        self.attrs = {k: v for k, v in self.attrs.items() if k not in _PARALLEL_ATTRS}
        self._primary = source.kind != "sharded" and (
            source.num_components == 1 or rule_for(source.kind, source.attrs).value == "primary"
        )

    def component_shape(self, i: int) -> tuple[int, ...]:
        self._check_index(i)
        return self.shape

    def component(self, i: int) -> np.ndarray:
        self._check_index(i)
        return self.source.component(0) if self._primary else self.source.value()

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        self._check_index(i)
        self.check_out(i, out)  # the aggregate is assigned: another dtype would be cast
        if self._primary:
            self.source.read_component_into(0, out)
        else:
            out[...] = self.source.value()

    def value(self) -> np.ndarray:
        return self.component(0)


def exported(
    view: Mapping[str, Entry],
    *,
    components: str = "all",
    only: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    model_only: bool = False,
    root: str | None = None,
    on_left_out: Callable[[Mapping[str, str]], Any] | None = None,
    file: str | None = None,
    target: str | None = None,
) -> Mapping[str, Entry]:
    """``view`` as an export writes it: the selected entries (see :func:`select_entries`), each
    its logical value with ``components="logical"``; the view itself when nothing changes.
    What :func:`convert` and :func:`~parallelvars.formats.write_checkpoint` write.

    ``root`` (a path such as ``"model"``) exports that subtree as the whole: its entries under
    their paths below it (``model/dense/kernel`` as ``dense/kernel``, which the dotted style
    writes ``dense.kernel``, a torch module's own ``state_dict`` key), everything else left out.
    """
    if components not in ("all", "logical", "primary"):
        raise InvalidArgumentError(
            f"components must be 'all' or 'logical' ('primary'), got {components!r}"
        )
    if not (only or exclude or model_only or root) and components == "all":
        return view
    where = file if file is not None else str(getattr(view, "path", "<memory>"))
    entries: dict[str, Entry] = dict(view.items())
    if only or exclude or model_only:
        kept, left = select_entries(
            view, only=only, exclude=exclude, model_only=model_only, target=target
        )
        entries = {k: entries[k] for k in kept}
    else:
        left = {}
    if root:
        prefix = root.strip("/") + "/"
        if prefix == "/":
            raise InvalidArgumentError("root must name a path, such as 'model'")
        left.update((k, "outside --root") for k in entries if not k.startswith(prefix))
        entries = {k[len(prefix) :]: e for k, e in entries.items() if k.startswith(prefix)}
        if not entries:
            raise InvalidArgumentError(f"{where}: nothing lies under the root {root!r}")
    if left and on_left_out is not None:
        on_left_out(left)
    if components in ("logical", "primary"):
        for key, e in entries.items():
            if not has_logical_value(e):  # as `extract` refuses it
                raise no_value_error(
                    e,
                    file=where,
                    variable=key,
                    hint="keep them with components='all' (--components all), or extract one "
                    "with 'parallelvars extract --component'",
                )
        entries = {k: _PrimaryEntry(e) for k, e in entries.items()}
    return DictView.derived(view, entries)
