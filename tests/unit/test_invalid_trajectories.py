"""Invalid trajectories (an infrastructure failure, not a wrong answer) are kept and counted, but
never trained and never part of a group's statistics, reward metrics or pass@k."""

import asyncio

import torch
from helpers import tiny_lm

from megatron_stepwise.algo.advantages import compute_advantages
from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.algo.prepare import prepare_rows
from megatron_stepwise.envs.echo import EchoEnv
from megatron_stepwise.loop.evaluation import eval_metrics
from megatron_stepwise.metrics.core import rollout_metrics
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from megatron_stepwise.steps import INVALID, Step, TrajectoryID

TOK, CONFIG = tiny_lm("tiny_word")


class InfraFailureEnv(EchoEnv):
    """'crash': the tool raises on the first step; 'judge_down': the env itself reports that it
    could not score the answer; 'ok': the echo task."""

    def reset(self, sample):
        self.kind = sample["kind"]
        return super().reset(sample)

    def step(self, text):
        if self.kind == "crash":
            raise RuntimeError("tool server unreachable")
        observation, reward, done, info = super().step(text)
        if self.kind == "judge_down":
            return observation, 0.0, done, {**(info or {}), "invalid": "judge timed out"}
        return observation, reward, done, info


def rollout(**cfg):
    samples = [{"prompt_id": kind, "digits": [1, 2, 3], "kind": kind} for kind in ("crash", "judge_down", "ok")]
    config = AgentLoopConfig(
        sampling=SamplingParams(max_new_tokens=4), max_turns=3, max_input_length=200, n_samples_per_prompt=2, **cfg
    )
    loop = AgentLoop(LocalEngine(CONFIG, tokenizer=TOK, seed=0), TOK, InfraFailureEnv, config)
    try:
        return asyncio.run(loop.rollout(samples))
    finally:
        loop.close()


def last_steps(steps):
    return {s.trajectory_id: s for s in steps if s.is_last_step}


def test_env_errors_and_the_envs_own_verdict_mark_the_trajectory_invalid():
    last = last_steps(rollout(env_error_reward=-1.0))
    for k in range(2):
        assert last[TrajectoryID("crash", k)].invalid_reason == "env_error"
        assert last[TrajectoryID("judge_down", k)].invalid_reason == "env: judge timed out"
        assert last[TrajectoryID("judge_down", k)].metadata["turn"] == 0  # the env's verdict ends it
        assert last[TrajectoryID("ok", k)].invalid_reason is None


def test_scoring_env_errors_keeps_the_old_behaviour_when_asked():
    last = last_steps(rollout(env_error_reward=-1.0, score_env_errors=True))
    crashed = last[TrajectoryID("crash", 0)]
    assert crashed.invalid_reason is None and crashed.reward == -1.0 and crashed.stop_reason == "env_error"


def step(prompt_id, k, reward, invalid=None, response=(5, 6, 7)):
    return Step(
        trajectory_id=TrajectoryID(prompt_id, k),
        prompt_ids=[1, 2],
        response_ids=list(response),
        loss_mask=[1] * len(response),
        rollout_logprobs=[-0.5] * len(response),
        reward=reward,
        is_last_step=True,
        metadata={INVALID: invalid} if invalid else {},
    )


def test_an_invalid_trajectory_is_out_of_its_groups_mean_and_std():
    # An infrastructure failure scored 0 would drag the group mean down and push the model away
    # from right answers (peers' placeholder-rollout bug): it must weigh nothing.
    with_failure = [step("p", 0, 1.0), step("p", 1, 0.0), step("p", 2, 0.0, invalid="env_error"), step("p", 3, 1.0)]
    valid_only = [with_failure[0], with_failure[1], with_failure[3]]
    for estimator in ("grpo", "rloo", "dr_grpo"):
        metrics = {}
        got = compute_advantages(with_failure, estimator, metrics=metrics)
        want = compute_advantages(valid_only, estimator)
        for i, j in ((0, 0), (1, 1), (3, 2)):
            torch.testing.assert_close(got[i], want[j])
        assert torch.count_nonzero(got[2]) == 0
        assert metrics["invalid_trajectories"] == 1 and metrics["num_trajectories"] == 3


def test_prepared_batches_train_no_token_of_an_invalid_trajectory():
    steps = [step("p", 0, 1.0), step("p", 1, 0.0, invalid="abort"), step("p", 2, 0.0)]
    batch, metrics = prepare_rows(groups_of(steps))
    mask = batch.token_fields["loss_mask"]
    rows = [mask[batch.offsets[r] : batch.offsets[r + 1]] for r in range(3)]
    assert rows[0].sum() == 3 and rows[1].sum() == 0 and rows[2].sum() == 3
    assert metrics["advantages/invalid_trajectories"] == 1
    assert steps[1].loss_mask.sum() == 3  # the caller's steps (and any dump of them) keep their mask


def test_reward_metrics_and_pass_at_k_count_valid_trajectories_only():
    steps = [step("a", 0, 1.0), step("a", 1, 1.0), step("a", 2, 0.0, invalid="env_error")]
    steps += [step("b", 0, 0.0), step("b", 1, 0.0, invalid="abort"), step("b", 2, 0.0)]
    m = rollout_metrics(groups_of(steps))
    assert m["rollout/invalid_share"] == 2 / 6 and m["rollout/trajectories"] == 6
    assert m["reward/mean"] == 0.5 and m["reward/pass@1"] == 0.5
    assert m["reward/zero_variance_groups"] == 1.0  # the invalid 0 is no signal in group "a"
    assert not any(g.summary().has_reward_variance for g in groups_of(steps))


def test_eval_of_only_invalid_trajectories_reports_them_without_failing():
    steps = [step("a", 0, 0.0, invalid="env_error"), step("b", 0, 0.0, invalid="env_error")]
    m = eval_metrics(groups_of(steps), TOK, success_threshold=1.0)
    assert m["prompts"] == 0 and m["rollout/invalid_share"] == 1.0 and "reward/mean" not in m


def test_a_dump_keeps_the_reason_and_the_untrained_mask(tmp_path):
    from megatron_stepwise.rundir.dump_table import dump_path, read_dump_table
    from megatron_stepwise.rundir.dumps import Captured, write_dump

    steps = [step("p", 0, 1.0), step("p", 1, 0.0, invalid="env_error"), step("p", 2, 0.0)]
    batch, _ = prepare_rows(groups_of(steps), keep_metadata=True)
    write_dump(
        dump_path(tmp_path, 3),
        [Captured(batch, [dict(m) for m in batch.metadata])],
        iteration=3,
        weight_version=3,
        config={},
        train_metrics=[],
    )
    _, table = read_dump_table(tmp_path, 3, columns=["sample_index", "invalid", "loss_mask"])
    cols = table.to_pydict()
    assert cols["invalid"] == [None, "env_error", None]
    assert [sum(m) for m in cols["loss_mask"]] == [3, 0, 3]
