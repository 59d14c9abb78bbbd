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


def test_core_never_imports_formats_or_cli() -> None:
    offenders = []
    for py in (ROOT / "parallelvars").rglob("*.py"):
        if py.name == "__main__.py":
            continue  # the documented `python -m parallelvars` shim
        for node in ast.walk(ast.parse(py.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                if n.startswith(("parallelvars.formats", "parallelvars.cli")):
                    offenders.append(f"{py.relative_to(ROOT)} imports {n}")
    assert not offenders, offenders
