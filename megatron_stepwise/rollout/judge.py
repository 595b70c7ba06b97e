"""Rewards from an LLM judge: a served model reads the trajectory and answers with a verdict.

`env.judge.prompt` is a template over the sample and the trajectory (`{question}`, `{answer}`,
`{transcript}`, `{sample[FIELD]}`); the judge model (`judge:` section, its own engines) answers it
through its chat template, and `env.judge.parser` reads a number from the answer. `reward:
outcome` judges the whole trajectory once (its last answer); `turn` judges every turn's answer
(each becomes the step's `turn_reward`, their sum the outcome). `combine` replaces the
environment's reward or adds to it. The judge's prompt, raw answer and reward are kept in the
last step's metadata (`judge`), so dumps and the viewer show them. An answer the parser cannot
read makes the trajectory invalid (counted, never trained), never a reward of 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Optional

from megatron_stepwise.errors import UserError
from megatron_stepwise.options import check_options, option
from megatron_stepwise.rollout.engines.protocol import EngineError, FleetLost, NoLiveEngine, SamplingParams
from megatron_stepwise.steps import INVALID, Step

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


@dataclass
class JudgeConfig:
    """LLM-judge rewards: a prompt for the `judge:` model and how to read its verdict (docs/distill.md)."""

    prompt: Optional[str] = option(
        None,
        "template the judge answers: {question}, {answer}, {transcript}, {sample[FIELD]}; null = no judge",
    )
    parser: str = option(
        "number",
        "how the verdict is read: number (the answer's first number), yes_no (its first yes or no word: "
        "1 or 0), tag:NAME (the number inside <NAME>...</NAME>), or regex:PATTERN (its first group, a number)",
    )
    reward: Literal["outcome", "turn"] = option("outcome", "judge the trajectory once, or each turn's answer")
    combine: Literal["replace", "add"] = option(
        "replace", "the judge's reward replaces the environment's, or adds to it"
    )
    max_new_tokens: int = option(64, "tokens of the judge's answer at most", min=1)
    temperature: float = option(0.0, "judge sampling temperature (0 = greedy)", min=0.0)

    def __post_init__(self) -> None:
        check_options(self, "env.judge.")

    @property
    def enabled(self) -> bool:
        return self.prompt is not None

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if parser_problem(self.parser):
            out.append(("parser", parser_problem(self.parser)))
        if self.prompt is not None:
            why = template_problem(self.prompt)
            if why:
                out.append(("prompt", why))
        return out


def parser_problem(parser: str) -> Optional[str]:
    if parser in ("number", "yes_no") or (parser.startswith("tag:") and re.fullmatch(r"[\w.-]+", parser[4:])):
        return None
    if parser.startswith("regex:"):
        try:
            if re.compile(parser[6:]).groups < 1:
                return "regex:PATTERN needs a capturing group (the number)"
        except re.error as e:
            return f"regex:PATTERN does not compile: {e}"
        return None
    return f"must be number, yes_no, tag:NAME or regex:PATTERN (got {parser!r})"


def template_problem(prompt: str) -> Optional[str]:
    try:
        prompt.format(question="q", answer="a", transcript="t", sample=_AnyField())
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        return f"is not a template over {{question}}, {{answer}}, {{transcript}}, {{sample[FIELD]}}: {e!r}"
    return None


class _AnyField(dict):
    def __missing__(self, key):
        return ""


def parse_verdict(parser: str, answer: str) -> Optional[float]:
    """The number the parser reads from the judge's answer, or None (unparsable)."""
    if parser == "yes_no":
        m = re.search(r"\b(yes|no)\b", answer, re.IGNORECASE)
        return None if m is None else float(m.group(1).lower() == "yes")
    if parser == "number":
        m = re.search(_NUMBER, answer)  # the first: "8/10", "7 out of 10" are verdicts first
        text = m.group(0) if m else None
    elif parser.startswith("tag:"):
        name = re.escape(parser[4:])
        m = re.search(rf"<{name}>\s*({_NUMBER})\s*</{name}>", answer)
        text = m.group(1) if m else None
    else:
        m = re.search(parser[6:], answer)
        text = m.group(1) if m else None
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


class Judge:
    """The after-trajectory hook that sets rewards from the judge model's verdicts."""

    def __init__(self, generator: Any, judge_tokenizer: Any, config: JudgeConfig, policy_tokenizer: Any = None):
        self.generator, self.tokenizer, self.config = generator, judge_tokenizer, config
        self.policy_tokenizer = policy_tokenizer or judge_tokenizer
        self.sampling = SamplingParams(temperature=config.temperature, max_new_tokens=config.max_new_tokens)
        self.counts = {"judge/calls": 0.0, "judge/unparsable": 0.0}

    async def __call__(self, steps: list[Step], sample: dict[str, Any]) -> None:
        if steps[-1].invalid_reason is not None or steps[-1].is_padding:
            return
        judged = steps if self.config.reward == "turn" else [steps[-1]]
        verdicts = []
        for step in judged:
            prompt, answer, value = await self._verdict(steps, step, sample)
            verdicts.append({"prompt": prompt, "answer": answer, "reward": value})
            if value is None:
                self.counts["judge/unparsable"] += 1
                steps[-1].metadata["judge"] = verdicts
                steps[-1].metadata[INVALID] = f"judge: no verdict in its answer {answer[:200]!r}"
                return
        steps[-1].metadata["judge"] = verdicts
        self._set_rewards(steps, [v["reward"] for v in verdicts])

    def _set_rewards(self, steps: list[Step], values: list[float]) -> None:
        add = self.config.combine == "add"
        if self.config.reward == "turn":
            for step, value in zip(steps, values):
                step.turn_reward = step.turn_reward + value if add else value
            steps[-1].reward = (steps[-1].reward if add else 0.0) + sum(values)
        else:
            steps[-1].reward = steps[-1].reward + values[0] if add else values[0]

    async def _verdict(self, steps: list[Step], step: Step, sample: dict) -> tuple[str, str, Optional[float]]:
        decode = lambda ids: self.policy_tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        last = steps[-1]
        try:
            prompt = self.config.prompt.format(
                question=_question(sample),
                answer=decode(step.response_ids.tolist()),
                transcript=decode(last.prompt_ids.tolist() + last.response_ids.tolist()),
                sample=sample,
            )
        except KeyError as e:
            raise UserError(f"env.judge.prompt: sample {sample.get('prompt_id', '?')!r} has no field {e}") from None
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        try:
            result = await self.generator.generate(ids, self.sampling)
        except (NoLiveEngine, FleetLost):  # no judge left: no reward can be given
            raise
        except (EngineError, ValueError) as e:  # this trajectory gets no verdict: invalid, not 0
            self.counts["judge/calls"] += 1
            return prompt, f"(no answer: {type(e).__name__}: {str(e)[:300]})", None
        self.counts["judge/calls"] += 1
        answer = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        return prompt, answer, parse_verdict(self.config.parser, answer)

    def metrics(self) -> dict[str, float]:
        out, self.counts = self.counts, dict.fromkeys(self.counts, 0.0)
        return out


def _question(sample: dict) -> str:
    """The sample's question: its `prompt` (a string, or the last user message of a chat)."""
    prompt = sample.get("prompt", sample.get("question", ""))
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1]) if users else ""
    return str(prompt)
