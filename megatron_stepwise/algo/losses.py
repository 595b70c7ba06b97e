"""Step-wise policy losses: PPO clip / dual-clip, GSPO, CISPO, off-policy correction, KL, entropy.

`policy_loss(inputs, cfg)` works on the trained positions of one micro-batch and returns a
partial sum `sum_t w_t * (pg_t + kl_coef * kl_t - entropy_coef * ent_t)`, `w_t` from
`loss_token_weights` (`algo/reductions.py`); the mini-batch loss and every metric are plain sums
of partials over micro-batches and DP ranks (`_max` metrics combine with max). A "sequence" is
one row (one step, or a merged row), so GSPO and sequence-level TIS / IcePop are per step;
`check_loss_compatibility` refuses the combinations merging would change.

The step-wise meaning of sequence-level quantities and the off-policy correction:
docs/megatron.md, 'Policy losses, step by step'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch

from megatron_stepwise.algo.advantages import is_temporal_estimator, list_estimators
from megatron_stepwise.algo.reductions import MERGE_INVARIANT_REDUCTIONS, REDUCTIONS
from megatron_stepwise.algo.registry import Registry
from megatron_stepwise.options import check_options, option, option_problems

__all__ = [
    "LossConfig",
    "LossInputs",
    "Segments",
    "check_loss_compatibility",
    "combine_metric_partials",
    "get_policy_loss",
    "kl_estimate",
    "list_policy_losses",
    "policy_loss",
    "register_policy_loss",
]

KL_ESTIMATORS = ("k1", "k2", "k3")
TIS_MODES = ("none", "token", "sequence")
ICEPOP_LEVELS = ("token", "sequence")


# ----------------------------------------------------------------------------- registry

# A policy loss maps (inputs, cfg, segments) to a per-token loss pg_t and a dict of per-token
# indicators (0/1 or floats) that become w-weighted metric partials.
PolicyLossFn = Callable[["LossInputs", "LossConfig", "Segments"], tuple]


# flag: sequence_level (uses per-row quantities, so its value changes when rows are merged)
_POLICY_LOSSES = Registry("algo.loss.policy_loss", "policy loss")


def register_policy_loss(name: str, *, sequence_level: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register `fn(inputs, cfg, segments) -> (pg_per_token, {name: per_token_indicator})`.

    Set `sequence_level=True` if the loss uses per-row quantities (like GSPO), so that config
    validation refuses it together with step merging.
    """
    return _POLICY_LOSSES.register(name, sequence_level)


def get_policy_loss(name: str) -> PolicyLossFn:
    return _POLICY_LOSSES.lookup(name)[0]


def list_policy_losses() -> list[str]:
    return _POLICY_LOSSES.names()


# ----------------------------------------------------------------------------- config


