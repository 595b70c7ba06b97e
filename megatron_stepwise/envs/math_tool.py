"""`math_tool`: arithmetic word problems solved with a Python tool, called as people write it.

The environment declares one tool, `python` (`tools`: a function schema with a `code` string
argument), which the agent loop passes to the chat template as `tools=`. The model calls it in the
Hermes / Qwen format, `<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`,
up to `MAX_CALLS_PER_TURN` calls per turn; each call's code runs in the sandbox (`sandbox.py`: its
own namespaces, no network, only a private directory writable, limits; docs/security.md; the
sample's answer never reaches it) and what it prints comes back as a role "tool" message, one per
call, in order. A malformed call (invalid JSON, no name, arguments that are not an object, another
tool, no `code`) is answered with a tool message saying what is wrong, instead of running anything.
The episode ends when the model writes `<answer>N</answer>`: reward 1 if N equals the problem's
answer (numerically), else 0. A turn with neither gets a hint.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from megatron_stepwise.envs.base import EnvSpec, Message, StepOutput, question_samples, register_env
from megatron_stepwise.envs.sandbox import run_python
from megatron_stepwise.envs.tool_calls import ToolCall, function_tool, parse_tool_calls, tool_message

DATA = Path(__file__).parent / "data" / "math_problems.jsonl"
PYTHON_TOOL = function_tool(
    "python",
    "Run a Python 3 program in a sandbox and return what it prints (stdout, then any error).",
    {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program; print the values you need"}},
        "required": ["code"],
        "additionalProperties": False,
    },
)
CALL_EXAMPLE = '<tool_call>\n{"name": "python", "arguments": {"code": "print(12 * 7)"}}\n</tool_call>'
SYSTEM_PROMPT = (
    "Solve the problem. To compute, call the python tool, e.g.\n" + CALL_EXAMPLE + "\n"
    "What the code prints comes back as the tool's response. Give the final answer as <answer>number</answer>."
)
HINT = "Call the python tool to compute, e.g.\n" + CALL_EXAMPLE + "\nor answer with <answer>number</answer>."
MAX_CALLS_PER_TURN = 4
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _as_number(text: str):
    try:
        value = float(text.strip().replace(",", ""))
    except ValueError:
        return None
    return value


class MathToolEnv:
    tools = [PYTHON_TOOL]  # passed to the chat template as tools= (envs/base.py)

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 300):
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.answer = ""
        self.tool_calls = 0
        self.tool_errors = 0

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        if "question" not in sample or "answer" not in sample:
            raise ValueError(f"math_tool sample {sample.get('prompt_id')!r} needs 'question' and 'answer'")
        self.answer = str(sample["answer"])
        self.tool_calls = self.tool_errors = 0
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": sample["question"]}]

    def step(self, assistant_text: str) -> StepOutput:
        answer = _ANSWER.search(assistant_text)
        if answer is not None:
            given, expected = _as_number(answer.group(1)), _as_number(self.answer)
            correct = given is not None and expected is not None and abs(given - expected) < 1e-6
            return [], float(correct), True, {"answer": answer.group(1).strip(), **self._counts()}
        blocks = parse_tool_calls(assistant_text, self.tools).blocks
        if not blocks:
            return [{"role": "user", "content": HINT}], 0.0, False, {"format_error": True, **self._counts()}
        observation = [self._answer_call(b) for b in blocks[:MAX_CALLS_PER_TURN]]
        if len(blocks) > MAX_CALLS_PER_TURN:
            self.tool_errors += 1
            observation.append(
                tool_message(
                    f"Error: at most {MAX_CALLS_PER_TURN} tool calls per turn; the other "
                    f"{len(blocks) - MAX_CALLS_PER_TURN} were not run"
                )
            )
        return observation, 0.0, False, self._counts()

    def _answer_call(self, block) -> Message:
        if not isinstance(block, ToolCall):
            self.tool_errors += 1
            return tool_message(f"Error: {block.message}", name=block.name)
        self.tool_calls += 1
        result = run_python(block.arguments["code"], timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        return tool_message(result.as_observation(self.max_output_chars), name=block.name)

    def _counts(self) -> dict[str, int]:
        return {"tool_calls": self.tool_calls, "tool_errors": self.tool_errors}


def math_dataset(num_prompts: int | None = None, offset: int = 0) -> list[dict]:
    return question_samples(DATA, num_prompts, offset)


register_env(
    EnvSpec(
        name="math_tool",
        factory=MathToolEnv,
        dataset=math_dataset,
        tokenizer="tiny_char",
        description="arithmetic word problems with a sandboxed Python tool; exact numeric answer",
    )
)
