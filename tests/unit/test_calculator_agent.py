"""The tool-calling recipe's parts (configs/smollm2_calculator_agent_cpu.yaml): the ChatML template
with tools, and examples/calculator_agent.py driven through the gateway.

The template must render a chat with one more message as the same text followed by more (token
mode), and render an assistant's call so the gateway's parser reads the same call back. The
agent, on a scripted generator, must turn a tool call and an answer into two steps, exactly
continued, and score its own answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_stepwise.envs.tool_calls import parse_tool_calls
from megatron_stepwise.gateway.server import GatewaySettings
from megatron_stepwise.hf.chat_templates import read_chat_template
from megatron_stepwise.hf.tokenizers import load_tokenizer
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from tests.gateway_fixtures import Scripted, Served, assert_exact

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "configs" / "templates" / "chatml_tools.jinja"
TOK = load_tokenizer("tiny_bpe", chat_template=str(TEMPLATE))
QUESTION = {"question": "Tom has 69 apples and buys 46 more. How many apples does he have now?", "answer": 115}


@pytest.fixture(scope="module")
def agent():
    from tests.helpers import load_script

    return load_script(ROOT / "examples" / "calculator_agent.py")


def render(messages, tools, generation=False):
    return TOK.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)


def test_template_compiles_and_grows_by_appending(agent):
    read_chat_template(str(TEMPLATE))  # what `validate` runs
    messages = agent.opening(QUESTION["question"])
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "69 + 46"}}}
    chat = messages + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "115"},
        {"role": "assistant", "content": "<answer>115</answer>"},
    ]
    tools = [agent.CALCULATOR]
    assert '"name": "calculator"' in render(chat[:1], tools)  # the tools are listed in the system turn
    for n in range(1, len(chat)):
        shorter, longer = render(chat[:n], tools, generation=True), render(chat[: n + 1], tools)
        assert longer.startswith(shorter.removesuffix("<|im_start|>assistant\n")), (
            f"message {n} rewrites the text before it"
        )


def test_a_rendered_call_parses_back(agent):
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 7"}}}
    before = render([{"role": "user", "content": "q"}], [agent.CALCULATOR], generation=True)
    after = render(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
        [agent.CALCULATOR],
    )
    turn = after[len(before) :].removesuffix("<|im_end|>\n")
    parsed = parse_tool_calls(turn, [agent.CALCULATOR])
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "12 * 7"})]


@pytest.mark.parametrize(
    "replies, reward",
    [
        (
            [
                '<tool_call>\n{"name": "calculator", "arguments": {"expression": "69 + 46"}}\n</tool_call>',
                "<answer>115</answer>",
            ],
            1.0,
        ),
        (
            [
                '<tool_call>\n{"name": "calculator", "arguments": {"expression": "69 * 46"}}\n</tool_call>',
                "<answer>3174</answer>",
            ],
            0.0,
        ),
    ],
)
def test_the_agent_through_the_gateway(agent, replies, reward):
    settings = GatewaySettings(sampling=SamplingParams(max_new_tokens=64), max_input_length=4096)
    served = Served(Scripted(TOK, list(replies)), TOK, settings)  # tiny_bpe spends ~2x SmolLM2's tokens
    try:
        url = served.open("calc", 0)
        out = agent.solve(QUESTION, url, served.gateway.api_key)
        steps = served.gateway.finish(url, out["reward"])
    finally:
        served.close()
    assert out == {"reward": reward, "info": {"tool_calls": 1}}
    assert_exact(steps, served.recording.calls)
    assert [s.metadata["prefix_break"] for s in steps] == [False, False]
    # the second prompt holds the first, the sampled call and the tool's result (token-in, token-out)
    first, second = steps[0], steps[1]
    held = first.prompt_ids.tolist() + first.response_ids.tolist()
    assert second.prompt_ids.tolist()[: len(held)] == held
    arguments = json.dumps(json.loads(replies[0].split("\n")[1])["arguments"])
    delta = TOK.decode(second.prompt_ids[len(held) :])
    assert delta.startswith("\n<|im_start|>tool\n" + agent.calculate(arguments) + "<|im_end|>")