@dataclass
class LossConfig:
    """The policy loss, its off-policy corrections and its reduction."""

    # The one declaration of the `algo.loss` config section: YAML configs build this class (the
    # config package reads these options for types, checks and docs/config.md) and Python code
    # constructs it directly; both check the same bounds and choices and name `algo.loss.<key>`.
    policy_loss: str = option(
        "ppo", "ppo (clip, dual-clip), gspo, cispo, or a registered loss", choices=list_policy_losses
    )
    clip_low: float = option(0.2, "lower clip: ratios below 1 - clip_low are clipped", min=0.0, lt=1.0)
    clip_high: float = option(0.2, "upper clip: ratios above 1 + clip_high are clipped", min=0.0)
    clip_c: Optional[float] = option(
        None, "dual-clip constant for negative advantages: their loss stops growing at ratio clip_c; null = off", gt=1.0
    )
    reduction: str = option("token_mean", "how token losses are averaged over a mini-batch", choices=REDUCTIONS)
    max_response_len: Optional[int] = option(
        None, "the constant normaliser of seq_mean_token_sum_norm (Dr.GRPO); required by that reduction", min=1
    )
    kl_coef: float = option(0.0, "weight of the KL-to-reference term; 0 = no reference model", min=0.0)
    kl_estimator: str = option("k3", "KL estimator (Schulman's k1, k2, k3)", choices=KL_ESTIMATORS)
    entropy_coef: float = option(0.0, "weight of the entropy bonus", min=0.0)
    tis: str = option("none", "truncated importance sampling between trainer and rollout log-probs", choices=TIS_MODES)
    tis_cap: float = option(2.0, "upper cap of the truncated importance weight", gt=0.0)
    icepop_low: Optional[float] = option(
        None, "mask tokens whose train/rollout ratio is below this; null = off", min=0.0, lt=1.0
    )
    icepop_high: Optional[float] = option(
        None, "mask tokens whose train/rollout ratio is above this; null = off", gt=1.0
    )
    icepop_level: str = option(
        "token", "IcePop masks tokens, or whole steps by their geometric-mean ratio", choices=ICEPOP_LEVELS
    )
    router_aux_coef: float = option(
        0.0,
        "MoE only: weight of the per-step router load-balancing loss "
        "(sequence-wise, invariant to every split; 0 = off)",
        min=0.0,
    )
    router_z_coef: float = option(0.0, "MoE only: weight of the router z-loss (docs/megatron.md); 0 = off", min=0.0)
    options: dict[str, Any] = option({}, "keyword settings for a registered custom loss (free mapping)")

    def __post_init__(self) -> None:
        check_options(self, "algo.loss.")

    def problems(self) -> list[tuple[str, str]]:
        """(key, why) for each invalid setting: the options' bounds and choices, then combinations.

        The IcePop band needs no ordering check: its bounds keep icepop_low < 1 < icepop_high.
        """
        out = option_problems(self)
        if self.reduction == "seq_mean_token_sum_norm" and self.max_response_len is None:
            out.append(
                (
                    "max_response_len",
                    "must be set for reduction 'seq_mean_token_sum_norm', its constant normaliser (got None)",
                )
            )
        return out

    @property
    def uses_icepop(self) -> bool:
        return self.icepop_low is not None or self.icepop_high is not None

    @property
    def needs_rollout_logprobs(self) -> bool:
        return self.tis != "none" or self.uses_icepop


@dataclass
class LossInputs:
    """1-D tensors over the trained positions (loss_mask == 1) of one micro-batch, all aligned.

    >>> x = LossInputs(logprobs=torch.tensor([-0.5, -1.0, -0.2]), old_logprobs=torch.tensor([-0.5, -0.9, -0.2]),
    ...     advantages=torch.tensor([1.0, 1.0, -1.0]), weights=torch.tensor([0.25, 0.25, 0.5]),
    ...     segment_ids=torch.tensor([0, 0, 1]))  # two rows: 2 trained tokens, then 1
    >>> x.check()
    """

    logprobs: torch.Tensor  # current policy, requires grad
    old_logprobs: torch.Tensor  # the trainer's old policy
    advantages: torch.Tensor
    weights: torch.Tensor  # loss_token_weights at these positions
    segment_ids: torch.Tensor  # long: the row each token belongs to; rows are never split
    rollout_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None  # requires grad if entropy_coef != 0

    def check(self) -> None:
        n = self.logprobs.numel()
        for f in fields(self):
            t = getattr(self, f.name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise ValueError(f"LossInputs.{f.name}: expected a 1-D tensor, got {_describe(t)}")
            if t.numel() != n:
                raise ValueError(f"LossInputs.{f.name}: has {t.numel()} entries, logprobs has {n}")
        if self.segment_ids.dtype != torch.long:
            raise ValueError(f"LossInputs.segment_ids: expected torch.long, got {self.segment_ids.dtype}")


def _describe(t) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


class Segments:
    """Per-row (per-step) sums and means of token values, broadcast back to the tokens."""

    def __init__(self, segment_ids: torch.Tensor):
        _, self.ids = torch.unique(segment_ids, return_inverse=True)
        self.num = int(self.ids.max()) + 1 if self.ids.numel() else 0

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.num, dtype=x.dtype, device=x.device).index_add(0, self.ids, x)[self.ids]

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        count = torch.bincount(self.ids, minlength=self.num).to(x.dtype)
        return self.sum(x) / count[self.ids]


# ----------------------------------------------------------------------------- built-in losses


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> tuple:
    """PPO's pessimistic clipped objective (as a loss), with optional dual clip for adv < 0."""
    low, high = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
    indicators = {
        "clipfrac_low": (adv < 0) & (ratio < low),
        "clipfrac_high": (adv > 0) & (ratio > high),
    }
    if cfg.clip_c is not None:
        # For adv < 0 the loss -adv*ratio grows without bound in ratio; cap it at -adv*clip_c.
        dual = (adv < 0) & (ratio > cfg.clip_c)
        pg = torch.where(dual, -adv * cfg.clip_c, pg)
        indicators["clipfrac_dual"] = dual
    return pg, indicators


