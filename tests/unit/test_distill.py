"""On-policy distillation: teacher scoring of each sampled token on exactly the policy's context,
the per-token advantage against a hand-computed reference (merged and unmerged rows), mixing
with an outcome estimator, its metrics, and the config refusals (temperature, missing teacher)."""

import asyncio

import pytest
import torch

from megatron_stepwise.algo.advantages import compute_advantages
from megatron_stepwise.algo.distill import distill_means, with_distillation
from megatron_stepwise.algo.groups import RolloutGroup
from megatron_stepwise.algo.prepare import prepare_rows
from megatron_stepwise.config import config_from_dict
from megatron_stepwise.config.errors import ConfigError
from megatron_stepwise.rollout.teacher import TeacherScorer, prefix_chains
from megatron_stepwise.steps import INVALID, Step, StepBatch, StepwiseBatchError, TrajectoryID


class PositionTeacher:
    """A fake teacher whose log-prob of token x at position i is -(x + i / 100): any slice taken
    at the wrong offset shows. Records every request."""

    def __init__(self):
        self.requests = []

    async def score(self, input_ids, start, temperature=1.0):
        self.requests.append((list(input_ids), start, temperature))
        return [-(input_ids[i] + i / 100) for i in range(start, len(input_ids))]


def expected(step):
    """The fake teacher's log-probs of `step`'s response, by position in prompt + response."""
    p = step.prompt_ids.numel()
    return torch.tensor([-(int(x) + (p + k) / 100) for k, x in enumerate(step.response_ids)], dtype=torch.float32)


def two_turns(prompt_id="q", k=0, reward=1.0, break_prefix=False):
    """A token-mode trajectory: turn 1's prompt = turn 0's prompt + response + observation [9]."""
    t = TrajectoryID(prompt_id, k)
    first = Step(t, [1, 2], [3, 4], [1, 1], rollout_logprobs=[-0.5, -1.0])
    prompt = [7, 7, 9] if break_prefix else [1, 2, 3, 4, 9]
    second = Step(
        t, prompt, [5, 6, 8], [1, 1, 0], rollout_logprobs=[-0.25, -2.0, 0.0], reward=reward, is_last_step=True
    )
    return [first, second]


def test_one_request_scores_a_token_mode_trajectory_at_the_policys_context():
    teacher = PositionTeacher()
    steps = two_turns()
    asyncio.run(TeacherScorer(teacher, temperature=0.6)(steps, {}))
    assert teacher.requests == [([1, 2, 3, 4, 9, 5, 6, 8], 2, 0.6)]  # prompt + both turns, from turn 0's response
    for s in steps:
        assert torch.equal(s.teacher_logprobs, expected(s))


def test_a_broken_prefix_gets_its_own_request():
    teacher = PositionTeacher()
    steps = two_turns(break_prefix=True)
    asyncio.run(TeacherScorer(teacher, temperature=1.0)(steps, {}))
    assert [r[1] for r in teacher.requests] == [2, 3]
    assert [len(c) for c in prefix_chains(steps)] == [1, 1]
    for s in steps:
        assert torch.equal(s.teacher_logprobs, expected(s))


def test_invalid_and_untrained_steps_are_not_scored():
    teacher = PositionTeacher()
    invalid = two_turns()
    invalid[-1].metadata[INVALID] = "env_error"
    asyncio.run(TeacherScorer(teacher, 1.0)(invalid, {}))
    untrained = [Step(TrajectoryID("q", 1), [1], [2], [0], rollout_logprobs=[-1.0], is_last_step=True)]
    asyncio.run(TeacherScorer(teacher, 1.0)(untrained, {}))
    assert teacher.requests == []
    assert all(s.teacher_logprobs is None for s in invalid + untrained)


def scored_group(n=2, rewards=(1.0, 0.0)):
    trajectories = [two_turns(k=k, reward=rewards[k]) for k in range(n)]
    for t in trajectories:
        asyncio.run(TeacherScorer(PositionTeacher(), 1.0)(t, {}))
    return RolloutGroup("q", trajectories)


def hand_opd(steps, coef=1.0):
    return [coef * (expected(s) - s.rollout_logprobs) * s.loss_mask.float() for s in steps]


@pytest.mark.parametrize("merge", [False, True])
def test_opd_advantages_equal_the_hand_computed_reference_merged_or_not(merge):
    group = scored_group()
    batch, metrics = prepare_rows([group], estimator="opd", distill_coef=0.5, merge_steps=merge)
    steps = [s for t in group.trajectories for s in t]
    want = hand_opd(steps, coef=0.5)
    got = batch.token_fields["advantages"][batch.token_fields["loss_mask"] != 0]
    trained = torch.cat([w[s.loss_mask != 0] for w, s in zip(want, steps)])
    assert torch.allclose(got, trained, atol=1e-7)
    assert batch.num_rows == (2 if merge else 4)
    # reverse KL: mean of rollout - teacher log-prob over the trained tokens
    diff = torch.cat([(s.rollout_logprobs - expected(s))[s.loss_mask != 0] for s in steps])
    means = distill_means(metrics)
    assert means["distill/reverse_kl"] == pytest.approx(float(diff.mean()), rel=1e-6)
    assert means["distill/advantage_share"] == pytest.approx(1.0)


def test_opd_mixed_with_grpo_adds_the_weighted_term_to_the_outcome_advantage():
    group = scored_group(rewards=(1.0, 0.0))
    steps = [s for t in group.trajectories for s in t]
    grpo = compute_advantages(steps, "grpo")
    mixed = with_distillation(steps, grpo, 0.25, metrics := {}, alone=False)
    for m, g, h in zip(mixed, grpo, hand_opd(steps, 0.25)):
        assert torch.allclose(m, g + h)
    assert 0 < distill_means(metrics)["distill/advantage_share"] < 1


