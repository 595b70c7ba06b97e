"""Build a megatron-core `GPTModel` from a Hugging Face config of the Llama / Qwen2 / Qwen3 family
and the Qwen3-MoE / Mixtral mixtures of experts.

RMSNorm, SwiGLU, RoPE (theta, Llama-3 scaling), GQA, Qwen2's qkv bias, Qwen3's per-head QK
RMSNorm and explicit head_dim, tied or untied embeddings, top-k routed experts in every layer.
The Transformer Engine spec is used when TE imports; otherwise the local spec with the
torch-native packed attention and norm of `local_layers`. bf16 on GPU, fp32 on CPU.

Both paths take THD packed micro-batches (`PackedSeqParams`), see `packing.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F

from megatron_stepwise.hf import presets

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


class ModelConfigError(ValueError):
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


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default) if not isinstance(cfg, Mapping) else cfg.get(name, default)


def _rope(cfg: Any) -> tuple[float, Optional[float]]:
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


def arch_from_hf(cfg: Any) -> GPTArch:
    """Normalise a transformers `LlamaConfig` / `Qwen2Config` / `Qwen3Config` / `Qwen3MoeConfig` /
    `MixtralConfig` (or an equivalent dict)."""
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


def _moe_fields(cfg: Any) -> dict:
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
            raise ModelConfigError(f"sliding_window={_get(cfg, 'sliding_window')} is not supported "
                                   "(Mixtral with full causal attention only: sliding_window must be null)")
        # HF multiplies the MoE input by U(1 - eps, 1 + eps) noise when training; nothing here does.
        jitter = _get(cfg, "router_jitter_noise", 0.0)
        if float(jitter or 0.0) != 0.0:
            raise ModelConfigError(f"router_jitter_noise={jitter} is not supported (must be 0)")
        # output_router_logits / router_aux_loss_coef only add HF's load-balancing loss to a
        # forward given labels; the step-wise loss owns router losses, so they are ignored.
        # The expert width is intermediate_size; the top-k probabilities are always renormalised.
        return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=int(_get(cfg, "intermediate_size")),
                    moe_norm_topk=True)
    if int(_get(cfg, "decoder_sparse_step", 1) or 1) != 1 or _get(cfg, "mlp_only_layers"):
        raise ModelConfigError("decoder_sparse_step != 1 / mlp_only_layers (dense layers in a MoE model) are not supported")
    return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=int(_get(cfg, "moe_intermediate_size")),
                moe_norm_topk=bool(_get(cfg, "norm_topk_prob", True)))


def tiny_config(*, num_layers: int = 4, **kwargs: Any) -> dict:
    """`hf.presets.tiny_config` with 4 layers by default (PP x VPP splits in tests and tools)."""
    return presets.tiny_config(num_layers=num_layers, **kwargs)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Rows of the embedding and output layer: the vocabulary rounded up to a multiple of TP.
    Padding rows are never looked up, and the log-prob head leaves them out of the softmax
    (`StepwisePlugin(vocab_size=...)`), so log-probs match the unpadded HF model."""
    return vocab_size + (-vocab_size) % tp


def validate_parallel(arch: GPTArch, *, tp: int, pp: int, tokenizer_vocab_size: Optional[int] = None,
                      vpp: int = 1) -> None:
    """Clear errors for layouts the model cannot be split into, and vocab mismatches."""
    checks = [
        ("num_attention_heads", arch.num_heads, tp, "tensor_parallel"),
        ("num_key_value_heads", arch.num_kv_heads, tp, "tensor_parallel"),
        ("intermediate_size", arch.ffn_hidden_size, tp, "tensor_parallel"),
        ("num_hidden_layers", arch.num_layers, pp, "pipeline_parallel"),
        ("num_hidden_layers", arch.num_layers, pp * vpp, "pipeline_parallel x virtual_pipeline"),
    ]
    for key, value, size, what in checks:
        if value % size:
            raise ModelConfigError(f"{what}={size} does not divide {key}={value}")
    if padded_vocab_size(arch.vocab_size, tp) // tp * (tp - 1) >= arch.vocab_size:
        raise ModelConfigError(f"vocab_size={arch.vocab_size} is too small to split over tensor_parallel={tp}")
    if arch.num_heads % arch.num_kv_heads:
        raise ModelConfigError(f"num_key_value_heads={arch.num_kv_heads} does not divide "
                               f"num_attention_heads={arch.num_heads}")
    if tokenizer_vocab_size is not None and tokenizer_vocab_size > arch.vocab_size:
        raise ModelConfigError(f"tokenizer has {tokenizer_vocab_size} tokens but the model's vocab_size "
                               f"is {arch.vocab_size}")


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions import transformer_engine as _te  # noqa: F401
    except Exception:
        return False
    return True


