"""`env.agent` as the source of trajectories: groups of steps, rewards, and agents that fail."""

from __future__ import annotations

import asyncio

import openai
import pytest

from megatron_stepwise.errors import UserError
from megatron_stepwise.gateway.agents import AgentRollout
from megatron_stepwise.gateway.config import AgentConfig
from megatron_stepwise.gateway.outcome import AgentError
from megatron_stepwise.gateway.server import GatewaySettings
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from megatron_stepwise.steps import INVALID
from tests.gateway_fixtures import Recording, assert_exact_in_any_order
from tests.helpers import tiny_lm

TOK, CONFIG = tiny_lm("tiny_bpe")
SAMPLES = [{"prompt_id": "a", "n": 2}, {"prompt_id": "b", "n": 1}]


def rollout(agent, seed=None, **agent_config):
    local = LocalEngine(CONFIG, tokenizer=TOK, eos_token_ids=[TOK.eos_token_id], seed=0)
    engine = Recording(local)
    settings = GatewaySettings(
        sampling=SamplingParams(max_new_tokens=4), max_input_length=512, agent=AgentConfig(**agent_config)
    )
    source = AgentRollout(engine, TOK, agent, settings, [TOK.eos_token_id], n_samples_per_prompt=2)

    async def go():
        try:
            return await source.rollout_groups(SAMPLES, seed=seed)
        finally:
            await source.gateway.close()
            await local.close()

    groups = asyncio.run(go())
    source.close()
    return groups, engine.calls, source