@register_policy_loss("ppo")
def ppo_loss(inputs: LossInputs, cfg: LossConfig, segments: Segments) -> tuple:
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
    return clipped_surrogate(ratio, inputs.advantages, cfg)


@register_policy_loss("gspo", sequence_level=True)
def gspo_loss(inputs: LossInputs, cfg: LossConfig, segments: Segments) -> tuple:
    """GSPO-token: every token carries its step's ratio in value, its own log-prob's gradient."""
    log_seq = segments.mean(inputs.logprobs - inputs.old_logprobs)
    ratio = torch.exp(log_seq.detach() + inputs.logprobs - inputs.logprobs.detach())
    return clipped_surrogate(ratio, inputs.advantages, cfg)


@register_policy_loss("cispo")
def cispo_loss(inputs: LossInputs, cfg: LossConfig, segments: Segments) -> tuple:
    """CISPO: clip the (stop-gradient) importance weight, never the token's gradient."""
    low, high = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs).detach()
    pg = -ratio.clamp(low, high) * inputs.advantages * inputs.logprobs
    return pg, {"clipfrac_low": ratio < low, "clipfrac_high": ratio > high}


# ----------------------------------------------------------------------------- KL and off-policy


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3)."""
    d = logprobs - ref_logprobs  # log(pi / pi_ref)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"algo.loss.kl_estimator={estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")


def _off_policy_correction(inputs: LossInputs, cfg: LossConfig, seg: Segments) -> tuple:
    """Detached per-token factor on pg (TIS weight x IcePop keep-mask), indicators, max metrics."""
    log_rho = (inputs.old_logprobs - inputs.rollout_logprobs).detach().to(torch.float64)
    factor = torch.ones_like(log_rho)
    indicators: dict[str, torch.Tensor] = {"logprob_gap": log_rho.abs()}
    maxima: dict[str, torch.Tensor] = {"logprob_gap_max": log_rho.abs()}
    if cfg.tis != "none":
        log_w = log_rho if cfg.tis == "token" else seg.sum(log_rho)
        capped = log_w > math.log(cfg.tis_cap)
        tis_w = torch.exp(log_w.clamp(max=math.log(cfg.tis_cap)))
        factor = factor * tis_w
        indicators.update(tis_weight_mean=tis_w, tis_capped_frac=capped)
        maxima["tis_weight_max"] = tis_w
    if cfg.uses_icepop:
        band = torch.exp(log_rho if cfg.icepop_level == "token" else seg.mean(log_rho))
        keep = torch.ones_like(band, dtype=torch.bool)
        if cfg.icepop_low is not None:
            keep &= band >= cfg.icepop_low
        if cfg.icepop_high is not None:
            keep &= band <= cfg.icepop_high
        factor = factor * keep
        indicators["icepop_masked_frac"] = ~keep
    return factor, indicators, maxima


# ----------------------------------------------------------------------------- the loss


def policy_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(partial loss, metric partials) for one micro-batch; see the module docstring."""
    inputs.check()
    loss_fn = get_policy_loss(cfg.policy_loss)
    if cfg.needs_rollout_logprobs and inputs.rollout_logprobs is None:
        raise ValueError(
            f"algo.loss.tis={cfg.tis!r} / algo.loss.icepop_* need rollout log-probs, "
            "but LossInputs.rollout_logprobs is None"
        )
    if cfg.kl_coef != 0.0 and inputs.ref_logprobs is None:
        raise ValueError(f"algo.loss.kl_coef={cfg.kl_coef!r} needs LossInputs.ref_logprobs (a reference policy)")
    if cfg.entropy_coef != 0.0 and inputs.entropy is None:
        raise ValueError(f"algo.loss.entropy_coef={cfg.entropy_coef!r} needs LossInputs.entropy")

    dtype = inputs.logprobs.dtype
    w = inputs.weights.detach().to(dtype)
    inputs = _detached(inputs)
    seg = Segments(inputs.segment_ids)
    pg, indicators = loss_fn(inputs, cfg, seg)
    maxima: dict[str, torch.Tensor] = {}
    if inputs.rollout_logprobs is not None:
        factor, more, maxima = _off_policy_correction(inputs, cfg, seg)
        pg = pg * factor.to(dtype)
        indicators = {**indicators, **more}

    loss = (w * pg).sum()
    metrics = {"pg_loss": loss.detach()}
    if inputs.ref_logprobs is not None:
        kl = kl_estimate(inputs.logprobs, inputs.ref_logprobs, cfg.kl_estimator)
        kl_sum = (w * kl).sum()
        metrics["kl"] = kl_sum.detach()
        if cfg.kl_coef != 0.0:
            loss = loss + cfg.kl_coef * kl_sum
    if inputs.entropy is not None:
        ent_sum = (w * inputs.entropy.to(dtype)).sum()
        metrics["entropy"] = ent_sum.detach()
        if cfg.entropy_coef != 0.0:
            loss = loss - cfg.entropy_coef * ent_sum  # a bonus: higher entropy, lower loss

    for name, ind in indicators.items():
        metrics[name] = (w * ind.detach().to(dtype)).sum()
    for name, values in maxima.items():
        metrics[name] = values.max().to(dtype) if values.numel() else torch.zeros((), dtype=dtype, device=w.device)
    metrics["loss_weight_sum"] = w.sum()
    metrics["num_tokens"] = torch.tensor(float(w.numel()), dtype=dtype, device=w.device)
    return loss, metrics


