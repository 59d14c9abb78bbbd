"""The README's Python examples run as written (so the quick tour cannot rot)."""

from __future__ import annotations

import pathlib
import re

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
