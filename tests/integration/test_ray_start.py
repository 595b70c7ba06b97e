"""A local Ray started by `ensure_ray` (rollout/fleet/ray_start.py): its workers inherit their environment
from the raylet instead of a job runtime_env (no setup process per worker), see the driver's
sources and one OpenMP thread, and the driver's own environment is left as it was."""

import json
import os
import sys

import pytest
from helpers import run_launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = """
import json, os, ray
from megatron_stepwise.rollout.fleet.ray_start import ensure_ray

ensure_ray(num_cpus=1)

@ray.remote(num_cpus=0.5)
class Probe:
    def env(self):
        return {k: os.environ.get(k) for k in ("PYTHONPATH", "OMP_NUM_THREADS")}

probe = Probe.remote()
print(json.dumps({
    "worker": ray.get(probe.env.remote(), timeout=120),
    "driver_omp": os.environ.get("OMP_NUM_THREADS"),
    "job_runtime_env": ray.get_runtime_context().runtime_env,
}))
ray.shutdown()
"""


@pytest.mark.timeout(300)
def test_local_ray_workers_inherit_the_worker_environment_without_a_runtime_env(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="3")  # the driver's own: must stay 3
    out = run_launch([sys.executable, "-c", _SCRIPT], env=env, cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["worker"] == {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    assert seen["driver_omp"] == "3"
    assert not seen["job_runtime_env"].get("env_vars")  # no runtime_env: workers start without a setup process
