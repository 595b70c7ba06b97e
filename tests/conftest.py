"""Shared fixtures, for tests/unit and tests/integration alike.

Layout: tests/unit (in-process, fast), tests/integration (torchrun, Ray, subprocesses, end to
end), tests/workers (the scripts those launch and the modules only they import); the shared
helpers stay in tests/. pytest's `pythonpath` has tests/ and tests/workers.

The shared plain helpers are in tests/helpers.py, imported by bare name (`tests` is on pytest's
`pythonpath`): the Step factory `make_step` (also called from module-level data builders and
hypothesis strategies), the torchrun launcher `run_torchrun` / `check_ok` (called from cached
launch functions), `tiny_lm` and `load_script`.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """One Ray for the whole test session (per xdist worker): the first fleet starts it
    (`ensure_ray`), every later module that asks for it shares it, and it shuts down at the end. Starting one per module made
    the suite wait on a raylet's start deadline once per module (the one a busy machine misses).
    Modules use it with `pytestmark = [..., pytest.mark.usefixtures("ray_session")]` and shut
    their own fleets and workers down, so the next module finds every CPU free."""
    import ray

    yield
    ray.shutdown()
