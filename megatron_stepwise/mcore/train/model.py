"""Build a megatron-core `GPTModel` from a Hugging Face config of the Llama / Qwen2 / Qwen3 family
and the Qwen3-MoE / Mixtral mixtures of experts.

RMSNorm, SwiGLU, RoPE (theta, Llama-3 scaling), GQA, Qwen2's qkv bias, Qwen3's per-head QK
RMSNorm and explicit head_dim, tied or untied embeddings, top-k routed experts in every layer.
The Transformer Engine spec is used when TE imports; otherwise the local spec with the
torch-native packed attention of `local_layers` and the RMSNorm of `hf_rms_norm`. bf16 on GPU, fp32 on CPU.

Both paths take THD packed micro-batches (`PackedSeqParams`), see `train/packing.py`.

`build_gpt_model`, `model_provider` and `build_model_chunks` take an HF config (dict or
transformers object) and parse it once; the `*_from_arch` builders below them take the parsed
`GPTArch`, which is what a run passes down from where it resolved its model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from megatron_stepwise.hf import presets

# The architecture is parsed in hf/arch.py (config validation reads it too).
from megatron_stepwise.hf.arch import (
    GPTArch,
    HFConfig,
    arch_from_hf,
    padded_vocab_size,
    validate_parallel,
)


def tiny_config(*, num_layers: int = 4, **kwargs: Any) -> dict:
    """`hf.presets.tiny_config` with 4 layers by default (PP x VPP splits in tests and tools)."""
    return presets.tiny_config(num_layers=num_layers, **kwargs)


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions import transformer_engine as _te  # noqa: F401
    except Exception:
        return False
    return True


def transformer_config(
    arch: GPTArch,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    sequence_parallel: Optional[bool] = None,
    dtype: Optional[torch.dtype] = None,
    use_te: Optional[bool] = None,
    **overrides: Any,
):
    """The megatron `TransformerConfig` for `arch` at this layout (overrides win)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    use_te = te_available() if use_te is None else use_te
    dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
    fields = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=arch.attention_dropout,
        init_method_std=arch.init_std,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=(tp > 1 if sequence_parallel is None else sequence_parallel) and tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Micro-batches are packed to different lengths: PP must exchange shapes.
        variable_seq_lengths=True,
        # allgather (the default) refuses variable_seq_lengths, even for a dense model.
        moe_token_dispatcher_type="alltoall",
        # Fusions that need CUDA kernels stay off unless TE provides them.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=bool(use_te and on_gpu),
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not on_gpu,
        # gloo matches a batch's sends and receives by peer and order: with PP=2 both neighbours
        # are one rank, and the interleaved schedule's batched activation and gradient exchange
        # would swap them. The unbatched path sends each direction on its own group.
        batch_p2p_comm=on_gpu,
    )
    if arch.num_experts:
        fields.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            # HF: softmax over all experts, top-k, renormalised (norm_topk_prob) or not. Megatron:
            # softmax over the top-k logits (the same renormalised probabilities), or pre-softmax.
            moe_router_pre_softmax=not arch.moe_norm_topk,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",  # router losses are the step-wise loss's business
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            expert_tensor_parallel_size=1,  # experts are split over EP, not TP
        )
    fields.update(overrides)
    return TransformerConfig(**fields)


def layer_spec(
    config,
    *,
    use_te: bool,
    vp_stage: Optional[int] = None,
    packed_attention: str = "auto",
    fused_elementwise: bool = False,
):
    """Decoder block spec: TE spec, or megatron's local spec with our packed attention + norm
    (`packed_attention`: local_layers.PACKED_ATTENTION; `fused_elementwise`: compiled RMSNorm)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if use_te:
        return specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage
        )
    if config.num_moe_experts:
        _patch_router_gemm()
    from megatron_stepwise.mcore.train.hf_rms_norm import HFRoundedRMSNorm
    from megatron_stepwise.mcore.train.local_layers import PackedCausalAttention

    base = specs.get_gpt_layer_local_spec(
        normalization="RMSNorm",
        qk_layernorm=config.qk_layernorm,
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
    )
    attn = base.submodules.self_attention
    norm = ModuleSpec(module=HFRoundedRMSNorm, params={"fused": fused_elementwise})
    qk_norm = norm if config.qk_layernorm else None
    core = ModuleSpec(module=PackedCausalAttention, params={"packed_attention": packed_attention})
    attn_sub = dataclasses.replace(attn.submodules, core_attention=core, q_layernorm=qk_norm, k_layernorm=qk_norm)
    sub = dataclasses.replace(
        base.submodules,
        input_layernorm=norm,
        pre_mlp_layernorm=norm,
        self_attention=dataclasses.replace(attn, submodules=attn_sub),
    )
    layer = dataclasses.replace(base, submodules=sub)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=norm)


def _patch_router_gemm() -> None:
    """megatron-core 0.16's router refers to Transformer Engine's GEMM, undefined (NameError) when
    TE is absent; None selects its torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(hf_config: HFConfig, **kwargs: Any):
    """One GPTModel chunk for this rank's pipeline stage from an HF config (parsed here once);
    the keyword arguments are `gpt_model_from_arch`'s."""
    return gpt_model_from_arch(arch_from_hf(hf_config), **kwargs)


