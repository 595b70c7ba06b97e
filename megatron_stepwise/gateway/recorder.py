"""One trajectory as the gateway sees it: each call's prompt, and each call as its `Step`.

A call whose messages are the previous call's messages, then the assistant message the gateway
returned, then new messages, is a continuation: its prompt is the previous prompt + the sampled
ids + the template's delta (`rollout/agent/context.py`, the agent loop's token mode), never the chat
re-tokenised, so what the model sampled is what the next prompt holds. Any other call (history
dropped, summarised, edited, other tools, a sub-agent) is a prefix break: rendered fresh and
counted. Either way the step records the exact ids the engine received and sampled.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from megatron_stepwise.gateway.messages import MessageKey, message_key, tools_key
from megatron_stepwise.rollout.agent.context import extend_context, render_prompt, turn_delta
from megatron_stepwise.rollout.engines.protocol import GenerateResult
from megatron_stepwise.rollout.engines.routed_experts import pad_to_tokens
from megatron_stepwise.steps import INVALID, PREFIX_BREAK, Step, TrajectoryID


@dataclass
class Prompt:
    """A call's prompt ids, whether it broke the prefix, and what the next delta extends."""

    ids: list[int]
    prefix_break: bool
    history: list[dict]  # the template messages these ids render
    head: Optional[str]  # token mode: their rendering with the generation prompt, when known


class TrajectoryRecorder:
    """The calls of one trajectory, in order; `finish` hands them over as its steps."""

    def __init__(
        self,
        traj_id: TrajectoryID,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        append_eos: bool = True,
        seed: Optional[int] = None,
    ):
        self.traj_id, self.tokenizer = traj_id, tokenizer
        self.seed = seed  # the rollout's: call k samples with turn_seed(seed, trajectory, k)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.append_eos = append_eos
        self.steps: list[Step] = []
        self.prefix_breaks = 0
        self.tokens = 0  # prompt + sampled tokens over all calls (env.agent_max_tokens)
        self.finished = False
        self.lock = asyncio.Lock()  # one call at a time: each extends the one before
        self.answers: dict[str, asyncio.Future] = {}  # request key -> its answer (retries answered once)
        self.transcript: list[dict] = []  # per call: {"api", "messages", "tools", "reply"} (env.reward_fn reads it)
        self._expected: list[MessageKey] = []  # the last call's messages + the reply it got
        self._tools = ""
        self._last: Optional[Prompt] = None
        self._reply_text = ""
        self._response: list[int] = []  # the last step's response ids (an appended EOS included)
        self._sampled: list[int] = []  # the last call's sampled ids

    def prompt_for(self, messages: list[dict], tools: Optional[list[dict]]) -> Prompt:
        """This call's prompt: the last one extended when the messages continue it, else fresh."""
        n = len(self._expected)
        keys = [message_key(m) for m in messages]
        last = self._last
        if last is not None and tools_key(tools) == self._tools and keys[:n] == self._expected:
            observation = messages[n:]
            delta, head = turn_delta(self.tokenizer, last.history, self._reply_text, observation, tools, last.head)
            ids = extend_context(self.tokenizer, last.ids, self._response, delta, self.eos_token_ids)
            history = last.history + [{"role": "assistant", "content": self._reply_text}] + observation
            return Prompt(ids, False, history, head)
        return Prompt(render_prompt(self.tokenizer, messages, tools), last is not None, list(messages), None)

    def raw_prompt(self, ids: list[int]) -> Prompt:
        """A completions call's ids: a prefix break unless they extend the last prompt and its sample."""
        last = self._last
        held = last is not None and ids[: len(last.ids) + len(self._sampled)] == last.ids + self._sampled
        return Prompt(list(ids), last is not None and not held, [], None)

    def record(
        self,
        prompt: Prompt,
        result: GenerateResult,
        messages: list[dict],
        tools: Optional[list[dict]],
        reply: dict,
        text: str,
        api: str,
    ) -> Step:
        """The call as a step; `reply` (the assistant message returned) is what the next call
        must repeat to continue this prefix, `text` the sampled text the template extends."""
        step, response = self._step(prompt.ids, result, api, prompt.prefix_break)
        self.steps.append(step)
        self.transcript.append({"api": api, "messages": messages, "tools": tools, "reply": reply})
        self.prefix_breaks += prompt.prefix_break
        self.tokens += len(prompt.ids) + len(result.output_ids)
        self._expected = [message_key(m) for m in messages] + [message_key(reply)]
        self._tools = tools_key(tools)
        self._last, self._reply_text, self._response = prompt, text, response
        self._sampled = list(result.output_ids)
        return step

    def finish(
        self, reward: float, turn_rewards: Optional[Sequence[float]] = None, invalid: Optional[str] = None
    ) -> list[Step]:
        """The trajectory's steps, the last one carrying the outcome `reward` (and `invalid`,
        why it must not be trained). No call at all: one zero-token step keeps it counted."""
        self.finished = True
        steps = list(self.steps) or [self._placeholder()]
        for step, r in zip(steps, turn_rewards or ()):
            step.turn_reward = float(r)
        last = steps[-1]
        last.is_last_step, last.reward = True, float(reward)
        if invalid:
            last.metadata[INVALID] = invalid
        return steps

    def _step(self, prompt: list[int], result: GenerateResult, api: str, prefix_break: bool) -> tuple[Step, list[int]]:
        response, logprobs = list(result.output_ids), list(result.logprobs)
        versions = list(result.token_weight_versions or [result.weight_version] * len(response))
        loss_mask = [1] * len(response)
        if (
            self.append_eos
            and result.finish_reason != "abort"
            and (not response or response[-1] not in self.eos_token_ids)
        ):
            # not sampled: never trained, but the next prompt holds it (the template closes the turn)
            response.append(self.eos_token_ids[0])
            loss_mask.append(0)
            logprobs.append(0.0)
            versions.append(versions[-1] if versions else result.weight_version)
        step = Step(
            trajectory_id=self.traj_id,
            prompt_ids=torch.tensor(prompt, dtype=torch.long),
            response_ids=torch.tensor(response, dtype=torch.long),
            loss_mask=torch.tensor(loss_mask, dtype=torch.long),
            rollout_logprobs=torch.tensor(logprobs, dtype=torch.float32),
            stop_reason={"stop": "stop", "length": "length"}.get(result.finish_reason, "abort"),
            weight_versions=torch.tensor(versions, dtype=torch.long),
            metadata={
                "turn": len(self.steps),
                "finish_reason": result.finish_reason,
                "engine": result.engine,
                "api": api,
                PREFIX_BREAK: prefix_break,
            },
            routed_experts=pad_to_tokens(result.routed_experts, len(prompt) + len(response)),
        )
        if result.finish_reason == "abort":
            step.metadata[INVALID] = "abort"
        return step, response

    def _placeholder(self) -> Step:
        return Step(
            trajectory_id=self.traj_id,
            prompt_ids=[self.eos_token_ids[0]],
            response_ids=[],
            loss_mask=[],
            rollout_logprobs=[],
            stop_reason="no_calls",
            weight_versions=[],
            metadata={"turn": 0},
        )
