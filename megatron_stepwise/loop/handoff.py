"""Rank 0 produces, the training ranks receive: the hand-offs of the loop.

Only global rank 0 drives the rollout fleet and draws prompts. What it produces reaches the
other ranks one of two ways, always with the prompt dataset's position (every rank's checkpoint
must hold the same one) and rank 0's error, if any (raised on every rank: none is left waiting
in a collective):

- `from_driver`: one small object for every rank (decisions, timings);
- `to_ranks`: one payload per data-parallel rank (the mini-batch shards it trains), pickled once
  per DP rank and sent point to point, so each rank receives ~1/DP of the rollout's bytes.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


class Handoff:
    """`dataset`: has state_dict()/load_state_dict(); `group`: a CPU (gloo) process group of every
    rank; `dp_rank`: this rank's data-parallel rank (for `to_ranks`)."""

    def __init__(self, dataset: Any, group: Any = None, dp_rank: int = 0):
        self.dataset = dataset
        self.group = group
        self.dp_rank = dp_rank
        self.is_driver = dist.get_rank() == 0
        self._dp_of_rank: Optional[list[int]] = None
        self.bytes_received = 0  # by this rank through `to_ranks`, since it was built

    def from_driver(self, produce: Callable[[], Any], what: str, iteration: int) -> Any:
        """Run `produce` on rank 0 and return its result on every rank."""
        payload: list[Any] = [None]
        error: Optional[BaseException] = None
        if self.is_driver:
            error, payload[0] = self._run(produce)
        dist.broadcast_object_list(payload, src=0, group=self.group)
        return self._open(payload[0], error, what, iteration)

    def to_ranks(self, produce: Callable[[], list[Any]], what: str, iteration: int) -> Any:
        """Run `produce` on rank 0; it returns one payload per data-parallel rank, and every rank
        returns its own DP rank's."""
        ranks = self._dp_ranks()
        world, me = len(ranks), dist.get_rank()
        sizes = torch.zeros(world, dtype=torch.long)
        error: Optional[BaseException] = None
        if self.is_driver:
            error, (kind, result, state) = self._run(produce)
            if kind == "ok" and len(result) != max(ranks) + 1:
                kind, result = "error", f"{what} produced {len(result)} payloads for {max(ranks) + 1} DP ranks"
            per_dp = result if kind == "ok" else [result] * (max(ranks) + 1)
            blobs = {dp: bytearray(pickle.dumps((kind, per_dp[dp], state), protocol=5)) for dp in set(ranks[1:])}
            for r in range(1, world):
                sizes[r] = len(blobs[ranks[r]])
            mine = (kind, per_dp[ranks[0]], state)
        if world > 1:
            dist.broadcast(sizes, src=0, group=self.group)
        if self.is_driver:
            sends = [dist.isend(torch.frombuffer(blobs[ranks[r]], dtype=torch.uint8), dst=r, group=self.group)
                     for r in range(1, world)]
            for work in sends:
                work.wait()
            return self._open(mine, error, what, iteration)
        buf = torch.empty(int(sizes[me]), dtype=torch.uint8)
        dist.recv(buf, src=0, group=self.group)
        self.bytes_received += buf.numel()
        return self._open(pickle.loads(buf.numpy().tobytes()), None, what, iteration)

    def _dp_ranks(self) -> list[int]:
        """Each global rank's data-parallel rank (gathered once)."""
        if self._dp_of_rank is None:
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, self.dp_rank, group=self.group)
            self._dp_of_rank = [int(r) for r in ranks]
        return self._dp_of_rank

    def _run(self, produce: Callable[[], Any]) -> tuple[Optional[BaseException], tuple]:
        try:
            return None, ("ok", produce(), self.dataset.state_dict())
        except Exception as e:  # every rank must leave the collective, then all raise
            # As text: the exception itself may not pickle (Ray and HTTP client errors hold
            # locks and sockets), and a failed pickle would leave the other ranks waiting.
            return e, ("error", f"{type(e).__name__}: {e}", None)

    def _open(self, payload: tuple, error: Optional[BaseException], what: str, iteration: int) -> Any:
        kind, result, dataset_state = payload
        if kind == "error":
            raise RuntimeError(f"{what} failed on rank 0 at iteration {iteration}: {result}") from error
        self.dataset.load_state_dict(dataset_state)
        return result
