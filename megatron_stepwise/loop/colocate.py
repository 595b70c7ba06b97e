"""Colocated mode (`rollout.colocate`): training and rollout take turns on the same GPUs.

Each iteration, once the rollout is done:

    release(weights, kv_cache) -> prepare, score, train -> resume(weights) -> push -> resume(kv_cache)

The engines give their memory to Megatron while it trains. Coming back, SGLang needs this
order: a weight update writes into the weights' memory, so that comes back first (its values
are stale until the push); the KV cache, usually the largest part, comes back last, when the
next rollout needs it.

Only global rank 0 talks to the fleet. The release ends with a hand-off to every rank, so no
rank starts computing while an engine on its GPU still holds memory (and a failed release
stops every rank, not just rank 0); the resumes need none, the push is collective anyway.
Without colocation both context managers do nothing.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Iterator, Optional

if TYPE_CHECKING:
    from megatron_stepwise.loop.handoff import Handoff
    from megatron_stepwise.loop.sources import Driver

RELEASED = ("weights", "kv_cache")  # what the engines free for training (SGLang memory tags)


class Colocation:
    """Drives the engines' memory around training and the weight push (see module docstring).

    `driver`: rank 0's `Driver` (None elsewhere); `handoff`: the loop's `Handoff`."""

    def __init__(self, enabled: bool, driver: Optional[Driver], handoff: Handoff):
        self.enabled, self.driver, self.handoff = enabled, driver, handoff

    def _fleet(self, method: str, tags) -> float:
        """Rank 0: one fan-out to the fleet; returns the seconds it took."""
        t = time.perf_counter()
        self.driver.run(getattr(self.driver.fleet, method)(list(tags)))
        return time.perf_counter() - t

    @contextlib.contextmanager
    def released(self, iteration: int, times: dict[str, float]) -> Iterator[None]:
        """Around everything that computes on the trainer's GPUs between rollout and push."""
        if self.enabled:
            # Every rank waits for rank 0's release: training must not allocate before it is done.
            times["time/engine_release"] += self.handoff.from_driver(
                lambda: self._fleet("release_memory_occupation", RELEASED), "releasing the engines' memory", iteration
            )
        yield

    @contextlib.contextmanager
    def resumed(self, times: dict[str, float]) -> Iterator[None]:
        """Around the weight push: weights' memory back before it, the KV cache after it."""
        if not (self.enabled and self.driver is not None):
            yield
            return
        times["time/engine_resume"] += self._fleet("resume_memory_occupation", ["weights"])
        yield
        times["time/engine_resume"] += self._fleet("resume_memory_occupation", ["kv_cache"])
