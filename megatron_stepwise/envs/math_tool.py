"""`math_tool`: arithmetic word problems solved with a Python tool.

The model may write `<python>code</python>`; the code runs in the sandbox (`sandbox.py`: its
own namespaces, no network, only a private directory writable, limits; docs/security.md; the
sample's answer never reaches it) and its printed output comes back as the next user message
`<output>...</output>`. The episode ends when the model writes `<answer>N</answer>`: reward 1 if
N equals the problem's answer (numerically), else 0. A turn with neither tag gets a format hint.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from megatron_stepwise.envs.base import EnvSpec, Message, StepOutput, register_env
from megatron_stepwise.envs.sandbox import run_python

DATA = Path(__file__).parent / "data" / "math_problems.jsonl"
SYSTEM_PROMPT = (
    "Solve the problem. To compute, write <python>code</python> and print the result; the output "
    "is returned in <output></output>. Give the final answer as <answer>number</answer>."
)
_PYTHON = re.compile(r"<python>(.*?)</python>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _as_number(text: str):
    try:
        value = float(text.strip().replace(",", ""))
    except ValueError:
        return None
    return value


class MathToolEnv:
    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 300):
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.answer = ""
        self.tool_calls = 0

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        if "question" not in sample or "answer" not in sample:
            raise ValueError(f"math_tool sample {sample.get('prompt_id')!r} needs 'question' and 'answer'")
        self.answer = str(sample["answer"])
        self.tool_calls = 0
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": sample["question"]}]

    def step(self, assistant_text: str) -> StepOutput:
        answer = _ANSWER.search(assistant_text)
        if answer is not None:
            given, expected = _as_number(answer.group(1)), _as_number(self.answer)
            correct = given is not None and expected is not None and abs(given - expected) < 1e-6
            return [], float(correct), True, {"answer": answer.group(1).strip(), "tool_calls": self.tool_calls}
        code = _PYTHON.search(assistant_text)
        if code is not None:
            self.tool_calls += 1
            result = run_python(code.group(1), timeout_s=self.timeout_s, memory_mb=self.memory_mb)
            obs = f"<output>{result.as_observation(self.max_output_chars)}</output>"
            return [{"role": "user", "content": obs}], 0.0, False, {"tool_calls": self.tool_calls}
        hint = "Use <python>code</python> to compute or <answer>number</answer> to answer."
        return [{"role": "user", "content": hint}], 0.0, False, {"format_error": True}


@lru_cache(maxsize=1)
def _problems() -> tuple[dict, ...]:
    with open(DATA) as f:
        return tuple(json.loads(line) for line in f if line.strip())


def math_dataset(num_prompts: int | None = None, offset: int = 0) -> list[dict]:
    rows = _problems()[offset:]
    rows = rows if num_prompts is None else rows[:num_prompts]
    return [{"prompt_id": r["id"], "question": r["question"], "answer": r["answer"]} for r in rows]


register_env(
    EnvSpec(
        name="math_tool",
        factory=MathToolEnv,
        dataset=math_dataset,
        tokenizer="tiny_char",
        description="arithmetic word problems with a sandboxed Python tool; exact numeric answer",
    )
)
