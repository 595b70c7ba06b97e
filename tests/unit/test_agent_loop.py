"""The step-wise agent loop driven by the embedded engine (tiny_word tokenizer, echo env)."""

import asyncio
import threading

import pytest
import torch
from helpers import tiny_lm

from megatron_stepwise.envs.custom import RewardFnEnv
from megatron_stepwise.envs.echo import EchoEnv, echo_dataset
from megatron_stepwise.rollout.agent.context import render_prompt
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from megatron_stepwise.steps import StepBatch, TrajectoryID

TOK, CONFIG = tiny_lm("tiny_word")
EOS = TOK.eos_token_id


class RecordingEngine:
    """Wraps an engine and keeps every (prompt, result) it served, keyed by request id."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = {}

    async def generate(self, input_ids, sampling, rid=None, session=None):
        result = await self.engine.generate(input_ids, sampling, rid=rid, session=session)
        self.calls[rid] = (list(input_ids), result)
        return result


def make_engine(seed=0):
    return LocalEngine(CONFIG, tokenizer=TOK, seed=seed)


def run_loop(generator, env_factory, samples, **cfg):
    cfg.setdefault("sampling", SamplingParams(max_new_tokens=4))
    loop = AgentLoop(generator, TOK, env_factory, AgentLoopConfig(**cfg))
    try:
        return asyncio.run(loop.rollout(samples))
    finally:
        loop.close()


def by_trajectory(steps):
    out = {}
    for s in steps:
        out.setdefault(s.trajectory_id, []).append(s)
    return out


def test_steps_hold_generated_tokens_exact_logprobs_and_masked_eos():
    engine = make_engine()
    rec = RecordingEngine(engine)
    samples = echo_dataset(num_prompts=6, num_turns=3, seed=1)
    steps = run_loop(rec, EchoEnv, samples, max_turns=3, max_input_length=200, n_samples_per_prompt=3)
    assert len(rec.calls) == len(steps)
    for s in steps:
        prompt, result = rec.calls[f"{s.trajectory_id}/turn{s.metadata['turn']}"]
        n = len(result.output_ids)
        assert s.prompt_ids.tolist() == prompt
        # Response = exactly the sampled tokens, then an EOS appended only if the turn did not end on one.
        assert s.response_ids[:n].tolist() == result.output_ids
        if result.output_ids and result.output_ids[-1] == EOS:
            assert s.response_ids.numel() == n and s.loss_mask.tolist() == [1] * n
        else:
            assert s.response_ids.tolist() == result.output_ids + [EOS]
            assert s.loss_mask.tolist() == [1] * n + [0]
            assert s.rollout_logprobs[-1] == 0.0
        assert s.rollout_logprobs.numel() == s.response_ids.numel() == s.weight_versions.numel()
        # Log-probs align 1:1 with the sampled tokens: a teacher-forced forward agrees.
        ids = torch.tensor([s.prompt_ids.tolist() + s.response_ids.tolist()])
        with torch.no_grad():
            logp = torch.log_softmax(engine.model(input_ids=ids).logits[0].float(), -1)
        positions = torch.arange(s.prompt_ids.numel() - 1, ids.shape[1] - 1)[:n]
        expected = logp[positions, s.response_ids[:n]]
        torch.testing.assert_close(s.rollout_logprobs[:n], expected, atol=1e-4, rtol=0)


def _contains(seq, sub):
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_observations_go_to_the_next_prompt_not_the_response():
    samples = echo_dataset(4, num_turns=3, seed=2)
    digits = {p["prompt_id"]: p["digits"] for p in samples}
    steps = run_loop(make_engine(), EchoEnv, samples, max_turns=3, max_input_length=200, n_samples_per_prompt=2)
    for tid, traj in by_trajectory(steps).items():
        for prev, nxt in zip(traj, traj[1:]):
            p, r, q = prev.prompt_ids.tolist(), prev.response_ids.tolist(), nxt.prompt_ids.tolist()
            # The env's observation for this turn, tokenised, sits in the next prompt after this
            # prompt (which the next one extends), and never in this turn's response.
            feedback = "good" if prev.metadata["env_info"]["turn_score"] == 1.0 else "no"
            obs = TOK(f"{feedback} say {digits[tid.prompt_id][prev.metadata['turn'] + 1]}", add_special_tokens=False)[
                "input_ids"
            ]
            assert q[: len(p)] == p
            assert _contains(q[len(p) :], obs)
            assert not _contains(r, obs)


def test_trajectory_reward_on_last_step_and_stop_reasons():
    steps = run_loop(
        make_engine(),
        EchoEnv,
        echo_dataset(5, num_turns=3, seed=3),
        max_turns=3,
        max_input_length=200,
        n_samples_per_prompt=2,
    )
    for traj in by_trajectory(steps).values():
        assert [s.is_last_step for s in traj] == [False] * (len(traj) - 1) + [True]
        assert all(s.reward == 0.0 for s in traj[:-1])
        env_rewards = [s.metadata["env_reward"] for s in traj]
        assert traj[-1].reward == pytest.approx(sum(env_rewards))
        assert [s.turn_reward for s in traj] == env_rewards  # each turn's own reward, first-class
        assert len(traj) == 3  # echo is done exactly after its 3 turns
        for s in traj:
            assert s.stop_reason == ("stop" if s.metadata["finish_reason"] == "stop" else "length")
    # Running out of turns before the env is done is recorded on the last step.
    steps = run_loop(
        make_engine(),
        EchoEnv,
        echo_dataset(2, num_turns=3, seed=3),
        max_turns=2,
        max_input_length=200,
        n_samples_per_prompt=2,
    )
    for traj in by_trajectory(steps).values():
        assert len(traj) == 2 and traj[-1].stop_reason == "max_turns" and traj[-1].is_last_step


def test_prompts_never_exceed_max_input_length_when_history_grows():
    samples = echo_dataset(4, num_turns=6, seed=4)
    first_len = len(render_prompt(TOK, EchoEnv().reset(samples[0])))
    limit = first_len + 14  # room for about two turns of history, not six
    rec = RecordingEngine(make_engine())
    steps = run_loop(rec, EchoEnv, samples, max_turns=6, max_input_length=limit, n_samples_per_prompt=2)
    assert all(len(prompt) <= limit for prompt, _ in rec.calls.values())
    assert all(s.prompt_ids.numel() <= limit for s in steps)
    for traj in by_trajectory(steps).values():
        assert 1 <= len(traj) < 6
        assert traj[-1].is_last_step and traj[-1].stop_reason == "context_limit"
        assert sum(s.is_last_step for s in traj) == 1


def test_first_prompt_too_long_keeps_the_group_size():
    samples = echo_dataset(3, num_turns=2, seed=5)
    first_len = len(render_prompt(TOK, EchoEnv().reset(samples[0])))
    rec = RecordingEngine(make_engine())
    steps = run_loop(
        rec,
        EchoEnv,
        samples,
        max_turns=2,
        max_input_length=first_len - 1,
        n_samples_per_prompt=4,
        context_limit_reward=-1.0,
    )
    assert rec.calls == {}  # nothing was sent to the engine
    assert [s.trajectory_id for s in steps] == [TrajectoryID(p["prompt_id"], k) for p in samples for k in range(4)]
    for s in steps:
        assert s.is_last_step and s.stop_reason == "context_limit" and s.reward == -1.0
        assert s.num_trainable == 0 and s.response_ids.numel() == 0
        assert s.prompt_ids.numel() == first_len - 1
    assert StepBatch.from_steps(steps).row_fields["group_index"].tolist() == [0] * 4 + [1] * 4 + [2] * 4


class FlakyEnv(EchoEnv):
    """Raises on its second step for sample 0; for sample 1, reset blocks until the test releases
    it (after the rollout), so it outlasts any timeout however fast or slow the machine is."""

    release = threading.Event()

    def reset(self, sample):
        self.kind = sample["kind"]
        if self.kind == "slow_reset":
            self.release.wait(300)
        return super().reset(sample)

    def step(self, text):
        if self.kind == "raise" and self.turn == 1:
            raise RuntimeError("tool crashed")
        return super().step(text)


def test_env_errors_and_timeouts_end_only_that_trajectory():
    samples = [
        {"prompt_id": "raise", "digits": [1, 2, 3], "kind": "raise"},
        {"prompt_id": "slow", "digits": [1, 2, 3], "kind": "slow_reset"},
        {"prompt_id": "fine", "digits": [1, 2, 3], "kind": "ok"},
    ]
    FlakyEnv.release.clear()
    try:
        # The timeout is generous for the other env calls (microseconds each, even on a loaded machine).
        steps = run_loop(
            make_engine(),
            FlakyEnv,
            samples,
            max_turns=3,
            max_input_length=200,
            n_samples_per_prompt=2,
            env_timeout_s=2.0,
            env_error_reward=-0.5,
        )
    finally:
        FlakyEnv.release.set()  # frees the env threads still blocked in reset
    trajs = by_trajectory(steps)
    assert len(trajs) == 6
    for k in range(2):
        crashed = trajs[TrajectoryID("raise", k)]
        assert len(crashed) == 2 and crashed[-1].stop_reason == "env_error" and crashed[-1].reward == -0.5
        assert "tool crashed" in crashed[-1].metadata["error"] and crashed[-1].is_last_step
        slow = trajs[TrajectoryID("slow", k)]
        assert len(slow) == 1 and slow[0].stop_reason == "env_error" and "timed out" in slow[0].metadata["error"]
        assert slow[0].num_trainable == 0 and slow[0].reward == -0.5
        assert len(trajs[TrajectoryID("fine", k)]) == 3


def test_output_order_contiguity_and_weight_versions():
    engine = make_engine()
    samples = echo_dataset(5, num_turns=3, seed=6)

    async def go():
        await engine.update_weights_from_tensors({}, weight_version=4)
        loop = AgentLoop(
            engine,
            TOK,
            "echo",
            AgentLoopConfig(
                max_turns=3,
                max_input_length=200,
                n_samples_per_prompt=3,
                max_concurrency=4,
                sampling=SamplingParams(max_new_tokens=4),
            ),
        )
        return await loop.rollout(samples)

    steps = asyncio.run(go())
    order = [s.trajectory_id for s in steps]
    expected = [TrajectoryID(p["prompt_id"], k) for p in samples for k in range(3)]
    assert list(dict.fromkeys(order)) == expected  # sorted by prompt then sample
    seen = set()
    for i, tid in enumerate(order):  # contiguous: a trajectory never reappears after another started
        if i and order[i - 1] != tid:
            assert tid not in seen
        seen.add(tid)
    assert all((s.weight_versions == 4).all() for s in steps)
    batch = StepBatch.from_steps(steps)
    assert int(batch.row_fields["is_last"].sum()) == len(expected)


def test_config_and_sample_errors_are_clear():
    with pytest.raises(ValueError, match="max_turns"):
        AgentLoopConfig(max_turns=0)
    with pytest.raises(ValueError, match="duplicate prompt_id"):
        run_loop(make_engine(), EchoEnv, [{"prompt_id": "a", "digits": [1]}] * 2)


def test_a_tagged_rollout_runs_beside_one_of_the_same_prompts_and_samples_the_same():
    # Evaluation during async training: the same prompts may be in flight; the tag keeps the
    # engine's request ids apart, and the sampling seeds (hence the tokens) are unchanged.
    rec = RecordingEngine(make_engine())
    samples = echo_dataset(num_prompts=3, num_turns=2, seed=4)
    loop = AgentLoop(
        rec,
        TOK,
        EchoEnv,
        AgentLoopConfig(
            max_turns=2, max_input_length=200, n_samples_per_prompt=2, sampling=SamplingParams(max_new_tokens=4)
        ),
    )

    async def both():
        return await asyncio.gather(loop.rollout(samples, seed=11), loop.rollout(samples, seed=11, request_tag="eval/"))

    try:
        train, evaluation = asyncio.run(both())
    finally:
        loop.close()
    tagged = [rid for rid in rec.calls if rid.startswith("eval/")]
    assert len(tagged) == len(evaluation) and len(rec.calls) == len(train) + len(evaluation)
    assert [s.response_ids.tolist() for s in train] == [s.response_ids.tolist() for s in evaluation]


def test_a_multi_turn_reward_functions_per_turn_rewards_land_on_each_step():
    def score(response, sample, turn):
        return (0.25 * (turn + 1), "again") if turn < 2 else (1.0, None)

    steps = run_loop(
        make_engine(),
        lambda: RewardFnEnv(score),
        [{"prompt_id": "r", "prompt": "say 3"}],
        max_turns=5,
        max_input_length=200,
        n_samples_per_prompt=2,
    )
    for traj in by_trajectory(steps).values():
        assert [s.turn_reward for s in traj] == [0.25, 0.5, 1.0]
        assert traj[-1].reward == 1.75 and traj[-1].is_last_step
