"""``parallelvars inspect``: the tree of variables in a checkpoint."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from parallelvars._dtypes import dtype_name
from parallelvars.errors import ParallelVarsError
from parallelvars.formats import CheckpointView, Entry

from ._common import (
    add_format_option,
    format_bytes,
    metadata_text,
    natural_key,
    open_view,
    shape_str,
)
from ._output import Output, Progress

__all__ = ["add_parser", "run", "components_equal", "training_structure"]

_EPILOG = """\
For each variable: its kind (single, mirrored, on_read, independent, sharded), dtype, logical
shape, number of components (one per device) and bytes. Mirrored variables are read in full to
tell whether every component is bit-for-bit equal to the primary. The last line says what the
file records of the training run: its object graph and optimizer slots (a file without them
restores its values by path).

examples:
  parallelvars inspect run.h5
  parallelvars inspect model.safetensors --json | jq '.variables[].path'
  parallelvars inspect ckpt-3 --from tf"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "inspect",
        help="list the variables of a checkpoint",
        description="List the variables of a checkpoint as a tree.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="checkpoint file, directory or prefix")
    add_format_option(parser, "--from", "format of CKPT")
    return parser


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "O":
        return bool(np.array_equal(a, b))
    # Bit-for-bit: NaN equals the same NaN, -0.0 differs from 0.0, as a restore would see it.
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def components_equal(entry: Entry, progress: Progress | None = None) -> list[int]:
    """Indices of the components that differ from the primary (empty when all are equal)."""
    primary = entry.component(0)
    if progress is not None:
        progress.advance(entry.component_nbytes(0))
    differing = []
    for i in range(1, entry.num_components):
        if not _same(primary, entry.component(i)):
            differing.append(i)
        if progress is not None:
            progress.advance(entry.component_nbytes(i))
    return differing


def _row(entry: Entry) -> dict[str, Any]:
    return {
        "path": entry.path,
        "kind": entry.kind,
        "dtype": dtype_name(entry.dtype),
        "shape": [int(s) for s in entry.shape],
        "components": int(entry.num_components),
        "bytes": int(entry.nbytes),
        "attrs": dict(entry.attrs),
    }


def _detail(row: dict[str, Any]) -> str:
    attrs = row["attrs"]
    bits = []
    if "damaged" in row:
        bits.append("DAMAGED (see 'parallelvars verify')")
    elif row["kind"] == "mirrored":
        bits.append("equal" if row["equal"] else f"NOT EQUAL (components {row['differing']})")
    elif row["kind"] == "on_read" and "aggregation" in attrs:
        bits.append(f"aggregation={attrs['aggregation']}")
    elif row["kind"] == "sharded" and "shard_axis" in attrs:
        bits.append(f"axis={attrs['shard_axis']}")
    if "slot_name" in attrs:
        bits.append(f"slot={attrs['slot_name']}")
    return ", ".join(bits)


@dataclass
class _Node:
    row: dict[str, Any] | None = None
    children: dict[str, _Node] = field(default_factory=dict)


def _tree(rows: list[dict[str, Any]]) -> _Node:
    root = _Node()
    for row in rows:
        node = root
        for part in row["path"].split("/"):
            node = node.children.setdefault(part, _Node())
        node.row = row
    return root


# Deeper levels are not indented further (their rows show the rest of the path), and the name
# column is at most this wide, so the output stays linear in the paths' total length.
_MAX_INDENT = 32
_MAX_NAME_WIDTH = 80


