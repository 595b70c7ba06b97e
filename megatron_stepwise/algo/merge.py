"""Prefix merge: fold consecutive steps of a trajectory into one training row.

Step i's prompt is the history as sent: built from the sampled ids in the agent loop's token
mode, where it always starts with `prompt[i-1] + response[i-1]`, or re-tokenised, where it
does when the tokeniser reproduces the sampled ids; the rest of it (`obs_delta`: the
observation and the chat-template glue) is what the environment added. Training on one row
`prompt[0] + response[0] + obs_delta[1] + response[1] + ...` gives every sampled token
exactly the context it had in its own step, so the loss and gradients are unchanged while
the shared history is computed once instead of once per turn (O(T^2) -> O(T) tokens).

Where re-tokenisation drifted (a BPE re-encoding the sampled text differently, templates
that rewrite earlier turns) the prefix check fails and a new row starts: merging never
changes what a token was conditioned on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_stepwise.step_structure import step_structure
from megatron_stepwise.steps import PREFIX_BREAK, UNKNOWN_EXPERT, Step

#: weight_versions value for obs_delta tokens: no policy produced them (loss_mask is 0 there).
NOT_SAMPLED_VERSION = -1
#: logprob_forwards / route_forwards value where no forward pass is known.
UNKNOWN_FORWARD = -1


@dataclass
class MergeStats:
    """Before/after counts over real rows (padding rows are passed through and not counted)."""

    rows_before: int
    rows_after: int
    tokens_before: int
    tokens_after: int
    trainable_tokens: int  # loss_mask = 1 tokens; the same before and after by construction
    padding_rows: int = 0
    broken_prefixes: int = 0  # consecutive steps that could not merge because the prefix differed

    @property
    def token_ratio(self) -> float:
        """tokens_before / tokens_after (how many times fewer tokens to compute)."""
        return self.tokens_before / self.tokens_after if self.tokens_after else 1.0


def merge_steps(steps: Sequence[Step], *, max_tokens: Optional[int] = None) -> tuple[list[Step], MergeStats]:
    """Greedily merge consecutive steps of each trajectory whose prefixes line up.

    The plugin API's entry, on a flat list: its trajectories are derived once (`step_structure`),
    then merged as `merge_trajectories` merges them.

    While `prompt[i-1] + response[i-1]` is a prefix of `prompt[i]`, the row grows by
    obs_delta (loss_mask 0, log-prob 0, weight version -1) then step i's response, mask,
    log-probs and weight versions; otherwise a new row starts. A merged row keeps the
    first step's prompt and the last merged step's reward, turn_reward, is_last_step, stop_reason and
    metadata, with `metadata["merged_steps"]` = how many steps it holds (1 if unmerged), and its
    first step's `metadata["prefix_break"]` (a gateway call that began a fresh prefix). Steps also do not merge when only one of them has rollout_logprobs or weight_versions
    (nothing is invented), or when the row would exceed `max_tokens`.
    `routed_experts` (MoE routing replay; they cover prompt and response) and their
    `route_forwards`: a position whose logits gave a step's sampled token (step i owns
    [len(prompt_i) - 1, len(prompt_i) + len(response_i) - 1)) takes that step's route, so each
    trained token's route and log-prob come from one forward pass; any other position takes the
    earliest merged step that reported it (the forward pass in which the engine first computed
    it); -1 (unknown) where no step reported it. `logprob_forwards` move with the responses.
    Padding steps pass through untouched. Input steps are not modified; output rows may
    share tensors with them. Expects a validated batch (`validate_steps`).

    Outcome advantages may be computed before or after merging: a merged row keeps its
    trajectory id and last-step reward, and scalar x merged loss_mask equals the merged
    per-step advantages (obs_delta positions are 0 either way). Turn-level advantages differ
    from turn to turn: compute them first and merge with `merge_with_advantages`.
    """
    rows, stats, _ = _merge(steps, _runs_of(steps), max_tokens)
    return [r for run in rows for r in run], stats


def merge_with_advantages(
    steps: Sequence[Step], advantages: Sequence[torch.Tensor], *, max_tokens: Optional[int] = None
) -> tuple[list[Step], list[torch.Tensor], MergeStats]:
    """`merge_steps`, carrying per-step response-aligned `advantages` along: a merged row's
    advantages are each turn's own at that turn's response positions, 0 at obs_delta."""
    if len(advantages) != len(steps):
        raise ValueError(f"merge_with_advantages: {len(advantages)} advantage tensors for {len(steps)} steps")
    rows, stats, members = _merge(steps, _runs_of(steps), max_tokens)
    flat = [r for run in rows for r in run]
    return flat, _carried(steps, flat, [m for run in members for m in run], advantages), stats


def merge_trajectories(
    trajectories: Sequence[Sequence[Step]],
    *,
    max_tokens: Optional[int] = None,
    advantages: Optional[Sequence[torch.Tensor]] = None,
) -> tuple[list[list[Step]], Optional[list[torch.Tensor]], MergeStats]:
    """`merge_steps` on trajectories that know their steps (a `RolloutGroup`'s): each trajectory's
    rows, the rows' advantages (`advantages`: per step, in the trajectories' order; carried as
    `merge_with_advantages` carries them; None without), and the stats. Nothing is re-derived.

    >>> from megatron_stepwise.steps import TrajectoryID
    >>> a, b = TrajectoryID("p", 0), TrajectoryID("p", 1)
    >>> turn0 = Step(a, [1, 2], [3], [1])
    >>> turn1 = Step(a, [1, 2, 3, 9], [4], [1], reward=1.0, is_last_step=True)  # 9: the observation
    >>> rows, _, stats = merge_trajectories([[turn0, turn1], [Step(b, [1, 2], [5], [1], is_last_step=True)]])
    >>> [r.response_ids.tolist() for r in rows[0]], rows[0][0].loss_mask.tolist(), stats.rows_after
    ([[3, 9, 4]], [1, 0, 1], 2)
    """
    steps = [s for t in trajectories for s in t]
    if advantages is not None and len(advantages) != len(steps):
        raise ValueError(f"merge_trajectories: {len(advantages)} advantage tensors for {len(steps)} steps")
    runs, start = [], 0
    for t in trajectories:
        runs.append(list(range(start, start + len(t))))
        start += len(t)
    rows, stats, members = _merge(steps, runs, max_tokens)
    if advantages is None:
        return rows, None, stats
    flat = [r for run in rows for r in run]
    return rows, _carried(steps, flat, [m for run in members for m in run], advantages), stats


def _runs_of(steps: Sequence[Step]) -> list[list[int]]:
    """A flat list's runs of consecutive steps of one trajectory (its `step_structure`); a padding
    step is a run of its own."""
    traj_of_step = step_structure(steps).traj_of_step
    runs: list[list[int]] = []
    for i, step in enumerate(steps):
        if runs and not (step.is_padding or steps[i - 1].is_padding) and traj_of_step[i - 1] == traj_of_step[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _merge(
    steps: Sequence[Step], runs: Sequence[Sequence[int]], max_tokens: Optional[int]
) -> tuple[list[list[Step]], MergeStats, list[list[list[int]]]]:
    """Each run's merged rows (a run: one trajectory's consecutive step indices, or one padding
    step, passed through), the stats, and each row's input step indices."""
    stats = MergeStats(0, 0, 0, 0, 0)
    rows: list[list[Step]] = []
    members: list[list[list[int]]] = []
    for run in runs:
        if len(run) == 1 and steps[run[0]].is_padding:
            stats.padding_rows += 1
            out, idx_of = [steps[run[0]]], [list(run)]
        else:
            out, idx_of = _merge_run(steps, run, max_tokens, stats)
        rows.append(out)
        members.append(idx_of)
    return rows, stats, members


