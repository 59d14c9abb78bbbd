"""The README's Python examples run as written (so the quick tour cannot rot)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_python_blocks_run(doc, tmp_path, monkeypatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__doc_example__"}
    for block in blocks:  # one namespace per document: later blocks build on earlier ones
        exec(compile(block, str(doc), "exec"), namespace)


# What a plain `pip install .` gives when Python is then run from the repository root: the
# source tree's parallelvars/ comes first on sys.path, and no editable-install finder helps.
_AS_FROM_ROOT = """
import sys
def editable(f): return (f if isinstance(f, type) else type(f)).__module__.startswith("__editable__")
sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
sys.path_importer_cache.clear()
"""


def _from_root(code: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _AS_FROM_ROOT + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TOUR_DIR": str(tmp_path)},
    )


def test_subpackages_import_from_the_repository_root(tmp_path) -> None:
    code = (
        "import parallelvars, parallelvars.formats.safetensors\n"
        "from parallelvars import formats, cli\n"
        "print(formats.__name__, cli.__name__)\n"
        "import runpy\n"
        "sys.argv = ['parallelvars', '--version']\n"
        "runpy.run_module('parallelvars', run_name='__main__')\n"
    )
    proc = _from_root(code, tmp_path)
    assert "parallelvars.formats parallelvars.cli" in proc.stdout, proc.stderr
    assert "0.1.0" in proc.stdout and proc.returncode == 0, proc.stderr


def test_readme_tour_runs_from_the_repository_root(tmp_path) -> None:
    code = (
        "import os, re\n"
        "import parallelvars\n"
        "text = open('README.md').read()\n"
        "os.chdir(os.environ['TOUR_DIR'])\n"
        "ns = {'__name__': '__doc_example__'}\n"
        "for block in re.findall(r'```python\\n(.*?)```', text, re.S):\n"
        "    exec(compile(block, 'README.md', 'exec'), ns)\n"
        "print('tour ok', parallelvars.__file__)\n"
    )
    proc = _from_root(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tour ok" in proc.stdout
