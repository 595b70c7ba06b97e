"""Shared fixtures.

The shared plain helpers are in tests/helpers.py, imported by bare name (`tests` is on pytest's
`pythonpath`): the Step factory `make_step` (also called from module-level data builders and
hypothesis strategies), the torchrun launcher `run_torchrun` / `check_ok` (called from cached
launch functions), `tiny_lm` and `load_script`.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_session():
    """Ray for the tests of one module: a fleet starts it on first use (`ensure_ray`); this
    shuts it down after the module, so the next module starts a fresh one. Modules use it with
    `pytestmark = [..., pytest.mark.usefixtures("ray_session")]`."""
    import ray

    yield
    ray.shutdown()