def sync_agent(sample, base_url, api_key):
    """A plain synchronous OpenAI-SDK agent: `n` user turns, a reward per call."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = []
    for turn in range(sample["n"]):
        messages.append({"role": "user", "content": f"say {turn}"})
        text = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
        messages.append({"role": "assistant", "content": text})
    return {"reward": 0.5, "turn_rewards": [0.25] * sample["n"], "info": {"n": sample["n"]}}


async def async_agent(sample, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": sample["prompt_id"]}])
    return 1


def test_sync_agent_makes_groups_of_exact_steps():
    groups, calls, source = rollout(sync_agent)
    assert [g.prompt_id for g in groups] == ["a", "b"] and all(len(g.trajectories) == 2 for g in groups)
    lengths = [len(t) for g in groups for t in g.trajectories]
    assert lengths == [2, 2, 1, 1] and len(calls) == 6
    for traj in (t for g in groups for t in g.trajectories):
        assert traj[-1].is_last_step and traj[-1].reward == 0.5 and traj[-1].metadata["agent_info"]
        assert [s.turn_reward for s in traj] == [0.25] * len(traj)
        assert not traj[-1].invalid_reason and not any(s.metadata["prefix_break"] for s in traj)
    assert_exact_in_any_order([s for g in groups for t in g.trajectories for s in t], calls)
    assert source.metrics()["gateway/calls"] == 6 and source.metrics()["gateway/calls"] == 0  # deltas


def test_a_seeded_rollout_repeats_call_by_call():
    def sampled(groups):
        return {
            (str(s.trajectory_id), s.metadata["turn"]): s.response_ids.tolist()
            for g in groups
            for t in g.trajectories
            for s in t
        }

    first, again, other = (sampled(rollout(sync_agent, seed=s)[0]) for s in (7, 7, 8))
    assert first == again and first != other


def test_coroutine_agent():
    groups, calls, _ = rollout(async_agent)
    assert [len(t) for g in groups for t in g.trajectories] == [1, 1, 1, 1] and len(calls) == 4
    assert all(t[-1].reward == 1.0 for g in groups for t in g.trajectories)


@pytest.mark.parametrize(
    "agent, reason",
    [
        (lambda sample, url, key: 1 / 0, "agent_error: ZeroDivisionError"),
        (lambda sample, url, key: "great", "agent_error: AgentError"),
        (lambda sample, url, key: {"score": 1}, "agent_error: AgentError"),
        (lambda sample, url, key: float("nan"), "agent_error: AgentError"),
    ],
)
def test_a_failing_agent_invalidates_only_its_trajectory(agent, reason):
    def solve(sample, url, key):
        if sample["prompt_id"] == "a":
            return agent(sample, url, key)
        return sync_agent(sample, url, key)

    groups, _, source = rollout(solve)
    bad = [t[-1].invalid_reason for t in groups[0].trajectories]
    assert all(r and r.startswith(reason) for r in bad), bad
    assert all(not t[-1].invalid_reason for t in groups[1].trajectories)
    assert source.agent_errors == 2


def test_a_hanging_agent_times_out_and_its_later_calls_are_refused():
    async def hang(sample, url, key):
        client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        await asyncio.Event().wait()  # hangs until the timeout cancels it

    # the timeout must outlast one call on a loaded machine (2 s did not, at load 20)
    groups, calls, _ = rollout(hang, agent_timeout_s=8.0)
    for traj in (t for g in groups for t in g.trajectories):
        assert len(traj) == 1 and traj[-1].metadata[INVALID].startswith("agent_timeout")
    assert len(calls) == 4


def test_call_cap_is_the_agents_problem():
    def greedy(sample, url, key):
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        for _ in range(3):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return 1.0

    groups, calls, _ = rollout(greedy, agent_max_calls=2)
    traj = groups[0].trajectories[0]
    assert len(traj) == 2 and "BadRequestError" in traj[-1].invalid_reason and len(calls) == 8


def test_an_agent_that_is_no_function_is_a_user_error_naming_env_agent():
    assert issubclass(AgentError, UserError) and issubclass(AgentError, ValueError)  # `except ValueError` still works
    settings = GatewaySettings(sampling=SamplingParams(max_new_tokens=4), max_input_length=512, agent=AgentConfig())
    with pytest.raises(AgentError, match=r"env.agent='tests.unit.test_gateway_agents:SAMPLES' is not a function"):
        AgentRollout(None, TOK, "tests.unit.test_gateway_agents:SAMPLES", settings, [TOK.eos_token_id])


@pytest.mark.parametrize(
    "path, words",
    [
        ("tests.unit.test_gateway_agents:nope", ["env.agent", "has no 'nope'"]),
        ("no_such_pkg.agent:solve", ["env.agent", "cannot import 'no_such_pkg.agent'"]),
        ("tests.unit.test_gateway_agents:SAMPLES", ["env.agent", "is not a function"]),
        ("solve", ["env.agent", "expected module:name"]),
    ],
)
def test_a_bad_env_agent_is_a_config_problem_naming_the_key(tmp_path, path, words):
    from config_fakes import FakeProbes

    from megatron_stepwise.config import load_config
    from megatron_stepwise.config.errors import ConfigError

    config = tmp_path / "c.yaml"
    config.write_text("name: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(config), [f"env.agent={path}"], probes=FakeProbes(modules=()))
    (problem,) = [str(p) for p in e.value.problems]
    assert all(w in problem for w in words), problem


def test_closing_from_sync_code_leaves_no_request_handler_pending(caplog):
    """An agent that keeps its connections alive (one shared httpx client, as the examples do):
    `close()` after the rollout, then the loop's close, as the trainer does: nothing pending."""
    import gc

    import httpx

    shared = httpx.Client()

    def keep_alive_agent(sample, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=shared)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "say 1"}])
        return 1.0

    local = LocalEngine(CONFIG, tokenizer=TOK, eos_token_ids=[TOK.eos_token_id], seed=0)
    settings = GatewaySettings(sampling=SamplingParams(max_new_tokens=4), max_input_length=512)
    source = AgentRollout(local, TOK, keep_alive_agent, settings, [TOK.eos_token_id], n_samples_per_prompt=2)
    loop = asyncio.new_event_loop()
    try:
        groups = loop.run_until_complete(source.rollout_groups(SAMPLES))
        assert all(s.reward == 1.0 for g in groups for t in g.trajectories for s in t[-1:])
        assert len(shared._transport._pool.connections) > 0  # still open: kept alive
        with caplog.at_level("ERROR", logger="asyncio"):
            source.close()
            loop.run_until_complete(local.close())
            loop.close()
            del source, groups  # pending tasks are reported when they are collected
            gc.collect()
        assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]
    finally:
        shared.close()
