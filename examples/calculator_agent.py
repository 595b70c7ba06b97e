"""A tool-calling agent written against the OpenAI SDK: word problems with a `calculator` function.

Nothing here knows about training. The agent offers one function tool, runs the calls the model
makes, and scores the final `<answer>N</answer>`. Trained through the gateway with
configs/smollm2_calculator_agent_cpu.yaml:

    megatron-stepwise train configs/smollm2_calculator_agent_cpu.yaml

The problems are the `calculator` environment's (`env.name: calculator`): `sample` holds
`question` and `answer`. The opening messages hold one worked example of a tool call, as a
few-shot prompt would for any small model.
"""

from __future__ import annotations

import json
import re
import zlib

import httpx
from openai import OpenAI

from megatron_stepwise.envs.calculator import evaluate

SYSTEM = "Solve the problem. Use the calculator tool to compute. Then give the final answer as <answer>number</answer>."
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 12 * 7"}},
            "required": ["expression"],
        },
    },
}
# one worked example per question, by its text, so no single operation is the example's
EXAMPLES = [
    ("A box holds 12 eggs. How many eggs are in 7 boxes?", "12 * 7", "84"),
    ("Sam has 45 stamps and gets 28 more. How many stamps does he have?", "45 + 28", "73"),
    ("A tank holds 90 liters. 34 liters are used. How many liters are left?", "90 - 34", "56"),
]
HINT = "Call the calculator tool to compute, or give the final answer as <answer>number</answer>."
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
MAX_CALLS = 3
HTTP = httpx.Client()  # one connection pool for every trajectory (a client of its own costs ~40 ms CPU)


def opening(question: str) -> list[dict]:
    """The system prompt, the worked examples (rotated by the question) and the question."""
    k = zlib.crc32(question.encode()) % len(EXAMPLES)
    messages = [{"role": "system", "content": SYSTEM}]
    for i, (example, expression, result) in enumerate(EXAMPLES[k:] + EXAMPLES[:k]):
        arguments = json.dumps({"expression": expression})
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
        messages += [
            {"role": "user", "content": example},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": result},
            {"role": "assistant", "content": f"<answer>{result}</answer>"},
        ]
    return messages + [{"role": "user", "content": question}]


def calculate(arguments: str) -> str:
    try:
        value = evaluate(str(json.loads(arguments)["expression"]))
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError, RecursionError) as e:
        return f"Error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def correct(text: str, answer: float) -> bool:
    found = ANSWER.search(text or "")
    try:
        return found is not None and abs(float(found.group(1).strip().replace(",", "")) - answer) < 1e-6
    except ValueError:
        return False


def solve(sample: dict, base_url: str, api_key: str) -> dict:
    client = OpenAI(base_url=base_url, api_key=api_key, http_client=HTTP)
    messages, tool_calls = opening(sample["question"]), 0
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        if message.tool_calls:
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                tool_calls += 1
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)}
                )
        elif ANSWER.search(message.content or ""):
            solved = correct(message.content, float(sample["answer"]))
            return {"reward": float(solved), "info": {"tool_calls": tool_calls}}
        else:
            messages += [{"role": "assistant", "content": message.content or ""}, {"role": "user", "content": HINT}]
    return {"reward": 0.0, "info": {"tool_calls": tool_calls, "no_answer": True}}
