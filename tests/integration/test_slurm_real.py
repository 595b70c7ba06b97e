"""launch/train_slurm.sbatch on a real SLURM: munge, slurmctld and slurmd on this machine
(tools/local_slurm.sh, installed with apt-get when missing), the tiny CPU experiment submitted
with sbatch exactly as a user does, waited for, checked; then cancelled mid-run with scancel
and resubmitted, which resumes from the last checkpoint.

Skipped, with the reason, only where SLURM is not installed and cannot be (no root or apt-get).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "local_slurm.sh"
EXIT_CANNOT_INSTALL = 3

# Longer than the suite's 600 s: starting the local SLURM cluster is allowed 900 s, a job as long again.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash"),
    pytest.mark.timeout(1200),
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    # Ports of its own: another cluster on this machine (a second test session) keeps working.
    ports = dict(os.environ, LOCAL_SLURM_CTLD_PORT=str(_free_port()), LOCAL_SLURM_D_PORT=str(_free_port()))
    out = subprocess.run(
        ["bash", str(SCRIPT), "start", str(state)], env=ports, capture_output=True, text=True, timeout=900
    )
    if out.returncode == EXIT_CANNOT_INSTALL:
        pytest.skip(
            f"no SLURM here and it cannot be installed: {out.stderr.strip()}; this test runs where "
            "slurm-wlm and munge are installed, or as root with apt-get (as in CI)"
        )
    assert out.returncode == 0, out.stdout + out.stderr
    env = dict(os.environ, SLURM_CONF=str(state / "slurm.conf"), PYTHON=sys.executable)
    env.pop("WORLD_SIZE", None)
    yield env
    subprocess.run(["bash", str(SCRIPT), "stop", str(state)], capture_output=True, timeout=120)


def _free_port() -> int:
    # An ephemeral port: outside Ray's worker port range (10002-19999) and not Ray's default 6379.
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _submit(env, run_dir: Path, iterations: int, ray_port: int) -> str:
    cmd = [
        "sbatch",
        "--parsable",
        "--gpus-per-node=0",
        f"--output={run_dir}.slurm-%j.out",
        str(REPO / "launch" / "train_slurm.sbatch"),
        "configs/tiny_cpu.yaml",
        f"trainer.iterations={iterations}",
        "checkpoint.every=1",
        "trainer.eval_every=0",
        "logging.progress=false",
        f"logging.run_dir={run_dir}",
        f"launch.ray_port={ray_port}",
    ]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _job(env, job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S+)", out.stdout))


def _wait(env, job_id: str, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout=900):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _job(env, job_id)
        if job.get("JobState") in states:
            return job
        time.sleep(2)
    raise AssertionError(f"job {job_id} still {_job(env, job_id).get('JobState')} after {timeout}s")


def _iterations(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines() if line.strip()]


def _latest_checkpoint(run_dir: Path) -> str | None:
    path = run_dir / "checkpoints" / "latest"
    return path.read_text().strip() if path.exists() else None


def test_sbatch_trains_and_a_resubmission_after_scancel_resumes(slurm, tmp_path):
    """One job submitted as a user does, cancelled mid-run with scancel; the same sbatch line
    resumes it from its last checkpoint and completes (one run: startup dominates here)."""
    run_dir = tmp_path / "run"
    first = _submit(slurm, run_dir, iterations=8, ray_port=_free_port())
    deadline = time.monotonic() + 900
    while len(_iterations(run_dir)) < 3 or _latest_checkpoint(run_dir) is None:  # a checkpoint, mid-run
        assert time.monotonic() < deadline, "no checkpoint within 900 s"
        assert _job(slurm, first).get("JobState") in ("PENDING", "RUNNING"), _job(slurm, first)
        time.sleep(1)
    subprocess.run(["scancel", first], env=slurm, check=True, timeout=30)
    assert _wait(slurm, first)["JobState"] == "CANCELLED"
    done_before = _iterations(run_dir)
    assert 3 <= len(done_before) < 8, done_before

    second = _submit(slurm, run_dir, iterations=8, ray_port=_free_port())
    job = _wait(slurm, second)
    log = Path(f"{run_dir}.slurm-{second}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    resumed = re.search(r"resumed from iteration (\d+)", log)
    assert resumed and int(resumed.group(1)) >= 2, log[-3000:]
    # every iteration once: the lines after the checkpoint were re-run, not duplicated
    assert _iterations(run_dir) == list(range(8))
    assert _latest_checkpoint(run_dir).endswith("iter_0000008")
    assert "done: 8 iterations" in log
