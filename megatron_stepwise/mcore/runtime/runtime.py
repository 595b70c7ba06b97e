"""Process groups for megatron-core: torch.distributed + model-parallel state, GPU or CPU.

`init_distributed` reads the launcher's environment (torchrun or SLURM), starts
torch.distributed (NCCL on GPU, gloo on CPU), creates megatron-core's TP/PP/CP/DP groups and
seeds the RNGs the Megatron way. On a machine without a GPU it enables the CPU compatibility
layer (`cpu_compat`) for the lifetime of the runtime; `destroy_distributed` undoes everything.
"""

from __future__ import annotations

import os
import random
import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_stepwise.mcore.runtime import cpu_compat
from megatron_stepwise.mcore.runtime.megatron_import import import_megatron_core


def comm_device() -> torch.device:
    """Where collective buffers live: NCCL reduces CUDA tensors only, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# What megatron-core says that is noise to us: at import, that Transformer Engine / Apex are
# missing (it falls back to torch, as intended on CPU), a deprecated default of its own
# TransformerConfig, and torch's deprecation of APIs it still calls (ShardedTensor and
# load_state_dict in dist_checkpointing, the *_tensor collectives in the distributed optimizer).
_NOISE = (
    (UserWarning, ".*(Transformer Engine and Apex are not installed|Apex is not installed|full scope is deprecated)"),
    (
        FutureWarning,
        ".*(deprecating ShardedTensor|`load_state_dict` is deprecated"
        "|`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated)",
    ),
)


def silence_megatron_noise() -> None:
    """Hide megatron-core's set-up warnings listed above (call before importing megatron-core)."""
    for category, message in _NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)


_COMPAT_HELD = False  # whether this runtime enabled the CPU compatibility layer


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits (tp x pp x cp x dp = world size); the one layout object of the
    plugin, the checkpoints and weight conversion."""

    rank: int
    world_size: int
    local_rank: int
    tp: int
    pp: int
    cp: int
    dp: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    device: torch.device
    vpp: int = 1  # model chunks per rank (virtual pipeline stages)

    def sizes(self) -> dict[str, int]:
        """The group sizes, as a checkpoint stores them (a plain dict on disk)."""
        return {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp}


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports unused on `host` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_env(environ: Optional[dict] = None) -> LaunchEnv:
    """Rank/world/master from torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or SLURM (SLURM_PROCID...).

    A single process with neither set is a world of one.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local = int(env.get("SLURM_LOCALID", 0))
    else:
        rank, world, local = 0, 1, 0
    # SLURM: the launch node's address is the usual rendezvous when the batch script set none.
    addr = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
    if "MASTER_PORT" in env:
        port = int(env["MASTER_PORT"])
    elif "SLURM_JOB_ID" in env:
        port = 20000 + int(env["SLURM_JOB_ID"]) % 20000
    else:
        port = 29500
    if not 0 <= rank < world:
        raise ValueError(f"launcher environment: rank {rank} is outside world size {world}")
    return LaunchEnv(rank, world, local, addr, port)


def init_distributed(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    *,
    virtual_pipeline: Optional[int] = None,
    expert_parallel: int = 1,
    seed: int = 1234,
    backend: Optional[str] = None,
    timeout_minutes: int = 10,
) -> ParallelLayout:
    """Start torch.distributed and megatron-core's parallel state; returns this rank's layout.

    The data-parallel size is what remains: world / (tp * pp * cp). `virtual_pipeline`: model
    chunks per pipeline rank (interleaved 1F1B; None or 1: one chunk). `expert_parallel`: MoE
    experts split over that many ranks of the data-parallel x context-parallel group (experts are
    never split over TP: expert TP is 1). Calling it again re-creates
    megatron's groups for a new layout on the same torch.distributed world.
    """
    global _COMPAT_HELD
    import_megatron_core()  # without compiling its fused kernels' decorators (megatron_import.py)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as mtp

    env = launch_env()
    model_parallel = tensor_parallel * pipeline_parallel * context_parallel
    if min(tensor_parallel, pipeline_parallel, context_parallel) < 1:
        raise ValueError(
            f"parallel sizes must be >= 1, got tensor_parallel={tensor_parallel}, "
            f"pipeline_parallel={pipeline_parallel}, context_parallel={context_parallel}"
        )
    if env.world_size % model_parallel:
        raise ValueError(
            f"world size {env.world_size} is not divisible by tensor_parallel x pipeline_parallel x "
            f"context_parallel = {tensor_parallel} x {pipeline_parallel} x {context_parallel}"
        )
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    elif not _COMPAT_HELD:  # once per runtime, however often the layout is re-initialised
        _COMPAT_HELD = cpu_compat.enable_cpu_compat()

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        # A world of one rendezvouses with nobody: a free port keeps two such processes (replay,
        # eval, a notebook) from colliding on the default 29500.
        lone = env.world_size == 1 and "MASTER_PORT" not in os.environ
        os.environ.setdefault("MASTER_PORT", str(free_port() if lone else env.master_port))
        dist.init_process_group(
            backend=backend or ("nccl" if use_cuda else "gloo"),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(minutes=timeout_minutes),
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        context_parallel_size=context_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline if (virtual_pipeline or 1) > 1 else None,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=timeout_minutes,
    )
    layout = current_layout(local_rank=env.local_rank)
    # Seeded as Megatron-LM does: offset per pipeline stage, then the model-parallel RNG tracker
    # (TP ranks get distinct streams for their shards).
    stage_seed = seed + 100 * layout.pp_rank
    random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    mtp.model_parallel_cuda_manual_seed(stage_seed)
    return layout


def current_layout(*, device: Optional[torch.device] = None, local_rank: int = 0) -> ParallelLayout:
    """The layout of this process from megatron-core's parallel state (must be initialised)."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        device=comm_device() if device is None else device,
        vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    )


def destroy_distributed() -> None:
    """Tear down megatron-core's groups, torch.distributed, and the CPU compatibility layer."""
    global _COMPAT_HELD
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    if _COMPAT_HELD:
        cpu_compat.disable_cpu_compat()
        _COMPAT_HELD = False
