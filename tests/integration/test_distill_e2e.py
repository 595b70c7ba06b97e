"""End to end through the real `train` command (DP2 on gloo, embedded engines on Ray): a student
distils from a served teacher with `algo.estimator: opd` alone, and an LLM judge's verdicts are the
rewards. The teacher and the judge are tiny random models of the echo task's vocabulary, saved as
HF directories: the student's own architecture, another init made confident, so the reverse KL
starts far from 0.
Slow (about 2 minutes each on a 2-core machine), run in CI.
"""

import json
import os

import pytest
from helpers import run_launch, tiny_lm, train_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A tiny Qwen2 of the echo tokenizer's vocabulary, another init than the student's, its final
    norm scaled up so that it is confident (a random init's next-token distribution is nearly
    uniform, as the student's is: they would start close): an HF directory."""
    import torch

    from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm, save_safetensors_dir

    tok, config = tiny_lm("tiny_word")
    model = build_causal_lm(config, seed=4321)
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)
    path = tmp_path_factory.mktemp("teacher")
    save_safetensors_dir(model, path)
    return str(path)


def _train(run_dir, *overrides):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    common = ("trainer.eval_every=0", "checkpoint.every=0", "rollout.num_engines=1")
    command = train_command(run_dir, *common, *overrides)
    out = run_launch(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_student_distils_from_a_served_teacher(tmp_path, other_model):
    m = _train(
        str(tmp_path / "run"),
        "trainer.iterations=10",
        "algo.estimator=opd",
        f"teacher.hf_checkpoint={other_model}",
        "teacher.tokenizer=tiny_word",
        "rollout.context=tokens",
    )
    kl = [r["distill/reverse_kl"] for r in m]
    # every trained token scored, one request per trajectory (token mode: its turns are one chain)
    assert all(r["teacher/requests"] == r["rollout/trajectories"] for r in m), [r["teacher/requests"] for r in m]
    assert all(r["distill/tokens"] > 0 and r["distill/advantage_share"] == 1.0 for r in m)
    print("reverse KL by iteration:", [round(k, 3) for k in kl])
    assert sum(kl[-3:]) / 3 < 0.7 * sum(kl[:3]) / 3, kl  # the student moves toward the teacher
    assert max(r["train/logprob_gap_max"] for r in m) < 1e-4  # the policy's engines still match it


def test_judge_verdicts_are_the_rewards_and_unparsable_ones_are_invalid(tmp_path, other_model):
    m = _train(
        str(tmp_path / "run"),
        "trainer.iterations=4",
        f"judge.hf_checkpoint={other_model}",
        "judge.tokenizer=tiny_word",
        "env.judge.prompt=say {answer}",
        "env.judge.max_new_tokens=2",
        "env.judge.temperature=1.0",  # a random judge answers digits or words: both kinds occur
    )
    calls = sum(r["judge/calls"] for r in m)
    unparsable = sum(r["judge/unparsable"] for r in m)
    invalid = sum(r["advantages/invalid_trajectories"] for r in m)
    assert calls == sum(r["rollout/trajectories"] for r in m)
    assert 0 < unparsable < calls and invalid == unparsable
    assert max(r["reward/max"] for r in m) > 1.0  # a digit verdict: echo's own rewards are at most 1
