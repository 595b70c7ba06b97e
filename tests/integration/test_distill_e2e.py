"""End to end through the real `train` command (DP2 on gloo, embedded engines on Ray): a student
distils from a served teacher with `algo.estimator: opd` alone while an LLM judge's verdicts are the
rewards (one run with both). The teacher and the judge are tiny random models of the echo task's vocabulary, saved as
HF directories: the student's own architecture, another init made confident, so the reverse KL
starts far from 0.
Slow (about 1.5 minutes on a 2-core machine), run in CI.
"""

import json
import os

import pytest
from helpers import run_launch, tiny_lm, train_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny_model(path, confident: bool) -> str:
    """A tiny Qwen2 of the echo tokenizer's vocabulary, another init than the student's, as an HF
    directory. `confident`: its final norm scaled up, so that its next-token distribution is
    peaked (a random init's is nearly uniform, as the student's is: they would start close)."""
    import torch

    from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm, save_safetensors_dir

    tok, config = tiny_lm("tiny_word")
    model = build_causal_lm(config, seed=4321)
    if confident:
        with torch.no_grad():
            model.model.norm.weight.mul_(30.0)
    save_safetensors_dir(model, path)
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run with both second models: the judge's verdicts are the rewards (measured, not trained
    on: OPD alone), the teacher's scores the advantages. The judge is a plain random model: about
    half of its tokens are digits, so some of its 2-token answers hold a number and some do not."""
    teacher = _tiny_model(tmp_path_factory.mktemp("teacher"), confident=True)
    judge = _tiny_model(tmp_path_factory.mktemp("judge"), confident=False)
    return _train(
        str(tmp_path_factory.mktemp("run")),
        "trainer.iterations=10",
        "algo.estimator=opd",
        f"teacher.hf_checkpoint={teacher}",
        "teacher.tokenizer=tiny_word",
        "rollout.context=tokens",
        f"judge.hf_checkpoint={judge}",
        "judge.tokenizer=tiny_word",
        "env.judge.prompt=say {answer}",
        "env.judge.max_new_tokens=2",
        "env.judge.temperature=1.0",
    )


def _train(run_dir, *overrides):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    common = ("trainer.eval_every=0", "checkpoint.every=0", "rollout.num_engines=1")
    command = train_command(run_dir, *common, *overrides)
    out = run_launch(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_student_distils_from_a_served_teacher(run):
    m = run
    kl = [r["distill/reverse_kl"] for r in m]
    valid = [r["rollout/trajectories"] - r["advantages/invalid_trajectories"] for r in m]
    # every valid trajectory scored in one request (token mode: its turns are one chain)
    assert [r["teacher/requests"] for r in m] == valid
    assert all(r["distill/tokens"] > 0 and r["distill/advantage_share"] == 1.0 for r in m)
    print("reverse KL by iteration:", [round(k, 3) for k in kl])
    assert sum(kl[-3:]) / 3 < 0.7 * sum(kl[:3]) / 3, kl  # the student moves toward the teacher
    assert max(r["train/logprob_gap_max"] for r in m) < 1e-4  # the policy's engines still match it


def test_judge_verdicts_are_the_rewards_and_unparsable_ones_are_invalid(run):
    m = run
    calls = sum(r["judge/calls"] for r in m)
    unparsable = sum(r["judge/unparsable"] for r in m)
    invalid = sum(r["advantages/invalid_trajectories"] for r in m)
    print(f"judge: {calls:.0f} calls, {unparsable:.0f} unparsable")
    assert calls == sum(r["rollout/trajectories"] for r in m)
    assert 0 < unparsable < calls and invalid == unparsable
    assert max(r["reward/max"] for r in m) > 1.0  # a digit verdict: echo's own rewards are at most 1
