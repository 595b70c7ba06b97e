"""One mini-batch of validated steps -> the `StepBatch` the plugin trains on.

Both mini-batch sources (the synchronous rollout and the async group buffer) hand every
mini-batch to `prepare`, and so do the demo and the host-pipeline benchmarks, so what they
measure is what runs. A mini-batch holds whole prompt groups, so merging and the (group-wise)
advantages give the same result whether one prepares a mini-batch or the iteration.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from megatron_stepwise.algo.advantages import compute_advantages
from megatron_stepwise.algo.merge import merge_with_advantages
from megatron_stepwise.steps import Step, StepBatch


@dataclass(frozen=True)
class PrepareOptions:
    """What `prepare` needs from the experiment config (`algo.estimator*`, `data.merge_steps`)."""

    estimator: str = "grpo"
    estimator_options: Mapping[str, Any] = field(default_factory=dict)
    merge_steps: bool = False
    max_tokens: Optional[int] = None  # a merged row never outgrows the micro-batch budget

    @classmethod
    def from_config(cls, cfg) -> "PrepareOptions":
        return cls(
            cfg.algo.estimator,
            dict(cfg.algo.estimator_options),
            cfg.data.merge_steps,
            cfg.data.max_tokens_per_microbatch,
        )


def prepare(
    steps: Sequence[Step], options: PrepareOptions = PrepareOptions(), *, keep_metadata: bool = False
) -> tuple[Optional[StepBatch], dict]:
    """Advantages, merge (optionally, carrying each turn's advantage), columnar batch with the
    `advantages` field.

    `steps` are one mini-batch (whole prompt groups), already validated by the source that
    produced them. Returns (None, metrics) when no step has a trained token (e.g. every
    trajectory hit the context limit on its first prompt). Metrics are counts, so the metrics
    of several mini-batches add up (`add_counts`). `keep_metadata`: the batch keeps each row's
    step metadata (for a rollout dump).
    """
    batch, metrics = prepare_rows(steps, options, keep_metadata=keep_metadata)
    if not bool((batch.token_fields["loss_mask"] != 0).any()):
        return None, metrics
    return batch, metrics


def prepare_rows(
    steps: Sequence[Step], options: PrepareOptions = PrepareOptions(), *, keep_metadata: bool = False
) -> tuple[StepBatch, dict]:
    """`prepare`, keeping a batch with no trained token: whole groups prepared one at a time
    (an agent worker prepares each group it made) concatenate to the mini-batch's batch."""
    steps = untrained_if_invalid(steps)
    metrics: dict[str, Any] = {
        "batch/rows_before_merge": len(steps),
        "batch/tokens_before_merge": sum(s.num_tokens for s in steps),
    }
    counts: dict[str, Any] = {}
    # Before merging: turn-level estimators give each turn its own advantage.
    advantages = compute_advantages(steps, options.estimator, metrics=counts, **options.estimator_options)
    metrics.update({f"advantages/{k}": v for k, v in counts.items()})
    if options.merge_steps:
        steps, advantages, stats = merge_with_advantages(steps, advantages, max_tokens=options.max_tokens)
        metrics["batch/rows_after_merge"] = stats.rows_after
        metrics["batch/tokens_after_merge"] = stats.tokens_after
        metrics["batch/broken_prefixes"] = stats.broken_prefixes  # steps that drifted from their history
    batch = StepBatch.from_steps(steps, keep_metadata=keep_metadata)
    batch.set_response_field("advantages", advantages)
    return batch, metrics


def untrained_if_invalid(steps: Sequence[Step]) -> list[Step]:
    """The steps, those of invalid trajectories (`Step.invalid_reason`) with no trained token: their
    rows stay where the mini-batch plan put them (and in dumps), but nothing of them is learned."""
    invalid = {s.trajectory_id for s in steps if s.is_last_step and s.invalid_reason is not None}
    if not invalid:
        return list(steps)
    return [
        dataclasses.replace(s, loss_mask=torch.zeros_like(s.loss_mask)) if s.trajectory_id in invalid else s
        for s in steps
    ]


def add_counts(items: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum count metrics over mini-batches (the keys `prepare` returns)."""
    total: Counter = Counter()
    for item in items:
        total.update(item)
    return dict(total)
