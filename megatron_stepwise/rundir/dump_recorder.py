"""Capturing what the trainer trained, for the rollout dump (rundir/dumps.py writes and reads it).

Rank 0's `DumpRecorder` keeps a copy of each prepared mini-batch of a dumped iteration (`capture`
runs as rank 0 prepares each, `loop/rounds.py` `RowsOnRank0`); after the iteration every rank's
log-probs of its shard are put back into mini-batch order (`assemble_logprobs`) and rank 0 writes the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from megatron_stepwise.rundir.dumps import Captured
from megatron_stepwise.steps import StepBatch


@dataclass
class DumpRecorder:
    """Rank 0: collects the mini-batches of a dumped iteration (`capture`, as rank 0 prepares each)."""

    every: int = 0
    active: bool = False
    minibatches: list[Captured] = field(default_factory=list)

    def begin(self, iteration: int) -> bool:
        self.active = bool(self.every) and iteration % self.every == 0
        self.minibatches = []
        return self.active

    def capture(self, batch: StepBatch, metadata: Sequence[dict[str, Any]]) -> None:
        if self.active:  # a copy of the dict: the plugin adds fields to shards, never to this batch
            self.minibatches.append(
                Captured(
                    StepBatch(**{**batch.__dict__, "token_fields": dict(batch.token_fields), "metadata": None}),
                    list(metadata),
                )
            )


def assemble_logprobs(
    minibatch: StepBatch, pieces: Sequence[tuple[list[int], torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Each DP shard's flat log-probs (its rows in the mini-batch, its own row offsets, its flat
    [T]) -> the mini-batch's flat [T]."""
    out = torch.zeros(minibatch.tokens.numel(), dtype=torch.float32)
    for rows, offsets, flat in pieces:
        for k, r in enumerate(rows):
            out[minibatch.row_slice(r)] = flat[int(offsets[k]) : int(offsets[k + 1])]
    return out
