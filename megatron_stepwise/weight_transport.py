"""Weight transport between the trainer (rank 0) and rollout engines (ranks 1..N).

Used by both sides: `mcore/weights/sync.py` opens the group and broadcasts, `rollout/engines/embedded/engine.py` joins
it and receives. Dtypes travel by name (`dtype_name` / `parse_dtype`, SGLang's convention).

This is the CPU/gloo counterpart of SGLang's `init_weights_update_group` +
`update_weights_from_distributed` (NCCL there): a standalone process group, separate from the
trainer's own `torch.distributed` world, built from a TCPStore. The trainer opens it as rank 0
and broadcasts each tensor; every engine joins with its `rank_offset` and receives into buffers
of the announced names, dtypes and shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

import torch
import torch.distributed as dist


@dataclass
class WeightGroup:
    """A gloo process group plus the TCPStore it was built from (kept alive with it)."""

    group: Any
    store: Any
    rank: int
    world_size: int


def _group(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float):
    if not 0 <= rank < world_size:
        raise ValueError(f"weight-update group: rank {rank} outside world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout)
    return WeightGroup(dist.ProcessGroupGloo(store, rank, world_size, timeout), store, rank, world_size)


def open_group(master_address: str, master_port: int, world_size: int, timeout_s: float = 300.0):
    """Trainer side: rank 0 of a new weight-update group (blocks until every engine joined)."""
    return _group(master_address, master_port, 0, world_size, timeout_s)


def join_group(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float = 300.0):
    """Engine side: join the group as `rank` (blocks until every member joined)."""
    return _group(master_address, master_port, rank, world_size, timeout_s)


def broadcast(group, tensors: Iterable[torch.Tensor]) -> None:
    """Trainer side: send tensors (in the order announced to the engines) from rank 0."""
    for t in tensors:
        group.group.broadcast(t.detach().contiguous().cpu(), 0).wait()


def receive(group, buffers: Iterable[torch.Tensor]) -> None:
    """Engine side: fill `buffers` in place from rank 0's broadcasts."""
    for b in buffers:
        group.group.broadcast(b, 0).wait()


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' / 'torch.bfloat16' -> torch.bfloat16 (SGLang sends dtype names as strings)."""
    short = name.split(".")[-1]
    dtype = getattr(torch, short, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the inverse of `parse_dtype`)."""
    return str(dtype).split(".")[-1]
