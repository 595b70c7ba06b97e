"""Fused elementwise blocks of the local (no Transformer Engine) spec: `model.fused_elementwise`.

Each block is a few elementwise torch operations that `torch.compile` (inductor) turns into
one generated kernel forward and one backward, so a layer launches fewer kernels and reads its
activations fewer times:

- RMSNorm: `HFRoundedRMSNorm(fused=True)` runs HF's rounding compiled (`hf_rounded_rms_norm`).
- SwiGLU: megatron's own `bias_swiglu_impl` (`bias_activation_fusion=True`), compiled by
  megatron's `jit_fuser` (torch.compile).
- RoPE: megatron calls a fused RoPE through two hooks of `rope_utils` that Transformer Engine
  fills when it is installed (`apply_rope_fusion=True`); without TE `install_rope_hooks` fills
  them with the compiled functions here. The packed (THD) one also drops the unfused path's
  per-row split and its `.tolist()` of `cu_seqlens` (a device-to-host copy per layer, twice):
  every position's place in its row is computed on the device.

The results equal the unfused blocks' (the same operations, in another order of evaluation).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _hf_rounded_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def hf_rounded_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF transformers' RMSNorm rounding (mcore/train/hf_rms_norm.py), compiled."""
    return _compiled(_hf_rounded_rms_norm)(x, weight, eps)


def _rotate(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """megatron's unfused RoPE (`_apply_rotary_pos_emb_bshd`, not interleaved) on [s, b, n, d]."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd(t, freqs)


def rope_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if interleaved:
        raise ValueError("the local spec's fused RoPE is not interleaved (model.fused_elementwise=false)")
    return _compiled(_rotate)(t, freqs)


def positions_in_rows(cu_seqlens: torch.Tensor, total: int, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """long [total]: each local packed position's place in its row, for the global bounds
    `cu_seqlens`; under CP a row's local positions are its chunks cp_rank and 2cp-1-cp_rank."""
    cu = cu_seqlens.long()
    starts = cu[:-1] // cp_size
    pos = torch.arange(total, device=cu.device)
    row = torch.searchsorted(cu[1:] // cp_size, pos, right=True)
    within = pos - starts[row]
    if cp_size == 1:
        return within
    chunk = (cu[1:] - cu[:-1])[row] // (2 * cp_size)
    later = within >= chunk
    return torch.where(later, 2 * cp_size - 1 - cp_rank, cp_rank) * chunk + within - later * chunk


def rope_thd(
    t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1, cp_rank: int = 0
) -> torch.Tensor:
    """RoPE of packed [T, n, d], positions restarting per row; `freqs` [max_len, 1, 1, d]."""
    place = positions_in_rows(cu_seqlens, t.size(0), cp_size, cp_rank)
    return _compiled(_rotate)(t.unsqueeze(1), freqs[place]).squeeze(1)


def install_rope_hooks() -> None:
    """Fill megatron's fused-RoPE hooks where Transformer Engine left them empty."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = rope_bshd
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = rope_thd


def fused_overrides() -> dict:
    """TransformerConfig fields of the fused blocks (after `install_rope_hooks`)."""
    return {"bias_activation_fusion": True, "apply_rope_fusion": True}
