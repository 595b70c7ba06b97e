"""Torch-native layers for the local (no Transformer Engine) GPT spec.

megatron-core's local spec has no packed-sequence attention (`DotProductAttention` asserts
`packed_seq_params is None`) and its torch norm refuses sequence parallelism. These two small
modules fill the gaps so the CPU path runs the same THD packed format as the TE path:

- `PackedCausalAttention`: causal attention within each packed sequence (`cu_seqlens`), i.e.
  a block-diagonal causal mask, and a sequence's result does not depend on what it is packed
  with. Two implementations (`model.packed_attention`): `one_call` gathers the rows into one
  padded [rows, longest row] batch and makes one `scaled_dot_product_attention(is_causal=True)`
  call per micro-batch (`packed_layout.py`: no per-row loop, no device-to-host copy; work
  rows x longest^2); `per_row` makes one call per sequence (work sum(L_i^2), one kernel launch
  per row). RoPE positions restart per sequence because megatron applies them from the same
  `cu_seqlens`.
- `LocalRMSNorm`: `torch.nn.RMSNorm` whose weight is tagged `sequence_parallel` so
  megatron's `finalize_model_grads` all-reduces its gradient over TP when SP is on.

Context parallelism (`packing.split_for_context_parallel`: rank r holds chunks r and
2*cp-1-r of every sequence) is all-gather attention: each rank gathers the keys and values of
the CP group (small next to the activations: 2 x kv_heads x head_dim per token), rebuilds each
sequence's full K/V and attends its two query chunks to the keys before them (per row, or all rows in one call).
The backward sums the K/V gradients of all ranks back to their owners.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention.bias import causal_lower_right

from megatron_stepwise.mcore.train.packed_layout import (
    PaddedRows,
    cached_rows,
    context_parallel_rows,
    longest_row,
    padded_rows,
)

# model.packed_attention. auto: one_call on a GPU, where per-row kernel launches bound the step
# (results/gpu_h200.md); per_row on CPU, where it measured faster (docs/megatron.md): the padded
# batch's extra work outweighs the few calls it saves there.
PACKED_ATTENTION = ("auto", "one_call", "per_row")


class LocalRMSNorm(torch.nn.RMSNorm):
    """RMSNorm usable by megatron's spec builder, sequence-parallel aware; `fused`
    (model.fused_elementwise) is read by the spec's norm, `hf_rms_norm.HFRoundedRMSNorm`."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, fused: bool = False, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.fused = fused
        # finalize_model_grads all-reduces grads of params tagged this way across TP.
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)


