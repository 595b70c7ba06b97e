"""Deciding a mini-batch's shards: which rows each data-parallel rank trains, in which micro-batches,
and the mini-batch totals and loss denominators the loss normalises by.

The decision reads the layout's sizes and each row's lengths and counts (`RowTable`), never a
model and never a token, so one process can decide for every rank (the trainer's rank 0) and
whoever holds a rank's rows cuts its `MinibatchShard` (`ShardDecision.cut`): rank 0 from the rows it
prepared (`PreparedRows`), or the agent workers' holders (`workers/worker_rows.py`). Training a shard
is `StepwisePlugin`'s job (`mcore/train/plugin.py`); its `plan_shards` / `decide_shards` check the
model and call `ShardPlanner` here. All input errors are raised here, before any collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_stepwise.algo.planner import packed_lengths
from megatron_stepwise.algo.planner import plan_microbatches as package_planner
from megatron_stepwise.algo.reductions import row_denominators, weights_from_denominators
from megatron_stepwise.algo.rows import RowTable
from megatron_stepwise.errors import UserError
from megatron_stepwise.steps import StepBatch, StepwiseBatchError

TRAIN, LOGPROBS = "train", "logprobs"


class UnsupportedLayoutError(UserError, ValueError):
    """A model layout the step-wise plugin refuses (MTP, EP overlap schedule plans)."""


class HostLoopMismatchError(UserError, ValueError):
    """The host training loop assumes something the plugin's plan does not hold (e.g. another
    number of micro-batches per optimizer step); raised instead of training silently wrong."""


@dataclass
class ShardDecision:
    """What `decide_shards` decides for one DP rank: which rows of the mini-batch it trains (in
    this order), its micro-batches as positions in that list, the mini-batch totals, and each
    row's loss denominator (None when the weights were computed on the whole batch)."""

    plan: list[list[int]]
    rows: list[int]
    dp_rank: int
    dp_size: int
    trained_tokens: int  # over the whole mini-batch
    data_rows: int  # rows that are not DP padding, whole mini-batch
    data_tokens: int
    tokens: int  # every row's tokens, whole mini-batch
    rollout_logprobs: bool  # the engine's log-probs go to the loss
    rollout_logprobs_complete: bool  # ... and every trained token has one
    traj_index: torch.Tensor
    group_index: torch.Tensor
    denominators: Optional[torch.Tensor] = None
    pad_to: Optional[int] = None

    def cut(self, batch: StepBatch) -> MinibatchShard:
        """This rank's shard from `batch`, which holds exactly its rows, in `rows` order."""
        if batch.num_rows != len(self.rows):
            raise StepwiseBatchError(
                f"DP rank {self.dp_rank}: got {batch.num_rows} rows for a decision of {len(self.rows)}"
            )
        row_fields = {**batch.row_fields, "traj_index": self.traj_index, "group_index": self.group_index}
        token_fields = batch.token_fields
        if self.denominators is not None:
            token_fields = {**token_fields, "weights": weights_from_denominators(batch, self.denominators)}
        return MinibatchShard(self, dataclasses.replace(batch, token_fields=token_fields, row_fields=row_fields))


@dataclass
class MinibatchShard:
    """One data-parallel rank's part of a mini-batch (`StepwisePlugin.plan_shards`): its decision
    (rows, micro-batches as row lists, the mini-batch totals the loss and metrics normalise by) and
    its rows, with the token fields the loss reads (`weights`, computed over the whole mini-batch,
    advantages, old/ref log-probs)."""

    decision: ShardDecision
    batch: StepBatch  # the decision's rows, in its order

    @property
    def token_fields(self) -> dict[str, torch.Tensor]:
        return self.batch.token_fields

    # Sent between processes with narrower integer types (`StepBatch.for_wire`).
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "batch": self.batch.for_wire()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, batch=state["batch"].from_wire())

    def minibatch_token_index(self, local: torch.Tensor, minibatch: StepBatch) -> torch.Tensor:
        """Token positions in `batch` -> the same tokens' positions in the whole `minibatch`."""
        row = torch.searchsorted(self.batch.offsets, local, right=True) - 1
        rows = torch.as_tensor(self.decision.rows, dtype=torch.long)
        return minibatch.offsets[:-1][rows[row]] + (local - self.batch.offsets[:-1][row])


@dataclass
class PreparedRows:
    """A mini-batch prepared where the decision is made (rank 0): its rows, with the interface of
    the rows the agent workers hold (`worker_rows.HeldMinibatch`): a row table to decide on and
    `cut`, which gives a rank's shard."""

    batch: StepBatch

    @property
    def rows(self) -> RowTable:
        return RowTable.of(self.batch)

    def cut(self, decision: ShardDecision) -> MinibatchShard:
        return decision.cut(self.batch.select(decision.rows))


