"""Causal attention over a packed micro-batch on the local (no-TE) path, forward+backward on CPU.

Three exact ways to keep packed sequences from attending to each other:

- per_sequence:  `PackedCausalAttention` (what the local spec uses): SDPA(is_causal) per row;
- sdpa_mask:     one SDPA call with a [T, T] block-diagonal causal boolean mask;
- megatron_mask: megatron's DotProductAttention recipe (baddbmm, masked_fill -10000, softmax, bmm)
                 with the same mask, i.e. the "block-diagonal mask" option on the local spec.

FlexAttention with a document mask is not an option for training here: torch 2.13 refuses its
backward on CPU (checked at run time below). Prints measured times and max differences.

    python tools/bench/bench_local_attention.py [--lengths 512 384 256 256 192 128 128 64 64 64 --heads 8]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F


def block_mask(lengths: list[int]) -> torch.Tensor:
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    t = seg.numel()
    causal = torch.arange(t)[None, :] <= torch.arange(t)[:, None]
    return (seg[:, None] == seg[None, :]) & causal  # True = may attend


def per_sequence(q, k, v, lengths, scale):
    # q [T, nh, d], k/v [T, ng, d]
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_stepwise.mcore.train.local_layers import PackedCausalAttention

    nh, ng, d = q.size(1), k.size(1), q.size(2)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=nh * d,
        num_attention_heads=nh,
        num_query_groups=ng,
        kv_channels=d,
        attention_dropout=0.0,
    )
    attn = PackedCausalAttention(cfg, 1, AttnMaskType.causal, "self", softmax_scale=scale)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
    )
    return attn(q, k, v, None, packed_seq_params=psp).reshape(q.size(0), nh, d)


def sdpa_mask(q, k, v, mask, scale):
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def megatron_mask(q, k, v, mask, scale):
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [nh, T, d]
    scores = torch.baddbmm(
        torch.empty(qh.size(0), qh.size(1), kh.size(1)), qh, kh.transpose(1, 2), beta=0.0, alpha=scale
    )
    probs = torch.softmax(scores.masked_fill(~mask, -10000.0), dim=-1)
    return torch.bmm(probs, vh).transpose(0, 1)


def timed(fn, q, k, v, reps):
    best, out = float("inf"), None
    for _ in range(reps + 1):
        for t in (q, k, v):
            t.grad = None
        start = time.perf_counter()
        out = fn(q, k, v)
        out.sum().backward()
        best = min(best, time.perf_counter() - start)
    return best, out.detach()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 384, 256, 256, 192, 128, 128, 64, 64, 64])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    t = sum(args.lengths)
    q = torch.randn(t, args.heads, args.head_dim, generator=g).requires_grad_()
    k = torch.randn(t, args.kv_heads, args.head_dim, generator=g).requires_grad_()
    v = torch.randn(t, args.kv_heads, args.head_dim, generator=g).requires_grad_()
    scale = 1.0 / math.sqrt(args.head_dim)
    mask = block_mask(args.lengths)
    variants = {
        "per_sequence": lambda q, k, v: per_sequence(q, k, v, args.lengths, scale),
        "sdpa_mask": lambda q, k, v: sdpa_mask(q, k, v, mask, scale),
        "megatron_mask": lambda q, k, v: megatron_mask(q, k, v, mask, scale),
    }
    print(
        f"CPU, {args.threads} threads: {len(args.lengths)} packed sequences, T={t}, {args.heads} heads "
        f"({args.kv_heads} KV), head_dim {args.head_dim}, fp32, forward+backward (best of {args.reps})"
    )
    results = {name: timed(fn, q, k, v, args.reps) for name, fn in variants.items()}
    ref = results["sdpa_mask"][1]
    base = results["per_sequence"][0]
    for name, (sec, out) in results.items():
        print(
            f"  {name:<14} {sec * 1e3:9.1f} ms   {sec / base:5.2f}x per_sequence   "
            f"max |diff| vs sdpa_mask {float((out - ref).abs().max()):.1e}"
        )
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        seg = torch.repeat_interleave(torch.arange(len(args.lengths)), torch.tensor(args.lengths))
        bm = create_block_mask(lambda b, h, qi, ki: (seg[qi] == seg[ki]) & (ki <= qi), None, None, t, t, device="cpu")
        out = flex_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            block_mask=bm,
            scale=scale,
            enable_gqa=True,
        )
        out.sum().backward()
        print("  flex_attention: forward+backward ran on CPU")
    except Exception as e:  # torch 2.13: "FlexAttention does not support backward on CPU"
        print(f"  flex_attention: unavailable for training on CPU ({type(e).__name__}: {str(e).splitlines()[0]})")


if __name__ == "__main__":
    main()