def transformer_config(arch: GPTArch, *, tp: int = 1, pp: int = 1, cp: int = 1,
                       sequence_parallel: Optional[bool] = None, dtype: Optional[torch.dtype] = None,
                       use_te: Optional[bool] = None, **overrides: Any):
    """The megatron `TransformerConfig` for `arch` at this layout (overrides win)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    use_te = te_available() if use_te is None else use_te
    dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
    fields = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0, attention_dropout=arch.attention_dropout, init_method_std=arch.init_std,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        sequence_parallel=(tp > 1 if sequence_parallel is None else sequence_parallel) and tp > 1,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # Micro-batches are packed to different lengths: PP must exchange shapes.
        variable_seq_lengths=True,
        # allgather (the default) refuses variable_seq_lengths, even for a dense model.
        moe_token_dispatcher_type="alltoall",
        # Fusions that need CUDA kernels stay off unless TE provides them.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=bool(use_te and on_gpu), persist_layer_norm=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=not on_gpu,
        # gloo matches a batch's sends and receives by peer and order: with PP=2 both neighbours
        # are one rank, and the interleaved schedule's batched activation and gradient exchange
        # would swap them. The unbatched path sends each direction on its own group.
        batch_p2p_comm=on_gpu,
    )
    if arch.num_experts:
        fields.update(
            num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            # HF: softmax over all experts, top-k, renormalised (norm_topk_prob) or not. Megatron:
            # softmax over the top-k logits (the same renormalised probabilities), or pre-softmax.
            moe_router_pre_softmax=not arch.moe_norm_topk, moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",  # router losses are the step-wise loss's business
            moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, moe_router_dtype="fp32",
            expert_tensor_parallel_size=1,  # experts are split over EP, not TP
        )
    fields.update(overrides)
    return TransformerConfig(**fields)


def layer_spec(config, *, use_te: bool, vp_stage: Optional[int] = None):
    """Decoder block spec: TE spec, or megatron's local spec with our packed attention + norm."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if use_te:
        return specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage
        )
    if config.num_moe_experts:
        _patch_router_gemm()
    from megatron_stepwise.megatron.local_layers import LocalRMSNorm, PackedCausalAttention

    base = specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm,
                                          num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    attn = base.submodules.self_attention
    qk_norm = LocalRMSNorm if config.qk_layernorm else None
    attn_sub = dataclasses.replace(attn.submodules, core_attention=PackedCausalAttention,
                                   q_layernorm=qk_norm, k_layernorm=qk_norm)
    sub = dataclasses.replace(base.submodules, input_layernorm=LocalRMSNorm, pre_mlp_layernorm=LocalRMSNorm,
                              self_attention=dataclasses.replace(attn, submodules=attn_sub))
    layer = dataclasses.replace(base, submodules=sub)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=LocalRMSNorm)


