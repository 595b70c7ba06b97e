"""Rollout throughput of the Ray fleet of embedded CPU engines: 1 vs 2 engines, side by side.

Runs the step-wise agent loop on the `echo` task (tiny random Qwen2, tiny_word tokenizer) and
reports trajectories/s and generated tokens/s after a warm-up round. The in-process engine (no
Ray, no actor hop) is measured too as the reference. No asserts: numbers are printed.

    python tools/bench/bench_rollout.py            # 64 prompts x 4 samples, 3 turns, 16 new tokens
    python tools/bench/bench_rollout.py --quick    # 16 prompts x 4 samples
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[2]))

from harness import bench_parser  # noqa: E402

from megatron_stepwise.envs.echo import echo_dataset  # noqa: E402
from megatron_stepwise.hf.tokenizers import load_tokenizer  # noqa: E402
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig  # noqa: E402
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine  # noqa: E402
from megatron_stepwise.rollout.engines.embedded.hf_model import tiny_qwen2_config  # noqa: E402
from megatron_stepwise.rollout.engines.protocol import SamplingParams  # noqa: E402
from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec  # noqa: E402
from megatron_stepwise.rollout.fleet.fleet import RolloutFleet  # noqa: E402


async def measure(generator, tok, samples, cfg) -> dict:
    loop = AgentLoop(generator, tok, "echo", cfg)
    try:
        await loop.rollout(samples[: max(1, len(samples) // 4)])  # warm-up
        start = time.perf_counter()
        steps = await loop.rollout(samples)
        elapsed = time.perf_counter() - start
    finally:
        loop.close()
    trajectories = sum(s.is_last_step for s in steps)
    tokens = sum(int(s.loss_mask.sum()) for s in steps)
    return {
        "trajectories/s": trajectories / elapsed,
        "gen tokens/s": tokens / elapsed,
        "steps": len(steps),
        "seconds": elapsed,
    }


async def bench(args) -> dict[str, dict]:
    tok = load_tokenizer("tiny_word")
    config = tiny_qwen2_config(len(tok))
    samples = echo_dataset(args.prompts, num_turns=3, seed=0)
    cfg = AgentLoopConfig(
        max_turns=3,
        max_input_length=256,
        n_samples_per_prompt=args.samples,
        max_concurrency=args.concurrency,
        sampling=SamplingParams(max_new_tokens=args.new_tokens),
    )
    results = {}
    engine = LocalEngine(config, tokenizer=tok, seed=0, max_batch_size=args.batch)
    results["in-process x1"] = await measure(engine, tok, samples, cfg)
    await engine.close()
    for n in (1, 2):
        specs = [
            EngineSpec(model_config=config, tokenizer="tiny_word", seed=i, num_cpus=0.5, max_batch_size=args.batch)
            for i in range(n)
        ]
        fleet = RolloutFleet(specs, max_concurrency=args.concurrency)
        await fleet.wait_ready()
        results[f"fleet x{n}"] = await measure(fleet, tok, samples, cfg)
        await fleet.shutdown()
    return results


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts = 16
    return args


def run(quick: bool = False) -> dict:
    """What `tools/bench/suite.py` collects: prints the table, returns the figures."""
    return report(parse_args(["--quick"] if quick else []))


def report(args: argparse.Namespace) -> dict:
    results = asyncio.run(bench(args))
    import ray

    ray.shutdown()
    names = list(results)
    print(
        f"\nrollout throughput, echo task, {args.prompts} prompts x {args.samples} samples, 3 turns, "
        f"max {args.new_tokens} new tokens, {os.cpu_count()} CPU cores"
    )
    print(f"{'':>16}" + "".join(f"{n:>16}" for n in names))
    for metric in ("trajectories/s", "gen tokens/s", "steps", "seconds"):
        print(f"{metric:>16}" + "".join(f"{results[n][metric]:>16.2f}" for n in names))
    base = results["fleet x1"]["trajectories/s"]
    ratio = results["fleet x2"]["trajectories/s"] / base
    print(f"{'x2 / x1':>16}{ratio:>16.2f}  (fleet trajectories/s ratio)")
    return {"config": vars(args), "results": results, "fleet_x2_over_x1": ratio}


if __name__ == "__main__":
    report(parse_args())
