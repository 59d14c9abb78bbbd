"""The test helpers are importable through pytest's ``pythonpath`` and ``helper_env``, not
through ``sys.path`` edits in each test or child script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_EDIT = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path\s*(\+=|=)")


def test_no_test_or_tool_edits_sys_path() -> None:
    files = [p for d in ("tests", "tools", "bench") for p in sorted((ROOT / d).rglob("*.py"))]
    assert files
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if _EDIT.search(line) and p.name != "test_conftest.py"
    ]
    assert offenders == []


def test_helper_env_lets_a_child_import_the_helpers(helper_env: dict[str, str]) -> None:
    code = "import _mpi_model, fuzz_readers, soak_crash, make_golden_native; print('ok')"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=helper_env
    )
    assert proc.stdout.strip() == "ok", proc.stderr
