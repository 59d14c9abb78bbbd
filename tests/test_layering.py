"""The import graph of parallelvars, formats and cli: no cycles, no upward edges.

Every module of ``parallelvars/``, ``formats/`` (``parallelvars.formats``) and ``cli/``
(``parallelvars.cli``) is parsed with ``ast`` and *every* import counts: at module level, inside
functions, and under ``TYPE_CHECKING``. ``from package import name`` is an edge to the
submodule when ``name`` is one, else to the package. docs/ARCHITECTURE.md describes the layers.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import pathlib
from collections.abc import Iterable

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {
    "parallelvars": "parallelvars",
    "parallelvars.formats": "formats",
    "parallelvars.cli": "cli",
}

# The layers, lowest first: a module may import modules of its own layer and of the layers below,
# never above. Every module belongs to exactly one layer (the first whose patterns it matches).
LAYERS: list[tuple[str, list[str]]] = [
    (
        "foundation: errors, dtypes, files, threads, shard geometry, aggregation rules, the update core",
        [
            "parallelvars._version",
            "parallelvars.errors",
            "parallelvars.enums",
            "parallelvars._ints",
            "parallelvars._dtypes",
            "parallelvars._threads",
            "parallelvars._fileio",
            "parallelvars._spans",
            "parallelvars._geometry",
            "parallelvars._storage",
            "parallelvars._source_tree",
            "parallelvars._aggregate",
            "parallelvars.update_core",
        ],
    ),
    (
        "modes and values: the mode, creator and update-device stacks, write routing, and the "
        "per-replica values variables take",
        ["parallelvars._modes", "parallelvars._write_plan", "parallelvars._values"],
    ),
    (
        # pack(name=...) makes a variable through the constructor the facade hands devices.
        "devices: the parallel device",
        ["parallelvars.devices"],
    ),
    (
        # Variables import no strategy module (tests/test_packaging.py).
        "distribution: variables, strategies",
        [
            "parallelvars._proxy",
            "parallelvars._sharded",
            "parallelvars._creation",
            "parallelvars.variables",
            "parallelvars.strategy",
            "parallelvars.strategy.*",
        ],
    ),
    (
        "HDF5 bytes: lookup3, the bounded object-header parser, message bodies, the global heap",
        [
            "parallelvars.checkpoint.h5raw",
            "parallelvars.checkpoint.h5raw.lookup3",
            "parallelvars.checkpoint.h5raw.source",
            "parallelvars.checkpoint.h5raw.header",
            "parallelvars.checkpoint.h5raw.messages",
            "parallelvars.checkpoint.h5raw.global_heap",
            "parallelvars.checkpoint.h5raw.fractal_heap",
            "parallelvars.checkpoint.h5raw.templates",
            "parallelvars.checkpoint.h5raw.virtual",
            "parallelvars.checkpoint.h5raw.symbol_table",
            "parallelvars.checkpoint.h5raw.links",
        ],
    ),
    (
        "the saved-entry model: entries, the saveable registry, file policy, retention",
        [
            "parallelvars.checkpoint.entry",
            "parallelvars.checkpoint.registry",
            "parallelvars.checkpoint._h5policy",
            "parallelvars.checkpoint._gcfreeze",
            "parallelvars.checkpoint.retention",
        ],
    ),
    ("tracking: the object graph's containers", ["parallelvars.tracking"]),
    ("optimizers", ["parallelvars.optimizers", "parallelvars.optimizers.*"]),
    (
        "the native layout's bytes (h5io, and the file generator of h5raw)",
        [
            "parallelvars.checkpoint.h5io",
            "parallelvars.checkpoint.h5io.*",
            "parallelvars.checkpoint.h5raw.objects",
            "parallelvars.checkpoint.h5raw.generate",
            "parallelvars.checkpoint.h5raw.component_bytes",
            "parallelvars.checkpoint.h5raw.native",
            "parallelvars.checkpoint.h5raw.index_file",
        ],
    ),
    (
        "checkpoints: graph, restore planner, sources, Checkpoint, manager",
        ["parallelvars.checkpoint", "parallelvars.checkpoint.*"],
    ),
    ("the facade: the package's lazy public names", ["parallelvars"]),
    # Imported by no library module: the documented seam tests reach internals through.
    ("test support: parallelvars.testing", ["parallelvars.testing"]),
    (
        "formats: adapters and converters, plugged into the core",
        ["parallelvars.formats", "parallelvars.formats.*"],
    ),
    ("the command line", ["parallelvars.cli", "parallelvars.cli.*"]),
    # `python -m parallelvars`: starts the command line; nothing imports it.
    ("the entry point", ["parallelvars.__main__"]),
]


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for prefix, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def _known(name: str, known: Iterable[str]) -> str | None:
    """``name`` or its nearest enclosing module that is one of ours."""
    names = set(known)
    while name and name not in names:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> dict[str, int]:
    """Every module of ours that ``name`` imports, anywhere in it, with the first line."""
    out: dict[str, int] = {}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [
                f"{module}.{a.name}" if f"{module}.{a.name}" in known else module
                for a in node.names
            ]
        for target in targets:
            found = _known(target, known)
            if found is not None and found != name:
                out.setdefault(found, node.lineno)
    return out


@functools.cache
def graph() -> dict[str, dict[str, int]]:
    """The import graph of the tree as it is on disk (read once per test session: every test
    here only reads it)."""
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, Iterable[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(component)
    return out


def layer_of(name: str) -> int | None:
    for number, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return number
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    edges = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["e"]}
    assert cycles(edges) == [{"a", "b", "c"}]
    assert cycles({"a": ["b"], "b": []}) == []


def test_imports_count_function_level_and_type_checking(tmp_path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from parallelvars.checkpoint import graph\n"
        "def f():\n    import parallelvars.formats._source\n"
        "from . import sibling\n"
    )
    known = {
        "parallelvars.checkpoint": module,
        "parallelvars.checkpoint.graph": module,
        "parallelvars.formats._source": module,
        "parallelvars.x.sibling": module,
        "parallelvars.x.m": module,
    }
    assert set(imports("parallelvars.x.m", module, known)) == {
        "parallelvars.checkpoint.graph",
        "parallelvars.formats._source",
        "parallelvars.x.sibling",
    }


def test_no_import_cycles() -> None:
    edges = graph()
    assert len(edges) > 100  # (the graph was read)
    assert [sorted(c) for c in cycles(edges)] == []


def test_every_module_has_a_layer() -> None:
    missing = sorted(name for name in modules() if layer_of(name) is None)
    assert not missing, f"place these modules in LAYERS: {missing}"


def test_no_upward_imports() -> None:
    upward = []
    for name, targets in graph().items():
        mine = layer_of(name)
        for target, line in targets.items():
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(
                    f"{name}:{line} imports {target} ({LAYERS[mine][0].split(':')[0]} -> "
                    f"{LAYERS[theirs][0].split(':')[0]})"
                )
    assert not upward, upward


def test_the_core_never_imports_formats_or_cli() -> None:
    edges = graph()
    core = [m for m in edges if not m.startswith(("parallelvars.formats", "parallelvars.cli"))]
    bad = [
        f"{m} imports {t}"
        for m in core
        if m != "parallelvars.__main__"  # `python -m parallelvars` runs the command line
        for t in edges[m]
        if t.startswith(("parallelvars.formats", "parallelvars.cli"))
    ]
    bad += [
        f"{m} imports {t}"
        for m in edges
        if m.startswith("parallelvars.formats")
        for t in edges[m]
        if t.startswith("parallelvars.cli")
    ]
    assert not bad, bad