def _detached(inputs: LossInputs) -> LossInputs:
    """Everything but logprobs and entropy is a constant of the loss."""

    def d(t):
        return None if t is None else t.detach()

    return LossInputs(
        logprobs=inputs.logprobs,
        old_logprobs=inputs.old_logprobs.detach(),
        advantages=inputs.advantages.detach(),
        weights=inputs.weights.detach(),
        segment_ids=inputs.segment_ids,
        rollout_logprobs=d(inputs.rollout_logprobs),
        ref_logprobs=d(inputs.ref_logprobs),
        entropy=inputs.entropy,
    )


def combine_metric_partials(partials: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Mini-batch metrics from per-micro-batch partials: sum, or max for names ending in `_max`."""
    out: dict[str, torch.Tensor] = {}
    for part in partials:
        for name, value in part.items():
            if name not in out:
                out[name] = value.detach().clone()
            elif name.endswith("_max"):
                out[name] = torch.maximum(out[name], value.detach())
            else:
                out[name] = out[name] + value.detach()
    return out


# ----------------------------------------------------------------------------- config validation


def check_loss_compatibility(cfg: LossConfig, *, merge_steps: bool, estimator: str, multi_step: bool) -> list[str]:
    """Errors (empty if fine) for combinations that cannot be right; each names its config keys."""
    errors: list[str] = []
    if estimator not in list_estimators():
        known = ", ".join(list_estimators())
        errors.append(f"algo.estimator={estimator!r} is not a registered estimator; known: {known}")
    elif multi_step and is_temporal_estimator(estimator):
        errors.append(
            f"algo.estimator={estimator!r} is a temporal estimator and cannot train multi-step trajectories: "
            "step-wise training splits a trajectory into one sequence per turn with only an outcome reward; "
            "use grpo, dr_grpo, rloo or maxrl"
        )
    if not merge_steps:
        return errors
    why = "a merged row (several turns of one trajectory) counts as one sequence, so the loss would change with merging"
    if cfg.reduction not in MERGE_INVARIANT_REDUCTIONS:
        errors.append(
            f"algo.loss.reduction={cfg.reduction!r} cannot be combined with data.merge_steps=true: it counts rows "
            f"and {why}; use one of {', '.join(sorted(MERGE_INVARIANT_REDUCTIONS))} or set data.merge_steps=false"
        )
    if cfg.policy_loss in _POLICY_LOSSES.names() and _POLICY_LOSSES.lookup(cfg.policy_loss)[1]:
        errors.append(
            f"algo.loss.policy_loss={cfg.policy_loss!r} cannot be combined with data.merge_steps=true: its ratio is "
            f"per sequence and {why}; use ppo or cispo, or set data.merge_steps=false"
        )
    if cfg.tis == "sequence":
        errors.append(
            f"algo.loss.tis='sequence' cannot be combined with data.merge_steps=true: the importance ratio is per "
            f"sequence and {why}; use algo.loss.tis='token' or set data.merge_steps=false"
        )
    if cfg.uses_icepop and cfg.icepop_level == "sequence":
        errors.append(
            f"algo.loss.icepop_level='sequence' cannot be combined with data.merge_steps=true: {why}; "
            "use algo.loss.icepop_level='token' or set data.merge_steps=false"
        )
    return errors
