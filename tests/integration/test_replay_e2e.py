"""Dump and replay through the real commands: the tiny CPU experiment (DP2, torchrun, embedded
engines) with `trainer.dump_rollouts=2`, then `replay` of a dumped iteration from its checkpoint,
with no engines, at the run's layout (bit-identical) and at TP2 and PP2 (fp32 rounding).

Checkpoints are data: a copy of the same run, its `.metadata` replaced by a pickle whose
`__reduce__` writes a marker file and its manifests rewritten to match (the attack the manifest
cannot see), then `train` (resume), `eval --checkpoint` and `replay`: each stops with one line
naming the file and the class (exit 2), and the marker never appears. (One training run serves
both halves: a second would cost the file as much again.)
"""

import builtins
import json
import os
import pickle
import shutil
import sys

import pytest
from helpers import run_launch

# Longer than the suite's 600 s: the module's training run (its launch allowed 900 s) before a test's own command.
pytestmark = pytest.mark.timeout(1200)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs/tiny_cpu.yaml")
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
# The run every test here starts from: 3 iterations, a checkpoint after each, iterations 0 and 2 dumped.
RUN_OVERRIDES = [
    "logging.progress=false",
    "trainer.iterations=3",
    "trainer.eval_every=0",
    "checkpoint.every=1",
    "checkpoint.keep_last=4",
    "trainer.dump_rollouts=2",
]


