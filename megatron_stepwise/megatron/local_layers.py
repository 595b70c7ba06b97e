"""Torch-native layers for the local (no Transformer Engine) GPT spec.

megatron-core's local spec has no packed-sequence attention (`DotProductAttention` asserts
`packed_seq_params is None`) and its torch norm refuses sequence parallelism. These two small
modules fill the gaps so the CPU path runs the same THD packed format as the TE path:

- `PackedCausalAttention`: causal attention within each packed sequence (`cu_seqlens`), i.e.
  a block-diagonal causal mask, computed one sequence at a time with
  `scaled_dot_product_attention(is_causal=True)`; work is sum(L_i^2), not (sum L_i)^2, and a
  sequence's result does not depend on what it is packed with. RoPE positions restart per
  sequence because megatron applies them from the same `cu_seqlens`.
- `LocalRMSNorm`: `torch.nn.RMSNorm` whose weight is tagged `sequence_parallel` so
  megatron's `finalize_model_grads` all-reduces its gradient over TP when SP is on.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class LocalRMSNorm(torch.nn.RMSNorm):
    """RMSNorm usable by megatron's spec builder, sequence-parallel aware."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        # finalize_model_grads all-reduces grads of params tagged this way across TP.
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)


class PackedCausalAttention(MegatronModule):
    """Core attention for THD packed sequences (and plain [s, b] batches) on any device."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("PackedCausalAttention (local spec) does not support context parallelism")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"PackedCausalAttention is causal only, got {attn_mask_type}")
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [b, np, s, hn], k/v [b, ng, s, hn]; GQA handled by SDPA.
        p = self.dropout_p if self.training else 0.0
        kwargs = dict(is_causal=True, scale=self.softmax_scale, dropout_p=p, enable_gqa=q.size(1) != k.size(1))
        if p > 0.0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("PackedCausalAttention does not support attention_bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # query [T, np, hn], key/value [T, ng, hn]
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            bounds = cu.tolist()
            outs = []
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end == start:
                    continue
                q = query[start:end].transpose(0, 1).unsqueeze(0)
                k = key[start:end].transpose(0, 1).unsqueeze(0)
                v = value[start:end].transpose(0, 1).unsqueeze(0)
                outs.append(self._sdpa(q, k, v)[0].transpose(0, 1))
            out = torch.cat(outs, dim=0) if outs else query.new_zeros(query.shape)
            return out.reshape(out.size(0), -1)
        if attention_mask is not None:
            raise ValueError(
                "PackedCausalAttention takes packed sequences (PackedSeqParams, qkv_format='thd') or a "
                "plain causal batch; an explicit attention_mask is not supported"
            )
        # [s, b, np, hn] -> [b, np, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._sdpa(q, k, v)  # [b, np, s, hn]
        return out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)
