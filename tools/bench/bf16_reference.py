"""A Qwen2 forward in plain torch whose every part can round to bf16 on its own.

`reference_logprobs(weights, arch, ids, Precision(...), scored)` computes log p(ids[i] | ids[<i]) for one
sequence from an HF state dict. Everything runs in fp32 except the parts a `Precision` switches
to bf16: then that part computes on bf16 inputs and its output is rounded to bf16, the way a bf16
model runs it. Switching one part at a time measures how much each contributes to the distance
between a bf16 model and the exact (fp32) function of the same weights; the bf16 gap analysis
(`bench_bf16_gap.py`) prints that table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from megatron_stepwise.hf.arch import GPTArch

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Precision:
    """Which parts of the forward run in bf16; the rest computes and stores fp32."""

    linear: bool = False  # q/k/v/o and MLP projections: bf16 inputs, bf16 outputs
    attention: bool = False  # SDPA on bf16 q/k/v
    # "bf16": upcast inside, bf16 result times bf16 weight (HF's); "bf16-fused": upcast, times the
    # weight in fp32, one rounding (torch.nn.RMSNorm's, the trainer's); "bf16-naive": no upcast
    norm: str = "fp32"
    rope: bool = False  # cos/sin and the rotation in bf16
    activations: bool = False  # the residual stream, its adds and SiLU(gate) * up stored in bf16
    head: bool = False  # logits = bf16 hidden @ bf16 output weight, rounded to bf16
    log_softmax: bool = False  # log-softmax computed (and returned) in bf16
    fused_qkv: bool = False  # one [q|k|v] projection (megatron's) instead of three (HF's)
    eager_attention: bool = False  # softmax(q k^T) v spelled out instead of SDPA
    split_k: bool = False  # bf16 projections summed as two fp32 halves of the inner dimension (a GPU GEMM's split-K)

    def with_(self, **changes) -> "Precision":
        return dataclasses.replace(self, **changes)


ALL_BF16 = Precision(linear=True, attention=True, norm="bf16", rope=True, activations=True, head=True)


def bf16_valued(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict's tensors rounded to bf16 values, held in fp32."""
    return {k: t.to(BF16).float() for k, t in state.items()}


def _round(x: torch.Tensor, on: bool) -> torch.Tensor:
    return x.to(BF16).float() if on else x


def _linear(x, weight, bias, p: Precision) -> torch.Tensor:
    if not p.linear:
        return F.linear(x, weight, bias)
    b = None if bias is None else bias.to(BF16)
    if not p.split_k:
        return F.linear(x.to(BF16), weight.to(BF16), b).float()
    x, weight, half = _round(x, True), _round(weight, True), x.size(-1) // 2
    out = F.linear(x[..., :half], weight[:, :half]) + F.linear(x[..., half:], weight[:, half:])
    return _round(out if b is None else out + b.float(), True)


def _rms_norm(x, weight, eps: float, mode: str) -> torch.Tensor:
    if mode == "fp32":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    if mode == "bf16":
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(BF16)
        return (weight.to(BF16) * normed).float()
    if mode == "bf16-fused":
        xf = _round(x, True)
        return _round(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * _round(weight, True), True)
    if mode == "bf16-naive":
        xb = x.to(BF16)
        return (xb * torch.rsqrt(xb.pow(2).mean(-1, keepdim=True) + eps) * weight.to(BF16)).float()
    raise ValueError(f"Precision.norm must be 'fp32', 'bf16', 'bf16-fused' or 'bf16-naive', got {mode!r}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x, cos, sin, bf16: bool) -> torch.Tensor:  # x [heads, L, d]; cos/sin [L, d] fp32
    if bf16:
        x, cos, sin = x.to(BF16), cos.to(BF16), sin.to(BF16)
    return (x * cos + _rotate_half(x) * sin).float()


def _attention(q, k, v, p: Precision) -> torch.Tensor:  # q [nh, L, d], k/v [nkv, L, d] -> [L, nh * d]
    group = q.size(0) // k.size(0)
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    if p.attention:
        q, k, v = q.to(BF16), k.to(BF16), v.to(BF16)
    if p.eager_attention:
        scores = (q @ k.transpose(-1, -2)) / q.size(-1) ** 0.5
        causal = torch.ones(q.size(1), q.size(1), dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).float().softmax(-1).to(q.dtype)
        out = probs @ v
    else:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    return out.float().transpose(0, 1).reshape(q.size(1), -1)


def _qkv(h, w: Mapping[str, torch.Tensor], pre: str, p: Precision) -> list[torch.Tensor]:
    names = [f"{pre}self_attn.{n}_proj" for n in "qkv"]
    weights = [w[f"{n}.weight"] for n in names]
    biases = [w.get(f"{n}.bias") for n in names]
    if not p.fused_qkv:
        return [_linear(h, wt, b, p) for wt, b in zip(weights, biases)]
    bias = None if biases[0] is None else torch.cat(biases)
    fused = _linear(h, torch.cat(weights), bias, p)
    return list(fused.split([wt.size(0) for wt in weights], dim=-1))


def rope_tables(length: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    freqs = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@torch.no_grad()
def reference_logprobs(
    w: Mapping[str, torch.Tensor], arch: GPTArch, ids: torch.Tensor, p: Precision, scored: torch.Tensor
) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) at the positions i of `scored` (a bool [L] mask, False at 0), fp32;
    `w` an HF Qwen2/Llama state dict of fp32 tensors (see `bf16_valued`)."""
    if arch.num_experts or arch.qk_norm or arch.rope_scaling_factor:
        raise ValueError(f"the reference forward is a dense Qwen2/Llama without RoPE scaling, got {arch}")
    nh, nkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    eps, act = arch.rms_norm_eps, p.activations
    cos, sin = rope_tables(ids.numel(), d, arch.rope_theta, ids.device)
    x = _round(w["model.embed_tokens.weight"][ids], act)
    for i in range(arch.num_layers):
        pre = f"model.layers.{i}."
        h = _rms_norm(x, w[pre + "input_layernorm.weight"], eps, p.norm)
        q, k, v = (t.view(-1, n, d).transpose(0, 1) for t, n in zip(_qkv(h, w, pre, p), (nh, nkv, nkv)))
        q, k = _rope(q, cos, sin, p.rope), _rope(k, cos, sin, p.rope)
        attn = _linear(_attention(q, k, v, p), w[pre + "self_attn.o_proj.weight"], None, p)
        x = _round(x + attn, act)
        h = _rms_norm(x, w[pre + "post_attention_layernorm.weight"], eps, p.norm)
        gate = _linear(h, w[pre + "mlp.gate_proj.weight"], None, p)
        up = _linear(h, w[pre + "mlp.up_proj.weight"], None, p)
        mlp = _linear(_round(_round(F.silu(gate), act) * up, act), w[pre + "mlp.down_proj.weight"], None, p)
        x = _round(x + mlp, act)
    h = _rms_norm(x, w["model.norm.weight"], eps, p.norm)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    logits = _linear(h[:-1][scored[1:]], head, None, Precision(linear=p.head))
    if p.log_softmax:
        logp = torch.log_softmax(logits.to(BF16), dim=-1).float()
    else:
        logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids[scored][:, None])[:, 0]
