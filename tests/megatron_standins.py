"""Minimal stand-ins for `algo.losses` / `algo.batching` used by the Megatron tests until the
real modules land on main. They follow the published contracts (see issue 3 / issue 2):
token weights already divided by the mini-batch's global denominator, additive metric partials,
and a DP-balanced micro-batch plan with equal micro-batch counts per rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class LossInputs:
    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    segment_ids: torch.Tensor
    rollout_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None


@dataclass
class LossConfig:
    reduction: str = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.05
    entropy_coef: float = 0.01
    max_response_len: Optional[int] = None


def loss_token_weights(batch, reduction, *, max_response_len=None):
    """token_mean: 1 / (number of trainable tokens in the mini-batch) on trainable tokens."""
    assert reduction == "token_mean"
    mask = (batch.token_fields["loss_mask"] != 0).float()
    return mask / mask.sum()


def policy_loss(inp: LossInputs, cfg: LossConfig):
    """PPO clip (asymmetric) + k3 KL to the reference policy - entropy bonus; token weighted."""
    w = inp.weights
    ratio = torch.exp(inp.logprobs - inp.old_logprobs)
    clipped_ratio = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = -torch.minimum(ratio * inp.advantages, clipped_ratio * inp.advantages)
    loss = (w * pg).sum()
    metrics = {
        "pg_loss": (w * pg).sum().detach(),
        "pg_clipfrac": (w * (clipped_ratio != ratio).float()).sum().detach(),
    }
    if cfg.kl_coef:
        d = inp.ref_logprobs - inp.logprobs
        kl = torch.exp(d) - d - 1
        loss = loss + cfg.kl_coef * (w * kl).sum()
        metrics["kl"] = (w * kl).sum().detach()
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * (w * inp.entropy).sum()
        metrics["entropy_loss"] = (w * inp.entropy).sum().detach()
    return loss, metrics


def plan_microbatches(lengths, *, dp_size, max_tokens):
    """Longest-first onto the least-loaded rank, then first-fit into micro-batches; every rank
    padded with empty micro-batches to the same count."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ranks = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for i in order:
        if lengths[i] > max_tokens:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens, over max_tokens={max_tokens}")
        r = min(range(dp_size), key=lambda k: (load[k], k))
        ranks[r].append(i)
        load[r] += lengths[i]
    plan = []
    for rows in ranks:
        mbs, sums = [], []
        for i in rows:
            for m, s in enumerate(sums):
                if s + lengths[i] <= max_tokens:
                    mbs[m].append(i)
                    sums[m] += lengths[i]
                    break
            else:
                mbs.append([i])
                sums.append(lengths[i])
        plan.append(mbs)
    n = max(len(p) for p in plan)
    return [p + [[] for _ in range(n - len(p))] for p in plan]