def gpt_model_from_arch(
    arch: GPTArch,
    *,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    use_te: Optional[bool] = None,
    config_overrides: Optional[dict[str, Any]] = None,
    tokenizer_vocab_size: Optional[int] = None,
    vp_stage: Optional[int] = None,
    packed_attention: str = "auto",
    fused_elementwise: bool = False,
):
    """One GPTModel chunk for this rank's pipeline stage (parallel state must be initialised).

    On the local spec: `packed_attention` picks `PackedCausalAttention`'s implementation
    (model.packed_attention), `fused_elementwise` compiles RMSNorm, RoPE and SwiGLU (fused_ops.py).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size() if arch.num_experts else 1
    validate_parallel(arch, tp=tp, pp=pp, tokenizer_vocab_size=tokenizer_vocab_size, vpp=vpp or 1, ep=ep)
    use_te = te_available() if use_te is None else use_te
    overrides = dict(config_overrides or {})
    if arch.num_experts:
        # The model config must know EP: it marks expert weights so DDP reduces their gradients
        # over the expert-data-parallel group, not the whole DP group (which holds other experts).
        overrides.setdefault("expert_model_parallel_size", ep)
    if vpp is not None:  # interleaved pipeline: this chunk's layers depend on vp_stage
        overrides.setdefault("virtual_pipeline_model_parallel_size", vpp)
        if vp_stage is None:
            raise ValueError(f"virtual pipeline parallelism ({vpp} chunks per rank) needs the chunk's vp_stage")
    fused = fused_elementwise and not use_te
    if fused:
        from megatron_stepwise.mcore.train.fused_ops import fused_overrides, install_rope_hooks

        install_rope_hooks()  # before the config: it checks that a fused RoPE exists
        overrides = {**fused_overrides(), **overrides}
    config = transformer_config(arch, tp=tp, pp=pp, cp=cp, use_te=use_te, **overrides)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(
            config, use_te=use_te, vp_stage=vp_stage, packed_attention=packed_attention, fused_elementwise=fused
        ),
        vocab_size=padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    model.unpadded_vocab_size = arch.vocab_size  # what the plugin scores over (see padded_vocab_size)
    return model


def model_provider(hf_config: HFConfig, **kwargs: Any) -> Callable[..., Any]:
    """A Megatron-LM style `model_provider(pre_process, post_process, vp_stage=None)`; the HF
    config is parsed once, here, not at each call."""
    arch = arch_from_hf(hf_config)

    def provide(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None, **_):
        return gpt_model_from_arch(
            arch, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage, **kwargs
        )

    return provide


def wrap_ddp(
    model,
    *,
    use_distributed_optimizer: bool = False,
    grad_reduce_in_fp32: bool = True,
    overlap_grad_reduce: bool = False,
    disable_bucketing: bool = False,
    **ddp_kwargs: Any,
):
    """Wrap a built chunk in megatron's DDP (and Float16Module for bf16/fp16 on GPU)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = model.config
    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        **ddp_kwargs,
    )
    return DistributedDataParallel(
        config=config, ddp_config=ddp_config, module=model, disable_bucketing=disable_bucketing
    )


def build_model_chunks(hf_config: HFConfig, **kwargs: Any) -> list:
    """`model_chunks_from_arch` for an HF config (parsed here once)."""
    return model_chunks_from_arch(arch_from_hf(hf_config), **kwargs)


def model_chunks_from_arch(
    arch: GPTArch,
    *,
    wrap: bool = True,
    use_distributed_optimizer: bool = False,
    init: Optional[Callable[[list], None]] = None,
    **build_kwargs: Any,
) -> list:
    """This rank's model chunks, one per virtual pipeline stage (one without virtual pipeline
    parallelism), built and DDP-wrapped; `build_kwargs` are `gpt_model_from_arch`'s.

    `init(chunks)` runs on the bare chunks before wrapping (e.g. loading weights).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    stages = [None] if vpp is None else list(range(vpp))
    bare = [gpt_model_from_arch(arch, vp_stage=stage, **build_kwargs) for stage in stages]
    if not torch.cuda.is_available():
        bare = [chunk.to(torch.device("cpu")) for chunk in bare]
    if init is not None:
        init(bare)
    if not wrap:
        return bare
    # As Megatron-LM does: only the first chunk's gradients are bucketed for overlap.
    chunks = [
        wrap_ddp(chunk, use_distributed_optimizer=use_distributed_optimizer, disable_bucketing=i > 0)
        for i, chunk in enumerate(bare)
    ]
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