def test_a_trained_step_without_teacher_logprobs_is_named():
    steps = two_turns()
    with pytest.raises(StepwiseBatchError, match=r"step 0 \(q#0\): field 'teacher_logprobs'"):
        compute_advantages(steps, "opd")


def test_teacher_logprobs_survive_the_columnar_batch_and_an_unscored_row_stays_unscored():
    scored, unscored = two_turns(k=0), two_turns(k=1)
    asyncio.run(TeacherScorer(PositionTeacher(), 1.0)(scored, {}))
    batch = StepBatch.from_groups([[scored, unscored]])
    back = StepBatch.concat([batch.for_wire().from_wire(), batch]).to_steps()
    assert torch.equal(back[0].teacher_logprobs, scored[0].teacher_logprobs)
    assert back[2].teacher_logprobs is None and back[3].teacher_logprobs is None


BASE = {"model": {"hf_config": "tiny"}, "env": {"name": "echo"}, "launch": {"nproc_per_node": 1}}


def problems(**sections):
    """{key: message} of what validation finds in the tiny config with `sections` (empty: none)."""
    try:
        config_from_dict({**BASE, **sections}, world_size=1)
    except ConfigError as e:
        return {p.key: p.message for p in e.problems}
    return {}


def test_config_refuses_a_teacher_temperature_other_than_the_rollouts(tmp_path):
    found = problems(
        algo={"estimator": "opd"},
        teacher={"hf_checkpoint": str(tmp_path), "temperature": 1.0},
        rollout={"sampling": {"temperature": 0.6}},
    )
    assert "teacher.temperature" in found and "rollout.sampling.temperature is 0.6" in found["teacher.temperature"]


def test_config_refuses_an_sglang_teacher_off_temperature_one_and_opd_without_teacher(tmp_path):
    found = problems(
        algo={"estimator": "opd"},
        teacher={"hf_checkpoint": str(tmp_path), "engine": "sglang"},
        rollout={"sampling": {"temperature": 0.7}},
    )
    assert "without temperature" in found["teacher.engine"]
    assert "needs a teacher" in problems(algo={"opd_coef": 0.5})["algo.opd_coef"]
    assert "nothing trains" in problems(teacher={"hf_checkpoint": str(tmp_path)})["teacher.hf_checkpoint"]
    for missing in ("./nope", "runs/teacher/hf"):  # a path, and no hub id (Org/Name) either
        found = problems(algo={"estimator": "opd"}, teacher={"hf_checkpoint": missing})
        assert "no such file" in found["teacher.hf_checkpoint"]


def test_a_teacher_of_another_vocabulary_is_refused_by_name():
    from megatron_stepwise.compose.served import check_same_vocabulary
    from megatron_stepwise.errors import UserError
    from megatron_stepwise.hf.tokenizers import load_tokenizer

    word, char = load_tokenizer("tiny_word"), load_tokenizer("tiny_char")
    check_same_vocabulary(word, load_tokenizer("tiny_word"))  # the same vocabulary: accepted
    with pytest.raises(UserError, match=r"teacher.hf_checkpoint: the teacher's tokenizer \(\d+ entries\) differs"):
        check_same_vocabulary(word, char)


def test_launched_sglang_teachers_need_ports_of_their_own(tmp_path):
    found = problems(
        algo={"estimator": "opd"},
        rollout={"engine": "sglang", "num_engines": 2},
        teacher={"hf_checkpoint": str(tmp_path), "engine": "sglang"},
    )
    assert "ports rollout's servers launch on too (30000..30001)" in found["teacher.sglang.base_port"]
    moved = problems(
        algo={"estimator": "opd"},
        rollout={"engine": "sglang", "num_engines": 2},
        teacher={"hf_checkpoint": str(tmp_path), "engine": "sglang", "sglang": {"base_port": 31000}},
    )
    assert "teacher.sglang.base_port" not in moved


class FailingTeacher:
    def __init__(self, error):
        self.error = error

    async def score(self, input_ids, start, temperature=1.0):
        raise self.error


def test_a_row_the_teacher_cannot_score_makes_its_trajectory_invalid_and_a_lost_teacher_ends_the_run():
    from megatron_stepwise.rollout.engines.protocol import EngineError, FleetLost

    scorer = TeacherScorer(FailingTeacher(ValueError("input_ids hold 9000 tokens, more than the model's 8192")), 1.0)
    steps = two_turns()
    asyncio.run(scorer(steps, {}))
    assert steps[-1].invalid_reason.startswith("teacher: ValueError: input_ids hold 9000 tokens")
    assert scorer.metrics()["teacher/failures"] == 1.0
    batch, metrics = prepare_rows([RolloutGroup("q", [steps, scored_group().trajectories[0]])], estimator="opd")
    assert metrics["advantages/invalid_trajectories"] == 1  # not trained, and no error for its missing scores
    again = two_turns()
    asyncio.run(TeacherScorer(FailingTeacher(EngineError("request failed after 3 attempts")), 1.0)(again, {}))
    assert again[-1].invalid_reason.startswith("teacher: EngineError")
    with pytest.raises(FleetLost):
        asyncio.run(TeacherScorer(FailingTeacher(FleetLost("every teacher engine is dead")), 1.0)(two_turns(), {}))


def test_listed_sglang_servers_are_reached_round_robin_with_a_scheme():
    from megatron_stepwise.rollout.served_model import SGLangConfig

    servers = SGLangConfig(servers=["10.0.0.1:30000", "https://teacher.example:443"])
    assert [servers.server_url(i) for i in range(3)] == [
        "http://10.0.0.1:30000",
        "https://teacher.example:443",
        "http://10.0.0.1:30000",
    ]
