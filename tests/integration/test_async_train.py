"""The tiny CPU experiment in async mode, end to end (2 gloo training ranks + 2 Ray engines).

Marked slow and distributed (~1.5 min on 2 cores). Checks what the metrics of every iteration
must show: the staleness bound, exactly two optimizer steps of 4 groups, truncated importance
weights within the cap, every started group accounted for, and the reward rising.
`tools/bench/bench_async.py` runs the full 80 iterations next to the synchronous mode.
"""

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import run_launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 24


def test_tiny_async_experiment_keeps_the_bound_and_learns(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "megatron_stepwise.cli",
        "train",
        str(REPO / "configs/tiny_cpu_async.yaml"),
        f"trainer.iterations={ITERATIONS}",
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        "checkpoint.every=0",
        "checkpoint.resume=never",
    ]
    proc = run_launch(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=480)
    # On failure show what rank 0 (the driver) said: the other rank's traceback would bury it.
    assert proc.returncode == 0, "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("[rank1]"))[
        -4000:
    ]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(ITERATIONS))

    for r in rows:
        assert r["train/optimizer_steps"] == 2 and r["train/skipped_steps"] == 0
        # counts add up over the iteration's 2 optimizer steps of 4 groups x 8 trajectories
        assert r["advantages/num_groups"] == 8 and r["advantages/num_trajectories"] == 64
        # the bound (max_staleness 1), for whole groups and for every trained token
        assert 0 <= r["async/group_staleness_max"] <= 1
        assert 0 <= r["async/token_staleness_min"] <= r["async/token_staleness_max"] <= 1
        assert r["train/tis_weight_max"] <= 2.0 + 1e-6  # algo.loss.tis_cap
        # every started group is trained, dropped, re-queued, filtered or still outstanding
        accounted = sum(
            r[f"async/groups_{k}"]
            for k in ("trained", "stale_dropped", "stale_requeued", "filtered", "in_flight", "ready")
        )
        assert accounted == r["async/groups_started"]
    assert rows[-1]["async/groups_trained"] == 4 * 2 * ITERATIONS
    assert rows[-1]["weight_version"] == 2 * ITERATIONS == rows[-1]["fleet/weight_version"]
    # the fleet ran ahead of the trainer: some trained tokens came from the previous version
    assert max(r["async/token_staleness_mean"] for r in rows) > 0
    # the final checkpoint keeps the prompts drawn but not trained, for a resumed run to roll out first
    state = json.loads((run_dir / "checkpoints" / f"iter_{ITERATIONS:07d}" / "trainer_state.json").read_text())
    last = rows[-1]
    pending = state["parts"]["rollouts"]["pending"]
    assert len(pending) == sum(last[f"async/groups_{k}"] for k in ("in_flight", "ready", "requeue_waiting"))
    assert len(pending) > 0 and all("prompt_id" in s for s in pending)
    # learning: mean trajectory reward of the last 6 iterations well above the first 6
    first = sum(r["reward/mean"] for r in rows[:6]) / 6
    last = sum(r["reward/mean"] for r in rows[-6:]) / 6
    assert last > first + 0.08, (first, last)


def test_async_training_with_agent_workers_keeps_the_bound(tmp_path):
    """Groups rolled out by 2 agent workers while the trainer trains: the same bound and accounting,
    and the rows stay in the workers (rank 0 sends rank 1 manifests, never rows)."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "megatron_stepwise.cli",
        "train",
        str(REPO / "configs/tiny_cpu_async.yaml"),
        "trainer.iterations=5",
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        "checkpoint.every=0",
        "checkpoint.resume=never",
        "rollout.agent_workers=2",
    ]
    proc = run_launch(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(5))
    for r in rows:
        assert r["agents/workers"] == 2 and r["train/optimizer_steps"] == 2
        assert r["agents/rows_held"] == 1.0
        # two manifests (one per optimizer step) of ~130 rows each: a few kB, against ~60 kB of rows
        assert 0 < r["handoff/rank0_bytes_sent"] < 20_000, r["handoff/rank0_bytes_sent"]
        assert 0 <= r["async/token_staleness_min"] <= r["async/token_staleness_max"] <= 1
        accounted = sum(
            r[f"async/groups_{k}"]
            for k in ("trained", "stale_dropped", "stale_requeued", "filtered", "in_flight", "ready")
        )
        assert accounted == r["async/groups_started"]
    assert rows[-1]["weight_version"] == 10 == rows[-1]["fleet/weight_version"]