def _merge_run(
    steps: Sequence[Step], run: Sequence[int], max_tokens: Optional[int], stats: MergeStats
) -> tuple[list[Step], list[list[int]]]:
    """One trajectory's consecutive steps as merged rows, and each row's step indices."""
    out: list[Step] = []
    idx_of: list[list[int]] = []
    group: list[Step] = []  # steps of the row being built
    idx: list[int] = []
    for i in run:
        step = steps[i]
        stats.rows_before += 1
        stats.tokens_before += step.num_tokens
        if group and not _can_extend(group, step, max_tokens, stats):
            _flush(group, out, idx, idx_of)
        group.append(step)
        idx.append(i)
    _flush(group, out, idx, idx_of)
    for row in out:
        stats.rows_after += 1
        stats.tokens_after += row.num_tokens
        stats.trainable_tokens += row.num_trainable  # equals the input's: masks are copied, never changed
    return out, idx_of


def _carried(
    steps: Sequence[Step], rows: Sequence[Step], members: Sequence[list[int]], advantages: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Each merged row's advantages: each turn's own at its response positions, 0 at obs_delta."""
    merged: list[torch.Tensor] = []
    for row, idx in zip(rows, members):
        if len(idx) == 1:
            merged.append(advantages[idx[0]])
            continue
        values = torch.zeros(row.response_ids.numel(), dtype=advantages[idx[0]].dtype)
        start = row.prompt_ids.numel()
        for i in idx:  # where each step's response lands in the merged response (as in _merge_group)
            a = steps[i].prompt_ids.numel() - start
            values[a : a + steps[i].response_ids.numel()] = advantages[i]
        merged.append(values)
    return merged


def _can_extend(group: list[Step], step: Step, max_tokens: Optional[int], stats: MergeStats) -> bool:
    prev = group[-1]
    if (prev.rollout_logprobs is None) != (step.rollout_logprobs is None):
        return False
    if (prev.weight_versions is None) != (step.weight_versions is None):
        return False
    # The merged row would be exactly prompt[i] + response[i], starting at group[0]'s prompt.
    if max_tokens is not None and step.num_tokens > max_tokens:
        return False
    if not _is_continuation(prev, step):
        stats.broken_prefixes += 1
        return False
    return True


def _is_continuation(prev: Step, step: Step) -> bool:
    """`prev.prompt + prev.response` is a prefix of `step.prompt` (tensor comparisons only)."""
    p, r = prev.prompt_ids.numel(), prev.response_ids.numel()
    nxt = step.prompt_ids
    if nxt.numel() < p + r:
        return False
    return torch.equal(nxt[:p], prev.prompt_ids) and torch.equal(nxt[p : p + r], prev.response_ids)


def _flush(group: list[Step], out: list[Step], idx: list[int], members: list[list[int]]) -> None:
    if not group:
        return
    members.append(list(idx))
    idx.clear()
    if len(group) == 1:
        s = group[0]
        out.append(dataclasses.replace(s, metadata={**s.metadata, "merged_steps": 1}))
    else:
        out.append(_merge_group(group))
    group.clear()


def _merge_group(group: list[Step]) -> Step:
    first, last = group[0], group[-1]
    start = first.prompt_ids.numel()
    # By the prefix checks, the merged row's tokens are exactly last.prompt + last.response.
    response_ids = torch.cat([last.prompt_ids[start:], last.response_ids])
    n = response_ids.numel()

    # Where each step's response lands inside the merged response; the rest is obs_delta.
    resp_starts = [s.prompt_ids.numel() - start for s in group]
    loss_mask = torch.zeros(n, dtype=torch.long)
    logprobs = None if first.rollout_logprobs is None else torch.zeros(n, dtype=torch.float32)
    versions = None if first.weight_versions is None else torch.full((n,), NOT_SAMPLED_VERSION, dtype=torch.long)
    teacher = None
    if all(s.teacher_logprobs is not None for s in group):
        teacher = torch.zeros(n, dtype=torch.float32)
    forwards = None
    if any(s.logprob_forwards is not None for s in group):
        forwards = torch.full((n,), UNKNOWN_FORWARD, dtype=torch.long)
    for s, a in zip(group, resp_starts):
        b = a + s.response_ids.numel()
        loss_mask[a:b] = s.loss_mask
        if logprobs is not None:
            logprobs[a:b] = s.rollout_logprobs
        if versions is not None:
            versions[a:b] = s.weight_versions
        if teacher is not None:
            teacher[a:b] = s.teacher_logprobs
        if forwards is not None and s.logprob_forwards is not None:
            forwards[a:b] = s.logprob_forwards

    return Step(
        routed_experts=_merge_positions(group, "routed_experts", start + n),
        route_forwards=_merge_positions(group, "route_forwards", start + n),
        logprob_forwards=forwards,
        trajectory_id=first.trajectory_id,
        prompt_ids=first.prompt_ids,
        response_ids=response_ids,
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        reward=last.reward,
        is_last_step=last.is_last_step,
        turn_reward=last.turn_reward,
        stop_reason=last.stop_reason,
        weight_versions=versions,
        teacher_logprobs=teacher,
        metadata=_merged_metadata(group),
    )


def _merged_metadata(group: list[Step]) -> dict:
    """The last step's metadata and how many steps the row holds; a row starts where its first
    step starts, so it began a fresh prefix (a gateway prefix break) when its first step did."""
    metadata = {**group[-1].metadata, "merged_steps": len(group)}
    if PREFIX_BREAK in group[0].metadata:
        metadata[PREFIX_BREAK] = group[0].metadata[PREFIX_BREAK]
    return metadata


def _merge_positions(group: list[Step], name: str, num_tokens: int) -> Optional[torch.Tensor]:
    """The merged row's `name` (routed_experts or route_forwards, one entry per position): where
    a step's sampled tokens were computed from (the positions it owns), that step's; elsewhere
    the earliest step's that is known; unknown (-1) where none is."""
    carried = [(s, getattr(s, name)) for s in group if getattr(s, name) is not None]
    if not carried:
        return None
    first = carried[0][1]
    out = torch.full((num_tokens, *first.shape[1:]), UNKNOWN_EXPERT, dtype=first.dtype)

    def known(values: torch.Tensor) -> torch.Tensor:
        return (values >= 0).reshape(values.size(0), -1).all(-1)

    for _, values in reversed(carried):  # later steps first: earlier ones overwrite where they know
        ok = known(values)
        out[: values.size(0)][ok] = values[ok]
    for s, values in carried:  # each step's own positions: the forward its log-probs came from
        lo = max(s.prompt_ids.numel() - 1, 0)
        hi = min(s.num_tokens - 1, values.size(0))
        if hi > lo:
            ok = known(values[lo:hi])
            out[lo:hi][ok] = values[lo:hi][ok]
    return out
