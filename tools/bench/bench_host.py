"""Host-side pipeline overhead of one RL iteration, against a stated reference GPU time
(prints measured figures; never asserts).

Workload: 512 prompts x 8 samples, 1-8 turns, the Search-R1 shape of `megatron_stepwise.data.synthetic`
(~67M step tokens). Phases, calling what training runs in its order (`trainer_pipeline` of
`tools/bench/bench_pipeline.py`), on ONE core (`torch.set_num_threads(1)`): validate (`validate_steps`
on the rollout, as the mini-batch sources do) -> minibatch (`prompt_minibatches`) -> prepare
(the trainer's `algo.prepare.prepare` per mini-batch: prefix merge, GRPO advantages, the
columnar StepBatch with its advantages field that the plugin gets) -> plan (the plugin's host
planning of each prepared batch: `packed_lengths` -> `plan_microbatches`, DP 8, 32k-token
micro-batches aligned to 128). Reported: the first run (cold: memory is page-faulted in) and the
median of later runs (warm, as in a training loop), wall and CPU time (CPU time is robust to
other processes sharing the machine).

Reference GPU time (an assumption, printed): the model FLOPs (`tools/bench/flops.py`) of training a
Qwen2.5-7B on the rows this run produced (merged, packed), at 40% MFU on 8 x H100 (989 dense bf16
TFLOP/s each). The pipeline runs once per iteration, so its time is compared with the GPU time of
the whole iteration's training (all its mini-batches); per optimizer step both shrink alike.

    python tools/bench/bench_host.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import trainer_pipeline  # noqa: E402
from flops import QWEN2_CONFIGS, ModelShape, training_flops  # noqa: E402
from harness import (  # noqa: E402
    PhaseTimer,
    add_seed_and_out,
    bench_parser,
    config,
    repeat_runs,
    run_args,
    script_main,
    warm_median,
)

from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps  # noqa: E402

PHASES = ("validate", "minibatch", "prepare", "plan")

REFERENCE = {"model": "qwen2.5-7b", "gpus": 8, "gpu": "H100 SXM", "peak_tflops_per_gpu": 989.0, "mfu": 0.40}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "64 prompts, 1 warm repeat")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--prompts-per-minibatch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="warm runs after the cold one")
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.repeats = 64, 1
    return args


def run_once(steps, args) -> tuple[dict[str, float], dict[str, float], Any]:
    """Wall and CPU seconds per phase, and the prepared batches (what the plugin trains on)."""
    phase = PhaseTimer()
    _, _, batches, _ = trainer_pipeline(
        steps,
        phase,
        vocab_size=32000,
        prompts_per_minibatch=args.prompts_per_minibatch,
        settings={"estimator": "grpo", "merge_steps": True, "max_tokens": args.max_tokens},
        dp=args.dp,
        max_tokens=args.max_tokens,
        micro_align=128,
    )
    return phase.wall, phase.cpu, batches


def reference_gpu_seconds(batches) -> dict[str, Any]:
    shape = ModelShape.from_hf(QWEN2_CONFIGS[REFERENCE["model"]])
    lengths = [n for b in batches for n in b.lengths.tolist()]
    trained = sum(int(b.token_fields["loss_mask"].sum()) for b in batches)
    flops = training_flops(shape, lengths, trained_tokens=trained)
    rate = REFERENCE["gpus"] * REFERENCE["peak_tflops_per_gpu"] * 1e12 * REFERENCE["mfu"]
    return {
        **REFERENCE,
        "params": shape.total_params,
        "tokens": sum(lengths),
        "flops": flops,
        "seconds": flops["total"] / rate,
    }


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    """Prints the table, returns the figures (what `tools/bench/suite.py` collects)."""
    args = run_args(parse_args, quick, options)
    torch.set_num_threads(1)
    w = AgentWorkload(
        num_prompts=args.prompts, samples_per_prompt=args.samples, turns=(1, args.max_turns), seed=args.seed
    )
    steps = make_agent_steps(w)
    n_tokens = sum(s.num_tokens for s in steps)
    walls, cpus, batches = repeat_runs(lambda: run_once(steps, args), args.repeats)
    summary = {
        "cold_wall": walls[0],
        "cold_cpu": cpus[0],
        "warm_wall": warm_median(walls),
        "warm_cpu": warm_median(cpus),
    }
    for v in summary.values():
        v["total"] = sum(v[k] for k in PHASES)
    ref = reference_gpu_seconds(batches)
    merged_rows = sum(b.num_rows for b in batches)

    print(
        f"host pipeline: {w.num_prompts} prompts x {w.samples_per_prompt} samples, 1-{args.max_turns} turns: "
        f"{len(steps):,} steps, {n_tokens:,} tokens -> {merged_rows:,} merged rows; dp={args.dp}, "
        f"max_tokens={args.max_tokens:,}, {args.prompts_per_minibatch} prompts per mini-batch, 1 thread"
    )
    print(
        f"{'phase':<22}{'cold wall':>11}{'cold cpu':>11}{'warm wall':>11}{'warm cpu':>11}"
        f"   (median of {len(walls[1:] or walls)})"
    )
    for k in list(PHASES) + ["total"]:
        print(
            f"{k:<22}" + "".join(f"{summary[c][k]:>10.3f}s" for c in ("cold_wall", "cold_cpu", "warm_wall", "warm_cpu"))
        )
    total = summary["warm_wall"]["total"]
    print(
        f"\nassumption: the GPU time of training this iteration's rows ({ref['tokens']:,} tokens, merged and packed) "
        f"with {ref['model']} ({ref['params'] / 1e9:.2f}B params) on {ref['gpus']} x {ref['gpu']} at {ref['mfu']:.0%} MFU "
        f"of {ref['peak_tflops_per_gpu']:.0f} dense bf16 TFLOP/s per GPU: {ref['flops']['total']:.3g} model FLOPs "
        f"(tools/bench/flops.py) -> {ref['seconds']:.1f} s"
    )
    print(
        f"host pipeline (warm wall) / reference GPU time = {total:.3f} s / {ref['seconds']:.1f} s = "
        f"{total / ref['seconds']:.2%}"
    )
    return {
        "config": config(args),
        "workload": {
            "steps": len(steps),
            "tokens": n_tokens,
            "merged_rows": merged_rows,
            "tokens_after_merge": ref["tokens"],
        },
        "time_s": summary,
        "reference_gpu": ref,
        "seconds": total,
        "fraction_of_gpu_time": total / ref["seconds"],
    }


if __name__ == "__main__":
    script_main(parse_args, run)
