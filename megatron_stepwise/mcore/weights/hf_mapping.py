"""Megatron <-> Hugging Face weights for the Llama / Qwen2 / Qwen3 family, Qwen3-MoE and Mixtral.

The Megatron side is the canonical full tensor of `weights/full_views.py` (TP shards
concatenated, layer index global, SwiGLU fc1 as `[gate; up]`). Everything here is exact
(slicing, reshaping, concatenation), so HF -> Megatron -> HF is bit-identical; vocabulary padding
rows are dropped on export and zero-filled on import. Pure functions, no torch.distributed: the
TP/PP-aware streaming, export and import built on them are in `weights/convert.py`. They take the
parsed `GPTArch` (`hf.arch.arch_from_hf`, once by the caller), never an HF config.

The per-layer name table: docs/weights.md, 'The Megatron <-> Hugging Face name mapping'.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Optional

import torch

from megatron_stepwise.errors import UserError
from megatron_stepwise.hf.arch import GPTArch

EMBED = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
_TOP_LEVEL = {EMBED: "model.embed_tokens.weight", FINAL_NORM: "model.norm.weight", OUTPUT: "lm_head.weight"}
_VOCAB_ROWS = (EMBED, OUTPUT)

# One megatron tensor <-> one HF tensor, by the name suffix after the layer prefix.
_LAYER_ONE_TO_ONE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
# Expert `e` (global index) of a MoE layer: the checkpoint (on-disk) per-expert names, under
# `_MOE_PREFIX` (Qwen3-MoE's `mlp`, Mixtral's `block_sparse_moe`).
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_EXPERT_HF = {
    "qwen3_moe": {"linear_fc1": ("gate_proj.weight", "up_proj.weight"), "linear_fc2": ("down_proj.weight",)},
    "mixtral": {"linear_fc1": ("w1.weight", "w3.weight"), "linear_fc2": ("w2.weight",)},
}
_MOE_PREFIX = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}
ROUTER = "mlp.router.weight"
# One fused megatron tensor <-> several HF tensors (in this order).
_LAYER_FUSED = {
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Buffers some HF checkpoints carry that are recomputed by the model, never weights.
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class WeightConversionError(UserError, ValueError):
    """A tensor that does not fit the mapping: unknown name, wrong shape, missing tensor."""


# ----------------------------------------------------------------------------- names


def _moe_type(arch: Optional[GPTArch]) -> str:
    """Whose checkpoint names the MoE tensors take: 'mixtral' or 'qwen3_moe' (the default)."""
    return "mixtral" if arch is not None and arch.model_type == "mixtral" else "qwen3_moe"


def hf_names_for(name: str, arch: Optional[GPTArch] = None) -> tuple[str, ...]:
    """The HF tensor name(s) one canonical megatron tensor maps to.

    arch picks the MoE names: Mixtral's hub names for a Mixtral model, Qwen3-MoE's otherwise
    (dense tensors are named the same in every supported family).
    """
    if name in _TOP_LEVEL:
        return (_TOP_LEVEL[name],)
    m = _LAYER.match(name)
    if m:
        layer, rest = m.groups()
        moe = _moe_type(arch)
        if rest == ROUTER:
            return (f"model.layers.{layer}.{_MOE_PREFIX[moe]}.gate.weight",)
        if rest in _LAYER_ONE_TO_ONE:
            return (f"model.layers.{layer}.{_LAYER_ONE_TO_ONE[rest]}",)
        if rest in _LAYER_FUSED:
            return tuple(f"model.layers.{layer}.{suffix}" for suffix in _LAYER_FUSED[rest])
        e = _EXPERT.match(rest)
        if e:
            prefix = f"model.layers.{layer}.{_MOE_PREFIX[moe]}.experts.{e.group(1)}"
            return tuple(f"{prefix}.{suffix}" for suffix in _EXPERT_HF[moe][e.group(2)])
    raise WeightConversionError(f"no Hugging Face mapping for megatron parameter {name!r}")


def canonical_names(arch: GPTArch, *, te_spec: bool = False) -> list[str]:
    """Every canonical megatron tensor name of the whole model, in model order."""
    input_norm = "self_attention.linear_qkv.layer_norm_weight" if te_spec else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te_spec else "pre_mlp_layernorm.weight"
    names = [EMBED]
    for i in range(arch.num_layers):
        layer = [input_norm, "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight"]
        if arch.qkv_bias:
            layer.append("self_attention.linear_qkv.bias")
        if arch.qk_norm:
            layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
        if arch.num_experts:
            layer += [mlp_norm, "mlp.router.weight"]
            for e in range(arch.num_experts):
                layer += [
                    f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                    f"mlp.experts.local_experts.{e}.linear_fc2.weight",
                ]
        else:
            layer += [mlp_norm, "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
        names += [f"decoder.layers.{i}.{suffix}" for suffix in layer]
    names.append(FINAL_NORM)
    if not arch.tie_word_embeddings:
        names.append(OUTPUT)
    return names


def hf_names(arch: GPTArch) -> list[str]:
    """Every HF tensor name a checkpoint of this architecture holds (tied: no lm_head)."""
    return [hf for name in canonical_names(arch) for hf in hf_names_for(name, arch)]


# ----------------------------------------------------------------------------- tensors


def _ffn_size(name: str, arch: GPTArch) -> int:
    """The MLP width of `name`: an expert's (moe_intermediate_size) or the dense one's."""
    return arch.moe_ffn_hidden_size if ".mlp.experts." in name else arch.ffn_hidden_size


def _qkv_rows(arch: GPTArch) -> tuple[int, int, int]:
    groups, head_dim = arch.num_kv_heads, arch.head_dim
    return groups, arch.num_heads // groups, head_dim


def _check_shape(name: str, tensor: torch.Tensor, dim0: int, rest: tuple[int, ...], what: str) -> None:
    if tensor.dim() != 1 + len(rest) or tensor.shape[0] != dim0 or tuple(tensor.shape[1:]) != rest:
        raise WeightConversionError(
            f"{name}: shape {tuple(tensor.shape)} does not match the model config (expected {(dim0, *rest)} for {what})"
        )


def _split_qkv(name: str, qkv: torch.Tensor, arch: GPTArch) -> list[torch.Tensor]:
    groups, q_per_group, head_dim = _qkv_rows(arch)
    rest = tuple(qkv.shape[1:])
    _check_shape(
        name,
        qkv,
        groups * (q_per_group + 2) * head_dim,
        rest,
        f"{arch.num_heads} query heads in {groups} groups of head_dim {head_dim}",
    )
    grouped = qkv.reshape(groups, q_per_group + 2, head_dim, *rest)
    q = grouped[:, :q_per_group].reshape(arch.num_heads * head_dim, *rest)
    k = grouped[:, q_per_group].reshape(groups * head_dim, *rest)
    v = grouped[:, q_per_group + 1].reshape(groups * head_dim, *rest)
    return [q, k, v]


def _fuse_qkv(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: GPTArch) -> torch.Tensor:
    groups, q_per_group, head_dim = _qkv_rows(arch)
    rest = tuple(q.shape[1:])
    q_name, k_name, v_name = hf_names_for(name, arch)
    _check_shape(q_name, q, arch.num_heads * head_dim, rest, f"{arch.num_heads} heads x head_dim {head_dim}")
    _check_shape(k_name, k, groups * head_dim, rest, f"{groups} key/value heads x head_dim {head_dim}")
    _check_shape(v_name, v, groups * head_dim, rest, f"{groups} key/value heads x head_dim {head_dim}")
    grouped = torch.cat(
        [
            q.reshape(groups, q_per_group, head_dim, *rest),
            k.reshape(groups, 1, head_dim, *rest),
            v.reshape(groups, 1, head_dim, *rest),
        ],
        dim=1,
    )
    return grouped.reshape(groups * (q_per_group + 2) * head_dim, *rest)


def to_hf(name: str, tensor: torch.Tensor, arch: GPTArch) -> list[tuple[str, torch.Tensor]]:
    """One canonical megatron tensor -> its HF (name, tensor) pairs.

    Outputs never share storage with each other or with the input's padding rows, so they can
    be written with safetensors directly.
    """
    names = hf_names_for(name, arch)
    if name in _VOCAB_ROWS:
        if tensor.shape[0] < arch.vocab_size:
            raise WeightConversionError(
                f"{name}: {tensor.shape[0]} vocabulary rows, fewer than the config's vocab_size={arch.vocab_size}"
            )
        parts = [tensor[: arch.vocab_size]]  # drop megatron's vocabulary padding
    elif name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        parts = _split_qkv(name, tensor, arch)
    elif name.endswith("linear_fc1.weight"):
        ffn = _ffn_size(name, arch)
        if tensor.shape[0] != 2 * ffn:
            raise WeightConversionError(
                f"{name}: shape {tuple(tensor.shape)} does not hold [gate; up] of an MLP of width {ffn}"
            )
        parts = list(tensor.chunk(2, dim=0))
    else:
        parts = [tensor]
    return [(hf, part.clone(memory_format=torch.contiguous_format)) for hf, part in zip(names, parts)]


def from_hf(
    name: str, hf_tensors: Mapping[str, torch.Tensor], arch: GPTArch, *, vocab_rows: Optional[int] = None
) -> torch.Tensor:
    """The canonical megatron tensor `name` from the HF tensors it maps to.

    vocab_rows: megatron's (padded) vocabulary size for the embedding / output layer; padding
    rows are zero.
    """
    names = hf_names_for(name, arch)
    missing = [n for n in names if n not in hf_tensors]
    if missing:
        raise WeightConversionError(f"megatron parameter {name!r} needs HF tensor(s) {missing}, not in the checkpoint")
    parts = [hf_tensors[n] for n in names]
    if name in _VOCAB_ROWS:
        (table,) = parts
        _check_shape(names[0], table, arch.vocab_size, (arch.hidden_size,), "vocab_size x hidden_size")
        rows = arch.vocab_size if vocab_rows is None else vocab_rows
        if rows < arch.vocab_size:
            raise WeightConversionError(
                f"{name}: the megatron model has {rows} vocabulary rows, fewer than the checkpoint's {arch.vocab_size}"
            )
        if rows == arch.vocab_size:
            return table.clone()
        return torch.cat([table, table.new_zeros(rows - arch.vocab_size, table.shape[1])])
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return _fuse_qkv(name, *parts, arch)
    if name.endswith("linear_fc1.weight"):
        gate, up = parts
        ffn = _ffn_size(name, arch)
        for hf, t in zip(names, parts):
            _check_shape(hf, t, ffn, (arch.hidden_size,), f"MLP width {ffn} x hidden_size")
        return torch.cat([gate, up], dim=0)
    (single,) = parts
    return single.clone()


# ----------------------------------------------------------------------------- whole state dicts


def canonical_to_hf(state: Mapping[str, torch.Tensor], arch: GPTArch) -> dict[str, torch.Tensor]:
    """A whole canonical megatron state (e.g. `weights.full_state`) -> an HF state dict."""
    if arch.tie_word_embeddings and OUTPUT in state:
        raise WeightConversionError(f"tie_word_embeddings=True but the megatron state has a separate {OUTPUT!r}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        out.update(to_hf(name, tensor, arch))
    missing = sorted(set(hf_names(arch)) - set(out))
    if missing:
        raise WeightConversionError(
            f"the megatron state lacks tensors for HF {missing[:6]}{' ...' if len(missing) > 6 else ''}"
        )
    return out


def check_hf_names(names: Iterable[str], arch: GPTArch) -> None:
    """Raise if a checkpoint's tensor names do not match the architecture (missing or unknown)."""
    have = {n for n in names if not _HF_IGNORED.search(n)}
    want = set(hf_names(arch))
    if arch.tie_word_embeddings:
        have.discard("lm_head.weight")  # some tied checkpoints still store the (equal) copy
    missing, unknown = sorted(want - have), sorted(have - want)
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s), e.g. {missing[:4]}")
    if unknown:
        layers = {int(m.group(1)) for n in unknown if (m := _HF_LAYER.match(n))}
        hint = f" (layers {sorted(layers)[:4]} are beyond num_hidden_layers={arch.num_layers}?)" if layers else ""
        problems.append(f"{len(unknown)} tensor(s) not in a {arch.model_type} model, e.g. {unknown[:4]}{hint}")
    if problems:
        raise WeightConversionError("HF checkpoint does not match the model config: " + "; ".join(problems))


def hf_to_canonical(
    hf_state: Mapping[str, torch.Tensor], arch: GPTArch, *, te_spec: bool = False, vocab_rows: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """An HF state dict -> the whole canonical megatron state (local or TE norm names)."""
    check_hf_names(hf_state.keys(), arch)
    return {
        name: from_hf(name, hf_state, arch, vocab_rows=vocab_rows) for name in canonical_names(arch, te_spec=te_spec)
    }