def _cli(*args, timeout=600):
    return run_launch(
        [sys.executable, "-m", "megatron_stepwise.cli", *args],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def dumped_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("dumped"))
    out = _cli("train", CONFIG, f"logging.run_dir={run_dir}", *RUN_OVERRIDES, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return run_dir, [json.loads(line) for line in f]


@pytest.mark.slow
def test_every_second_iteration_is_dumped_with_what_was_trained(dumped_run):
    from megatron_stepwise.rundir.dump_table import dumped_iterations
    from megatron_stepwise.rundir.dumps import read_dump

    run_dir, metrics = dumped_run
    assert dumped_iterations(run_dir) == [0, 2]
    dump = read_dump(run_dir, 2)
    rows = dump.table.to_pylist()
    assert len(rows) == metrics[2]["batch/rows_before_merge"]  # every trained step, once
    assert dump.meta["weight_version"] == 2 and len(dump.minibatches) == metrics[2]["train/optimizer_steps"]
    steps = dump.meta["train_metrics"]
    assert sum(s["loss"] for s in steps) / len(steps) == pytest.approx(metrics[2]["train/loss"], rel=1e-12)
    # the trainer's log-probs of sampled tokens with the weights that sampled them: the engine's, to fp32
    gaps = [
        abs(a - b) for r in rows for a, b, m in zip(r["trainer_logprobs"], r["rollout_logprobs"], r["loss_mask"]) if m
    ]
    assert gaps and max(gaps) < 1e-4
    assert {r["weight_versions"][0] for r in rows} == {2}


@pytest.mark.slow
def test_every_file_the_run_left_is_a_run_dir_path(dumped_run):
    """A real run's directory holds only what rundir/paths.py's RunDir names."""
    from megatron_stepwise.rundir.paths import RunDir

    run = RunDir(dumped_run[0])
    named = {run.config, run.run_record, run.log, run.lock, run.run_id, run.metrics, run.checkpoints, run.weights}
    named |= {run.dumps, run.rollout_bank, run.evals, run.views, run.replays, run.curves, run.hf_export}
    assert sorted(p for p in run.root.iterdir() if p not in named) == []
    assert {p.name for p in run.dumps.iterdir()} == {run.dump(0).name, run.dump(2).name}
    assert all(run.checkpoint(k).is_dir() for k in range(1, 4))


@pytest.mark.slow
def test_the_time_budget_adds_up_to_each_iteration(dumped_run):
    from megatron_stepwise.time_budget import PARTS

    _, metrics = dumped_run
    for m in metrics:
        parts = [m[f"budget/{k}"] for k in PARTS]
        assert min(parts) >= 0 and abs(sum(parts) - m["time/iteration"]) <= 0.02 * m["time/iteration"]
        assert m["budget/generation"] > 0 and m["budget/train"] > 0 and m["budget/weight_push"] > 0
        assert m["perf/tokens_per_s_per_gpu"] > 0


def _replay(run_dir, *args):
    return _cli("replay", run_dir, *args)


@pytest.mark.slow
def test_replay_at_the_same_layout_is_bit_identical(dumped_run, tmp_path):
    run_dir, _ = dumped_run
    report_path = str(tmp_path / "same.json")
    out = _replay(run_dir, "--iteration", "2", f"--out={report_path}", "--check-tol=0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(report_path) as f:
        report = json.load(f)
    assert report["layout"] == report["recorded_layout"] == "TP1 PP1 CP1 DP2"
    assert len(report["steps"]) == 2
    for step in report["steps"]:
        assert step["loss"] == step["recorded_loss"] and step["grad_norm"] == step["recorded_grad_norm"]
    assert report["params_max_abs_diff"] == 0.0 and report["params_checkpoint"].endswith("iter_0000003")


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,name", [("parallel.tensor=2", "TP2 PP1 CP1 DP1"), ("parallel.pipeline=2", "TP1 PP2 CP1 DP1")]
)
def test_replay_at_another_layout_matches_within_1e_5(dumped_run, tmp_path, layout, name):
    run_dir, _ = dumped_run
    report_path = str(tmp_path / "other.json")
    out = _replay(run_dir, layout, "--iteration", "2", f"--out={report_path}", "--check-tol=1e-5")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(report_path) as f:
        report = json.load(f)
    assert report["layout"] == name
    assert report["max_abs_diff"]["loss"] <= 1e-5 and report["max_abs_diff"]["grad_norm"] <= 1e-5
    assert report["params_max_abs_diff"] <= 1e-5


@pytest.mark.slow
def test_replay_without_the_checkpoint_before_is_one_clear_error(dumped_run, tmp_path):
    run_dir, _ = dumped_run
    out = _replay(run_dir, "checkpoint.dir=" + str(tmp_path / "none"), "launch.nproc_per_node=1", "--iteration", "2")
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "needs the checkpoint saved before it" in out.stderr and "Traceback" not in out.stderr
    out = _replay(run_dir, "--iteration", "1")
    assert out.returncode == 2 and "no dump of iteration 1" in out.stderr and "[0, 2]" in out.stderr
    out = _replay(run_dir, "parallel.tensor=3", "--iteration", "2")
    assert out.returncode == 2 and "parallel.tensor" in out.stderr and "Traceback" not in out.stderr


# ---- poisoned checkpoints -------------------------------------------------------------------------


class Poison:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def poisoned_run(dumped_run, tmp_path_factory):
    """(run_dir, overrides, marker): a copy of the dumped run whose checkpoints of iterations 2 and 3
    carry the poison (the original stays clean for the replay tests)."""
    from megatron_stepwise.mcore.weights.checkpoint_dir import checkpoint_name, write_manifest

    base = tmp_path_factory.mktemp("poisoned_run")
    run_dir, marker = str(base / "run"), str(base / "MARKER")
    shutil.copytree(dumped_run[0], run_dir)
    for it in (2, 3):
        ckpt = os.path.join(run_dir, "checkpoints", checkpoint_name(it))
        with open(os.path.join(ckpt, ".metadata"), "wb") as f:
            pickle.dump(Poison(marker), f)
        write_manifest(ckpt)
    return run_dir, [f"logging.run_dir={run_dir}", *RUN_OVERRIDES], marker


def _assert_refused(out, run_dir: str, marker: str, it: int) -> None:
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    bad = os.path.join(run_dir, "checkpoints", f"iter_{it:07d}", ".metadata")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error")]
    assert errors and bad in errors[0] and "builtins.exec" in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not os.path.exists(marker)


@pytest.mark.slow
def test_train_resume_refuses_a_poisoned_checkpoint(poisoned_run):
    run_dir, overrides, marker = poisoned_run
    out = _cli("train", CONFIG, *overrides, "trainer.iterations=4")
    _assert_refused(out, run_dir, marker, 3)


@pytest.mark.slow
def test_eval_refuses_a_poisoned_checkpoint(poisoned_run):
    run_dir, overrides, marker = poisoned_run
    out = _cli("eval", CONFIG, *overrides, "--checkpoint", os.path.join(run_dir, "checkpoints", "iter_0000003"))
    _assert_refused(out, run_dir, marker, 3)


@pytest.mark.slow
def test_replay_refuses_a_poisoned_checkpoint(poisoned_run):
    run_dir, _, marker = poisoned_run
    out = _cli("replay", run_dir, "launch.nproc_per_node=1", "--iteration", "2")
    _assert_refused(out, run_dir, marker, 2)
