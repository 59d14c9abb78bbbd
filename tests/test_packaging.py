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


# The core reads other formats through source plug-ins (parallelvars.checkpoint.sources): it
# never imports the formats, nor the command line, in any form (tests/test_layering.py checks
# the whole import graph).
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


# The layers below strategies (docs/ARCHITECTURE.md): they read the mode stacks of
# _modes and the values of _values, never a strategy module, in any form of import.
_BELOW_STRATEGY = (
    "_values.py",
    "_modes.py",
    "_write_plan.py",
    "devices.py",
    "variables.py",
    "_proxy.py",
    "_sharded.py",
    "_creation.py",
)


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


def test_a_foreign_restore_finds_the_formats_through_the_entry_point(
    tmp_path: pathlib.Path,
) -> None:
    # Nobody imports parallelvars.formats: the restore loads the plug-in the installed
    # distribution declares in the entry point group parallelvars.sources.
    import subprocess

    code = (
        "import sys, numpy as np, parallelvars as pv\n"
        "from safetensors.numpy import save_file\n"
        f"path = {str(tmp_path / 'w.safetensors')!r}\n"
        "save_file({'w': np.arange(3, dtype=np.float32)}, path)\n"
        "assert 'parallelvars.formats' not in sys.modules\n"
        "w = pv.Variable(np.zeros(3, np.float32))\n"
        "pv.Checkpoint(w=w).restore(path).expect_partial()\n"
        "print(w.components[0].tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[0.0, 1.0, 2.0]", out.stderr


def test_a_foreign_restore_without_any_plugin_says_what_is_missing(tmp_path, monkeypatch) -> None:
    import numpy as np
    import pytest
    from safetensors.numpy import save_file

    import parallelvars as pv
    from parallelvars.checkpoint import sources
    from parallelvars.errors import NotACheckpointError

    path = str(tmp_path / "w.safetensors")
    save_file({"w": np.ones(2, np.float32)}, path)
    monkeypatch.setattr(sources, "_plugins", [])
    monkeypatch.setattr(sources, "_loaded", False)
    monkeypatch.setattr(sources.metadata, "entry_points", lambda group: [])
    with pytest.raises(NotACheckpointError, match="no reader of this format is installed") as err:
        pv.Checkpoint(w=pv.Variable(np.zeros(2, np.float32))).restore(path)
    assert "parallelvars.sources" in str(err.value) and "safetensors" in str(err.value)


def test_a_registered_source_plugin_is_read_by_restore(tmp_path, monkeypatch) -> None:
    # The protocol a third-party format implements: detect() and open() -> a Source.
    import numpy as np

    import parallelvars as pv
    from parallelvars.checkpoint import ArrayEntry, sources

    class OneArray(dict):  # a Mapping[str, entry] with the Source members
        path, object_graph = "", None

        def stage(self, entries):
            return set()

        def unstage(self):
            pass

        def close(self):
            pass

    class Entry(ArrayEntry):
        def verify(self, i):
            pass

    class Plugin:
        def detect(self, path):
            return "ones" if path.endswith(".ones") else None

        def open(self, path, format):
            source = OneArray(w=Entry("w", [np.full(3, 7.0, np.float32)]))
            source.path = path
            return source

    path = tmp_path / "w.ones"
    path.write_bytes(b"PK not a zip")  # looks foreign (not HDF5) to the core
    monkeypatch.setattr(sources, "_plugins", [])
    monkeypatch.setattr(sources, "_loaded", True)
    sources.register_source_plugin(Plugin())
    w = pv.Variable(np.zeros(3, np.float32))
    pv.Checkpoint(w=w).restore(str(path)).expect_partial()
    assert w.components[0].tolist() == [7.0, 7.0, 7.0]
