"""Imports from a source checkout: ``parallelvars.formats`` and ``parallelvars.cli``.

In the repository, ``formats/`` and ``cli/`` sit beside ``parallelvars/`` and are installed as
its subpackages (the ``package-dir`` mapping in ``pyproject.toml``). Run from the repository
root, Python imports ``parallelvars`` from the source tree rather than from the installed copy,
and that tree has no ``formats/`` or ``cli/`` inside it. This finder maps exactly those two
names onto the folders beside it; an installed package has them inside and never uses it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

_SUBPACKAGES = ("formats", "cli")


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds ``parallelvars.<name>`` in ``<root>/<name>/`` for the mapped names only."""

    def __init__(self, folders: dict[str, str]) -> None:
        self.folders = folders

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )


def install(package_dir: str) -> None:
    """Register the finder when ``package_dir`` is ``parallelvars/`` of a source checkout."""
    root = os.path.dirname(os.path.abspath(package_dir))
    if not os.path.isfile(os.path.join(root, "pyproject.toml")):
        return
    folders = {
        f"parallelvars.{name}": os.path.join(root, name)
        for name in _SUBPACKAGES
        if not os.path.isdir(os.path.join(package_dir, name))
        and os.path.isfile(os.path.join(root, name, "__init__.py"))
    }
    if not folders or any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        return
    sys.meta_path.append(_SourceTreeFinder(folders))
