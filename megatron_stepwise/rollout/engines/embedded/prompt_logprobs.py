"""Prompt log-probs on the embedded server: /generate's `logprob_start_len` and its answer's
`meta_info.input_token_logprobs`, as SGLang 0.5.23 computes and returns them.

What SGLang does (its wheel, sglang/srt/...):
- `logprob_start_len` counts only with `return_logprob` (managers/scheduler.py:3256); -1, the
  default, means output log-probs only and an empty `input_token_logprobs`; a value over the
  prompt's length fails the request (scheduler.py:3275).
- With k >= 0 there is one [logprob, token_id, text] entry per prompt token from position k on:
  the ids are `origin_input_ids[k:]` (managers/scheduler_components/logprob_result_processor.py:50).
  The logits of positions k .. n-1 each score the next token (managers/schedule_batch.py:3031) and
  the values are shifted by one, `[None] + values[:-1]` (logprob_result_processor.py:38): the first
  entry (token k) has no log-prob (null), entry j > 0 is the log-prob of token k + j given the
  tokens before it.
- The values come from the raw logits, `log_softmax(logits)` with no temperature
  (layers/logprob_processor.py:734; only output log-probs divide by it, :425).
- Ids >= vocab_size - 1 are reported as 0 (logprob_result_processor.py:53).

The embedded engine computes them with `LocalEngine.score` at temperature 1, and only for a
prompt-only request (`max_new_tokens` 0): prompt log-probs beside a generation are refused.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megatron_stepwise.rollout.engines.embedded import request_fields as F
from megatron_stepwise.rollout.engines.protocol import GenerateResult, SamplingParams


def logprob_starts(
    body: dict, prompts: list, return_logprob: list, params: list[SamplingParams], routed: bool, where: str
) -> list[int]:
    """Each prompt's `logprob_start_len` as SGLang resolves it (-1: no prompt log-probs);
    `BadRequest` for a value the embedded engine cannot serve."""
    raw = body.get("logprob_start_len")
    starts = F.one_or_each(
        -1 if raw is None else raw,
        len(prompts),
        lambda v: F.is_int(v) and v >= -1,
        "an integer >= -1",
        where,
        "logprob_start_len",
    )
    out = []
    for prompt, k, flag, sampling in zip(prompts, starts, return_logprob, params):
        k = k if flag else -1  # SGLang ignores it without return_logprob
        if k > len(prompt):
            raise F.BadRequest(f"{where}: logprob_start_len={k} is higher than the {len(prompt)} input tokens")
        k = -1 if k == len(prompt) else k  # no prompt token from there: none to report
        if k >= 0 and sampling.max_new_tokens:
            raise F.BadRequest(
                f"{where}: prompt log-probs (logprob_start_len >= 0) need sampling_params.max_new_tokens=0 "
                "on the embedded engine (it scores a prompt or generates, not both in one request)"
            )
        if k >= 0 and routed:
            raise F.BadRequest(f"{where}: return_routed_experts needs a generation, not prompt log-probs")
        out.append(k)
    return out


async def input_logprobs(engine: Any, prompt: list[int], start: int) -> list[Optional[float]]:
    """The values of `input_token_logprobs` from position `start`: null, then the log-probs of
    `prompt[start + 1:]` at temperature 1 (as SGLang); none for start -1."""
    if start < 0:
        return []
    rest = await engine.score(prompt, start + 1, 1.0) if start + 1 < len(prompt) else []
    return [None, *rest]


def prompt_only_result(engine: Any) -> GenerateResult:
    """A scored prompt's result: nothing generated (finish "length", as SGLang's max_new_tokens 0)."""
    return GenerateResult([], [], "length", weight_version=engine.weights.version, engine=engine.name)


def input_token_logprobs(
    prompt: list[int], start: int, values: list, vocab_size: int, token_text: Optional[Callable] = None
) -> list[list]:
    """SGLang's entries [logprob, token_id, text] of `prompt[start:]` ([] for start -1)."""
    ids = [t if t < vocab_size - 1 else 0 for t in prompt[start:]] if start >= 0 else []
    text = token_text or (lambda t: None)
    return [[v, t, text(t)] for v, t in zip(values, ids)]
