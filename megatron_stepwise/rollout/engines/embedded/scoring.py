"""The embedded engine's `score`: log-probs of given tokens from one forward of the whole sequence.

No KV cache and no prefix cache: the teacher's forward is independent of whatever the running
batch holds, so scoring between two decode steps leaves the generations in flight unchanged.
"""

from __future__ import annotations

import inspect

import torch


def score_tokens(model: torch.nn.Module, ids: list[int], start: int, temperature: float) -> list[float]:
    """`log_softmax(logits / temperature)[ids[i]]` given `ids[:i]`, for each i >= start, in float32
    over the full vocabulary (the rollout log-prob convention, `protocol.py`)."""
    tokens = torch.tensor([ids])
    extra = {}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        # the lm_head only for the positions whose logits give a scored token (and the last one)
        extra["logits_to_keep"] = len(ids) - start + 1
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False, **extra).logits[0]
    logits = logits[-(len(ids) - start + 1) :]  # positions start - 1 .. len - 1
    logp = torch.log_softmax(logits[:-1].float() / temperature, -1)
    return logp.gather(-1, tokens[0, start:, None])[:, 0].tolist()
