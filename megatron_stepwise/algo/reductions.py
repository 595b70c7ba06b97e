"""Loss reductions as per-token weights with a global denominator.

The mini-batch loss is `L = sum_t w_t * l_t`, where `w_t` already holds the reduction's
normaliser computed once on the whole mini-batch, so the partial sums of any micro-batch / DP
split add up to `L` exactly, with no per-micro-batch fix-ups. Reductions: `token_mean`,
`step_mean`, `trajectory_mean`, `prompt_mean`, `seq_mean_token_sum_norm` (Dr.GRPO).
`step_mean` and `seq_mean_token_sum_norm` count rows, so they are not merge-invariant and
`check_loss_compatibility` refuses them with merging.

Each reduction's weight formula and the merge argument: docs/megatron.md,
'Loss reductions as token weights'.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_stepwise.algo.rows import RowTable
from megatron_stepwise.steps import StepBatch

REDUCTIONS = ("token_mean", "step_mean", "trajectory_mean", "prompt_mean", "seq_mean_token_sum_norm")
MERGE_INVARIANT_REDUCTIONS = frozenset({"token_mean", "trajectory_mean", "prompt_mean"})


def loss_token_weights(batch: StepBatch, reduction: str, *, max_response_len: Optional[int] = None) -> torch.Tensor:
    """float32 [T] aligned with `batch.tokens`: the reduction's weight of each token (see module doc)."""
    denominators = row_denominators(RowTable.of(batch), reduction, max_response_len=max_response_len)
    return weights_from_denominators(batch, denominators)


def weights_from_denominators(batch: StepBatch, denominators: torch.Tensor) -> torch.Tensor:
    """float32 [T]: each trained token's mask over its row's denominator (`row_denominators`),
    0 elsewhere and on padding rows. The rows may be any part of a mini-batch whose
    denominators were computed over the whole of it."""
    # Work on trained positions only: in agent batches most tokens are prompt / observation.
    loss_mask = batch.token_fields["loss_mask"]
    pos = torch.nonzero(loss_mask, as_tuple=True)[0]
    row = torch.searchsorted(batch.offsets[1:], pos, right=True)
    keep = ~batch.row_fields["is_padding"][row]
    pos, row = pos[keep], row[keep]
    out = torch.zeros(loss_mask.numel(), dtype=torch.float32)
    out[pos] = (loss_mask[pos].to(torch.float64) / denominators[row]).to(torch.float32)
    return out


def row_denominators(rows: RowTable, reduction: str, *, max_response_len: Optional[int] = None) -> torch.Tensor:
    """float64 [rows]: what a trained token of each row is divided by (>= 1), from the rows'
    trained-token counts alone, so a rank holding part of the mini-batch weighs its tokens
    exactly as the whole would."""
    real = ~rows.is_padding
    trained = torch.where(real, rows.trained, 0).to(torch.float64)
    if reduction == "token_mean":
        return trained.sum().clamp(min=1.0).expand(rows.num_rows).clone()
    if reduction == "step_mean":
        return _mean_of_means(trained, torch.arange(rows.num_rows), rows.num_rows)
    if reduction == "trajectory_mean":
        return _mean_of_means(trained, rows.traj_index, _size(rows.traj_index))
    if reduction == "prompt_mean":
        return _mean_of_means(trained, rows.group_index, _size(rows.group_index))
    if reduction == "seq_mean_token_sum_norm":
        if max_response_len is None or max_response_len <= 0:
            raise ValueError(
                "algo.loss.reduction='seq_mean_token_sum_norm' needs a positive algo.loss.max_response_len "
                f"(Dr.GRPO's constant normaliser), got {max_response_len!r}"
            )
        return torch.full((rows.num_rows,), float(max_response_len) * max(int(real.sum()), 1), dtype=torch.float64)
    raise ValueError(f"algo.loss.reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")


def _size(ids: torch.Tensor) -> int:
    return int(ids.max()) + 1 if ids.numel() else 0


def _mean_of_means(trained: torch.Tensor, key: torch.Tensor, n_keys: int) -> torch.Tensor:
    """Token mean within each key, then the mean over keys that have a trained token: each
    row's denominator is its key's trained tokens times the number of such keys."""
    counts = torch.zeros(n_keys, dtype=trained.dtype).index_add_(0, key, trained)
    n_nonempty = int((counts > 0).sum())
    return (counts[key] * max(n_nonempty, 1)).clamp(min=1.0)
