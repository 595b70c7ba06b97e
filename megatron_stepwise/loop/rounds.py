"""Making a round: rank 0 decides every DP rank's shards, whoever holds the rows cuts them.

One path whether the prepared rows are on rank 0 or stay in the agent workers. A *holder* turns a
mini-batch of groups into rows with two faces: a row table (lengths and counts, no token) to
decide on, and `cut(decision)`, which gives a rank its shard:

    holder                      hold(groups) gives    cut(decision) gives
    RowsOnRank0 (here)          algo.shards.PreparedRows   MinibatchShard (the rows themselves)
    worker_rows.RowsInWorkers   worker_rows.HeldMinibatch  RemoteShard (where to fetch them)

`decide_round` runs the plugin's `decide_shards` on each mini-batch's table and cuts one shard per
DP rank; `hand_off` sends each rank its own and, when a replica found holders gone, has rank 0
decide anew (`redo`) after the source rolled the lost groups out again.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

from megatron_stepwise.algo.prepare import prepare
from megatron_stepwise.algo.shards import PreparedRows
from megatron_stepwise.loop.handoff import ResolveFailed

if TYPE_CHECKING:
    from megatron_stepwise.algo.groups import RolloutGroup
    from megatron_stepwise.algo.rows import RowTable
    from megatron_stepwise.algo.shards import MinibatchShard, ShardDecision
    from megatron_stepwise.rundir.dump_recorder import DumpRecorder
    from megatron_stepwise.workers.worker_rows import RemoteShard

log = logging.getLogger(__name__)


@dataclass
class Round:
    """This rank's shards of the mini-batches trained with one policy snapshot (one per optimizer
    step), the round's metrics and `prepare`'s counts (the same on every rank), and how many
    mini-batches had no trainable token (no optimizer step)."""

    # one per mini-batch: the plugin's shard, or (rows kept by the workers) where to fetch it
    shards: list[MinibatchShard | RemoteShard]
    metrics: dict[str, Any] = field(default_factory=dict)
    counts: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0


class Holder(Protocol):
    def hold(self, groups: Sequence) -> tuple[Optional[Any], dict[str, Any]]:
        """(the mini-batch's rows, with `rows` and `cut`; None without a trained token), its counts."""


@dataclass
class RowsOnRank0:
    """Rank 0 prepares each mini-batch itself (`prepare`, see `sources.bind_prepare`); a
    `recorder` of a dumped iteration keeps each prepared mini-batch."""

    prepare: Callable = prepare
    recorder: Optional[DumpRecorder] = None

    def hold(self, groups: Sequence[RolloutGroup]) -> tuple[Optional[PreparedRows], dict[str, Any]]:
        keep = self.recorder is not None and self.recorder.active
        batch, counts = self.prepare(groups, keep_metadata=keep)
        if batch is None:
            return None, counts
        if keep:
            self.recorder.capture(batch, batch.metadata)
            batch.metadata = None  # the shards travel without it
        return PreparedRows(batch), counts


def decide_round(
    minibatches: list[list],
    holder: Holder,
    *,
    decide: Callable[[RowTable], list[ShardDecision]],
    dp_size: int,
    metrics: Optional[dict[str, Any]] = None,
) -> list[Round]:
    """Rank 0: each mini-batch of groups held (`holder`), decided from its row table (`decide`:
    the plugin's `decide_shards`) and cut into one shard per DP rank; one `Round` per DP rank."""
    t = time.perf_counter()
    shards, counts, skipped = [], [], 0
    for groups in minibatches:
        rows, count = holder.hold(groups)
        counts.append(count)
        if rows is None:
            skipped += 1
            continue
        shards.append([rows.cut(d) for d in decide(rows.rows)])
    metrics = {**(metrics or {}), "time/prepare": time.perf_counter() - t}
    return [Round([s[dp] for s in shards], metrics, counts, skipped) for dp in range(dp_size)]


def hand_off(
    handoff,
    what: str,
    iteration: int,
    produce: Callable[[], list],
    redo: Callable[[set[str]], list],
    *,
    resolve: Optional[Callable],
    retries: int,
):
    """Every rank's part of rank 0's `produce()`, its rows fetched (`resolve`). When a replica
    found holders gone (the same `ResolveFailed` on every rank: all retry, or all raise), rank 0
    makes the round again with `redo(lost workers)`, at most `retries` times."""
    for attempt in range(retries + 2):
        try:
            return handoff.to_ranks(produce, what, iteration, resolve=resolve)
        except ResolveFailed as e:
            if not e.lost or attempt > retries:
                raise
            log.warning("%s; rolling their groups out again", e)
            produce = functools.partial(redo, set(e.lost))
    raise AssertionError("unreachable")