def render_tree(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as an indented tree with aligned columns (iterative: any depth)."""
    lines: list[tuple[str, dict[str, Any] | None]] = []
    # Depth-first with an explicit stack; ``below`` holds the names under the deepest indented
    # group, joined only when a row is printed.
    stack: list[tuple[Iterator[tuple[str, _Node]], int]] = [(iter(_tree(rows).children.items()), 0)]
    below: list[str] = []
    while stack:
        children, depth = stack[-1]
        item = next(children, None)
        if item is None:
            stack.pop()
            if depth > _MAX_INDENT and below:
                below.pop()
            continue
        name, child = item
        pad = "  " * min(depth, _MAX_INDENT)
        if child.row is not None:
            label = "/".join([*below, name]) if depth >= _MAX_INDENT else name
            lines.append((pad + label, child.row))
        if child.children:
            if depth < _MAX_INDENT:
                lines.append((pad + name + "/", None))
            else:
                below.append(name)
            stack.append((iter(child.children.items()), depth + 1))
    cells = [
        [
            row["kind"],
            row["dtype"],
            shape_str(row["shape"]),
            f"{row['components']} component{'s' if row['components'] != 1 else ''}",
            format_bytes(row["bytes"]),
            _detail(row),
        ]
        for _, row in lines
        if row is not None
    ]
    widths = [max((len(c[j]) for c in cells), default=0) for j in range(6)]
    name_width = min(
        max((len(label) for label, row in lines if row is not None), default=0), _MAX_NAME_WIDTH
    )
    out = []
    it = iter(cells)
    for label, row in lines:
        if row is None:
            out.append(label)
            continue
        c = next(it)
        cols = [label.ljust(name_width)] + [c[j].ljust(widths[j]) for j in range(5)] + [c[5]]
        out.append("  ".join(cols).rstrip())
    return out


def _summary_row(
    path: str,
    kind: str,
    dtype: np.dtype,
    shape: tuple[int, ...],
    n: int,
    nbytes: int,
    attrs: Mapping[str, Any],
    names: dict[np.dtype, str],
) -> dict[str, Any]:
    """:func:`_row` from a reader's summary of the entry (``names``: dtype names met so far)."""
    name = names.get(dtype)
    if name is None:
        name = names[dtype] = dtype_name(dtype)
    return {
        "path": path,
        "kind": kind,
        "dtype": name,
        "shape": list(shape),
        "components": n,
        "bytes": nbytes,
        "attrs": attrs,  # (a dict of its own: see H5Reader.summaries)
    }


def collect(view: CheckpointView, out: Output) -> list[dict[str, Any]]:
    """One row per variable, sorted by path; mirrored variables get ``equal``/``differing``.

    A native file's rows come from its index's table (no entry made per variable) and its
    mirrored components are compared in bulk (read by offset, checksums verified); any other
    view's, and any entry the bulk path leaves out, entry by entry, component by component.
    """
    return list(Rows(view, out))


class Rows(Sequence[dict[str, Any]]):
    """:func:`collect`'s rows, each made when it is read (a native file's from its index's
    table): what is kept of every variable is its path and, for a mirrored one whose
    components differ or could not be read, what was found. The components are compared once,
    when the rows are made ready."""

    def __init__(self, view: CheckpointView, out: Output) -> None:
        self._view = view
        self.keys = sorted(view, key=natural_key)
        summary = getattr(view, "summary", None)
        if summary is None:
            summaries = getattr(view, "summaries", None)
            listed = summaries() if summaries is not None else None
            summary = listed.get if listed is not None else None
        self._summary = summary
        self._names: dict[np.dtype, str] = {}
        # Rows made from entries (a view without a table): kept, as the view keeps its entries.
        self._made: dict[str, dict[str, Any]] = {}
        self._differing: dict[str, list[int]] = {}  # (only those that differ)
        self._damaged: dict[str, str] = {}
        self._compare(out)

    def _base(self, key: str) -> dict[str, Any]:
        made = self._made.get(key)
        if made is not None:
            return dict(made)
        known = self._summary(key) if self._summary is not None else None
        if known is not None:
            kind, dtype, shape, n, nbytes, attrs = known
            return _summary_row(key, kind, dtype, shape, n, nbytes, attrs, self._names)
        try:
            entry = self._view[key]
        except ParallelVarsError as exc:  # shown in the tree, marked, with the others
            row = {
                "path": key,
                "kind": "?",
                "dtype": "?",
                "shape": [],
                "components": 0,
                "bytes": 0,
                "attrs": {},
                "damaged": str(exc),
            }
        else:
            row = _row(entry)
        if self._summary is None:
            self._made[key] = row
            return dict(row)
        return row

    def _facts(self, key: str) -> tuple[str, int, int, bool, Any]:
        """The kind, number of components, bytes of ``key``, whether its entry could not be
        made, and the variable whose slot it is (from the view's summary: no row made)."""
        known = self._summary(key) if self._summary is not None else None
        if known is not None:
            return known[0], known[3], known[4], False, known[5].get("slot_of")
        row = self._base(key)
        return (
            row["kind"],
            row["components"],
            row["bytes"],
            "damaged" in row,
            row["attrs"].get("slot_of"),
        )

    def totals(self) -> tuple[int, int, list[dict[str, Any]]]:
        """The bytes and components of every variable, and the rows of the damaged ones."""
        return self._bytes, self._components, [self.row(key) for key in self._broken]

    def _compare(self, out: Output) -> None:
        """Note what the listing's totals and training structure need of each variable, and
        compare every mirrored variable's components (in bulk where the view can)."""
        mirrored: list[str] = []
        sizes: list[int] = []
        total = nbytes = components = 0
        broken = []
        #: (slot path, its variable's path) of every optimizer slot
        self.slots: list[tuple[str, str]] = []
        for key in self.keys:
            kind, n, size, damaged, slot_of = self._facts(key)
            nbytes += size
            components += n
            if isinstance(slot_of, str):
                self.slots.append((key, slot_of))
            if damaged:
                broken.append(key)
            elif kind == "mirrored" and n > 1:
                mirrored.append(key)
                sizes.append(size)
                total += size
        self._bytes, self._components = nbytes, components
        bulk = getattr(self._view, "differing_components", None)
        known = bulk(mirrored) if bulk is not None else {}
        with out.progress(total, "compare components") as bar:
            for key, size in zip(mirrored, sizes, strict=True):
                try:
                    differing = known.get(key)
                    if differing is None:
                        differing = components_equal(self._view[key], bar)
                    else:
                        bar.advance(size)
                except ParallelVarsError as exc:
                    self._damaged[key] = str(exc)
                    broken.append(key)
                else:
                    if differing:
                        self._differing[key] = differing
        self._mirrored = set(mirrored)
        if broken:  # (in the listing's order)
            place = {key: k for k, key in enumerate(self.keys)}
            broken.sort(key=place.__getitem__)
        self._broken = broken

    def row(self, key: str) -> dict[str, Any]:
        """The row of the variable ``key``."""
        row = self._base(key)
        if key in self._damaged:
            row["damaged"] = self._damaged[key]
        elif key in self._mirrored:
            differing = self._differing.get(key, [])
            row["equal"] = not differing
            row["differing"] = differing
        return row

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, k: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, k: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, k: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(k, slice):
            return [self.row(key) for key in self.keys[k]]
        return self.row(self.keys[k])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return map(self.row, self.keys)


_UNSAID = object()


def training_structure(view: CheckpointView, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the file says of the training run beyond values: whose object graph it carries
    (``"parallelvars"``, ``"tensorflow"`` or None: a restore then matches by path), its
    optimizer slots, the slots whose variable is not in the file (they restore nowhere), the
    optimizer state a TF1 name-based checkpoint holds (``tf1_slots``, ``tf1_counters``: mapped
    by variable name at restore), and what no restore can map, with the reason
    (``not_mappable``)."""
    from parallelvars.formats._source import reasons_of
    from parallelvars.formats.tf._tf1 import name_based_state

    known = getattr(view, "graph_kind", _UNSAID)  # (a native view: known from its open)
    if known is _UNSAID:
        graph = getattr(view, "object_graph", None)
        known = None if graph is None else "parallelvars" if isinstance(graph, Mapping) else "other"
    slots: list[tuple[str, str]]  # (each slot's path and its variable's: not its row)
    if isinstance(rows, Rows):  # (noted as its rows were made ready: none made again)
        paths, slots = set(rows.keys), rows.slots
    else:
        paths, slots = set(), []
        for r in rows:
            paths.add(r["path"])
            target = r["attrs"].get("slot_of")
            if isinstance(target, str):
                slots.append((r["path"], target))
    tf1, counters = name_based_state(view)
    not_mappable = {k: s.reason for k, s in tf1.items() if s.slot_name is None}
    not_mappable.update(reasons_of(view))
    return {
        "object_graph": "tensorflow" if known == "other" else known,
        "slots": len(slots),
        "slots_without_variable": [path for path, target in slots if target not in paths],
        "tf1_slots": sum(s.slot_name is not None for s in tf1.values()),
        "tf1_counters": counters,
        "not_mappable": dict(sorted(not_mappable.items())),
    }


def _structure_text(structure: dict[str, Any]) -> str:
    n = structure["slots"]
    graph = structure["object_graph"]
    if graph is None and not n:
        text = "training structure: none recorded (a restore matches variables by path)"
        return text + _mapping_text(structure)
    text = "training structure: " + (
        f"{graph} object graph" if graph else "no object graph (rebuilt from the paths)"
    )
    text += f", {n} optimizer slot{'s' if n != 1 else ''}"
    orphans = structure["slots_without_variable"]
    if orphans:
        text += f"; {len(orphans)} without their variable: {', '.join(orphans[:5])}"
    return text + _mapping_text(structure)


def _mapping_text(structure: dict[str, Any]) -> str:
    """The TF1 name-based state and what no restore can map, for the structure line."""
    text = ""
    tf1, counters = structure["tf1_slots"], structure["tf1_counters"]
    if tf1 or counters:
        text += (
            f"; TF1 name-based optimizer state: {tf1} slot{'s' if tf1 != 1 else ''}"
            + (f" and {', '.join(counters)}" if counters else "")
            + " (mapped onto the live model by variable name at restore)"
        )
    unmapped = structure["not_mappable"]
    if unmapped:
        first, why = next(iter(unmapped.items()))
        text += f"; {len(unmapped)} not mappable, e.g. {first}: {why}"
    return text


def run(args: argparse.Namespace) -> int:
    out: Output = args.out
    with open_view(args.checkpoint, args.from_format, args.read_options) as view:
        # (each row made when it is written: a listing of 100,000 variables does not hold
        # 100,000 rows)
        rows = Rows(view, out)
        fmt, metadata = view.format, dict(view.metadata)
        structure = training_structure(view, rows)
        total, ncomp, damaged = rows.totals()
        return _emit(args, out, rows, fmt, metadata, structure, total, ncomp, damaged)


def _emit(
    args: argparse.Namespace,
    out: Output,
    rows: Rows,
    fmt: str,
    metadata: dict[str, Any],
    structure: dict[str, Any],
    total: int,
    ncomp: int,
    damaged: list[dict[str, Any]],
) -> int:
    """Print the listing (its rows read from the view, still open)."""
    data = {
        "path": args.checkpoint,
        "format": fmt,
        "metadata": metadata,
        "num_variables": len(rows),
        "num_components": ncomp,
        "bytes": total,
        "training_structure": structure,
        "variables": rows,
    }

    def human() -> str:
        head = (
            f"{args.checkpoint}: {fmt}, {len(rows)} variable{'s' if len(rows) != 1 else ''}, "
            f"{ncomp} component{'s' if ncomp != 1 else ''}, {format_bytes(total)}"
        )
        lines = [head]
        if metadata:
            lines.append("metadata:")
            for key in sorted(metadata, key=lambda k: natural_key(str(k))):
                value = metadata_text(str(key), metadata[key])
                lines.append(f"  {key}: {value if len(value) <= 72 else value[:69] + '...'}")
            lines.append("variables:")
        made = list(rows)
        lines.extend(render_tree(made))
        lines.append(_structure_text(structure))
        unequal = [r["path"] for r in made if r.get("equal") is False]
        if unequal:
            lines.append(f"{len(unequal)} mirrored variable(s) with unequal components")
        lines.extend(f"damaged: {r['damaged']}" for r in damaged)
        return "\n".join(lines)

    out.emit(data, human)
    return 1 if damaged else 0
