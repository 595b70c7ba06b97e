"""Rank 0 produces, every training rank receives: the one hand-off of the loop.

Only global rank 0 drives the rollout fleet and draws prompts. Each mini-batch source runs its
producer there and hands the result to every rank with `Handoff.from_driver`, together with the
prompt dataset's position (every rank's checkpoint must hold the same one) and rank 0's error,
if any (raised on every rank: none is left waiting in a collective).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist


class Handoff:
    """`dataset`: has state_dict()/load_state_dict(); `group`: a CPU (gloo) process group."""

    def __init__(self, dataset: Any, group: Any = None):
        self.dataset = dataset
        self.group = group
        self.is_driver = dist.get_rank() == 0

    def from_driver(self, produce: Callable[[], Any], what: str, iteration: int) -> Any:
        """Run `produce` on rank 0 and return its result on every rank."""
        payload: list[Any] = [None]
        error: Optional[BaseException] = None
        if self.is_driver:
            try:
                payload[0] = ("ok", produce(), self.dataset.state_dict())
            except Exception as e:  # every rank must leave the broadcast, then all raise
                # As text: the exception itself may not pickle (Ray and HTTP client errors hold
                # locks and sockets), and a failed pickle would leave the other ranks waiting.
                error, payload[0] = e, ("error", f"{type(e).__name__}: {e}", None)
        dist.broadcast_object_list(payload, src=0, group=self.group)
        kind, result, dataset_state = payload[0]
        if kind == "error":
            raise RuntimeError(f"{what} failed on rank 0 at iteration {iteration}: {result}") from error
        self.dataset.load_state_dict(dataset_state)
        return result
