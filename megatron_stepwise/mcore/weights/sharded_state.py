"""The sharded state of a checkpoint: what megatron-core's `dist_checkpointing` saves and loads
for the model chunks, the optimizer and every rank's RNG states, and the two megatron-core 0.16
quirks on CPU / gloo handled here (docs/weights.md, 'Checkpoints: pruning and megatron-core on
CPU').
"""

from __future__ import annotations

import queue
import random
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    """This process's RNG states (python, numpy, torch CPU/CUDA, megatron's tracker)."""
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


# ----------------------------------------------------------------------------- state dicts


def model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"  # Megatron-LM's naming (virtual pipeline chunks)


def distributed_optimizers(optimizer: Any) -> list:
    """(index, optimizer) of the distributed optimizers in `optimizer` (a chained one or not)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [(i, o) for i, o in enumerate(inner) if isinstance(o, DistributedOptimizer)]


def materialize_optimizer_state(optimizer: Any) -> None:
    """Give a fresh distributed optimizer its (dummy) Adam states before loading into it.

    Without Apex/TE (the CPU case) `DistributedOptimizer.state_dict()` reads every parameter's
    `step`, which torch's Adam creates only at its first step; megatron-core's own dummy-state
    initialiser (used for its FSDP loads) makes them, and the load then overwrites them.
    """
    for _, inner in distributed_optimizers(optimizer):
        if not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def restore_adam_steps(optimizer: Any, loaded: Any) -> None:
    """Put the checkpoint's step count back into torch Adam's per-parameter state.

    Without Apex/TE, megatron-core's distributed optimizer keeps the step in each parameter's
    torch state; its `load_state_dict` sets one tensor shared by all parameters (which torch's
    foreach Adam would then advance once per parameter) and the dp_reshardable loader
    overwrites it with the placeholder's value. The true count is in the loaded param groups.
    """
    chained = hasattr(optimizer, "chained_optimizers") and len(optimizer.chained_optimizers) > 1
    for i, inner in distributed_optimizers(optimizer):
        part = loaded[i] if chained else loaded
        steps = {g["step"] for g in part["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            continue  # Apex / TE optimizers keep the step in the param groups themselves
        step = float(steps.pop())
        for state in inner.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)


def sharded_metadata(optimizer: Any) -> dict:
    """The `metadata` megatron-core's sharded_state_dict methods take (Megatron-LM's defaults).

    The distributed optimizer's default format in 0.16 (`fully_sharded_model_space`) is
    deprecated and no longer saves; `dp_reshardable` writes each rank's buffer shards as they are.
    Its optimizer state reloads into the same TP/PP layout (tested: DP2); across a TP/PP change
    load the model only (`load_optimizer=False`). `fully_reshardable` is not offered: without
    Apex/TE (CPU) megatron-core 0.16 cannot load it (it looks for a per-parameter `step`).
    """
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer is not None and distributed_optimizers(optimizer):
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def build_sharded_state_dict(chunks, optimizer, metadata: dict, *, is_loading: bool, with_rng: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_stepwise.mcore.train.model import unwrap

    # megatron-core adds process groups to the metadata it is given: hand it copies, so that
    # `metadata` stays the plain dict recorded in the checkpoint.
    # The bare GPTModel's names (no DDP / Float16Module prefixes), as Megatron-LM saves them.
    sd: dict[str, Any] = {
        model_key(i, len(chunks)): unwrap(c).sharded_state_dict(metadata=dict(metadata)) for i, c in enumerate(chunks)
    }
    if optimizer is not None:
        # As Megatron-LM: the optimizer finds its params' sharded tensors anywhere in `sd`.
        sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), is_loading=is_loading, metadata=dict(metadata))
    if with_rng:  # one object per global rank: rank r writes slot r; only a placeholder when loading
        sd["rng_state"] = ShardedObject(
            "rng_state", rng_state(), (dist.get_world_size(),), (dist.get_rank(),), replica_id=0
        )
    return sd


@contextmanager
def in_process_results_queue() -> Iterator[None]:
    """Keep megatron's write-result queue inside this process (docs/weights.md, 'Checkpoints:
    pruning and megatron-core on CPU')."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    yield


def save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # One writer process per rank: each rank's shard is small next to the fork cost on a CPU box.
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
