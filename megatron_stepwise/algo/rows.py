"""What the trainer needs to know of a mini-batch's rows to decide it, without their tokens.

A `RowTable` holds, per row: its length, its trained tokens, how many of those have an engine
log-prob, its trajectory and group (dense ids within the mini-batch) and whether it is padding.
Planning micro-batches, the loss reductions' denominators and the rollout log-prob checks read
only these, so the process that decides a mini-batch (the trainer's rank 0) never needs the
token data: the agent workers that hold a group's rows send its table, and each data-parallel
rank fetches only the rows it trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_stepwise.steps import StepBatch


@dataclass
class RowTable:
    lengths: torch.Tensor  # long [rows]: prompt + response tokens
    trained: torch.Tensor  # long [rows]: sum of the loss mask
    trained_known: torch.Tensor  # long [rows]: trained tokens with an engine log-prob
    traj_index: torch.Tensor  # long [rows]
    group_index: torch.Tensor  # long [rows]
    is_padding: torch.Tensor  # bool [rows]
    trajectory_ids: list  # TrajectoryID per row, for error messages

    @property
    def num_rows(self) -> int:
        return int(self.lengths.numel())

    @classmethod
    def of(cls, batch: StepBatch) -> "RowTable":
        row = batch.row_of_token()
        mask = batch.token_fields["loss_mask"]
        known = batch.rollout_logprobs_known() & (mask != 0)
        per_row = lambda values: torch.zeros(batch.num_rows, dtype=torch.long).index_add_(0, row, values.long())
        return cls(
            batch.lengths.clone(),
            per_row(mask),
            per_row(known),
            batch.row_fields["traj_index"].clone(),
            batch.row_fields["group_index"].clone(),
            batch.row_fields["is_padding"].clone(),
            list(batch.trajectory_ids),
        )

    @classmethod
    def concat(cls, tables: Sequence["RowTable"]) -> "RowTable":
        """The tables of whole groups, one after the other, as one mini-batch's (trajectory and
        group ids renumbered in order, as `StepBatch.from_steps` numbers them)."""
        traj, group, t0, g0 = [], [], 0, 0
        for table in tables:
            traj.append(table.traj_index + t0)
            group.append(table.group_index + g0)
            t0 += _size(table.traj_index)
            g0 += _size(table.group_index)
        cat = lambda name: torch.cat([getattr(t, name) for t in tables])
        return cls(
            cat("lengths"),
            cat("trained"),
            cat("trained_known"),
            torch.cat(traj),
            torch.cat(group),
            cat("is_padding"),
            [i for t in tables for i in t.trajectory_ids],
        )

    def select(self, rows: Sequence[int]) -> "RowTable":
        rows = list(rows)
        index = torch.as_tensor(rows, dtype=torch.long)
        return RowTable(
            self.lengths[index],
            self.trained[index],
            self.trained_known[index],
            self.traj_index[index],
            self.group_index[index],
            self.is_padding[index],
            [self.trajectory_ids[r] for r in rows],
        )

    def first_row_missing_logprobs(self) -> int | None:
        """The first row with a trained token that has no engine log-prob, or None."""
        missing = torch.nonzero(self.trained_known < self.trained).flatten()
        return int(missing[0]) if missing.numel() else None


def _size(ids: torch.Tensor) -> int:
    return int(ids.max()) + 1 if ids.numel() else 0
