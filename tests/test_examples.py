"""The examples run as a user would run them (PyTorch and JAX ones skip cleanly without them)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from _interop import REQUIRED

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=EXAMPLES,
        check=False,
    )


def test_save_restore_example() -> None:
    proc = _run("save_restore.py")
    assert proc.returncode == 0, proc.stderr
    assert "round trip OK" in proc.stdout


def test_numpy_gradients_example_learns() -> None:
    proc = _run("numpy_gradients.py", "--steps", "150")
    assert proc.returncode == 0, proc.stderr
    assert "replicas identical after 150 steps: True" in proc.stdout
    first, last = (float(v) for v in proc.stdout.split("loss ")[1].split(" -> "))
    assert last < 0.5 * first


@pytest.mark.parametrize(
    ("script", "module"),
    [
        ("torch_gradients.py", "torch"),
        ("torch_bfloat16.py", "torch"),
        ("jax_gradients.py", "jax"),
    ],
)
def test_framework_gradient_examples(script: str, module: str) -> None:
    proc = _run(script, "--steps", "60")
    assert proc.returncode == 0, proc.stderr
    try:
        __import__(module)
    except ImportError:
        # CI's interop step installs PyTorch (tests/_interop.py); JAX is never required
        assert not (REQUIRED and module == "torch"), f"{module} is not installed"
        assert "not installed; skipping" in proc.stdout
        return
    assert "replicas identical after 60 steps: True" in proc.stdout
    first, last = (float(v) for v in proc.stdout.split("loss ")[1].split(" -> "))
    assert last < first
