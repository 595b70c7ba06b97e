"""Next-token sampling with temperature / top-p / top-k and SGLang's log-prob convention."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_stepwise.rollout.engines.protocol import SamplingParams


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None
) -> tuple[int, float]:
    """Sample one token from `logits` [V]; returns (token, log-prob).

    The log-prob is `log_softmax(logits / T)[token]` over the full vocabulary (raw
    `log_softmax(logits)` when greedy): top-p/top-k only restrict which tokens may be drawn,
    exactly as SGLang reports `output_token_logprobs`.
    """
    logits = logits.float()
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(logp[token])
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = logp.exp()
    probs = _truncate(probs, params.top_k, params.top_p)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logp[token])


def _truncate(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero out tokens outside top-k and the top-p nucleus (unnormalised is fine for multinomial)."""
    vocab = probs.numel()
    if (top_k is None or top_k <= 0 or top_k >= vocab) and top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k is not None and 0 < top_k < vocab:
        keep[top_k:] = False
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
        keep &= mass_before < top_p * sorted_probs[keep].sum()
    keep[0] = True
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_probs[keep]
    return out
