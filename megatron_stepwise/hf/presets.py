"""Named model configs (HF keys) and resolution of `model.hf_config` (preset, path or hub id).

Importable without megatron-core: the config validator uses it to check head/layer divisibility.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from megatron_stepwise.hf.errors import ModelSourceError
from megatron_stepwise.hf.gguf import is_gguf_source
from megatron_stepwise.hf.hub import resolve_model_dir

# HF model class of each supported model_type (a config.json's `architectures`).
ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def tiny_config(
    *,
    model_type: str = "qwen2",
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    ffn_hidden_size: Optional[int] = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
    **overrides: Any,
) -> dict[str, Any]:
    """A tiny Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral config in HF keys (CPU-fast): the `tiny` preset,
    tests and tools.

    `ffn_hidden_size` defaults to 2 x hidden_size; `overrides` are further HF keys, set last.
    """
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size if ffn_hidden_size is None else ffn_hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    }
    if model_type in ARCHITECTURES:
        cfg["architectures"] = [ARCHITECTURES[model_type]]
    if model_type in ("qwen3", "qwen3_moe"):  # Qwen3 configs name head_dim explicitly (the HF default is 128)
        cfg.update(head_dim=hidden_size // num_heads, attention_bias=False)
    if model_type == "qwen3_moe":  # 4 experts of half the dense width, 2 per token, every layer MoE
        cfg.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.0,
        )
    if model_type == "mixtral":  # 4 experts of the dense width (intermediate_size), 2 per token, renormalised
        cfg.update(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            router_jitter_noise=0.0,
            output_router_logits=False,
            router_aux_loss_coef=0.0,
        )
    cfg.update(overrides)
    return cfg


PRESETS: dict[str, dict[str, Any]] = {
    # The CPU experiment and CI model: ~60k parameters, learns the `echo` task in minutes.
    "tiny": tiny_config(),
    # The same size as Qwen3 (per-head QK RMSNorm, explicit head_dim).
    "tiny_qwen3": tiny_config(model_type="qwen3"),
    # Qwen3-MoE of the same size: 4 experts (half the dense MLP width each), 2 per token.
    "tiny_qwen3_moe": tiny_config(model_type="qwen3_moe"),
    # Mixtral of the same size: 4 experts (the dense MLP width each, intermediate_size), 2 per token.
    "tiny_mixtral": tiny_config(model_type="mixtral"),
}


def resolve_hf_config(
    name_or_path: str, *, vocab_size: Optional[int] = None, key: str = "model.hf_config"
) -> dict[str, Any]:
    """An HF config dict from a preset name, a config.json, a model directory, or a hub id.

    For presets, `vocab_size` (the tokenizer's) replaces the preset's so model and tokenizer agree.
    Hub ids come from the local HF cache, else are downloaded (megatron_stepwise.hf.hub); `key` names
    the config key in errors (ModelSourceError).
    """
    if name_or_path in PRESETS:
        cfg = dict(PRESETS[name_or_path])
        if vocab_size is not None:
            cfg["vocab_size"] = int(vocab_size)
        return cfg
    if os.path.isfile(name_or_path) and not is_gguf_source(name_or_path):  # a config.json by any name
        path = name_or_path
    else:
        path = os.path.join(
            resolve_model_dir(name_or_path, key=key, also_tried=f"a preset ({', '.join(PRESETS)})"), "config.json"
        )
        if not os.path.isfile(path):
            raise ModelSourceError(f"{key}={name_or_path!r}: the directory has no config.json")
    with open(path) as f:
        return json.load(f)
