"""Full (unsharded) views of a megatron model's parameters and gradients, by canonical name.

A canonical name is the parameter's name in the unwrapped `GPTModel` with the layer index
made global (`decoder.layers.{pp_offset + i}`), so the same name means the same tensor at
every TP/PP layout. A full tensor is the concatenation of the TP shards along the
parameter's `partition_dim`, except for SwiGLU's `linear_fc1`, whose shard r holds
`[gate_r; up_r]` and whose full form is `[gate; up]` (independent of TP).

Used to give every layout identical weights (`init_deterministic`) and to
compare gradients across layouts (`full_state(grads=True)`). `gather_full` / `shard_full` are
also the basis for the HF export and import (`weights/convert.py`).
"""

from __future__ import annotations

import re
import zlib
from typing import Iterator

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_INDEX = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")  # local in modules, global in names


def _model(chunk):
    from megatron_stepwise.mcore.train.model import unwrap

    return unwrap(chunk)


def _layer_offset(model) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config, vp_stage=getattr(model, "vp_stage", None))


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def expert_parallel():
    """(EP size, EP rank, EP group); experts are split over EP, never over TP (ETP = 1)."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_group(),
    )


def canonical_params(chunk) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter) for one model chunk, in a rank-independent order. Layer and
    expert indices are global (this stage's layer offset, this EP rank's first expert)."""
    model = _model(chunk)
    offset = _layer_offset(model)
    tied_copy = model.share_embeddings_and_output_weights and not model.pre_process
    experts = model.config.num_moe_experts or 0
    if experts:
        ep, ep_rank, _ = expert_parallel()
        first_expert = experts // ep * ep_rank
    else:
        first_expert = 0
    for name, param in model.named_parameters():
        m = _LAYER.match(name)
        if m:
            name = f"decoder.layers.{int(m.group(1)) + offset}." + name[m.end() :]
            e = _EXPERT_INDEX.search(name)
            if e:
                name = f"{name[: e.start(1)]}{int(e.group(1)) + first_expert}{name[e.end(1) :]}"
        if tied_copy and name == "output_layer.weight":
            # The last stage's copy of the tied word embeddings (kept equal by megatron).
            name = "embedding.word_embeddings.weight"
        yield name, param


def _is_glu_fc1(name: str, model) -> bool:
    return model.config.gated_linear_unit and ".mlp.linear_fc1." in name


def _tp_split(param, name: str):
    """(TP size, TP rank, TP group) when `param` is split over TP, else None (experts never are)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False) or is_expert(name):
        return None
    return tp, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()


def gather_full(local: torch.Tensor, param, name: str, model) -> torch.Tensor:
    """The full tensor of `param` (canonical `name`, in unwrapped `model`) from this rank's
    shard `local` (its data or a gradient). Collective over the TP group; a copy at TP 1 and for
    experts (not split over TP)."""
    split = _tp_split(param, name)
    if split is None:
        return local.detach().clone()
    tp, _, group = split
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    dim = param.partition_dim
    if _is_glu_fc1(name, model):
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def shard_full(full: torch.Tensor, param, name: str, model) -> torch.Tensor:
    """This TP rank's shard of `full` for `param` (the inverse of `gather_full`); not a collective."""
    split = _tp_split(param, name)
    if split is None:
        return full
    tp, rank, _ = split
    dim = param.partition_dim
    if _is_glu_fc1(name, model):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[rank], up.chunk(tp, dim=dim)[rank]], dim=dim)
    return full.chunk(tp, dim=dim)[rank]


def full_shape(param, name: str) -> tuple[int, ...]:
    shape, split = list(param.shape), _tp_split(param, name)
    if split is not None:
        shape[param.partition_dim] *= split[0]
    return tuple(shape)


def full_state(chunks: list, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors (fp32, CPU) of this pipeline stage's parameters, or of their gradients
    (`main_grad` under megatron DDP). Collective over the TP group."""
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        model = _model(chunk)
        for name, param in canonical_params(chunk):
            local = param.data
            if grads:  # megatron DDP accumulates into main_grad
                local = next(
                    (g for g in (getattr(param, "main_grad", None), param.grad) if g is not None),
                    torch.zeros_like(param),
                )
            full = gather_full(local.float(), param, name, model)
            out.update({n: t.cpu() for n, t in all_experts(name, full, model)})
    return out


def expert_names(name: str, model) -> list[str]:
    """[name], or for an expert under expert parallelism the names of the corresponding expert of
    every EP rank, in EP rank order."""
    ep, rank, _ = expert_parallel()
    if not is_expert(name) or ep == 1:
        return [name]
    per_rank = model.config.num_moe_experts // ep
    e = _EXPERT_INDEX.search(name)
    local = int(e.group(1)) - rank * per_rank
    return [f"{name[: e.start(1)]}{r * per_rank + local}{name[e.end(1) :]}" for r in range(ep)]


def all_experts(name: str, full: torch.Tensor, model) -> list[tuple[str, torch.Tensor]]:
    """[(name, full)], or for an expert tensor under expert parallelism the same tensor of every
    EP rank's corresponding expert (collective over the EP group)."""
    names = expert_names(name, model)
    if len(names) == 1:
        return [(name, full)]
    parts = [torch.empty_like(full) for _ in names]
    dist.all_gather(parts, full.contiguous(), group=expert_parallel()[2])
    return list(zip(names, parts))


def deterministic_full_tensor(name: str, shape: tuple[int, ...], seed: int, std: float = 0.02) -> torch.Tensor:
    """A layout-independent value for parameter `name`: seeded by (seed, name).

    1-D norm weights get 1 + 0.1 * noise (so they matter), biases 0.02 * noise, matrices
    std * noise.
    """
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1 and "norm" in name:
        return 1.0 + 0.1 * noise
    if len(shape) == 1:
        return 0.02 * noise
    return std * noise


@torch.no_grad()
def init_deterministic(chunks: list, seed: int = 0, std: float = 0.02) -> None:
    """Give every parameter its layout-independent deterministic value (see above)."""
    for chunk in chunks:
        model = _model(chunk)
        for name, param in canonical_params(chunk):
            full = deterministic_full_tensor(name, full_shape(param, name), seed, std)
            param.data.copy_(shard_full(full, param, name, model).to(param.dtype))
