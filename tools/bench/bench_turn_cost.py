"""Host CPU cost of one agent-loop turn (prints measured figures; never asserts).

The real `AgentLoop` runs `echo` trajectories of exactly `--turns` turns against an engine that
answers at once with the same `--new-tokens` ids every turn (finish_reason "length", so the loop
appends the EOS), with the shipped `tiny_bpe` tokenizer (byte-level BPE, ChatML template). No
model runs: what is timed is only the loop's own host work per turn (prompt building, the
environment call, the step). Figure: process CPU milliseconds per emitted step
(`time.process_time` delta / steps, so other processes on the machine do not count), the median
of `--repeats` rollouts after an untimed warm-up, for each `rollout.context` mode. `--profile`
adds a cProfile top-15 (by own time) of one rollout per mode.

    python tools/bench/bench_turn_cost.py [--quick] [--profile] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from harness import add_seed_and_out, bench_parser, config, run_args, script_main  # noqa: E402
from instant_engine import InstantEngine  # noqa: E402

from megatron_stepwise.envs.echo import EchoEnv, echo_dataset  # noqa: E402
from megatron_stepwise.hf.tokenizers import load_tokenizer  # noqa: E402
from megatron_stepwise.rollout.agent.context import CONTEXT_MODES  # noqa: E402
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig  # noqa: E402

TOKENIZER = "tiny_bpe"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "2 prompts, 1 repeat")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8, help="trajectories per prompt")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32, help="ids the engine answers per turn")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="print a cProfile top-15 per mode")
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.repeats = 2, 1
    return args


def loop_for(mode: str, args: argparse.Namespace, tokenizer) -> AgentLoop:
    """The loop with the experiment defaults but these turns, samples and context mode."""
    cfg = AgentLoopConfig(
        max_turns=args.turns, max_input_length=1_000_000, n_samples_per_prompt=args.samples, context=mode
    )
    return AgentLoop(InstantEngine(tokenizer, args.new_tokens), tokenizer, EchoEnv, cfg)


def cpu_ms_per_step(loop: AgentLoop, samples: list[dict], seed: int) -> tuple[float, int]:
    start = time.process_time()
    steps = asyncio.run(loop.rollout(samples, seed=seed))
    return 1000 * (time.process_time() - start) / len(steps), len(steps)


def profile_top(loop: AgentLoop, samples: list[dict], seed: int, top: int = 15) -> str:
    prof = cProfile.Profile()
    prof.enable()
    asyncio.run(loop.rollout(samples, seed=seed))
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    """Prints the figures, returns them (ms of process CPU per step, per context mode)."""
    args = run_args(parse_args, quick, options)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(TOKENIZER)
    samples = echo_dataset(args.prompts, num_turns=args.turns, seed=args.seed)
    rows = []
    for mode in CONTEXT_MODES:
        loop = loop_for(mode, args, tokenizer)
        try:
            cpu_ms_per_step(loop, samples, args.seed)  # warm-up: imports, template compilation, threads
            runs = [cpu_ms_per_step(loop, samples, args.seed) for _ in range(args.repeats)]
            rows.append(
                {
                    "mode": mode,
                    "cpu_ms_per_step": statistics.median(r[0] for r in runs),
                    "runs_ms": [r[0] for r in runs],
                    "steps": runs[0][1],
                }
            )
            if args.profile:
                print(f"--- cProfile, context={mode}, one rollout of {runs[0][1]} steps ---")
                print(profile_top(loop, samples, args.seed))
        finally:
            loop.close()
    print(
        f"agent loop host cost: {args.prompts} echo prompts x {args.samples} samples x {args.turns} turns, "
        f"{args.new_tokens} new tokens/turn, {TOKENIZER}, instant engine; median of {args.repeats}"
    )
    print(f"{'mode':>12}{'steps':>8}{'CPU ms/step':>13}   runs")
    for r in rows:
        print(
            f"{r['mode']:>12}{r['steps']:>8}{r['cpu_ms_per_step']:>13.3f}   "
            + " ".join(f"{x:.3f}" for x in r["runs_ms"])
        )
    figures = {f"cpu_ms_per_step_{r['mode']}": r["cpu_ms_per_step"] for r in rows}
    return {"config": config(args), "rows": rows, "figures": figures}


if __name__ == "__main__":
    script_main(parse_args, run)