def _patch_router_gemm() -> None:
    """megatron-core 0.16's router refers to Transformer Engine's GEMM, undefined (NameError) when
    TE is absent; None selects its torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(hf_config: Any, *, pre_process: Optional[bool] = None,
                    post_process: Optional[bool] = None, use_te: Optional[bool] = None,
                    config_overrides: Optional[dict] = None,
                    tokenizer_vocab_size: Optional[int] = None, vp_stage: Optional[int] = None):
    """One GPTModel chunk for this rank's pipeline stage (parallel state must be initialised)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    arch = hf_config if isinstance(hf_config, GPTArch) else arch_from_hf(hf_config)
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    validate_parallel(arch, tp=tp, pp=pp, tokenizer_vocab_size=tokenizer_vocab_size, vpp=vpp or 1)
    use_te = te_available() if use_te is None else use_te
    overrides = dict(config_overrides or {})
    if arch.num_experts:
        # The model config must know EP: it marks expert weights so DDP reduces their gradients
        # over the expert-data-parallel group, not the whole DP group (which holds other experts).
        ep = ps.get_expert_model_parallel_world_size()
        if arch.num_experts % ep:
            raise ModelConfigError(f"expert_parallel={ep} does not divide num_experts={arch.num_experts}")
        overrides.setdefault("expert_model_parallel_size", ep)
    if vpp is not None:  # interleaved pipeline: this chunk's layers depend on vp_stage
        overrides.setdefault("virtual_pipeline_model_parallel_size", vpp)
        if vp_stage is None:
            raise ValueError(f"virtual pipeline parallelism ({vpp} chunks per rank) needs the chunk's vp_stage")
    config = transformer_config(arch, tp=tp, pp=pp, cp=cp, use_te=use_te, **overrides)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(config, use_te=use_te, vp_stage=vp_stage),
        vocab_size=padded_vocab_size(arch.vocab_size, tp), max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings, position_embedding_type="rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0, vp_stage=vp_stage,
    )
    model.unpadded_vocab_size = arch.vocab_size  # what the plugin scores over (see padded_vocab_size)
    return model


def model_provider(hf_config: Any, **kwargs: Any) -> Callable[..., Any]:
    """A Megatron-LM style `model_provider(pre_process, post_process, vp_stage=None)`."""

    def provide(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None, **_):
        return build_gpt_model(hf_config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage, **kwargs)

    return provide


def wrap_ddp(model, *, use_distributed_optimizer: bool = False, grad_reduce_in_fp32: bool = True,
             overlap_grad_reduce: bool = False, disable_bucketing: bool = False, **ddp_kwargs: Any):
    """Wrap a built chunk in megatron's DDP (and Float16Module for bf16/fp16 on GPU)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = model.config
    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer, **ddp_kwargs)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                   disable_bucketing=disable_bucketing)


def build_model_chunks(hf_config: Any, *, wrap: bool = True, use_distributed_optimizer: bool = False,
                       init: Optional[Callable[[list], None]] = None, **build_kwargs: Any) -> list:
    """This rank's model chunks, one per virtual pipeline stage (one without virtual pipeline
    parallelism), built and DDP-wrapped.

    `init(chunks)` runs on the bare chunks before wrapping (e.g. loading weights).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    stages = [None] if vpp is None else list(range(vpp))
    bare = [build_gpt_model(hf_config, vp_stage=stage, **build_kwargs) for stage in stages]
    if not torch.cuda.is_available():
        bare = [chunk.to(torch.device("cpu")) for chunk in bare]
    if init is not None:
        init(bare)
    if not wrap:
        return bare
    # As Megatron-LM does: only the first chunk's gradients are bucketed for overlap.
    chunks = [wrap_ddp(chunk, use_distributed_optimizer=use_distributed_optimizer, disable_bucketing=i > 0)
              for i, chunk in enumerate(bare)]
    # What Megatron-LM's setup does: the schedules call these to reduce gradients over DP
    # (and SP norms, tied embeddings across PP) and to skip grad sync between micro-batches.
    no_sync = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
    for chunk in bare:
        chunk.config.finalize_model_grads_func = finalize_model_grads
        chunk.config.no_sync_func = no_sync
    return chunks


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model, "decoder", return_model_obj=True)

