"""Token-in/token-out vs re-tokenised context with a real byte-level BPE: merged tokens per
trajectory as the number of turns grows (prints measured figures; never asserts).

The real agent loop (`rollout.context` = `tokens` and `retokenize`) runs the `echo` task for
exactly T turns against the embedded engine: a randomly initialised tiny Qwen2 sized to the
shipped `tiny_bpe` tokenizer (byte-level BPE, ChatML template), the same engine seed and the
same per-turn sampling seeds in both modes. Nothing is simulated: drift is what re-tokenising
the decoded text of the sampled ids does. For each T and mode it reports, per trajectory,
- unmerged: tokens of the step-wise rows (every step re-reads its history);
- merged: tokens of the rows `merge_steps` leaves;
- unique: the trajectory's stream (last step's prompt + response), the least any layout computes;
and merged / unique, the rows left per trajectory, the prefixes the merge found broken and the
re-tokenisation drift rate (turn boundaries whose re-tokenised chat lost the sampled ids; the
same measurement in both modes). A random policy samples byte fragments and invalid UTF-8 far
more often than a trained LLM does, so its drift rate is a high-end figure; token mode's
merged / unique is 1.000 whatever the drift.

    python tools/bench/bench_context.py [--quick] [--turns 4,8,16] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from harness import add_seed_and_out, bench_parser, config, run_args, script_main  # noqa: E402

from megatron_stepwise.algo.groups import groups_of  # noqa: E402
from megatron_stepwise.algo.merge import merge_steps  # noqa: E402
from megatron_stepwise.envs.echo import EchoEnv, echo_dataset  # noqa: E402
from megatron_stepwise.hf.tokenizers import load_tokenizer  # noqa: E402
from megatron_stepwise.metrics.core import rollout_metrics  # noqa: E402
from megatron_stepwise.rollout.agent.context import CONTEXT_MODES  # noqa: E402
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig  # noqa: E402
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine  # noqa: E402
from megatron_stepwise.rollout.engines.embedded.hf_model import tiny_qwen2_config  # noqa: E402
from megatron_stepwise.rollout.engines.protocol import SamplingParams  # noqa: E402

TOKENIZER = "tiny_bpe"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "2 prompts instead of 8")
    p.add_argument("--turns", default="4,8,16", help="comma-separated turn counts T")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16, help="max_new_tokens per turn")
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts = 2
    return args


def rollout(mode: str, turns: int, args: argparse.Namespace, tokenizer) -> list:
    """One rollout of `prompts x samples` echo trajectories of exactly `turns` turns."""

    async def go() -> list:
        engine = LocalEngine(tiny_qwen2_config(len(tokenizer)), tokenizer=tokenizer, seed=args.seed)
        cfg = AgentLoopConfig(
            max_turns=turns,
            max_input_length=1_000_000,
            n_samples_per_prompt=args.samples,
            sampling=SamplingParams(max_new_tokens=args.new_tokens),
            context=mode,
            drift_sample_rate=1.0,
        )  # the drift of every trajectory, in both modes
        loop = AgentLoop(engine, tokenizer, EchoEnv, cfg)
        try:
            return await loop.rollout(
                echo_dataset(args.prompts, num_turns=turns, seed=args.seed + turns), seed=args.seed
            )
        finally:
            loop.close()
            await engine.close()

    return asyncio.run(go())


def measure(mode: str, turns: int, args: argparse.Namespace, tokenizer) -> dict[str, Any]:
    steps = rollout(mode, turns, args, tokenizer)
    merged, stats = merge_steps(steps)
    n_traj = sum(s.is_last_step for s in steps)
    unique = sum(s.num_tokens for s in steps if s.is_last_step)
    return {
        "mode": mode,
        "turns": turns,
        "trajectories": n_traj,
        "steps_per_traj": len(steps) / n_traj,
        "unmerged_tokens_per_traj": stats.tokens_before / n_traj,
        "merged_tokens_per_traj": stats.tokens_after / n_traj,
        "unique_tokens_per_traj": unique / n_traj,
        "merged_over_unique": stats.tokens_after / unique,
        "rows_per_traj_merged": stats.rows_after / n_traj,
        "broken_prefixes": stats.broken_prefixes,
        "drift_rate": rollout_metrics(groups_of(steps)).get("rollout/retokenize_drift_rate", 0.0),
        "trained_tokens_per_traj": sum(s.num_trainable for s in steps) / n_traj,
    }


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    """Prints the table, returns the figures (what `tools/bench/suite.py` collects)."""
    args = run_args(parse_args, quick, options)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(TOKENIZER)
    turn_counts = [int(t) for t in str(args.turns).split(",")]
    rows = [measure(mode, t, args, tokenizer) for t in turn_counts for mode in CONTEXT_MODES]

    print(
        f"context modes: {args.prompts * args.samples} echo trajectories of exactly T turns per mode, "
        f"{TOKENIZER} tokenizer ({len(tokenizer)} tokens), random tiny Qwen2, <= {args.new_tokens} new tokens/turn"
    )
    print(
        f"{'T':>3}{'mode':>12}{'unmerged tok/traj':>19}{'merged tok/traj':>17}{'unique tok/traj':>17}"
        f"{'merged/unique':>15}{'rows/traj':>11}{'broken prefixes':>17}{'drift rate':>12}"
    )
    for r in rows:
        print(
            f"{r['turns']:>3}{r['mode']:>12}{r['unmerged_tokens_per_traj']:>19,.1f}"
            f"{r['merged_tokens_per_traj']:>17,.1f}{r['unique_tokens_per_traj']:>17,.1f}{r['merged_over_unique']:>15.3f}{r['rows_per_traj_merged']:>11.2f}"
            f"{r['broken_prefixes']:>17}{r['drift_rate']:>12.3f}"
        )
    by = {(r["mode"], r["turns"]): r for r in rows}
    figures: dict[str, float] = {}
    for t in turn_counts:
        for mode in CONTEXT_MODES:
            figures[f"merged_tokens_per_traj_{mode}_T{t}"] = by[(mode, t)]["merged_tokens_per_traj"]
        figures[f"retokenize_over_tokens_T{t}"] = (
            by[("retokenize", t)]["merged_tokens_per_traj"] / by[("tokens", t)]["merged_tokens_per_traj"]
        )
    figures["tokens_merged_over_unique_max"] = max(r["merged_over_unique"] for r in rows if r["mode"] == "tokens")
    figures["retokenize_merged_over_unique_max_turns"] = by[("retokenize", turn_counts[-1])]["merged_over_unique"]
    retok = [r for r in rows if r["mode"] == "retokenize"]
    figures["retokenize_drift_rate"] = sum(r["drift_rate"] for r in retok) / len(retok)
    last = turn_counts[-1]
    print(
        f"\nat T={last}: merged tokens per trajectory, retokenize / tokens = "
        f"{figures[f'retokenize_over_tokens_T{last}']:.2f}x; "
        f"merged / unique: tokens {by[('tokens', last)]['merged_over_unique']:.3f}, "
        f"retokenize {by[('retokenize', last)]['merged_over_unique']:.3f}; "
        f"drift rate (retokenize, mean over T) {figures['retokenize_drift_rate']:.3f}"
    )
    return {"config": config(args), "rows": rows, "figures": figures}


if __name__ == "__main__":
    script_main(parse_args, run)
