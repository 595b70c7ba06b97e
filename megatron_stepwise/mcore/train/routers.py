"""What the plugin's MoE router hooks (router losses, routing replay) share: which packed tokens
this rank's routers see, and whether activation recomputation re-runs them."""

from __future__ import annotations

from typing import Optional

import torch


def moe_routers(gpt) -> list:
    """The top-k routers of a model chunk, in layer order (none in a dense model)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in gpt.modules() if isinstance(m, TopKRouter)]


def local_tokens(per_token: torch.Tensor, config) -> torch.Tensor:
    """The rows of a per-packed-token tensor (CP-local) that this rank's routers see: under
    sequence parallelism TP rank r holds the r-th of tp equal slices of the sequence."""
    from megatron.core import parallel_state as ps

    tp = config.tensor_model_parallel_size
    if not config.sequence_parallel or tp == 1:
        return per_token
    size = per_token.size(0) // tp
    rank = ps.get_tensor_model_parallel_rank()
    return per_token[rank * size : (rank + 1) * size]


def recomputation(config) -> Optional[str]:
    """The recompute settings that re-run MoE routers (None: they run once). A re-run router
    reads the micro-batch being run at backward time, not its own, so the hooks refuse them."""
    granularity = getattr(config, "recompute_granularity", None)
    modules = getattr(config, "recompute_modules", None) or []
    if granularity == "full" or (granularity == "selective" and "moe" in modules):
        return f"recompute_granularity={granularity!r}, recompute_modules={list(modules)}"
    return None
