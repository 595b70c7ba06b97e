"""Whole prompt groups -> the `StepBatch` the plugin trains on: advantages, merge, columnar batch.

Every caller hands `prepare` groups: the mini-batch sources (a synchronous mini-batch, an async
step's groups), an agent worker holding one group's rows (`prepare_rows`), the demo and the
host-pipeline benchmarks, so what they measure is what runs. A group already knows its
trajectories, so nothing here re-derives them from a flat step list, and merging and the
(group-wise) advantages give the same result whether one prepares a mini-batch or each group.
The settings are plain keyword arguments; the trainer binds them from `algo.estimator`,
`algo.estimator_options`, `algo.opd_coef` (`distill_coef`), `data.merge_steps` and `data.max_tokens_per_microbatch`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from megatron_stepwise.algo.advantages import group_advantages
from megatron_stepwise.algo.distill import OPD, opd_coef, with_distillation
from megatron_stepwise.algo.groups import RolloutGroup, flat_steps
from megatron_stepwise.algo.merge import merge_trajectories
from megatron_stepwise.steps import StepBatch


def prepare(
    groups: Sequence[RolloutGroup],
    *,
    estimator: str = "grpo",
    estimator_options: Optional[Mapping[str, Any]] = None,
    distill_coef: Optional[float] = None,
    merge_steps: bool = False,
    max_tokens: Optional[int] = None,
    keep_metadata: bool = False,
) -> tuple[Optional[StepBatch], dict]:
    """Advantages, merge (optionally, carrying each turn's advantage; a merged row never outgrows
    `max_tokens`), columnar batch with the `advantages` field.

    `groups` are one mini-batch, already validated by the source that produced them. Returns
    (None, metrics) when no step has a trained token (e.g. every trajectory hit the context
    limit on its first prompt). Metrics are counts, so the metrics of several mini-batches add
    up (`add_counts`). `keep_metadata`: the batch keeps each row's step metadata (for a dump).
    """
    batch, metrics = prepare_rows(
        groups,
        estimator=estimator,
        estimator_options=estimator_options,
        distill_coef=distill_coef,
        merge_steps=merge_steps,
        max_tokens=max_tokens,
        keep_metadata=keep_metadata,
    )
    if not bool((batch.token_fields["loss_mask"] != 0).any()):
        return None, metrics
    return batch, metrics


def prepare_rows(
    groups: Sequence[RolloutGroup],
    *,
    estimator: str = "grpo",
    estimator_options: Optional[Mapping[str, Any]] = None,
    distill_coef: Optional[float] = None,
    merge_steps: bool = False,
    max_tokens: Optional[int] = None,
    keep_metadata: bool = False,
) -> tuple[StepBatch, dict]:
    """`prepare`, keeping a batch with no trained token: whole groups prepared one at a time
    (an agent worker prepares each group it made) concatenate to the mini-batch's batch."""
    groups = [untrained_if_invalid(g) for g in groups]
    trajectories = [t for g in groups for t in g.trajectories]
    metrics: dict[str, Any] = {
        "batch/rows_before_merge": sum(len(t) for t in trajectories),
        "batch/tokens_before_merge": sum(s.num_tokens for t in trajectories for s in t),
    }
    counts: dict[str, Any] = {}
    # Before merging: turn-level estimators give each turn its own advantage.
    advantages = group_advantages(groups, estimator, metrics=counts, **dict(estimator_options or {}))
    coef = opd_coef(estimator, distill_coef)
    if coef:  # on-policy distillation: the teacher's per-token term, alone or added (algo/distill.py)
        advantages = with_distillation(flat_steps(groups), advantages, coef, metrics, alone=estimator == OPD)
    metrics.update({f"advantages/{k}": v for k, v in counts.items()})
    if merge_steps:
        trajectories, advantages, stats = merge_trajectories(trajectories, max_tokens=max_tokens, advantages=advantages)
        metrics["batch/rows_after_merge"] = stats.rows_after
        metrics["batch/tokens_after_merge"] = stats.tokens_after
        metrics["batch/broken_prefixes"] = stats.broken_prefixes  # steps that drifted from their history
    by_group, start = [], 0
    for g in groups:  # each group's (merged) trajectories
        by_group.append(trajectories[start : start + len(g.trajectories)])
        start += len(g.trajectories)
    batch = StepBatch.from_groups(by_group, keep_metadata=keep_metadata)
    batch.set_response_field("advantages", advantages)
    return batch, metrics


def untrained_if_invalid(group: RolloutGroup) -> RolloutGroup:
    """The group, its invalid trajectories (`Step.invalid_reason`) with no trained token: their
    rows stay where the mini-batch plan put them (and in dumps), but nothing of them is learned."""
    if all(bad is None for bad in group.invalid):
        return group
    untrained = lambda s: dataclasses.replace(s, loss_mask=torch.zeros_like(s.loss_mask))  # noqa: E731
    trajectories = [
        t if bad is None else [untrained(s) for s in t] for t, bad in zip(group.trajectories, group.invalid)
    ]
    return RolloutGroup.checked(group.prompt_id, trajectories)


def add_counts(items: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum count metrics over mini-batches (the keys `prepare` returns)."""
    total: Counter = Counter()
    for item in items:
        total.update(item)
    return dict(total)
