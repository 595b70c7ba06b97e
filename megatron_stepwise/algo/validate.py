"""Reject malformed step-wise batches before they reach advantages or the loss.

Every error names the step index, its trajectory and the field, because the batch usually
comes from a rollout fleet far away from the training code that trips over it.

Cost: one Python pass over the steps (a handful of integer comparisons each), one
min/max reduction per prompt tensor, and one reduction per field over the concatenated
responses of each chunk of steps. No Python loop ever touches a token.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_stepwise.steps import Step, StepwiseBatchError


def _where(i: int, step: Step) -> str:
    return f"step {i} (trajectory {step.trajectory_id})"


def _fail(i: int, step: Step, field: str, problem: str) -> StepwiseBatchError:
    return StepwiseBatchError(f"{_where(i, step)}: field {field!r} {problem}")


def validate_steps(steps: Sequence[Step], *, vocab_size: Optional[int] = None) -> None:
    """Raise `StepwiseBatchError` on the first problem found in a list of steps.

    Checks, per step: response_ids / loss_mask / rollout_logprobs / weight_versions /
    logprob_forwards have the same length; routed_experts and route_forwards (when present) have
    one row per prompt + response token;
    loss_mask holds only 0 and 1; an empty response has no trainable
    entry; rollout_logprobs and reward are finite; token ids are >= 0 and, when
    `vocab_size` is given, < vocab_size. Across steps: the steps of a trajectory are
    contiguous and exactly its final row has is_last_step; the trajectories of a prompt
    group (same prompt_id) are contiguous.
    """
    if vocab_size is not None and int(vocab_size) <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    _check_structure(steps)
    _check_token_values(steps, vocab_size)


def _check_structure(steps: Sequence[Step]) -> None:
    finished_trajs: set = set()
    finished_prompts: set = set()
    n = len(steps)
    for i, s in enumerate(steps):
        if not isinstance(s, Step):
            raise StepwiseBatchError(f"step {i}: expected a Step, got {type(s).__name__}")
        _check_lengths(i, s)
        if not math.isfinite(s.reward):
            raise _fail(i, s, "reward", f"is {s.reward} (must be finite)")

        tid = s.trajectory_id
        prev = steps[i - 1] if i > 0 else None
        if prev is not None and prev.trajectory_id == tid:
            if prev.is_last_step:
                raise _last_step_not_final(steps, i - 1)
            continue
        # Step i starts a trajectory: the previous one must have ended properly.
        if prev is not None:
            if not prev.is_last_step:
                raise _fail(
                    i - 1,
                    prev,
                    "is_last_step",
                    f"is False on the trajectory's final row (step {i} starts trajectory {tid})",
                )
            finished_trajs.add(prev.trajectory_id)
        if tid in finished_trajs:
            raise _fail(
                i, s, "trajectory_id", "reappears after other trajectories (a trajectory's steps must be contiguous)"
            )
        pid = tid.prompt_id
        if prev is not None and prev.trajectory_id.prompt_id != pid:
            finished_prompts.add(prev.trajectory_id.prompt_id)
            if pid in finished_prompts:
                raise _fail(
                    i,
                    s,
                    "trajectory_id",
                    f"prompt group {pid!r} reappears after other prompts (a prompt's trajectories must be contiguous)",
                )
    if n and not steps[-1].is_last_step:
        raise _fail(n - 1, steps[-1], "is_last_step", "is False on the trajectory's final row (end of batch)")


def _last_step_not_final(steps: Sequence[Step], i: int) -> StepwiseBatchError:
    tid = steps[i].trajectory_id
    j = i + 1
    while j < len(steps) and steps[j].trajectory_id == tid:
        if steps[j].is_last_step:
            return _fail(
                i, steps[i], "is_last_step", f"is True here and again at step {j}: the trajectory has two last steps"
            )
        j += 1
    return _fail(
        i,
        steps[i],
        "is_last_step",
        f"is True but step {i + 1} continues the trajectory (the last step must be its final row)",
    )


def _check_lengths(i: int, s: Step) -> None:
    n = s.response_ids.numel()
    m = s.loss_mask.numel()
    if m != n:
        if n == 0 and bool((s.loss_mask == 1).any()):
            raise _fail(
                i, s, "loss_mask", f"has {int((s.loss_mask == 1).sum())} entries equal to 1 but response_ids is empty"
            )
        raise _fail(i, s, "loss_mask", f"has length {m} but response_ids has length {n}")
    for field in ("rollout_logprobs", "weight_versions", "logprob_forwards", "teacher_logprobs"):
        value = getattr(s, field)
        if value is not None and value.numel() != n:
            raise _fail(i, s, field, f"has length {value.numel()} but response_ids has length {n}")
    if s.routed_experts is not None and s.routed_experts.size(0) != s.num_tokens:
        raise _fail(
            i,
            s,
            "routed_experts",
            f"has {s.routed_experts.size(0)} positions but the step has {s.num_tokens} tokens (prompt + response)",
        )
    if s.route_forwards is not None and s.route_forwards.numel() != s.num_tokens:
        raise _fail(
            i,
            s,
            "route_forwards",
            f"has {s.route_forwards.numel()} positions but the step has {s.num_tokens} tokens (prompt + response)",
        )


# Response-side fields are checked over the concatenation of this many steps at a time:
# one reduction per chunk, and chunks small enough (~2 MB) for the allocator to recycle.
_CHUNK = 1024


def _check_token_values(steps: Sequence[Step], vocab_size: Optional[int]) -> None:
    # Prompts are long (they hold the whole history), so each is reduced where it lies
    # instead of being copied; responses and their per-token fields are short.
    for i, s in enumerate(steps):
        if s.prompt_ids.numel():
            lo, hi = s.prompt_ids.aminmax()
            _check_id_range(i, s, "prompt_ids", s.prompt_ids, int(lo), int(hi), vocab_size)
    for first in range(0, len(steps), _CHUNK):
        _check_response_chunk(steps, first, min(first + _CHUNK, len(steps)), vocab_size)


def _check_response_chunk(steps: Sequence[Step], first: int, end: int, vocab_size: Optional[int]) -> None:
    chunk = steps[first:end]
    if not any(s.response_ids.numel() for s in chunk):
        return

    def first_bad_step(bad: torch.Tensor) -> tuple[int, int]:
        lens = np.fromiter((s.response_ids.numel() for s in chunk), dtype=np.int64, count=len(chunk))
        offsets = np.concatenate([[0], np.cumsum(lens)])
        pos = int(bad.nonzero()[0])
        row = int(np.searchsorted(offsets, pos, side="right") - 1)
        return first + row, pos - int(offsets[row])

    ids = torch.cat([s.response_ids for s in chunk])
    lo, hi = (int(v) for v in ids.aminmax())
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        row, _ = first_bad_step((ids < 0) if lo < 0 else (ids >= vocab_size))
        r = steps[row].response_ids
        _check_id_range(row, steps[row], "response_ids", r, *(int(v) for v in r.aminmax()), vocab_size)

    mask = torch.cat([s.loss_mask for s in chunk])
    lo, hi = (int(v) for v in mask.aminmax())
    if lo < 0 or hi > 1:
        row, k = first_bad_step((mask != 0) & (mask != 1))
        value = int(steps[row].loss_mask[k])
        raise _fail(row, steps[row], "loss_mask", f"has value {value} at position {k} (only 0 and 1 are allowed)")

    with_lp = [s.rollout_logprobs for s in chunk if s.rollout_logprobs is not None]
    # A finite sum is a cheap proof that every entry is finite (inf and nan propagate).
    if with_lp and not math.isfinite(float(torch.cat(with_lp).sum())):
        for i in range(first, end):
            lp = steps[i].rollout_logprobs
            if lp is not None and not bool(torch.isfinite(lp).all()):
                k = int((~torch.isfinite(lp)).nonzero()[0])
                raise _fail(i, steps[i], "rollout_logprobs", f"has non-finite value {float(lp[k])} at position {k}")


def _check_id_range(
    i: int, s: Step, field: str, ids: torch.Tensor, lo: int, hi: int, vocab_size: Optional[int]
) -> None:
    if lo < 0:
        k = int((ids < 0).nonzero()[0])
        raise _fail(i, s, field, f"has negative token id {int(ids[k])} at position {k}")
    if vocab_size is not None and hi >= vocab_size:
        k = int((ids >= vocab_size).nonzero()[0])
        raise _fail(
            i, s, field, f"has token id {int(ids[k])} at position {k}, outside the vocabulary (size {vocab_size})"
        )
