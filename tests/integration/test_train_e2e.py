"""End to end: the README's main job (tiny CPU experiment) through the real `train` command.

megatron-core on gloo with 2 DP ranks under torchrun, 2 embedded engines on a local Ray
fleet, the echo environment. Slow (about 2 minutes on a 2-core machine), run in CI.
"""

import json
import os
import subprocess

import pytest
from helpers import run_launch, train_command

# Longer than the suite's 600 s: a test may wait on the module's reference run and then train again, each launch allowed 900 s.
pytestmark = pytest.mark.timeout(1200)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(run_dir, *overrides, timeout=900):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return run_launch(
        train_command(run_dir, *overrides), env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_tiny_experiment_reward_rises_and_engines_match_the_trainer(tmp_path):
    run_dir = str(tmp_path / "run")
    out = _train(run_dir, "trainer.iterations=50", "checkpoint.every=0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m = _metrics(run_dir)
    assert [r["iteration"] for r in m] == list(range(50))
    first = sum(r["reward/mean"] for r in m[:5]) / 5
    last = sum(r["reward/mean"] for r in m[-5:]) / 5
    assert last > first + 0.3, (first, last)
    # Trajectory-level counts: 8 prompts x 8 samples every iteration, 2 optimizer steps.
    assert all(r["rollout/trajectories"] == 64 and r["train/optimizer_steps"] == 2 for r in m)
    # After every weight sync the engines sample from exactly the trainer's policy: Megatron's
    # old-policy log-probs of the sampled tokens equal the engine's (fp32 CPU). (The policy that
    # trains the second mini-batch has already moved; that gap is logprob_gap/train_vs_rollout.)
    assert max(r["train/logprob_gap_max"] for r in m) < 1e-4
    assert m[-1]["weight_version"] == 50


def test_train_rejects_a_bad_config_with_exit_2_and_no_traceback(tmp_path):
    out = _train(str(tmp_path), "data.prompts_per_minibatch=3", "optim.lr=fast", timeout=120)
    assert out.returncode == 2
    assert "data.prompts_per_minibatch" in out.stderr and "optim.lr" in out.stderr
    assert "Traceback" not in out.stderr


def _latest_iteration(run_dir):
    try:
        with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
            return int(f.read().strip().rsplit("_", 1)[-1])
    except (OSError, ValueError):
        return None


# The distributed optimizer, so that every resume below also restores its sharded state, and the
# change-of-TP test can start from these checkpoints.
SHORT_RUN = ("trainer.iterations=7", "checkpoint.every=2", "parallel.use_distributed_optimizer=true")


@pytest.fixture(scope="module")
def short_reference_run(tmp_path_factory):
    """The uninterrupted 7-iteration DP2 run the resume and context-parallel tests repeat:
    (its run directory, its metrics by iteration). Checkpoints 6 and 7 remain (keep_last=2)."""
    ref_dir = str(tmp_path_factory.mktemp("uninterrupted"))
    out = _train(ref_dir, *SHORT_RUN)
    assert out.returncode == 0, out.stderr[-3000:]
    return ref_dir, {r["iteration"]: r for r in _metrics(ref_dir)}


@pytest.fixture(scope="module")
def short_reference(short_reference_run):
    return short_reference_run[1]


@pytest.mark.slow
def test_context_parallel_run_repeats_the_data_parallel_run(tmp_path, short_reference):
    """The same experiment with each step row split over 2 CP ranks (DP1 x CP2) instead of DP2:
    the first iteration's update is the same to fp32 rounding, and the run learns alike."""
    run_dir = str(tmp_path / "cp2")
    out = _train(run_dir, *SHORT_RUN, "parallel.context=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m = _metrics(run_dir)
    assert [r["iteration"] for r in m] == list(range(7)) and m[-1]["weight_version"] == 7
    for key in ("train/loss", "train/grad_norm", "train/entropy", "train/tokens/trained"):
        assert m[0][key] == pytest.approx(short_reference[0][key], rel=1e-5, abs=1e-7), key
    for r in m:
        assert abs(r["reward/mean"] - short_reference[r["iteration"]]["reward/mean"]) < 0.05, r["iteration"]


@pytest.mark.slow
def test_agent_workers_repeat_the_in_process_run_exactly(tmp_path, short_reference):
    """The same experiment with the agent loop in 2 Ray agent workers: the turns' sampling seeds
    depend only on the trajectory and turn, so every rollout, reward, loss and eval is the same.
    The workers validate and prepare their groups and keep the rows; rank 0 decides from their
    row tables and each DP rank fetches its own rows from the workers (`rollout.handoff`)."""
    run_dir = str(tmp_path / "workers")
    out = _train(run_dir, *SHORT_RUN, "rollout.agent_workers=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m = _metrics(run_dir)
    assert [r["iteration"] for r in m] == list(range(7))
    for r in m:
        ref = short_reference[r["iteration"]]
        keys = [k for k in ref if k.startswith(("reward/", "eval/", "rollout/", "train/loss", "advantages/"))]
        assert keys and {k: r[k] for k in keys} == {k: ref[k] for k in keys}, r["iteration"]
        assert r["agents/workers"] == 2 and r["agents/worker_restarts"] == 0
        assert r["agents/rows_held"] == 1.0  # each replica fetched its rows from the workers
        assert r["fleet/requests"] == ref["fleet/requests"]  # the workers' turns counted by the fleet


@pytest.mark.slow
def test_sigkill_then_same_command_resumes_and_repeats_the_uninterrupted_run(tmp_path, short_reference):
    import signal
    import time

    overrides = SHORT_RUN
    reference = short_reference

    run_dir = str(tmp_path / "killed")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = train_command(run_dir, *overrides)
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 600
    while (_latest_iteration(run_dir) or 0) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher, both ranks, and the Ray fleet
    proc.wait()
    killed_at = _latest_iteration(run_dir)
    assert killed_at is not None and killed_at < 7

    out = _train(run_dir, *overrides)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = _metrics(run_dir)
    assert [r["iteration"] for r in resumed] == list(range(7))  # no gap, no duplicate line
    for r in resumed[killed_at:]:
        ref = reference[r["iteration"]]
        for key in ("reward/mean", "rollout/response_len_mean", "weight_version", "rollout/trainable_tokens"):
            assert r[key] == ref[key], (r["iteration"], key)
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert r[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (r["iteration"], key)


def _largest_file(checkpoint):
    files = [os.path.join(d, f) for d, _, names in os.walk(checkpoint) for f in names]
    return max(files, key=os.path.getsize)


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return f"expected {size} bytes, got {size // 2}"


def _flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return "expected sha256"


@pytest.mark.slow
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, short_reference_run):
    """The finished reference run, its latest checkpoint (7) truncated: the same command warns in
    one line naming the file, resumes from checkpoint 6 and repeats the reference's iteration 6.
    (A flipped byte takes the same fallback: test_no_good_checkpoint_is_one_clear_error sees it named.)"""
    import shutil

    damage = _truncate
    ref_dir, reference = short_reference_run
    run_dir = str(tmp_path / "run")
    shutil.copytree(ref_dir, run_dir)
    latest = os.path.join(run_dir, "checkpoints", "iter_0000007")
    assert _latest_iteration(run_dir) == 7 and os.path.isdir(os.path.join(run_dir, "checkpoints", "iter_0000006"))
    victim = _largest_file(latest)
    expected = damage(victim)

    out = _train(run_dir, *SHORT_RUN)
    assert out.returncode == 0, out.stderr[-3000:]
    warning = [line for line in out.stderr.splitlines() if "iter_0000007" in line and "falling back" in line]
    assert len(warning) == 1, out.stderr[-3000:]
    assert os.path.relpath(victim, latest) in warning[0] and expected in warning[0], warning[0]
    assert "iter_0000006" in warning[0]
    resumed = _metrics(run_dir)
    assert [r["iteration"] for r in resumed] == list(range(7))
    r, ref = resumed[6], reference[6]
    for key in ("reward/mean", "rollout/response_len_mean", "weight_version", "rollout/trainable_tokens"):
        assert r[key] == ref[key], key
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert r[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    assert _latest_iteration(run_dir) == 7  # saved again, good this time
    print(
        f"\n{damage.__name__}: {warning[0].split(': ', 1)[-1]}; iteration 6 reward "
        f"{r['reward/mean']} (reference {ref['reward/mean']}), loss {r['train/loss']} (reference {ref['train/loss']})"
    )


@pytest.mark.slow
def test_no_good_checkpoint_is_one_clear_error(tmp_path, short_reference_run):
    import shutil

    run_dir = str(tmp_path / "run")
    shutil.copytree(short_reference_run[0], run_dir)
    # Each checkpoint damaged its own way, each named with its file and what was wrong with it
    # (the words a fallback's warning would say: the same check makes both).
    damaged = {}
    for it, damage in ((7, _flip_byte), (6, _truncate)):
        checkpoint = os.path.join(run_dir, "checkpoints", f"iter_{it:07d}")
        victim = _largest_file(checkpoint)
        damaged[it] = (os.path.relpath(victim, checkpoint), damage(victim))
    out = _train(run_dir, *SHORT_RUN)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: no good checkpoint")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]  # rank 0's line
    assert f"no good checkpoint in {os.path.join(run_dir, 'checkpoints')}" in errors[0]
    assert "iter_0000007 (file" in errors[0] and "iter_0000006 (file" in errors[0]
    for it, (file, expected) in damaged.items():
        assert f"iter_{it:07d} (file {file}: {expected}" in errors[0], (it, errors[0])
    print(f"\n{errors[0]}")


@pytest.mark.slow
def test_a_run_refuses_another_runs_checkpoints_naming_both(tmp_path, short_reference_run):
    """A second run with its own run directory but the first one's checkpoint.dir (copied here,
    so the first run's lock is not what refuses it) stops before training: one line, exit 2."""
    import shutil

    ref_dir = short_reference_run[0]
    shared = str(tmp_path / "shared_checkpoints")
    shutil.copytree(os.path.join(ref_dir, "checkpoints"), shared)
    with open(os.path.join(ref_dir, "run_id")) as f:
        first = f.read().strip()
    run_dir = str(tmp_path / "second")
    out = _train(run_dir, *SHORT_RUN, f"checkpoint.dir={shared}")
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: checkpoint")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    with open(os.path.join(run_dir, "run_id")) as f:
        second = f.read().strip()
    assert (
        f"was written by another run (run_id {first} in {os.path.abspath(ref_dir)}), this is run {second}" in errors[0]
    )
    assert not os.path.exists(os.path.join(run_dir, "metrics.jsonl"))  # nothing trained


@pytest.mark.slow
def test_resume_at_another_tp_with_distributed_optimizer_state_is_a_clear_error(tmp_path, short_reference_run):
    """The distributed optimizer's checkpointed state follows DP changes only. Resuming the finished
    reference run's state at another TP size stops with one line naming the way out (exit 2, no
    traceback, checkpoint kept); with checkpoint.load_optimizer=false the same command resumes the
    model weights.

    The resumed run is TP2 + sequence parallelism on the echo tokenizer's 21-token vocabulary:
    the model pads it to 22 rows; the weights pushed to the engines drop the padding row and the
    trainer's softmax leaves it out, so the engine and trainer log-probs agree."""
    import shutil

    run_dir = str(tmp_path / "run")
    shutil.copytree(short_reference_run[0], run_dir)
    tp2 = (*SHORT_RUN, "trainer.iterations=8", "parallel.tensor=2", "parallel.sequence_parallel=true")
    out = _train(run_dir, *tp2)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "(tp 1 -> 2)" in out.stderr and "checkpoint.load_optimizer=false" in out.stderr
    assert "Traceback" not in out.stderr
    assert _latest_iteration(run_dir) == 7

    out = _train(run_dir, *tp2, "checkpoint.load_optimizer=false")
    assert out.returncode == 0, out.stderr[-3000:]
    m = _metrics(run_dir)
    assert [r["iteration"] for r in m] == list(range(8))
    assert m[7]["train/logprob_gap_max"] < 1e-4  # the TP2 iteration, on the padded vocabulary


@pytest.mark.slow
@pytest.mark.parametrize("context", ["tokens", "retokenize"])
def test_bpe_tokenizer_trains_in_both_context_modes(tmp_path, context):
    """The tiny experiment with the byte-level BPE (`tiny_bpe`) and the prefix merge. Token mode:
    every trajectory merges into one row (nothing re-read: merged = unique tokens) although the
    BPE drifts, and Megatron scores every trained token as the engine sampled it. Re-tokenise
    mode: the measured drift breaks rows, and each step is still trained on the prompt it was sent."""
    run_dir = str(tmp_path / context)
    out = _train(
        run_dir,
        "trainer.iterations=2",
        "checkpoint.every=0",
        "trainer.eval_every=0",
        "model.tokenizer=tiny_bpe",
        f"rollout.context={context}",
        "data.merge_steps=true",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m = _metrics(run_dir)
    assert [r["iteration"] for r in m] == [0, 1]
    for r in m:
        assert r["train/logprob_gap_max"] < 1e-4 and r["train/optimizer_steps"] == 2
        assert r["rollout/retokenize_drift_rate"] > 0  # measured in both modes
        if context == "tokens":
            assert r["batch/broken_prefixes"] == 0 and r["batch/rows_after_merge"] == r["rollout/trajectories"] == 64
        else:
            assert r["batch/broken_prefixes"] > 0 and r["batch/rows_after_merge"] > r["rollout/trajectories"]
    print(
        f"\n{context}: drift rate {[round(r['rollout/retokenize_drift_rate'], 3) for r in m]}, rows after merge "
        f"{[r['batch/rows_after_merge'] for r in m]}, tokens before/after merge "
        f"{[(r['batch/tokens_before_merge'], r['batch/tokens_after_merge']) for r in m]}, "
        f"gap {max(r['train/logprob_gap_max'] for r in m):.2e}"
    )
