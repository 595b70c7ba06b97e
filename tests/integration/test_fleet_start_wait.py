"""The other ranks wait for rank 0 to start the fleet with the fleet's start-up bound, not with
`parallel.timeout_minutes`: a user who sets that short (to fail fast on a frozen rank mid-run)
must still be able to start engines that take longer than it to load."""

import json
import os

import pytest
from helpers import run_launch, train_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_MINUTES = 0.2  # 12 s: collectives mid-run give up on a rank after this
SLOW_START_S = 2 * TIMEOUT_MINUTES * 60  # rank 0's fleet answers only after this


@pytest.mark.slow
def test_a_fleet_slower_to_start_than_the_collective_timeout_still_trains(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "workers")]),
        OMP_NUM_THREADS="1",
        SLOW_FLEET_START_S=str(SLOW_START_S),
    )
    cmd = train_command(
        run_dir,
        "trainer.iterations=1",
        "trainer.eval_every=0",
        "checkpoint.every=0",
        f"parallel.timeout_minutes={TIMEOUT_MINUTES}",
        "trainer.imports=[slow_fleet_start]",
    )
    out = run_launch(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0] and metrics[0]["weight_version"] == 1
