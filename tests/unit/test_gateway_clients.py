"""The gateway driven by the real, unmodified client libraries (openai, anthropic, openai-agents).

Plain chats run on a real tiny embedded engine (tiny_bpe: its sampled ids often re-encode
differently, so a re-tokenised history would drift); tool-call round trips on a scripted
generator, since a random tiny model never writes a valid call. Every call is checked: the
recorded step's prompt is what the generator received, its response what it sampled.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from megatron_stepwise.algo.merge import merge_steps
from megatron_stepwise.rollout.agent.context import render_prompt
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.steps import INVALID
from tests.gateway_fixtures import Scripted, Served, assert_exact, window_agent
from tests.helpers import tiny_lm

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

TOK, CONFIG = tiny_lm("tiny_bpe")
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


@pytest.fixture(scope="module")
def engine_served():
    engine = LocalEngine(CONFIG, tokenizer=TOK, eos_token_ids=[TOK.eos_token_id], seed=0)
    served = Served(engine, TOK, engine=engine)
    yield served
    served.close()


def scripted(replies):
    return Served(Scripted(TOK, replies), TOK)


def finish(served, url, reward=1.0):
    return served.gateway.finish(url, reward)


def test_openai_sync_chat_extends_the_prefix_in_tokens(engine_served):
    served, calls = engine_served, engine_served.recording.calls
    calls.clear()
    url = served.open("sync")
    client = openai.OpenAI(base_url=url, api_key=served.gateway.api_key, max_retries=0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say 3"}]
    for turn in range(3):
        stream = turn == 2
        if stream:
            chunks = list(client.chat.completions.create(model="gpt-4o", messages=messages, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        else:
            out = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=6, logprobs=True)
            text = out.choices[0].message.content
            assert out.usage.prompt_tokens == len(calls[-1][0]) and out.usage.completion_tokens == len(calls[-1][1])
            assert [c.logprob for c in out.choices[0].logprobs.content] == pytest.approx(calls[-1][2])
            assert calls[-1][3].max_new_tokens == 6
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": f"say {turn}"}]
    steps = finish(served, url)
    assert_exact(steps, calls)
    assert [s.metadata["prefix_break"] for s in steps] == [False, False, False]
    for before, after in zip(steps, steps[1:]):  # token mode: prompt + response is a prefix of the next
        head = before.prompt_ids.tolist() + before.response_ids.tolist()
        assert after.prompt_ids.tolist()[: len(head)] == head
    assert steps[-1].is_last_step and steps[-1].reward == 1.0 and not any(s.is_last_step for s in steps[:-1])
    assert served.gateway.counts["prefix_breaks"] == 0
    (merged,), _ = merge_steps(steps)  # one growing prefix: one row
    assert merged.prompt_ids.tolist() == steps[0].prompt_ids.tolist() and merged.num_tokens == steps[-1].num_tokens


def test_openai_async_client_streaming_and_not(engine_served):
    served, calls = engine_served, engine_served.recording.calls
    calls.clear()
    url = served.open("async")

    async def agent():
        client = openai.AsyncOpenAI(base_url=url, api_key=served.gateway.api_key, max_retries=0)
        messages = [{"role": "user", "content": "say 1"}]
        out = await client.chat.completions.create(model="m", messages=messages)
        messages += [
            {"role": "assistant", "content": out.choices[0].message.content},
            {"role": "user", "content": "more"},
        ]
        stream = await client.chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage.total_tokens == len(calls[-1][0]) + len(calls[-1][1])
        models = await client.models.list()
        assert [m.id for m in models.data] == ["policy"]

    asyncio.run(agent())
    steps = finish(served, url)
    assert_exact(steps, calls)
    assert [s.metadata["prefix_break"] for s in steps] == [False, False]


def test_openai_tool_call_round_trip():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    served = scripted([call, "It is 3."])
    try:
        url = served.open("tools")
        client = openai.OpenAI(base_url=url, api_key=served.gateway.api_key, max_retries=0)
        messages = [{"role": "user", "content": "1+2?"}]
        out = client.chat.completions.create(model="x", messages=messages, tools=[ADD])
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        (tc,) = choice.message.tool_calls
        assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 1, "b": 2}
        messages += [choice.message.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "tool_call_id": tc.id, "content": "3"}]
        out = client.chat.completions.create(model="x", messages=messages, tools=[ADD])
        assert out.choices[0].message.content == "It is 3." and out.choices[0].finish_reason == "stop"
        steps = finish(served, url)
        assert_exact(steps, served.recording.calls)
        assert not steps[1].metadata["prefix_break"]
        head = steps[0].prompt_ids.tolist() + steps[0].response_ids.tolist()
        assert steps[1].prompt_ids.tolist()[: len(head)] == head
    finally:
        served.close()


def test_anthropic_messages_with_tool_use_streaming_and_not():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 5}}\n</tool_call>'
    served = scripted([call, "Seven.", "Done."])
    try:
        url = served.open("anthropic")
        client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=served.gateway.api_key, max_retries=0)
        tools = [{"name": "add", "description": "add", "input_schema": ADD["function"]["parameters"]}]
        messages = [{"role": "user", "content": "2+5?"}]
        out = client.messages.create(model="claude-x", max_tokens=32, system="calc", messages=messages, tools=tools)
        assert out.stop_reason == "tool_use"
        (use,) = [b for b in out.content if b.type == "tool_use"]
        assert use.name == "add" and use.input == {"a": 2, "b": 5}
        messages += [{"role": "assistant", "content": [b.model_dump() for b in out.content]}]
        messages += [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "7"}]}]
        with client.messages.stream(model="c", max_tokens=32, system="calc", messages=messages, tools=tools) as s:
            final = s.get_final_message()
        assert final.content[0].text == "Seven." and final.stop_reason == "end_turn"
        assert final.usage.input_tokens == len(served.recording.calls[-1][0])
        messages += [{"role": "assistant", "content": "Seven."}, {"role": "user", "content": "thanks"}]
        client.messages.create(model="c", max_tokens=32, system="calc", messages=messages, tools=tools)
        steps = finish(served, url)
        assert_exact(steps, served.recording.calls)
        assert [s.metadata["prefix_break"] for s in steps] == [False, False, False]
        assert {s.metadata["api"] for s in steps} == {"anthropic"}
    finally:
        served.close()


def test_openai_agents_sdk_two_function_tools_over_turns():
    agents = pytest.importorskip("agents")
    replies = [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        '<tool_call>\n{"name": "square", "arguments": {"x": 5}}\n</tool_call>',
        "The answer is 25.",
    ]
    served = scripted(replies)
    try:
        url = served.open("agents")
        agents.set_tracing_disabled(True)

        @agents.function_tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @agents.function_tool
        def square(x: int) -> int:
            """Square an integer."""
            return x * x

        client = openai.AsyncOpenAI(base_url=url, api_key=served.gateway.api_key, max_retries=0)
        model = agents.OpenAIChatCompletionsModel(model="gpt-4o", openai_client=client)
        agent = agents.Agent(name="calc", instructions="use the tools", tools=[add, square], model=model)
        result = asyncio.run(agents.Runner.run(agent, "(2+3)^2?"))
        assert result.final_output == "The answer is 25."
        steps = finish(served, url)
        assert len(steps) == 3
        assert_exact(steps, served.recording.calls)
        assert [s.metadata["prefix_break"] for s in steps] == [False, False, False]
    finally:
        served.close()


def test_context_managing_agent_breaks_are_counted_and_each_step_is_what_was_sent(engine_served):
    served, calls = engine_served, engine_served.recording.calls
    calls.clear()
    breaks_before = served.gateway.counts["prefix_breaks"]
    url = served.open("window")
    client = openai.OpenAI(base_url=url, api_key=served.gateway.api_key, max_retries=0)
    sent = window_agent(client)  # system prompt + the last two exchanges
    steps = finish(served, url)
    assert_exact(steps, calls)
    flags = [s.metadata["prefix_break"] for s in steps]
    assert flags == [False, False, False, True, True, True]  # the window drops a turn from call 4 on
    assert served.gateway.counts["prefix_breaks"] - breaks_before == 3
    merged, _ = merge_steps(steps)  # the merge joins steps only where the prefix really holds
    assert len(merged) == 4 and merged[0].num_tokens == steps[2].num_tokens
    for step, window in zip(steps, sent):
        if step.metadata["prefix_break"] or step.metadata["turn"] == 0:  # rendered fresh: exactly what was sent
            assert step.prompt_ids.tolist() == render_prompt(TOK, window)


def test_a_step_with_no_calls_is_kept_and_marked(engine_served):
    url = engine_served.open("none")
    (step,) = engine_served.gateway.finish(url, 0.0, invalid="agent_error")
    assert step.is_last_step and step.num_trainable == 0 and step.metadata[INVALID] == "agent_error"
