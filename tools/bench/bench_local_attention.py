"""Causal attention over a packed micro-batch on the local (no-TE) path, forward+backward
(prints measured figures; never asserts).

The exact ways to keep packed rows from attending to each other, timed side by side (alternated,
median of the repeats) on the same q, k, v:

- one_call:  `PackedCausalAttention(packed_attention="one_call")` (the default): the rows
             gathered into one padded [rows, longest row] batch, one SDPA(is_causal) call;
- per_row:   `PackedCausalAttention(packed_attention="per_row")`, the baseline: SDPA(is_causal)
             per row, one call (one kernel launch on a GPU) per row;
- sdpa_mask: one SDPA call with a [T, T] block-diagonal causal boolean mask (work (sum L_i)^2).

Then the scaling rows: a fixed number of tokens cut into more and more equal rows. Attention
work within rows is sum(L_i^2) = T^2 / rows, so a path whose cost follows it gets faster as
rows get shorter; a [T, T] mask would stay at T^2.

FlexAttention (document-causal block mask) is checked at run time: torch 2.13 refuses its
backward on CPU, so it cannot train there.

    python tools/bench/bench_local_attention.py [--lengths 512 384 256 ...] [--total 2048 --rows 1 2 4 8 16 32]
        [--device cuda] [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import add_seed_and_out, bench_parser, config, run_args, script_main, side_by_side  # noqa: E402

LENGTHS = [512, 384, 256, 256, 192, 128, 128, 64, 64, 64]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "short rows, 2 repeats (a smoke run)")
    p.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="the mixed-length packed rows")
    p.add_argument("--total", type=int, default=2048, help="tokens of the scaling rows")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="row counts of the scaling rows")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.total, args.rows, args.repeats = [48, 32, 16, 8], 128, [1, 4, 16], 2
    return args


def block_mask(lengths: list[int], device) -> torch.Tensor:
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    t = seg.numel()
    pos = torch.arange(t, device=device)
    return (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])  # True = may attend


def packed_attention(mode: str, nh: int, ng: int, d: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_stepwise.mcore.train.local_layers import PackedCausalAttention

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=nh * d,
        num_attention_heads=nh,
        num_query_groups=ng,
        kv_channels=d,
        attention_dropout=0.0,
    )
    return PackedCausalAttention(cfg, 1, AttnMaskType.causal, "self", packed_attention=mode)


def packed_params(lengths: list[int], device):
    """What the packer hands megatron: device cu_seqlens, the longest row and the host bounds."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
    )
    psp.stepwise_bounds = bounds
    return psp


def variants(lengths: list[int], nh: int, ng: int, d: int, device, with_mask: bool) -> dict[str, Any]:
    """name -> fn(q, k, v) of [T, heads, d] -> [T, heads * d]; a fresh PackedSeqParams per call,
    as a micro-batch gets (its one-call maps are built once per micro-batch, inside the timing)."""
    out = {
        mode: (
            lambda q, k, v, m=packed_attention(mode, nh, ng, d): m(
                q, k, v, None, packed_seq_params=packed_params(lengths, device)
            )
        )
        for mode in ("one_call", "per_row")
    }
    if with_mask:
        mask = block_mask(lengths, device)

        def sdpa_mask(q, k, v):
            o = F.scaled_dot_product_attention(
                *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask, scale=1 / math.sqrt(d), enable_gqa=True
            )
            return o[0].transpose(0, 1).reshape(q.size(0), -1)

        out["sdpa_mask"] = sdpa_mask
    return out


