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
from helpers import _kill_tree, run_launch

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


def _latest_checkpoint(run_dir):
    """(iteration, trainer_state.json) of the run's latest checkpoint, or None."""
    try:
        name = (run_dir / "checkpoints" / "latest").read_text().strip()
        return int(name.rsplit("_", 1)[-1]), json.loads(
            (run_dir / "checkpoints" / name / "trainer_state.json").read_text()
        )
    except (OSError, ValueError):
        return None


def _recoverable(run_dir, probe_dir):
    """What a resume from the latest checkpoint would do with the bank: (pending, re-issued)
    banked groups by draw, and how many it discards; read from a copy (reading prunes the bank)."""
    import shutil

    from megatron_stepwise.rundir.paths import BANK
    from megatron_stepwise.workers.rollout_bank import RolloutBank

    latest = _latest_checkpoint(run_dir)
    if latest is None or not (run_dir / BANK).is_dir():
        return {}, {}, 0
    shutil.rmtree(probe_dir, ignore_errors=True)
    try:
        shutil.copytree(run_dir / BANK, probe_dir / BANK)
    except (OSError, shutil.Error):  # a file renamed or pruned while copied: look again
        return {}, {}, 0
    parts = latest[1]["parts"]
    rollouts = parts["rollouts"]
    bank = RolloutBank(probe_dir, run_id=latest[1]["run_id"], config_hash=latest[1]["config_hash"])  # the run's files
    recovery = bank.recover(
        list(zip(rollouts["pending"], rollouts["pending_draws"])), rollouts["draws"], parts["trainer"]["weight_version"]
    )
    return recovery.pending, recovery.reissued, bank.discarded


@pytest.mark.parametrize("workers", [0, 2], ids=["rows-through-rank0", "rows-in-2-agent-workers"])
def test_sigkill_mid_iteration_then_resume_trains_the_banked_groups(tmp_path, workers):
    """Killed while the bank holds finished groups the last checkpoint has not trained, the same
    command resumes: those groups are recovered and trained as they were made, not rolled out
    again, and the bound holds. Without agent workers rank 0 writes the bank, and the rollout dumps
    show the recovered tokens, log-probs and weight versions trained; with 2 agent workers holding
    the rows (the default hand-off; no dumps, which would send the rows through rank 0) the
    workers write it, and after the resume a worker adopts each recovered group; that run, before
    the kill and after the resume, keeps the bound and accounting of asynchronous training with agent
    workers, and rank 0 sends manifests, never rows (`_agent_workers_keep_the_bound`)."""
    import subprocess
    import time

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    iterations = 6
    cmd = [
        sys.executable,
        "-m",
        "megatron_stepwise.cli",
        "train",
        str(REPO / "configs/tiny_cpu_async.yaml"),
        f"trainer.iterations={iterations}",
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        "checkpoint.every=1",
        "trainer.eval_every=0",
        *(["trainer.dump_rollouts=1"] if workers == 0 else [f"rollout.agent_workers={workers}"]),
    ]
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    probe = tmp_path / "probe"
    try:
        deadline = time.time() + 400
        while proc.poll() is None and time.time() < deadline and not _recoverable(run_dir, probe)[0]:
            time.sleep(0.2)
    finally:
        # SIGKILL to the launcher, both ranks, and every Ray process they started, all at once:
        # an agent worker outliving its raylet by a moment would write to the bank after we look.
        _kill_tree(proc)
        proc.wait()
    killed_at, state = _latest_checkpoint(run_dir)
    assert killed_at < iterations
    pending, reissued, discarded = _recoverable(run_dir, probe)
    assert pending, "the bank held no finished group of the checkpoint's pending prompts at the kill"
    version = state["parts"]["trainer"]["weight_version"]

    out = run_launch(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(iterations))
    resumed = rows[killed_at:]
    # every banked group the checkpoint had not trained was recovered; those with tokens of weights
    # newer than the checkpoint's (lost with the kill) were discarded
    assert resumed[-1]["async/groups_recovered"] == len(pending) + len(reissued)
    assert resumed[-1]["async/bank_groups_discarded"] == discarded
    for r in resumed:  # the staleness bound (max_staleness 1) holds for recovered groups as for any
        assert 0 <= r["async/group_staleness_max"] <= 1
        assert 0 <= r["async/token_staleness_min"] <= r["async/token_staleness_max"] <= 1
        assert r["agents/rows_held"] == (1.0 if workers else 0.0)
    assert all(int(v) <= version for g in pending.values() for s in g.rollout.steps for v in s.weight_versions)
    if workers:  # rank 0 saw summaries only: the dumps below would need the rows on rank 0
        _agent_workers_keep_the_bound(rows)
        return

    # the recovered groups were trained as banked: each step's tokens, log-probs and weight versions
    # are rows of the resumed iterations' dumps (a rollout made again would sample afresh)
    from megatron_stepwise.rundir.dump_table import read_dump_table

    trained_rows = set()
    for it in range(killed_at, iterations):
        _, table = read_dump_table(run_dir, it)
        cols = table.to_pydict()
        trained_rows |= set(
            zip(
                map(tuple, cols["response_ids"]),
                map(tuple, cols["rollout_logprobs"]),
                map(tuple, cols["weight_versions"]),
            )
        )
    found = [
        all(
            (tuple(s.response_ids.tolist()), tuple(s.rollout_logprobs.tolist()), tuple(s.weight_versions.tolist()))
            in trained_rows
            for s in g.rollout.steps
        )
        for g in pending.values()
    ]
    # a recovered group the trainer only reached when it was too stale is dropped instead (counted)
    assert sum(found) >= 1 and sum(found) + resumed[-1]["async/groups_stale_dropped"] >= len(pending)


def _agent_workers_keep_the_bound(rows):
    """Groups rolled out by 2 agent workers while the trainer trains, before the kill and after the
    resume: the same bound and accounting as without them, and the rows stay in the workers (rank 0
    sends rank 1 manifests, never rows)."""
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
        assert accounted == r["async/groups_started"], r["iteration"]
    assert rows[-1]["weight_version"] == 2 * len(rows) == rows[-1]["fleet/weight_version"]
