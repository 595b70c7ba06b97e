"""The model architecture of a Hugging Face config, parsed once: `arch_from_hf` -> `GPTArch`.

Pure Python (no torch, no megatron-core), so config validation reads the same facts as the
Megatron builder (mcore/train/model.py), the weight mapping and the rollout fleet. An entry point
(the run's composition root, a CLI command, a public builder taking an HF config) parses once;
everything below it takes the `GPTArch` (or the `ModelSpec` pairing it with its HF config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

from megatron_stepwise.errors import UserError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# An HF config as users hold it: a dict of config.json keys or a transformers config object.
HFConfig = Union[Mapping[str, Any], "PretrainedConfig"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


class ModelConfigError(UserError, ValueError):
    """A model config that this builder (or the requested parallel layout) cannot use."""


@dataclass(frozen=True)
class GPTArch:
    """The architecture facts the builder needs, normalised from an HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: Optional[float]  # Llama-3 style scaling, None when absent
    qkv_bias: bool
    qk_norm: bool  # RMSNorm over each query and key head before RoPE (Qwen3)
    tie_word_embeddings: bool
    max_position_embeddings: int
    init_std: float
    attention_dropout: float
    # Mixture of experts (Qwen3-MoE, Mixtral): 0 experts = a dense MLP in every layer.
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk: bool = True  # renormalise the top-k router probabilities (HF norm_topk_prob)


@dataclass(frozen=True)
class ModelSpec:
    """A model as a run holds it: the HF config (what engines load and exports write as
    config.json, verbatim) and its architecture, parsed from it once (`model_spec`)."""

    hf_config: HFConfig
    arch: GPTArch


def model_spec(hf_config: HFConfig) -> ModelSpec:
    """Parse `hf_config` once (ModelConfigError naming the key when this builder cannot use it)."""
    return ModelSpec(hf_config, arch_from_hf(hf_config))


def _get(cfg: HFConfig, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default) if not isinstance(cfg, Mapping) else cfg.get(name, default)


def _rope(cfg: HFConfig) -> tuple[float, Optional[float]]:
    # transformers 5 keeps theta/scaling in `rope_parameters`; 4.x in rope_theta/rope_scaling.
    params = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
    # A config without a theta means the model class's default (transformers: 1e6 for Mixtral).
    default_theta = 1000000.0 if _get(cfg, "model_type") == "mixtral" else 10000.0
    theta = params.get("rope_theta") or _get(cfg, "rope_theta") or default_theta
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type == "llama3":
        # megatron-core implements Llama-3 scaling with these constants fixed; only the factor varies.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, want in fixed.items():
            if key in params and float(params[key]) != want:
                raise ModelConfigError(
                    f"rope_scaling.{key}={params[key]} is not supported (megatron-core fixes it to {want})"
                )
        return float(theta), float(params.get("factor", 8.0))
    raise ModelConfigError(f"rope_scaling type {rope_type!r} is not supported (only default and llama3)")


