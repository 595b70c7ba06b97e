"""On-policy distillation: the teacher's verdict on each token the policy sampled.

The policy samples, a teacher scores the policy's own tokens (`Step.teacher_logprobs`, on exactly
the context the policy saw, at the rollout temperature), and each trained token's advantage is

    opd_coef * (teacher log-prob - rollout log-prob)

the negative of a one-sample estimate of the per-token reverse KL(policy || teacher): a token the
teacher finds likelier than the policy did is pushed up. Both log-probs are data (no gradient
through either); the policy loss then treats the advantage as any other. `algo.estimator: opd`
trains on it alone; `algo.opd_coef` > 0 with any other estimator adds it to that estimator's
advantage. Pitfalls and how each is avoided: docs/distill.md.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_stepwise.algo.advantages import register_estimator
from megatron_stepwise.steps import Step, StepwiseBatchError

OPD = "opd"

# Count metrics of `prepare` (they add up over mini-batches); `distill_means` turns them into means.
TOKENS, KL_SUM, OPD_ABS, TOTAL_ABS = (
    "distill/tokens",
    "distill/reverse_kl_sum",
    "distill/opd_abs_sum",
    "distill/advantage_abs_sum",
)


def opd_coef(estimator: str, coef: Optional[float]) -> float:
    """The weight of the distillation term: `algo.opd_coef`, else 1 with `algo.estimator: opd`, else 0."""
    if coef is not None:
        return float(coef)
    return 1.0 if estimator == OPD else 0.0


def token_advantages(steps: Sequence[Step]) -> list[torch.Tensor]:
    """teacher log-prob - rollout log-prob on each step's trained tokens (0 elsewhere), float32.

    A trained step without either log-prob is an error naming the step and the field: a zero
    would train the token as if teacher and policy agreed."""
    out = []
    for i, s in enumerate(steps):
        mask = s.loss_mask.to(torch.float32)
        if s.is_padding or not bool(mask.any()):
            out.append(torch.zeros_like(mask))
            continue
        for field in ("teacher_logprobs", "rollout_logprobs"):
            if getattr(s, field) is None:
                raise StepwiseBatchError(
                    f"step {i} ({s.trajectory_id}): field {field!r} is missing, and on-policy distillation "
                    f"needs it on every trained token ({_why(field)})"
                )
        out.append((s.teacher_logprobs - s.rollout_logprobs) * mask)
    return out


def _why(field: str) -> str:
    if field == "teacher_logprobs":
        return "set a teacher: section, whose engines score every trained step"
    return "the engine reported no log-probs"


@register_estimator(OPD, token=True)
def opd(steps: Sequence[Step], *, eps: float, **_) -> list[torch.Tensor]:
    """`algo.estimator: opd`: the distillation advantage alone (no reward, no group baseline)."""
    return token_advantages(steps)


def with_distillation(
    steps: Sequence[Step], advantages: list[torch.Tensor], coef: float, metrics: Optional[dict] = None, *, alone: bool
) -> list[torch.Tensor]:
    """`advantages` (one tensor per step, an estimator's) with the distillation term: replaced by
    coef x it (`alone`: the estimator was `opd`), else coef x it added. `metrics` gets the counts."""
    terms = token_advantages(steps)
    total = [coef * t if alone else a + coef * t for a, t in zip(advantages, terms)]
    if metrics is not None:
        trained = [s.loss_mask.bool() & ~torch.tensor(s.is_padding) for s in steps]
        metrics[TOKENS] = metrics.get(TOKENS, 0) + sum(int(m.sum()) for m in trained)
        metrics[KL_SUM] = metrics.get(KL_SUM, 0.0) + sum(float(-t[m].sum()) for t, m in zip(terms, trained))
        metrics[OPD_ABS] = metrics.get(OPD_ABS, 0.0) + sum(
            float((coef * t[m]).abs().sum()) for t, m in zip(terms, trained)
        )
        metrics[TOTAL_ABS] = metrics.get(TOTAL_ABS, 0.0) + sum(float(a[m].abs().sum()) for a, m in zip(total, trained))
    return total


def distill_means(metrics: dict) -> dict:
    """The iteration's distillation metrics from the summed counts: the mean per-token reverse KL
    (rollout minus teacher log-prob over trained tokens) and the distillation term's share of
    the advantage (its summed magnitude over the whole advantage's)."""
    tokens = metrics.get(TOKENS)
    if not tokens:
        return {}
    total = metrics.get(TOTAL_ABS, 0.0)
    return {
        "distill/reverse_kl": metrics[KL_SUM] / tokens,
        "distill/advantage_share": metrics[OPD_ABS] / total if total else 1.0,
    }
