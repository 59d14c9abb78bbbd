"""Type-check the whole installed package: parallelvars, parallelvars.formats, parallelvars.cli.

formats/ and cli/ live at the top of the repository and install as subpackages of parallelvars
through setuptools' package-dir mapping (pyproject.toml). mypy has no such mapping: run on the
three folders directly, it cannot resolve ``from parallelvars.formats import ...`` and types
every use of it as ``Any``. So this script lays out the package as it installs, as symlinks in
a temporary folder, runs mypy on it with the project's configuration, and prints the findings
with the paths of the repository.

Usage: ``python tools/typecheck.py [extra mypy arguments]``; the exit code is mypy's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Subpackage name inside parallelvars -> folder in the repository (pyproject's package-dir).
MAPPED = {"formats": ROOT / "formats", "cli": ROOT / "cli"}


def _stage(into: Path) -> None:
    package = into / "parallelvars"
    package.mkdir()
    for entry in (ROOT / "parallelvars").iterdir():
        if entry.name not in MAPPED and entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in MAPPED.items():
        (package / name).symlink_to(folder)


def _repository_path(line: str) -> str:
    """``parallelvars/formats/x.py:3: error`` -> ``formats/x.py:3: error``."""
    for name in MAPPED:
        line = re.sub(rf"^parallelvars/{name}/", f"{name}/", line)
    return line


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="parallelvars-typecheck-") as tmp:
        _stage(Path(tmp))
        env = dict(os.environ, MYPY_CACHE_DIR=str(ROOT / ".mypy_cache"))
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
        proc = subprocess.run(
            [*cmd, "-p", "parallelvars", *argv],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    for line in (proc.stdout + proc.stderr).splitlines():
        print(_repository_path(line))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
