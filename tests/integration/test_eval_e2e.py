"""End to end: evaluation, the self-describing run directory, resume with another config, and
the generated metrics reference against a real run's metrics.jsonl.

One tiny CPU run (2 DP ranks, 2 iterations, an extra named eval set) is shared by the tests;
the `eval` command then re-evaluates its final checkpoint in one process. Slow (about 2 minutes
on a 2-core machine).
"""

import itertools
import json
import os
import sys

import pytest
import yaml
from helpers import run_launch

from megatron_stepwise.metrics.keys import describe, render_markdown

# Longer than the suite's 600 s: the module's training run (its launch allowed 900 s) before a test's own evaluation.
pytestmark = pytest.mark.timeout(1200)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args, timeout=900):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return run_launch(
        [sys.executable, "-m", "megatron_stepwise.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run_dir, the overrides it was trained with) of a 2-iteration run evaluated every iteration."""
    base = tmp_path_factory.mktemp("eval_run")
    extra = base / "extra.jsonl"
    extra.write_text("".join(json.dumps({"prompt_id": f"x{i}", "digits": [i % 4, 3 - i % 4]}) + "\n" for i in range(4)))
    run_dir = str(base / "run")
    overrides = [
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        "trainer.iterations=2",
        "trainer.eval_every=1",
        "checkpoint.every=0",
        f"eval.sets.extra={extra}",
        "eval.samples_per_prompt=4",
        "eval.temperature=0.7",
    ]
    out = _cli("train", "configs/tiny_cpu.yaml", *overrides)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir, overrides, out


def _lines(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_training_evaluates_every_named_set_and_the_final_policy(run):
    run_dir, _, out = run
    lines = _lines(run_dir)
    assert [r["iteration"] for r in lines] == [0, 1]  # one line per iteration, as before
    for r in lines:
        for prefix in ("eval/", "eval/extra/"):
            assert {
                f"{prefix}reward/mean",
                f"{prefix}reward/pass@1",
                f"{prefix}reward/pass@4",
                f"{prefix}reward/maj@4",
            } <= set(r), sorted(r)
            assert f"{prefix}reward/pass@8" not in r  # eval.samples_per_prompt=4, not training's 8
    with open(os.path.join(run_dir, "eval", "final.json")) as f:
        final = json.load(f)
    assert final["iteration"] == 2 and final["eval/extra/prompts"] == 4 and final["eval/prompts"] == 8
    # no progress bar (logging.progress=false): one line per iteration instead
    assert "iteration 1/2: reward" in out.stderr and "iteration 2/2: reward" in out.stderr


@pytest.mark.slow
def test_eval_command_on_the_final_checkpoint_repeats_training_final_evaluation(run):
    run_dir, overrides, _ = run
    out = _cli("eval", "configs/tiny_cpu.yaml", *overrides)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(os.path.join(run_dir, "eval", "iter_0000002.json")) as f:
        result = json.load(f)
    with open(os.path.join(run_dir, "eval", "final.json")) as f:
        final = json.load(f)
    assert result["iteration"] == 2
    # the same policy, prompts and sampling seeds: the same trajectories, so the same metrics
    for key in final:
        if key.startswith("eval/"):
            assert result[key] == pytest.approx(final[key], abs=1e-12), key
    # unbiased pass@k against brute force over every k-subset of each prompt's samples
    threshold = 1.0
    for name, prefix in (("default", "eval/"), ("extra", "eval/extra/")):
        groups = list(result["outcomes"][name].values())
        assert all(len(g) == 4 for g in groups)
        for k in (1, 2, 4):
            brute = sum(
                sum(any(r >= threshold for r in sub) for sub in itertools.combinations(g, k))
                / len(list(itertools.combinations(g, k)))
                for g in groups
            ) / len(groups)
            assert result[f"{prefix}reward/pass@{k}"] == pytest.approx(brute)
        assert result[f"{prefix}reward/mean"] == pytest.approx(sum(map(sum, groups)) / (4 * len(groups)))


@pytest.mark.slow
def test_the_run_directory_explains_itself(run):
    run_dir, overrides, _ = run
    with open(os.path.join(run_dir, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    shown = _cli("config", "show", "configs/tiny_cpu.yaml", *overrides, timeout=120)
    assert saved == yaml.safe_load(shown.stdout)  # the resolved config, overrides applied
    with open(os.path.join(run_dir, "run.json")) as f:
        start = json.load(f)["starts"][-1]
    assert start["argv"][1:3] == ["train", "configs/tiny_cpu.yaml"] and start["cwd"] == ROOT
    assert start["versions"]["torch"] and start["versions"]["megatron-core"]
    assert start["git"] is None or len(start["git"]["sha"]) == 40
    with open(os.path.join(run_dir, "train.log")) as f:
        assert "iteration 2/2: reward" in f.read()


@pytest.mark.slow
def test_resume_with_another_config_names_the_keys_and_the_remedies(run):
    run_dir, overrides, _ = run
    out = _cli(
        "train", "configs/tiny_cpu.yaml", *overrides, "trainer.iterations=3", "algo.loss.clip_high=0.3", "optim.lr=1e-3"
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "algo.loss.clip_high: 0.2 in the checkpoint, 0.3 now" in out.stderr
    assert "optim.lr: 0.002 -> 0.001" in out.stderr  # named too, as a key a resume may change
    assert "algo.loss.clip_high=0.2" in out.stderr and "checkpoint.resume=never" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_every_key_of_a_real_run_is_in_the_generated_metrics_reference(run):
    run_dir, _, _ = run
    keys = {k for r in _lines(run_dir) for k in r}
    with open(os.path.join(run_dir, "eval", "final.json")) as f:
        keys |= set(json.load(f))
    undocumented = sorted(k for k in keys - {"iteration"} if describe(k) is None)
    assert not undocumented, f"add these keys to megatron_stepwise/metrics/keys.py: {undocumented}"


def test_metrics_reference_is_generated_and_a_new_key_is_undocumented():
    with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
        assert f.read() == render_markdown(), (
            "regenerate: megatron-stepwise config metrics --markdown > docs/metrics.md"
        )
    assert describe("reward/pass@16").pattern == "reward/pass@<k>"
    assert describe("eval/hard_set/reward/maj@4").pattern == "eval/[<set>/]reward/maj@<k>"
    assert describe("train/some_new_loss_term") is None and describe("reward/pass@best") is None


def test_rollout_preview_prints_trajectories_turn_by_turn_with_an_env_errors_traceback(tmp_path):
    (tmp_path / "guess_env.py").write_text(
        "class Guess:\n"
        "    tokenizer = 'tiny_word'\n\n"
        "    @staticmethod\n"
        "    def dataset(num=8):\n"
        "        return [{'prompt': f'say {i}', 'target': i} for i in range(num)]  # no prompt_id: row<N>\n\n"
        "    def reset(self, sample):\n"
        "        self.target = sample['target']\n"
        "        return [{'role': 'user', 'content': sample['prompt']}]\n\n"
        "    def step(self, text):\n"
        "        if self.target == 1:\n"
        "            raise KeyError('no such target')\n"
        "        return [{'role': 'user', 'content': 'again'}], 0.5, False, {}\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{tmp_path}", OMP_NUM_THREADS="1")
    out = run_launch(
        [
            sys.executable,
            "-m",
            "megatron_stepwise.cli",
            "rollout",
            "configs/tiny_cpu.yaml",
            "env.name=guess_env:Guess",
            "env.dataset_options={}",
            "data.shuffle=false",
            "rollout.max_turns=2",
            "-n",
            "2",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert text.count("=== trajectory") == 2 and "=== trajectory row0#0 ===" in text
    assert "[turn 0 reply" in text and "env reward 0.5" in text and "[turn 1 reply" in text
    assert "--> reward 0, stop_reason env_error" in text and "KeyError: 'no such target'" in text
    assert 'guess_env.py", line 14, in step' in text  # the environment's own file and line (the raise)
