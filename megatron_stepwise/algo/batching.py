"""Batch shaping for step-wise training: DP padding and prompt-based mini-batches.

The trainer's pipeline for one iteration is

    validate_steps -> prompt_minibatches
        -> per mini-batch: groups_of, then compute advantages and merge (algo/prepare.py) -> plan_microbatches

`pad_for_data_parallel` is for loops that shard rows over DP ranks themselves.

`validate_steps` lives in `validate.py` and `plan_microbatches` in `planner.py` (the whole
pipeline is importable from the package root, `megatron_stepwise`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_stepwise.step_structure import step_structure
from megatron_stepwise.steps import PAD_PROMPT_PREFIX, Step, StepwiseBatchError, make_padding_step


def next_padding_index(steps: Sequence[Step]) -> int:
    """One past the largest `__pad__<n>` index already present (0 if none)."""
    largest = -1
    for s in steps:
        pid = s.trajectory_id.prompt_id
        if pid.startswith(PAD_PROMPT_PREFIX):
            suffix = pid[len(PAD_PROMPT_PREFIX) :]
            if suffix.isdigit():
                largest = max(largest, int(suffix))
    return largest + 1


def pad_for_data_parallel(steps: Sequence[Step], dp_size: int, *, first_index: Optional[int] = None) -> list[Step]:
    """Append the fewest padding steps that make `len(steps)` a multiple of `dp_size`.

    Padding steps (see `make_padding_step`) are loss-neutral: loss_mask all 0,
    is_last_step True, a one-step trajectory of their own whose prompt_id starts with
    `__pad__`. Their indices continue after any padding already in `steps`, so padding a
    batch that already holds padded pieces keeps every id unique. When padding pieces
    separately that will be concatenated later, pass distinct `first_index` values.

    The trainer and the plugin do not need it: the micro-batch planner balances any number of
    rows over the DP ranks and gives a rank without rows a loss-neutral empty micro-batch. It
    is for loops that shard rows over DP ranks themselves.
    """
    if int(dp_size) < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    missing = -len(steps) % dp_size
    start = next_padding_index(steps) if first_index is None else int(first_index)
    return list(steps) + [make_padding_step(start + k) for k in range(missing)]


def prompt_minibatches(steps: Sequence[Step], prompts_per_minibatch: int) -> list[list[Step]]:
    """Split into contiguous mini-batches of all steps of exactly `prompts_per_minibatch` prompts.

    Each mini-batch is one optimizer step downstream, so the number of optimizer steps
    never depends on how many turns the trajectories took. Padding steps do not count as
    prompts; they stay with the mini-batch they sit in (trailing ones join the last).
    Prompt groups must be contiguous (see `validate_steps`).
    """
    k = int(prompts_per_minibatch)
    if k < 1:
        raise ValueError(f"prompts_per_minibatch must be >= 1, got {prompts_per_minibatch}")
    # Index of the first step of every real prompt group, in order. Group ids count up in order
    # of first appearance, so a group seen before that comes back has a smaller id.
    starts: list[int] = []
    current = -1
    for i, (s, g) in enumerate(zip(steps, step_structure(steps).group_of_step)):
        if s.is_padding or g == current:
            continue
        if g < current:
            raise StepwiseBatchError(
                f"step {i} (trajectory {s.trajectory_id}): field 'trajectory_id' prompt group "
                f"{s.trajectory_id.prompt_id!r} reappears after other prompts (a prompt's trajectories must be contiguous)"
            )
        starts.append(i)
        current = g
    if not steps:
        return []
    if not starts:
        raise StepwiseBatchError(f"the batch has {len(steps)} steps but no real prompt (only padding)")
    if len(starts) % k:
        raise StepwiseBatchError(
            f"the batch has {len(starts)} prompts, which is not a multiple of prompts_per_minibatch={k}"
        )
    # Cut before the first step of prompts k, 2k, ...; the first piece also takes leading padding.
    cuts = [0] + starts[k::k] + [len(steps)]
    return [list(steps[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
