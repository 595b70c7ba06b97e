"""A run that trains nothing, stopped instead of exiting 0 with nothing learned.

An environment whose first prompt is longer than `rollout.max_input_length` ends every
trajectory `context_limit` before a token is sampled; a filter that drops every group, or a
mask that hides every response, leaves no trainable token. Either way the iteration takes no
optimizer step. `StarvationWatch` sees each iteration's metrics (the same on every rank: the
round's metrics and the number of optimizer steps), warns at the first such iteration and
raises `NothingTrained` on every rank after `patience` in a row (`trainer.max_idle_iterations`;
0 never raises), naming the cause and the key to change. The iteration's metrics line (and checkpoint) is already written when it raises.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_stepwise.errors import UserError

log = logging.getLogger(__name__)


class NothingTrained(UserError, RuntimeError):
    """Several iterations in a row took no optimizer step (the message says why and what to change)."""


class StarvationWatch:
    def __init__(self, *, max_input_length: int, patience: int = 3, speak: bool = True):
        self.max_input_length, self.patience, self.speak = max_input_length, patience, speak
        self.idle: list[int] = []  # the iterations in a row that trained nothing

    def _cause(self, metrics: dict[str, Any]) -> str | None:
        if metrics.get("stop_reason/context_limit", 0.0) >= 1.0:
            return (
                f"every trajectory ended context_limit: the prompts are longer than "
                f"rollout.max_input_length={self.max_input_length}; raise rollout.max_input_length "
                "or shorten the environment's prompts"
            )
        if metrics.get("train/optimizer_steps", 1) == 0:
            return (
                "no mini-batch held a trainable token (every group filtered by algo.filters, or every "
                "response masked); with algo.filters.zero_variance try algo.filters.dynamic_sampling=true"
            )
        return None

    def observe(self, iteration: int, metrics: dict[str, Any]) -> None:
        cause = self._cause(metrics)
        if cause is None:
            self.idle = []
            return
        self.idle.append(iteration)
        if self.patience and len(self.idle) >= self.patience:
            raise NothingTrained(
                f"nothing trained in iterations {self.idle[0]}-{self.idle[-1]}: {cause}; stopped "
                f"after {len(self.idle)} iterations in a row that took no optimizer step (trainer.max_idle_iterations)"
            )
        if self.speak and len(self.idle) == 1:
            log.warning("iteration %d trained nothing: %s", iteration, cause)
