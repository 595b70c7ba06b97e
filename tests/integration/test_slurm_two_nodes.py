"""launch/train_slurm.sbatch on a real two-node SLURM: two hosts of this machine (tools/two_nodes.sh:
network namespaces with their own addresses and hostnames, one shared filesystem), slurmctld and a
slurmd on host a, a slurmd on host b (tools/local_slurm.sh start DIR HOSTS). The tiny CPU experiment
is submitted from host a with `sbatch --nodes=2`, exactly as a user does on a login node, and must
run to the end with one training rank on each host and the Ray cluster across both.

Needs root (as CI has) and SLURM (installed with apt-get when missing); skips elsewhere, saying so.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from two_hosts import REPO, python_env, two_hosts

SCRIPT = REPO / "tools" / "local_slurm.sh"
EXIT_CANNOT_INSTALL = 3
ITERATIONS = 3
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

# Starting SLURM may install it (900 s); the job starts a Ray cluster and two ranks on 2 cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def slurm_on_two_hosts(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm2")
    hosts = two_hosts(state / "hosts")
    slurm_dir = state / "slurm"
    try:
        out = subprocess.run(
            ["bash", str(SCRIPT), "start", str(slurm_dir), str(hosts.state)],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if out.returncode == EXIT_CANNOT_INSTALL:
            pytest.skip(
                f"no SLURM here and it cannot be installed: {out.stderr.strip()}; this test runs where "
                "slurm-wlm and munge are installed, or as root with apt-get (as in CI)"
            )
        assert out.returncode == 0, out.stdout + out.stderr
        env = dict(python_env(), SLURM_CONF=str(slurm_dir / "slurm.conf"), PYTHON=sys.executable)
        env.pop("WORLD_SIZE", None)
        yield hosts, env
    finally:
        if (hosts.state / "hosts.env").exists():
            subprocess.run(
                ["bash", str(SCRIPT), "stop", str(slurm_dir), str(hosts.state)], capture_output=True, timeout=120
            )
        hosts.close()


def _job(hosts, env, job_id: str) -> dict[str, str]:
    out = hosts.run("a", ["scontrol", "show", "job", job_id], timeout=30, env=env)
    return dict(re.findall(r"(\w+)=(\S+)", out.stdout))


def _training_ranks(hosts, host: str) -> list[str]:
    return [cmd for cmd in hosts.processes(host).values() if "megatron_stepwise.cli train" in cmd]


def test_sbatch_on_two_nodes_trains_on_both(slurm_on_two_hosts, tmp_path):
    hosts, env = slurm_on_two_hosts
    run_dir = tmp_path / "run"  # the shared filesystem: both nodes write and read it
    out = hosts.run(
        "a",
        [
            "sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", f"--output={run_dir}.slurm-%j.out",
            "launch/train_slurm.sbatch", "configs/tiny_cpu.yaml", "launch.nnodes=2", "launch.nproc_per_node=1",
            f"trainer.iterations={ITERATIONS}", "checkpoint.every=0", "trainer.eval_every=0",
            "logging.progress=false", f"logging.run_dir={run_dir}",
        ],
        timeout=60,
        env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]

    # Until the job ends: which hosts ran a training rank (seen in their namespaces' processes).
    trained_on: set[str] = set()
    deadline = time.monotonic() + 900
    while (job := _job(hosts, env, job_id)).get("JobState") not in DONE:
        assert time.monotonic() < deadline, f"job {job_id} still {job.get('JobState')} after 900 s"
        trained_on |= {h for h in "ab" if _training_ranks(hosts, h)}
        time.sleep(0.5)

    log = Path(f"{run_dir}.slurm-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert job["NodeList"] == f"{hosts.name['a']},{hosts.name['b']}"
    assert trained_on == {"a", "b"}, f"training ranks seen on hosts {sorted(trained_on)}"
    # Rank 0, the fleet's driver, on the first node, at its cluster address (HEAD_IP).
    train_log = (run_dir / "train.log").read_text()
    assert f"placement: driver {hosts.ip['a']};" in train_log, train_log[:2000]
    assert json.loads((run_dir / "run.json").read_text())["starts"][0]["host"] == hosts.name["a"]
    assert f"done: {ITERATIONS} iterations" in log
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == list(range(ITERATIONS))
    for m in metrics:
        assert {"reward/mean", "train/loss", "weight_sync/bytes"} <= m.keys(), sorted(m)
