"""Count the tests' imports of private names, so the number stays known.

A statement counts when it imports, from ``parallelvars`` (formats and cli included), a module
path with a component starting with ``_`` or a name starting with ``_``; ``import`` and
``from ... import`` alike, at module level or inside functions. Tests reach internals through
the documented seams instead (``parallelvars.testing``, ``parallelvars.formats.testing``,
``parallelvars.cli.testing``); what is left are unit tests of a private module's own pieces.

Usage: ``python tools/count_private_imports.py [-v] [tests_dir]``; prints the count (and with
``-v`` every statement). ``tests/test_private_imports.py`` holds the number to a ceiling.
"""

from __future__ import annotations

import ast
import pathlib
import sys


def _private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def private_imports(tests: pathlib.Path) -> list[tuple[str, int, str]]:
    """``(file, line, what)`` for every statement in ``tests`` that imports a private name."""
    found = []
    for py in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(py.read_text(), str(py))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if not node.module.startswith("parallelvars"):
                    continue
                names = [a.name for a in node.names]
                if _private(node.module) or any(n.startswith("_") for n in names):
                    found.append((str(py), node.lineno, f"{node.module}: {', '.join(names)}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("parallelvars") and _private(alias.name):
                        found.append((str(py), node.lineno, alias.name))
    return found


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    args = [a for a in argv if a != "-v"]
    root = pathlib.Path(args[0]) if args else pathlib.Path(__file__).resolve().parents[1] / "tests"
    found = private_imports(root)
    if verbose:
        for path, line, what in found:
            print(f"{path}:{line}: {what}")
    print(len(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
