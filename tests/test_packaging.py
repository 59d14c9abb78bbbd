"""The installed package holds every subpackage of the tree, and the core stays independent."""

from __future__ import annotations

import ast
import pathlib
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAPPING = {
    "parallelvars": "parallelvars",
    "formats": "parallelvars.formats",
    "cli": "parallelvars.cli",
}


def _tree_packages() -> set[str]:
    found = set()
    for top, name in MAPPING.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    return found


def test_every_package_folder_is_listed_in_pyproject() -> None:
    if tomllib is None:
        return
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    assert _tree_packages() <= listed, sorted(_tree_packages() - listed)


# The one place the core reaches the formats: a restore of a file in another format opens it
# through them, importing them inside the function that needs them (never for our own files).
_RESTORE_SOURCES = pathlib.Path("parallelvars", "checkpoint", "_sources.py")


def test_core_never_imports_formats_or_cli() -> None:
    offenders = []
    for py in (ROOT / "parallelvars").rglob("*.py"):
        if py.name == "__main__.py":
            continue  # the documented `python -m parallelvars` shim
        nodes = ast.parse(py.read_text()).body  # module level only in _sources.py
        whole_file = py.relative_to(ROOT) != _RESTORE_SOURCES
        for node in ast.walk(ast.Module(body=nodes, type_ignores=[])) if whole_file else nodes:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                if n.startswith(("parallelvars.formats", "parallelvars.cli")):
                    offenders.append(f"{py.relative_to(ROOT)} imports {n}")
    assert not offenders, offenders


# The layers below strategies (docs/ARCHITECTURE-training.md): they read the mode stacks of
# _modes and the values of _values, never a strategy module, in any form of import.
_BELOW_STRATEGY = ("_values.py", "_modes.py", "_write_plan.py", "devices.py", "variables.py")


def test_variables_and_the_layers_below_import_no_strategy_module() -> None:
    offenders = []
    for name in _BELOW_STRATEGY:
        py = ROOT / "parallelvars" / name
        for node in ast.walk(ast.parse(py.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for n in names:
                if n == "parallelvars.strategy" or n.startswith("parallelvars.strategy."):
                    offenders.append(f"parallelvars/{name}:{node.lineno} imports {n}")
    assert not offenders, offenders


def test_a_native_restore_does_not_load_the_formats(tmp_path: pathlib.Path) -> None:
    import subprocess

    code = (
        "import sys, numpy as np, parallelvars as pv\n"
        f"path = pv.Checkpoint(w=pv.Variable(np.ones(2))).write({str(tmp_path / 'a.h5')!r})\n"
        "pv.Checkpoint(w=pv.Variable(np.zeros(2))).restore(path).assert_consumed()\n"
        "print(sorted(m for m in sys.modules if m.startswith('parallelvars.formats')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
