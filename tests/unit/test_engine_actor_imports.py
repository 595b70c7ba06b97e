"""An engine's Ray actor unpickles `EngineSpec` and `EngineActor` by module: that module
(rollout/fleet/engine_actor.py) imports neither the fleet nor its HTTP client stack."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_fleet_hands_out_the_engine_actor_module_s_classes():
    from megatron_stepwise.rollout.fleet import engine_actor, fleet

    assert fleet.EngineSpec is engine_actor.EngineSpec and fleet.EngineActor is engine_actor.EngineActor
    assert engine_actor.EngineSpec.__module__ == engine_actor.EngineActor.__module__ == engine_actor.__name__


@pytest.mark.timeout(120)
@pytest.mark.launches  # a fresh interpreter, to see what an engine's process imports for its actor
def test_an_engine_process_imports_no_fleet_and_no_http_client_for_its_actor():
    code = (
        "import pickle, sys\n"
        "from megatron_stepwise.rollout.fleet.engine_actor import EngineActor, EngineSpec\n"
        "blob = pickle.dumps((EngineActor, EngineSpec(kind='local', model_config={'model_type': 'qwen2'})))\n"
        "for name in [m for m in sys.modules if m.startswith(('megatron_stepwise', 'aiohttp'))]:\n"
        "    del sys.modules[name]\n"
        "pickle.loads(blob)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('megatron_stepwise.rollout.fleet.fleet', 'aiohttp')))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=100, env=dict(os.environ, PYTHONPATH=REPO))
