"""A turn that a weight update aborted, continued by a second request: the two results as one.

With `pause_mode: abort` an update ends the requests in flight (`abort_reason` "pause"); the
agent loop sends the turn again as prompt + the tokens sampled so far and joins the answers.
Everything already sampled is kept as it was: its tokens, log-probs, weight versions and the
routes of the positions whose logits gave them. Only positions from the last sampled token on
(whose logits the continuation computed) take the continuation's routes, so every token's route
and log-prob still come from one forward pass, however many times the turn was continued.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import torch

from megatron_stepwise.rollout.engines.protocol import GenerateResult, SamplingParams

# A turn aborted by weight updates is continued at most this many times (each update aborts it once).
MAX_CONTINUATIONS = 16


async def generate_continued(
    generator: Any, prompt: list[int], sampling: SamplingParams, rid: str, session: Optional[str]
) -> GenerateResult:
    """One turn's generation. A request a weight update aborted (pause_mode "abort") is sent
    again as prompt + its tokens so far, and the answers joined: the update loses no sampled
    token and rewrites no route (the agent loop's turns and the gateway's calls alike)."""
    result = await generator.generate(prompt, sampling, rid=rid, session=session)
    for k in range(1, MAX_CONTINUATIONS + 1):
        room = sampling.max_new_tokens - len(result.output_ids)
        if result.finish_reason != "abort" or result.abort_reason != "pause" or room <= 0:
            break
        rest_sampling = copy.copy(sampling)
        rest_sampling.__dict__["max_new_tokens"] = room
        rest = await generator.generate(
            prompt + list(result.output_ids), rest_sampling, rid=f"{rid}+{k}", session=session
        )
        result = join_continuation(result, rest, len(prompt))
    return result


def join_continuation(first: GenerateResult, rest: GenerateResult, prompt_len: int) -> GenerateResult:
    """`first` (aborted after its output) followed by `rest`, generated from prompt + first's output."""
    frozen = prompt_len + len(first.output_ids) - 1  # positions whose logits gave a sampled token

    def cat(a: Optional[list], b: Optional[list]) -> Optional[list]:
        return None if a is None or b is None else list(a) + list(b)

    return dataclasses.replace(
        rest,
        output_ids=list(first.output_ids) + list(rest.output_ids),
        logprobs=list(first.logprobs) + list(rest.logprobs),
        token_weight_versions=cat(first.token_weight_versions, rest.token_weight_versions),
        token_forwards=cat(first.token_forwards, rest.token_forwards),
        routed_experts=_append_only(first.routed_experts, rest.routed_experts, frozen),
        route_forwards=_append_only(first.route_forwards, rest.route_forwards, frozen),
        text=None if first.text is None or rest.text is None else first.text + rest.text,
        cached_tokens=first.cached_tokens + rest.cached_tokens,
    )


def _append_only(old: Optional[torch.Tensor], new: Optional[torch.Tensor], frozen: int) -> Optional[torch.Tensor]:
    """`new` (per position from 0), with `old`'s entries at the first `frozen` positions it has."""
    if new is None:
        return None
    if old is None:
        return new
    keep = max(0, min(frozen, old.size(0), new.size(0)))
    return torch.cat([old[:keep].to(new.dtype), new[keep:]])