def shard_rows(micros: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """One rank's micro-batches (rows of the mini-batch) -> (its rows in order, the same
    micro-batches as positions in that list)."""
    rows = [r for micro in micros for r in micro]
    local, at = [], 0
    for micro in micros:
        local.append(list(range(at, at + len(micro))))
        at += len(micro)
    return rows, local


def check_tokens(batch: StepBatch, vocab: int, *, need: Sequence[str]) -> None:
    """A whole mini-batch's own checks: steps, token ids inside the vocabulary, the fields `need`ed."""
    if batch.num_rows == 0:
        raise StepwiseBatchError("mini-batch has no steps")
    bad = (batch.tokens < 0) | (batch.tokens >= vocab)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        r = int(torch.searchsorted(batch.offsets, torch.tensor(i), right=True)) - 1
        raise StepwiseBatchError(
            f"step {r}: token id {int(batch.tokens[i])} is outside the model vocabulary [0, {vocab})"
        )
    for name in need:
        if name not in batch.token_fields:
            raise StepwiseBatchError(f"mini-batch is missing the per-token field {name!r}")


@dataclass(frozen=True)
class ShardLayout:
    """What of the parallel layout a decision depends on (the same on every rank)."""

    dp: int  # data-parallel ranks
    cp: int = 1  # context-parallel ranks (rows are padded to a multiple of 2*cp)
    pp: int = 1  # pipeline stages
    vpp: int = 1  # model chunks per rank (virtual pipeline stages)
    align: int = 1  # a packed micro-batch's length is a multiple of this (`packing.alignment_for`)


class ShardPlanner:
    """Decides mini-batches for a layout (module docstring). The hooks are `StepwisePlugin`'s:
    `plan_microbatches(lengths, dp_size=, max_tokens=)` and `token_weights(batch, reduction,
    max_response_len=...)`; None means the package's (the planner also packs to the alignment,
    the weights come from each row's counts)."""

    def __init__(
        self,
        loss_config: Any,
        *,
        max_tokens: int,
        num_microbatches: Optional[int] = None,
        plan_microbatches: Optional[Callable] = None,
        token_weights: Optional[Callable] = None,
    ):
        self.loss_config, self.max_tokens, self.num_microbatches = loss_config, max_tokens, num_microbatches
        self._plan = plan_microbatches or package_planner
        self._plan_takes_alignment = plan_microbatches is None
        self._token_weights = token_weights
        self.weighs_from_rows = token_weights is None  # the built-in reductions: weighable from row counts

    def plan(
        self,
        batch: StepBatch,
        layout: ShardLayout,
        *,
        mode: str = TRAIN,
        num_microbatches: Optional[int] = None,
        only: Optional[int] = None,
    ) -> list[MinibatchShard]:
        """`decide` for a whole `batch` (already checked against the model), cut into shards; a
        custom `token_weights` hook weighs the whole mini-batch first."""
        custom_weights = mode == TRAIN and not self.weighs_from_rows
        if custom_weights:  # a user's weighting sees the whole mini-batch
            max_len = getattr(self.loss_config, "max_response_len", None)
            weights = self._token_weights(batch, self.loss_config.reduction, max_response_len=max_len).float()
            batch = dataclasses.replace(batch, token_fields={**batch.token_fields, "weights": weights})
        decisions = self.decide(
            RowTable.of(batch),
            layout,
            mode=mode,
            num_microbatches=num_microbatches,
            only=only,
            weigh=not custom_weights,
        )
        return [PreparedRows(batch).cut(d) for d in decisions]

    def decide(
        self,
        rows: RowTable,
        layout: ShardLayout,
        *,
        mode: str = TRAIN,
        num_microbatches: Optional[int] = None,
        only: Optional[int] = None,
        weigh: bool = True,
    ) -> list[ShardDecision]:
        """Every DP rank's (or only rank `only`'s) rows, micro-batches, totals and loss denominators,
        from the rows' lengths and counts alone."""
        if weigh and mode == TRAIN and not self.weighs_from_rows:
            raise UnsupportedLayoutError(
                "decide_shards weighs tokens with the built-in loss reductions; a custom "
                "token_weights hook needs the whole mini-batch (use plan_shards)"
            )
        if rows.num_rows == 0:
            raise StepwiseBatchError("mini-batch has no steps")
        dp, cp, align = layout.dp, layout.cp, layout.align
        lengths = packed_lengths(rows.lengths, cp)
        self._check_lengths(lengths, cp)
        n_trained = int(rows.trained.sum())
        if n_trained == 0:
            raise StepwiseBatchError(
                "mini-batch has no trainable token (loss_mask is 0 on every step): nothing to "
                + ("train" if mode == TRAIN else "score")
            )
        extra = {"micro_align": align} if self._plan_takes_alignment else {}
        plan = self._plan(lengths.tolist(), dp_size=dp, max_tokens=self.max_tokens, **extra)
        if len(plan) != dp or len({len(p) for p in plan}) != 1:
            raise RuntimeError(f"micro-batch planner returned an invalid plan for dp_size={dp}")
        count = num_microbatches or self.num_microbatches
        if layout.vpp > 1:
            # The interleaved schedule runs groups of PP micro-batches per model chunk.
            pp = layout.pp
            if count is None:
                count = max(pp, -(-len(plan[0]) // pp) * pp)
            elif count % pp:
                raise HostLoopMismatchError(
                    f"num_microbatches={count} is not a multiple of the pipeline-parallel size {pp}, which the "
                    "interleaved (virtual pipeline) schedule needs"
                )
        plan = self._fixed_count(plan, count)
        rollout_logprobs = complete = False
        denominators = None
        if mode == TRAIN:
            if weigh:
                max_len = getattr(self.loss_config, "max_response_len", None)
                denominators = row_denominators(rows, self.loss_config.reduction, max_response_len=max_len)
            rollout_logprobs, complete = self._check_rollout_logprobs(rows)
        data = ~rows.is_padding
        totals = dict(
            dp_size=dp,
            trained_tokens=n_trained,
            data_rows=int(data.sum()),
            data_tokens=int(rows.lengths[data].sum()),
            tokens=int(rows.lengths.sum()),
            rollout_logprobs=rollout_logprobs,
            rollout_logprobs_complete=complete,
        )
        decisions = []
        for rank in range(dp) if only is None else [only]:
            mine, local = shard_rows(plan[rank])
            pad_to = None
            if layout.vpp > 1:
                # The interleaved schedule exchanges activations and gradients in both directions at
                # once, and megatron's shape exchange pairs those messages by order: with PP=2 both
                # neighbours are the same rank and a variable shape could be read for the wrong
                # tensor. Every micro-batch of the step is padded (loss-neutrally) to the longest.
                sizes = [int(lengths[micro].sum()) if micro else 0 for micro in plan[rank]]
                pad_to = max(max(align, size + (-size) % align) for size in sizes)
            index = torch.as_tensor(mine, dtype=torch.long)
            decisions.append(
                ShardDecision(
                    plan=local,
                    rows=mine,
                    dp_rank=rank,
                    pad_to=pad_to,
                    denominators=None if denominators is None else denominators[index],
                    traj_index=rows.traj_index[index],
                    group_index=rows.group_index[index],
                    **totals,
                )
            )
        return decisions

    def _check_lengths(self, lengths: torch.Tensor, cp: int) -> None:
        """`lengths`: the rows as packed (`packed_lengths`, padded for CP)."""
        over = torch.nonzero(lengths > self.max_tokens).flatten()
        if over.numel():
            r = int(over[0])
            padded = f" (padded to a multiple of {2 * cp} for context parallelism)" if cp > 1 else ""
            raise StepwiseBatchError(
                f"step {r}: {int(lengths[r])} tokens{padded} do not fit the micro-batch budget "
                f"max_tokens_per_microbatch={self.max_tokens}"
            )

    def _fixed_count(self, plan: list, count: Optional[int]) -> list:
        """Pad every rank's micro-batches to `count` with empty (loss-neutral) ones."""
        if count is None:
            return plan
        needed = len(plan[0])
        if needed > count:
            raise HostLoopMismatchError(
                f"this mini-batch needs {needed} micro-batches of <= {self.max_tokens} tokens per DP rank, but the host "
                f"loop runs num_microbatches={count} (Megatron-LM: global_batch_size / (micro_batch_size x DP)); "
                "raise the global batch size or max_tokens_per_microbatch, or use fewer prompts per mini-batch"
            )
        return [rank + [[] for _ in range(count - needed)] for rank in plan]

    def _check_rollout_logprobs(self, rows: RowTable) -> tuple[bool, bool]:
        """(the engine's log-probs go to the loss, every trained token has one).

        They go when any trained token has one; only when all have do they reach the loss's
        corrections. A loss that needs them (TIS, IcePop, the async off-policy correction)
        refuses a batch with a gap, naming the first step; otherwise the train-vs-rollout gap
        metric covers the known ones.
        """
        missing = rows.first_row_missing_logprobs()
        if missing is not None and getattr(self.loss_config, "needs_rollout_logprobs", False):
            raise StepwiseBatchError(
                f"step {missing} ({rows.trajectory_ids[missing]}): field 'rollout_logprobs' is missing (the rollout "
                f"engine reported no log-probs), but algo.loss.tis={self.loss_config.tis!r} / "
                "algo.loss.icepop_* need the engine's log-prob of every trained token"
            )
        present = bool((rows.trained_known > 0).any())
        return present, present and missing is None
