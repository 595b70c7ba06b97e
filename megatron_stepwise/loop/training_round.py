"""One training round: the mini-batches trained from one policy snapshot.

A round's shards are scored first (old-policy log-probs when the policy moves before a shard is
trained, i.e. the round makes more than one optimizer step; reference log-probs when the KL term
is on), then trained `epochs` times, one optimizer step per shard and epoch. `Trainer` and the
offline `replay` both train through `TrainingRound.run`, so a replay makes exactly the steps the
trainer made.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_stepwise.mcore.train.plugin import StepwisePlugin

Metrics = dict[str, float]


def _untimed(_key: str) -> ContextManager:
    return contextlib.nullcontext()


def _accept(_metrics: Metrics) -> None:
    pass


@dataclass
class TrainingRound:
    """The policy (`chunks`, `optimizer`, `scheduler`) the plugin trains, the reference model
    (`ref_chunks`, None without KL), and `check`, called on every step's metrics (the trainer's
    ends a diverged run there; replay reports whatever the step gave)."""

    plugin: StepwisePlugin
    chunks: list
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    epochs: int
    ref_chunks: Optional[list] = None
    check: Callable[[Metrics], None] = _accept

    def run(
        self,
        shards: list,
        *,
        clock: Callable[[str], ContextManager] = _untimed,
        inspect: Optional[Callable[[list], None]] = None,
    ) -> list[Metrics]:
        """Score, then train, this rank's `shards` (one per mini-batch of the round); returns each
        optimizer step's metrics, epoch by epoch. `clock(key)` times each part (`time/old_logprobs`,
        `time/dump`, `time/train`); `inspect` sees the scored shards before the first step."""
        with clock("time/old_logprobs"):
            self.score(shards)
        if inspect is not None:
            with clock("time/dump"):
                inspect(shards)
        with clock("time/train"):
            return [self.step(shard) for _ in range(self.epochs) for shard in shards]

    def score(self, shards: list) -> None:
        """Old-policy log-probs when the policy moves before a shard is trained; reference log-probs."""
        needs_old = len(shards) * self.epochs > 1
        for shard in shards:
            if needs_old:
                shard.token_fields["old_logprobs"] = self.plugin.compute_logprobs_flat(self.chunks, shard)
            if self.ref_chunks is not None:
                shard.token_fields["ref_logprobs"] = self.plugin.compute_logprobs_flat(self.ref_chunks, shard)

    def step(self, shard) -> Metrics:
        """One optimizer step on one shard."""
        metrics = self.plugin.train_minibatch(self.chunks, self.optimizer, shard, lr_scheduler=self.scheduler)
        self.check(metrics)
        return metrics
