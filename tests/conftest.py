"""Shared test set-up: the helper directories, for this process and for child interpreters.

pytest puts the ``pythonpath`` directories of pyproject.toml (tests/, tools/, bench/) on
``sys.path`` before collecting, so tests import their helpers (``_mpi_model``, ``fuzz_readers``,
``soak_crash``, ...) by name without editing ``sys.path``. A child interpreter a test starts
does not inherit ``sys.path``: it gets the same directories through ``PYTHONPATH`` from the
``helper_env`` fixture.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis's too_slow health check fails a test whose inputs take over a second to generate:
# a timing assertion, which on a loaded machine (several suites sharing two cores) fails tests
# that are correct. Tests that set their own suppress_health_check list keep theirs.
settings.register_profile("parallelvars", suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("parallelvars")


@pytest.fixture
def helper_env(pytestconfig: pytest.Config) -> dict[str, str]:
    """A copy of ``os.environ`` whose ``PYTHONPATH`` starts with the helper directories."""
    dirs = [str(path) for path in pytestconfig.getini("pythonpath")]
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        dirs.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dirs)
    return env
