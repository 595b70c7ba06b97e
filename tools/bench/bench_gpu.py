"""GPU training-step throughput and MFU of the step-wise plugin (prints measured figures; never
asserts). On a machine without a CUDA GPU it prints why it is skipped and exits 0.

Setup: megatron-core at world size 1 (NCCL), a randomly initialised Qwen2.5-0.5B (or 1.5B) from
its published config shape (`tools/bench/flops.py`; nothing is downloaded), bf16 weights with fp32
main parameters in megatron's Adam, Transformer Engine's spec if it imports (else the local spec
with its one-call packed attention). One mini-batch of agent-shaped step rows (1-3 turns, rows up to
~3.8k tokens), packed into 4096-token micro-batches by the plugin; one timed unit is one
`StepwisePlugin.train_minibatch` (forward, backward, optimizer step), synchronised.

Figures, measured side by side on the same device in the same run:
- peak: the best bf16 matmul throughput of the device (square matmuls of 4096..16384, timed with
  CUDA events): the denominator of MFU, so MFU is relative to what this GPU really sustains,
  not a datasheet;
- tokens/s: real (packed) tokens per second of the training step;
- MFU: model FLOPs of the step (`tools/bench/flops.py`: 6 x layer params x tokens + causal attention
  per row + output layer at trained positions) / step time / peak.

    python tools/bench/bench_gpu.py [--quick] [--model qwen2.5-1.5b] [--out results.json]

`--variants one_call per_row fused` times the local spec's packed attention and fused blocks
one after another in the same run (each its own model; `VARIANTS`); the top-level figures are
the first variant's, every variant's are under `variants`.

`--device cpu --model tiny` runs the same code on the CPU with the tiny model (the test suite's
smoke run of this script); its figures are CPU figures, not GPU ones.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flops import QWEN2_CONFIGS, ModelShape, training_flops  # noqa: E402
from harness import add_seed_and_out, bench_parser, config, cuda_skip, run_args, script_main, time_repeats  # noqa: E402

from megatron_stepwise.algo.advantages import compute_advantages  # noqa: E402
from megatron_stepwise.algo.losses import LossConfig  # noqa: E402
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps  # noqa: E402
from megatron_stepwise.hf.presets import tiny_config  # noqa: E402

MICRO_TOKENS = 4096
# --variants: the model builder's options (the local spec's model.packed_attention / fused_elementwise)
VARIANTS = {
    "default": {},
    "one_call": {"packed_attention": "one_call"},
    "per_row": {"packed_attention": "per_row"},
    "fused": {"packed_attention": "one_call", "fused_elementwise": True},
    "per_row_fused": {"packed_attention": "per_row", "fused_elementwise": True},
}
MODELS = {k: v for k, v in QWEN2_CONFIGS.items() if not k.endswith("7b")}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "a smaller mini-batch, fewer timed steps, one matmul size")
    p.add_argument("--model", default="qwen2.5-0.5b", choices=[*MODELS, "tiny"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of this script")
    p.add_argument("--micro-tokens", type=int, default=MICRO_TOKENS, help="packed micro-batch token budget")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS), help="timed one after another")
    p.add_argument(
        "--profile",
        help="after timing, profile one more step (torch.profiler) and write its "
        "top operators by host and by device time to this file (slow: on an H200 the 0.5B run "
        "with it did not finish within 130 s; use --prompts 2)",
    )
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.warmup, args.repeats = 4, 1, 2
    return args


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_peak_tflops(sizes: tuple[int, ...], device: str = "cuda", iters: int = 20) -> dict[str, float]:
    """Best measured bf16 dense matmul throughput (TFLOP/s) over square sizes."""
    out = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        synchronize(device)
        t = time.perf_counter()  # the synchronize brackets make host time the device's time
        for _ in range(iters):
            a @ b
        synchronize(device)
        out[str(n)] = 2.0 * n**3 * iters / (time.perf_counter() - t) / 1e12
        del a, b
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def gpu_minibatch(args: argparse.Namespace, vocab_size: int):
    """Agent-shaped step rows that fit a 4096-token micro-batch, with GRPO advantages."""
    from megatron_stepwise.steps import StepBatch

    w = AgentWorkload(
        num_prompts=args.prompts,
        samples_per_prompt=args.samples,
        turns=(1, 3),
        prompt_len=(100, 600),
        obs_len=(50, 1000),
        response_len=(20, 400),
        vocab_size=vocab_size,
        success_prob=0.5,
        seed=args.seed,
    )
    steps = make_agent_steps(w)
    batch = StepBatch.from_steps(steps)
    batch.set_response_field("advantages", compute_advantages(steps, "grpo"))
    return steps, batch


def profile_step(step, device: str, path: str, rows: int = 30) -> None:
    """One step under torch.profiler: tables of the top operators by self host (CPU) time and by
    self device time, written to `path`; the first lines of each printed."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        synchronize(device)
    averages = prof.key_averages()
    tables = [f"== by self CPU time\n{averages.table(sort_by='self_cpu_time_total', row_limit=rows)}"]
    if device == "cuda":
        tables.append(f"== by self device time\n{averages.table(sort_by='self_device_time_total', row_limit=rows)}")
    Path(path).write_text("\n".join(tables))
    for t in tables:
        print("\n".join(t.splitlines()[:16]))