def arch_from_hf(cfg: HFConfig) -> GPTArch:
    """Normalise a transformers `LlamaConfig` / `Qwen2Config` / `Qwen3Config` / `Qwen3MoeConfig` /
    `MixtralConfig` (or an equivalent dict)."""
    if isinstance(cfg, GPTArch):  # it has some config keys as attributes: say what happened, not "missing key"
        raise TypeError("arch_from_hf got a GPTArch, already parsed: pass it to the *_from_arch builders instead")
    model_type = _get(cfg, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if _get(cfg, key) is None:
            raise ModelConfigError(f"model config is missing {key!r}")
    act = _get(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"hidden_act={act!r} is not supported (SwiGLU needs 'silu')")
    if _get(cfg, "mlp_bias", False):
        raise ModelConfigError("mlp_bias=True is not supported")
    if _get(cfg, "use_sliding_window", False):
        raise ModelConfigError("use_sliding_window=True is not supported")
    heads = int(_get(cfg, "num_attention_heads"))
    hidden = int(_get(cfg, "hidden_size"))
    theta, scaling = _rope(cfg)
    return GPTArch(
        **_moe_fields(cfg),
        model_type=model_type,
        vocab_size=int(_get(cfg, "vocab_size")),
        hidden_size=hidden,
        ffn_hidden_size=int(_get(cfg, "intermediate_size")),
        num_layers=int(_get(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads") or heads),
        head_dim=int(_get(cfg, "head_dim") or hidden // heads),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling_factor=scaling,
        qkv_bias=model_type == "qwen2" or bool(_get(cfg, "attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 4096)),
        init_std=float(_get(cfg, "initializer_range", 0.02)),
        attention_dropout=float(_get(cfg, "attention_dropout", 0.0) or 0.0),
    )


def _moe_fields(cfg: HFConfig) -> dict[str, Any]:
    """The GPTArch MoE fields of a Qwen3-MoE or Mixtral config (none for a dense one).

    Both route as HF does: softmax over all experts, top-k, then (Mixtral always, Qwen3-MoE with
    norm_topk_prob) the k probabilities renormalised to sum to 1, which is megatron's softmax over
    the top-k logits (`moe_router_pre_softmax=False`). Every layer is a MoE layer, drop-less.
    """
    model_type = _get(cfg, "model_type")
    if model_type not in MOE_MODEL_TYPES:
        return {}
    # Qwen3-MoE hub configs say num_experts, Mixtral's num_local_experts (transformers aliases them).
    experts = int(_get(cfg, "num_experts") or _get(cfg, "num_local_experts") or 0)
    if not experts and model_type == "qwen3_moe":
        return {}  # HF builds a dense MLP in every layer of a Qwen3-MoE config without experts
    if experts < 1:
        raise ModelConfigError(f"num_local_experts={experts} is not supported (a {model_type} model needs >= 1)")
    if _get(cfg, "num_experts_per_tok") is None:
        raise ModelConfigError(f"a {model_type} config needs num_experts_per_tok")
    topk = int(_get(cfg, "num_experts_per_tok"))
    if not 1 <= topk <= experts:
        raise ModelConfigError(f"num_experts_per_tok={topk} must be in [1, num_experts={experts}]")
    if model_type == "mixtral":
        # Mixtral's attention may be windowed (Mistral style); megatron's here is full causal.
        if _get(cfg, "sliding_window") is not None:
            raise ModelConfigError(
                f"sliding_window={_get(cfg, 'sliding_window')} is not supported "
                "(Mixtral with full causal attention only: sliding_window must be null)"
            )
        # HF multiplies the MoE input by U(1 - eps, 1 + eps) noise when training; nothing here does.
        jitter = _get(cfg, "router_jitter_noise", 0.0)
        if float(jitter or 0.0) != 0.0:
            raise ModelConfigError(f"router_jitter_noise={jitter} is not supported (must be 0)")
        # output_router_logits / router_aux_loss_coef only add HF's load-balancing loss to a
        # forward given labels; the step-wise loss owns router losses, so they are ignored.
        # The expert width is intermediate_size; the top-k probabilities are always renormalised.
        return dict(
            num_experts=experts,
            moe_topk=topk,
            moe_ffn_hidden_size=int(_get(cfg, "intermediate_size")),
            moe_norm_topk=True,
        )
    if int(_get(cfg, "decoder_sparse_step", 1) or 1) != 1 or _get(cfg, "mlp_only_layers"):
        raise ModelConfigError(
            "decoder_sparse_step != 1 / mlp_only_layers (dense layers in a MoE model) are not supported"
        )
    return dict(
        num_experts=experts,
        moe_topk=topk,
        moe_ffn_hidden_size=int(_get(cfg, "moe_intermediate_size")),
        moe_norm_topk=bool(_get(cfg, "norm_topk_prob", True)),
    )


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Rows of the embedding and output layer: the vocabulary rounded up to a multiple of TP.
    Padding rows are never looked up, and the log-prob head leaves them out of the softmax
    (`StepwisePlugin(vocab_size=...)`), so log-probs match the unpadded HF model."""
    return vocab_size + (-vocab_size) % tp


def split_problems(arch: GPTArch, *, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1) -> list[tuple[str, str]]:
    """(parallel size, why) for each way a layout cannot split `arch`; the size is "tensor",
    "pipeline" or "expert". Config validation names its key, the builder raises the first."""
    checks = [
        ("tensor", "num_attention_heads", arch.num_heads, tp, "tensor_parallel"),
        ("tensor", "num_key_value_heads", arch.num_kv_heads, tp, "tensor_parallel"),
        ("tensor", "intermediate_size", arch.ffn_hidden_size, tp, "tensor_parallel"),
        ("pipeline", "num_hidden_layers", arch.num_layers, pp, "pipeline_parallel"),
    ]
    if vpp > 1:
        checks.append(
            ("pipeline", "num_hidden_layers", arch.num_layers, pp * vpp, "pipeline_parallel x virtual_pipeline")
        )
    out = [(size, f"{what}={n} does not divide {key}={value}") for size, key, value, n, what in checks if value % n]
    if padded_vocab_size(arch.vocab_size, tp) // tp * (tp - 1) >= arch.vocab_size:
        out.append(("tensor", f"vocab_size={arch.vocab_size} is too small to split over tensor_parallel={tp}"))
    if ep > 1 and not arch.num_experts:
        out.append(("expert", f"expert_parallel={ep} needs a mixture-of-experts model (this one is dense)"))
    elif arch.num_experts % ep:
        out.append(("expert", f"expert_parallel={ep} does not divide num_experts={arch.num_experts}"))
    return out


def validate_parallel(
    arch: GPTArch, *, tp: int, pp: int, tokenizer_vocab_size: Optional[int] = None, vpp: int = 1, ep: int = 1
) -> None:
    """Clear errors for layouts the model cannot be split into, and vocab mismatches."""
    problems = split_problems(arch, tp=tp, pp=pp, vpp=vpp, ep=ep)
    if problems:
        raise ModelConfigError(problems[0][1])
    if arch.num_heads % arch.num_kv_heads:
        raise ModelConfigError(
            f"num_key_value_heads={arch.num_kv_heads} does not divide num_attention_heads={arch.num_heads}"
        )
    if tokenizer_vocab_size is not None and tokenizer_vocab_size > arch.vocab_size:
        raise ModelConfigError(
            f"tokenizer has {tokenizer_vocab_size} tokens but the model's vocab_size is {arch.vocab_size}"
        )
