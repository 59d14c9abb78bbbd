"""Tests reach internals through the documented testing seams: the private imports left stay few.

``tools/count_private_imports.py`` counts the statements; what is left are unit tests of a
private module's own pieces (``_fileio``, ``_threads``, ``_write_plan``, the update core ...).
A new test should import what it needs from ``parallelvars.testing`` (or the formats' and the
command line's ``testing`` modules), or better, check the behaviour through the public API.
"""

from __future__ import annotations

import importlib.util
import pathlib
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
CEILING = 12


def _counter() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_count", ROOT / "tools" / "count_private_imports.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_private_imports_in_tests_stay_under_the_ceiling() -> None:
    found = _counter().private_imports(ROOT / "tests")
    listing = "\n".join(f"{p}:{line}: {what}" for p, line, what in found)
    assert len(found) <= CEILING, (
        f"{len(found)} private imports in tests (ceiling {CEILING}):\n{listing}"
    )


def test_the_counter_sees_every_form(tmp_path: pathlib.Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import parallelvars._fileio\n"
        "from parallelvars import _threads\n"
        "from parallelvars.update_core import _sum\n"
        "from parallelvars.checkpoint._restore import Piece\n"
        "def f():\n    from parallelvars.formats.tf import _crc\n"
        "from parallelvars.testing import fileio\n"
        "from parallelvars import Variable\n"
        "import numpy._core\n"
    )
    assert len(_counter().private_imports(tmp_path)) == 5