class _GatherFromContextParallel(torch.autograd.Function):
    """[T, ...] on each CP rank -> [cp, T, ...] everywhere; backward: each rank gets the sum,
    over ranks, of the gradients of its own slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            out = torch.empty_like(grad[0])
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch >= 2.13
            reduce_scatter(out, grad.flatten(0, 1), group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        return grad[dist.get_rank(ctx.group)].clone(), None


def _heads_first(t: torch.Tensor) -> torch.Tensor:  # [s, n, hn] -> [1, n, s, hn]
    return t.transpose(0, 1).unsqueeze(0)


def _concat(outs: list, query: torch.Tensor) -> torch.Tensor:  # per-sequence [s, np, hn] -> [T, np * hn]
    out = torch.cat(outs, dim=0) if outs else query.new_zeros(query.shape)
    return out.reshape(out.size(0), -1)


def _flat(rows: PaddedRows, out: torch.Tensor) -> torch.Tensor:  # [B, np, L, hn] -> [T, np * hn]
    out = rows.unpad(out)
    return out.reshape(out.size(0), -1)


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
        packed_attention: str = "auto",
    ):
        super().__init__(config=config)
        if packed_attention not in PACKED_ATTENTION:
            raise ValueError(
                f"model.packed_attention must be one of {', '.join(PACKED_ATTENTION)}, got {packed_attention!r}"
            )
        self.packed_attention = packed_attention
        self.cp_group = getattr(pg_collection, "cp", None)
        if self.cp_group is None and config.context_parallel_size > 1:
            self.cp_group = parallel_state.get_context_parallel_group()
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"PackedCausalAttention is causal only, got {attn_mask_type}")
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        # q [b, np, s, hn], k/v [b, ng, s, hn]; GQA handled by SDPA. Causal, or `mask`.
        p = self.dropout_p if self.training else 0.0
        kwargs = dict(
            is_causal=mask is None,
            attn_mask=mask,
            scale=self.softmax_scale,
            dropout_p=p,
            enable_gqa=q.size(1) != k.size(1),
        )
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
            bounds = getattr(packed_seq_params, "stepwise_bounds", None)  # host copy (packing.py)
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            cp = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
            if self.packed_attention == "one_call" or (self.packed_attention == "auto" and query.is_cuda):
                return self._one_call_thd(query, key, value, packed_seq_params, bounds, cu, cp)
            bounds = cu.tolist() if bounds is None else bounds
            if cp > 1:
                return self._context_parallel_thd(query, key, value, bounds, cp)
            return self._per_row_thd(query, key, value, bounds)
        if attention_mask is not None:
            raise ValueError(
                "PackedCausalAttention takes packed sequences (PackedSeqParams, qkv_format='thd') or a "
                "plain causal batch; an explicit attention_mask is not supported"
            )
        # [s, b, np, hn] -> [b, np, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._sdpa(q, k, v)  # [b, np, s, hn]
        return out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)

    def _per_row_thd(self, query, key, value, bounds: list[int]) -> torch.Tensor:
        """One SDPA call per packed row [bounds[i], bounds[i+1])."""
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                q, k, v = (_heads_first(t[start:end]) for t in (query, key, value))
                outs.append(self._sdpa(q, k, v)[0].transpose(0, 1))
        return _concat(outs, query)

    def _one_call_thd(self, query, key, value, packed_seq_params, bounds, cu, cp: int) -> torch.Tensor:
        """All rows of the micro-batch in one SDPA call over a padded batch (packed_layout.py)."""
        total = query.size(0)
        if total == 0:
            return query.reshape(0, query.size(1) * query.size(2))
        longest = longest_row(packed_seq_params, bounds, cu)
        if cp > 1:
            rank = dist.get_rank(self.cp_group)
            rows = cached_rows(packed_seq_params, lambda: context_parallel_rows(cu, longest, cp, rank, total))
            keys = _GatherFromContextParallel.apply(key, self.cp_group)  # [cp, T_local, ng, hn]
            values = _GatherFromContextParallel.apply(value, self.cp_group)
            k, v = (t[rows.key_rank, rows.key].transpose(1, 2) for t in (keys, values))
        else:
            rows = cached_rows(packed_seq_params, lambda: padded_rows(cu, longest, total))
            k, v = (t[rows.key].transpose(1, 2) for t in (key, value))  # [B, ng, L, hn]
        q = query[rows.query].transpose(1, 2)
        return _flat(rows, self._sdpa(q, k, v, rows.mask))

    def _context_parallel_thd(self, query, key, value, bounds: list[int], cp: int) -> torch.Tensor:
        """THD attention of this CP rank's chunks (r and 2cp-1-r of every sequence); `bounds` are
        the global (padded) sequence bounds, each length a multiple of 2 * cp."""
        rank = dist.get_rank(self.cp_group)
        keys = _GatherFromContextParallel.apply(key, self.cp_group)  # [cp, T_local, ng, hn]
        values = _GatherFromContextParallel.apply(value, self.cp_group)
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            c = (end - start) // (2 * cp)
            if c == 0:
                continue
            local = slice(start // cp, start // cp + 2 * c)
            # Full sequence: chunks 0..cp-1 are the ranks' first halves in rank order, chunks
            # cp..2cp-1 their second halves in reverse rank order.
            k_seq, v_seq = (
                torch.cat([t[:, local][:, :c].flatten(0, 1), t[:, local][:, c:].flip(0).flatten(0, 1)])
                for t in (keys, values)
            )
            q_local = query[local]
            for half, chunk_index in ((q_local[:c], rank), (q_local[c:], 2 * cp - 1 - rank)):
                seen = (chunk_index + 1) * c  # keys up to the end of this chunk
                # Query i of the chunk sits at position seen - c + i: causal aligned to the lower
                # right, a mask SDPA's fused (flash / memory-efficient) kernels take.
                mask = causal_lower_right(c, seen)
                q, k, v = (_heads_first(t) for t in (half, k_seq[:seen], v_seq[:seen]))
                outs.append(self._sdpa(q, k, v, mask)[0].transpose(0, 1))
        return _concat(outs, query)