def measure(lengths: list[int], args, with_mask: bool) -> dict[str, dict[str, float]]:
    """Median fwd+bwd seconds, tokens/s and max |diff| vs per_row of every variant."""
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(args.seed)
    t = sum(lengths)
    q, k, v = (
        torch.randn(t, n, args.head_dim, generator=g).to(device).requires_grad_()
        for n in (args.heads, args.kv_heads, args.kv_heads)
    )

    def step(fn):
        def call():
            for x in (q, k, v):
                x.grad = None
            out = fn(q, k, v)
            out.sum().backward()
            return out.detach(), q.grad.clone()

        return call

    calls = {
        name: step(fn)
        for name, fn in variants(lengths, args.heads, args.kv_heads, args.head_dim, device, with_mask).items()
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    timings = side_by_side(calls, args.repeats, sync=sync)
    ref_out, ref_grad = timings["per_row"].result
    return {
        name: {
            "ms": tm.median * 1e3,
            "tokens_per_s": t / tm.median,
            "max_abs_diff_out": float((tm.result[0] - ref_out).abs().max()),
            "max_abs_diff_dq": float((tm.result[1] - ref_grad).abs().max()),
        }
        for name, tm in timings.items()
    }


def flex_status(device: str) -> str:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        x = torch.randn(1, 1, 128, 16, device=device, requires_grad=True)
        bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, 128, 128, device=device)
        flex_attention(x, x, x, block_mask=bm).sum().backward()
        return "forward+backward ran"
    except Exception as e:  # torch 2.13 CPU: "FlexAttention does not support backward on CPU"
        return f"unavailable for training ({type(e).__name__}: {str(e).splitlines()[0]})"


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    """Prints the tables, returns the figures."""
    args = run_args(parse_args, quick, options)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_local_attention: --device cuda needs a CUDA GPU")
    torch.set_num_threads(args.threads)
    from megatron_stepwise.mcore.runtime.runtime import silence_megatron_noise

    silence_megatron_noise()
    lengths = args.lengths
    t, longest = sum(lengths), max(lengths)
    work = {"sum_L2": sum(n * n for n in lengths), "rows_x_longest2": len(lengths) * longest**2, "T2": t * t}
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} threads"
    print(
        f"{where}: {len(lengths)} packed rows of {min(lengths)}-{longest} tokens, T={t}, {args.heads} heads "
        f"({args.kv_heads} KV), head_dim {args.head_dim}, fp32, forward+backward, median of {args.repeats}"
    )
    print(
        f"  work (score entries): sum L_i^2 = {work['sum_L2']:,}   rows x longest^2 = {work['rows_x_longest2']:,}   "
        f"T^2 = {work['T2']:,}"
    )
    mixed = measure(lengths, args, with_mask=True)
    base = mixed["per_row"]["ms"]
    print(f"  {'path':<10}{'ms':>10}{'tokens/s':>12}{'vs per_row':>12}{'max|d out|':>12}{'max|d dq|':>12}")
    for name, r in mixed.items():
        print(
            f"  {name:<10}{r['ms']:>10.1f}{r['tokens_per_s']:>12,.0f}{base / r['ms']:>11.2f}x"
            f"{r['max_abs_diff_out']:>12.1e}{r['max_abs_diff_dq']:>12.1e}"
        )
    print(f"\n  scaling: T={args.total} tokens in equal rows (work within rows T^2 / rows)")
    print(
        f"  {'rows':>6}{'row len':>9}{'one_call ms':>13}{'per_row ms':>12}{'one_call tok/s':>16}{'per_row tok/s':>15}"
    )
    scaling = []
    for n in args.rows:
        rows = [args.total // n] * n
        r = measure(rows, args, with_mask=False)
        scaling.append({"rows": n, "row_len": rows[0], **{k: v for k, v in r.items()}})
        print(
            f"  {n:>6}{rows[0]:>9}{r['one_call']['ms']:>13.1f}{r['per_row']['ms']:>12.1f}"
            f"{r['one_call']['tokens_per_s']:>16,.0f}{r['per_row']['tokens_per_s']:>15,.0f}"
        )
    flex = flex_status(args.device)
    print(f"\n  flex_attention: {flex}")
    return {
        "config": config(args),
        "device": where,
        "work": work,
        "mixed": mixed,
        "one_call_over_per_row_tokens_per_s": mixed["one_call"]["tokens_per_s"] / mixed["per_row"]["tokens_per_s"],
        "scaling": scaling,
        "flex_attention": flex,
    }


if __name__ == "__main__":
    script_main(parse_args, run)