def time_variant(args, hf, batch, build: dict, model_flops: float, peak_tflops: float, keep: bool) -> dict[str, Any]:
    """One variant's model, optimizer and timed steps; its memory is freed before the next
    unless `keep` (its `step` is returned, to profile)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_stepwise.mcore.train.model import build_model_chunks
    from megatron_stepwise.mcore.train.plugin import StepwisePlugin

    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    chunks = build_model_chunks(hf, config_overrides={"dtype": torch.bfloat16}, **build)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-6, weight_decay=0.0, clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16
        ),
        chunks,
    )
    plugin = StepwisePlugin(
        LossConfig(policy_loss="ppo", reduction="token_mean"), max_tokens_per_microbatch=args.micro_tokens
    )

    def step():
        return plugin.train_minibatch(chunks, opt, batch)

    timing = time_repeats(step, args.repeats, args.warmup, lambda: synchronize(args.device))
    return {
        "build": build,
        "step_s": timing.median,
        "all_step_s": timing.seconds,
        "mfu": model_flops / timing.median / 1e12 / peak_tflops,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
        "loss": timing.result["loss"],
        "metrics": timing.result,
        "step": step if keep else None,
    }


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.machine()}, smoke run)"


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    """Prints the table, returns the figures; {'skipped': reason} without a GPU."""
    args = run_args(parse_args, quick, options)
    if skipped := cuda_skip("bench_gpu", args.device):
        return skipped
    from megatron_stepwise.mcore.runtime.runtime import destroy_distributed, silence_megatron_noise

    silence_megatron_noise()
    from bench_trainer_step import start_world_of_one

    from megatron_stepwise.mcore.train.model import te_available

    sizes = (8192,) if args.quick else (4096, 8192, 16384)
    peak = matmul_peak_tflops(sizes if args.device == "cuda" else (512,), args.device)
    peak_tflops = max(peak.values())
    hf = tiny_config() if args.model == "tiny" else MODELS[args.model]
    shape = ModelShape.from_hf(hf)
    steps, batch = gpu_minibatch(args, hf["vocab_size"])
    lengths = [s.num_tokens for s in steps]
    trained = sum(s.num_trainable for s in steps)
    flops = training_flops(shape, lengths, trained_tokens=trained)

    start_world_of_one()
    try:
        figures = {}
        for name in args.variants:
            keep = bool(args.profile) and name == args.variants[0]
            figures[name] = time_variant(args, hf, batch, VARIANTS[name], flops["total"], peak_tflops, keep)
            print(f"  {name}: {figures[name]['step_s']:.3f} s/step, MFU {figures[name]['mfu']:.1%}")
        if args.profile:
            profile_step(figures[args.variants[0]].pop("step"), args.device, args.profile)
    finally:
        destroy_distributed()
    for f in figures.values():
        f.pop("step", None)
    first = figures[args.variants[0]]
    times, timing_median, metrics = first["all_step_s"], first["step_s"], first["metrics"]
    memory_gib = first["max_memory_gib"]

    sec = timing_median
    tokens = sum(lengths)
    achieved = flops["total"] / sec / 1e12
    mfu = achieved / peak_tflops
    memory = f"{memory_gib:>14.1f}" if memory_gib is not None else f"{'n/a':>14}"
    print(
        f"Training step: {device_name(args.device)}, {args.model} ({shape.total_params / 1e9:.3g}B params, "
        f"random init, bf16), {'Transformer Engine' if te_available() else 'local'} spec; mini-batch of "
        f"{len(steps)} step rows, {tokens:,} tokens ({trained:,} trained), "
        f"{int(metrics['num_microbatches'])} packed micro-batches of <= {args.micro_tokens} tokens; median of {len(times)}"
    )
    print(
        "  bf16 matmul peak (measured): "
        + ", ".join(f"n={n}: {v:.3g}" for n, v in peak.items())
        + f" TFLOP/s -> {peak_tflops:.3g}"
    )
    print(
        f"  {'step s':>8}{'tokens/s':>12}{'model TFLOP/step':>18}{'achieved TFLOP/s':>18}{'MFU':>8}{'peak mem GiB':>14}"
    )
    print(f"  {sec:>8.3f}{tokens / sec:>12,.0f}{flops['total'] / 1e12:>18.1f}{achieved:>18.1f}{mfu:>8.1%}{memory}")
    if len(figures) > 1:
        print(f"  {'variant':<16}{'step s':>8}{'tokens/s':>12}{'MFU':>8}{'vs ' + args.variants[0]:>14}")
        for name, f in figures.items():
            print(
                f"  {name:<16}{f['step_s']:>8.3f}{tokens / f['step_s']:>12,.0f}{f['mfu']:>8.1%}{sec / f['step_s']:>13.2f}x"
            )
    print(
        f"  FLOPs split: dense {flops['dense'] / flops['total']:.0%}, attention {flops['attention'] / flops['total']:.0%}, "
        f"output layer (trained positions) {flops['output'] / flops['total']:.0%}"
    )
    return {
        "config": config(args),
        "device": device_name(args.device),
        "transformer_engine": te_available(),
        "params": shape.total_params,
        "matmul_peak_tflops": peak,
        "peak_tflops": peak_tflops,
        "tokens": tokens,
        "trained_tokens": trained,
        "flops": flops,
        "step_s": sec,
        "all_step_s": times,
        "tokens_per_s": tokens / sec,
        "achieved_tflops": achieved,
        "mfu": mfu,
        "num_microbatches": int(metrics["num_microbatches"]),
        "loss": metrics["loss"],
        "max_memory_gib": memory_gib,
        "variants": {
            name: {k: v for k, v in f.items() if k != "metrics"} | {"tokens_per_s": tokens / f["step_s"]}
            for name, f in figures.items()
        },
    }


if __name__ == "__main__":
    script_main(parse_args, run)
