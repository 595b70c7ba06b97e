"""Merge savings: tokens the model computes per trajectory, step-wise rows vs prefix-merged rows,
as the number of turns grows (prints measured figures; never asserts).

Workload: `megatron_stepwise.data.synthetic` agent trajectories with a FIXED number of turns T
(T = 1..16), the Search-R1 shape otherwise (prompt 100-600, observations 50-2000, responses
20-500 tokens), prefix-consistent (no re-tokenisation drift). For each T it reports, per
trajectory,
- unmerged: sum over steps of prompt + response, which grows like T^2 (every step re-reads the
  whole history);
- merged: the rows `merge_steps` leaves (one per trajectory unless a row would pass the
  micro-batch budget `--max-tokens`), which grows like T;
- unique: the trajectory's token stream (its last step's prompt + response), the least any
  layout can compute; merged / unique is the overhead of merging (1.0 unless rows were split
  at the budget, where the next row re-reads its prefix);
and, for contrast, merged / unique when 10% of turn boundaries re-tokenise differently (drift:
the row breaks there and the next row re-reads the history); and the growth exponent k of
tokens ~ T^k fitted by least squares in log-log space, over
T = 1..16 and over the upper half T = 8..16 (closer to the asymptote).

    python tools/bench/bench_merge.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import add_seed_and_out, bench_parser, config, run_args, script_main  # noqa: E402

from megatron_stepwise.algo.merge import merge_steps  # noqa: E402
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "16 trajectories per turn count instead of 64")
    p.add_argument("--max-turns", type=int, default=16)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32768, help="micro-batch budget a merged row must fit")
    p.add_argument("--drift", type=float, default=0.1, help="re-tokenisation drift probability of the contrast run")
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts = 4
    return args


def growth_exponent(turns: Sequence[int], tokens: Sequence[float]) -> float:
    """k in tokens ~ c * T^k, least squares on (log T, log tokens)."""
    k, _ = np.polyfit(np.log(np.asarray(turns, dtype=float)), np.log(np.asarray(tokens, dtype=float)), 1)
    return float(k)


def _workload(turns: int, args: argparse.Namespace, drift: float) -> AgentWorkload:
    return AgentWorkload(
        num_prompts=args.prompts,
        samples_per_prompt=args.samples,
        turns=(turns, turns),
        with_logprobs=False,
        drift_prob=drift,
        seed=args.seed + turns,
    )


def _unique_tokens(steps) -> int:
    return sum(s.num_tokens for s in steps if s.is_last_step)  # the stream: history + last response


def measure_turns(turns: int, args: argparse.Namespace) -> dict[str, float]:
    w = _workload(turns, args, drift=0.0)
    steps = make_agent_steps(w)
    n_traj = w.num_prompts * w.samples_per_prompt
    merged, stats = merge_steps(steps, max_tokens=args.max_tokens)
    unique = _unique_tokens(steps)
    drifted = make_agent_steps(_workload(turns, args, drift=args.drift))
    _, drift_stats = merge_steps(drifted, max_tokens=args.max_tokens)
    trained_unmerged = sum(s.num_trainable for s in steps)
    trained_merged = sum(s.num_trainable for s in merged)
    return {
        "turns": turns,
        "trajectories": n_traj,
        "unmerged_tokens_per_traj": stats.tokens_before / n_traj,
        "merged_tokens_per_traj": stats.tokens_after / n_traj,
        "unique_tokens_per_traj": unique / n_traj,
        "trained_tokens_per_traj": trained_unmerged / n_traj,
        "trained_tokens_equal": trained_unmerged == trained_merged,
        "unmerged_over_merged": stats.tokens_before / stats.tokens_after,
        "merged_over_unique": stats.tokens_after / unique,
        "rows_per_traj_unmerged": stats.rows_before / n_traj,
        "rows_per_traj_merged": stats.rows_after / n_traj,
        "broken_prefixes": stats.broken_prefixes,
        "merged_over_unique_with_drift": drift_stats.tokens_after / _unique_tokens(drifted),
    }


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    """Prints the table, returns the figures (what `tools/bench/suite.py` collects)."""
    args = run_args(parse_args, quick, options)
    rows = [measure_turns(t, args) for t in range(1, args.max_turns + 1)]

    print(
        f"merge savings: {args.prompts * args.samples} prefix-consistent trajectories per turn count, "
        f"merged rows capped at max_tokens={args.max_tokens:,}"
    )
    print(
        f"{'turns':>5}{'unmerged tok/traj':>19}{'merged tok/traj':>17}{'unique tok/traj':>17}"
        f"{'unmerged/merged':>17}{'merged/unique':>15}{'rows/traj':>11}{'trained/traj':>14}"
        f"{'merged/unique, drift ' + format(args.drift, '.0%'):>26}"
    )
    for r in rows:
        print(
            f"{r['turns']:>5}{r['unmerged_tokens_per_traj']:>19,.0f}{r['merged_tokens_per_traj']:>17,.0f}"
            f"{r['unique_tokens_per_traj']:>17,.0f}{r['unmerged_over_merged']:>16.2f}x"
            f"{r['merged_over_unique']:>15.3f}{r['rows_per_traj_merged']:>11.2f}{r['trained_tokens_per_traj']:>14,.0f}"
            f"{r['merged_over_unique_with_drift']:>26.3f}"
        )

    turns = [r["turns"] for r in rows]
    upper = [i for i, t in enumerate(turns) if t >= (args.max_turns + 1) // 2] or list(range(len(turns)))
    exponents = {}
    for layout in ("unmerged", "merged", "unique"):
        tokens = [r[f"{layout}_tokens_per_traj"] for r in rows]
        exponents[layout] = {
            "all": growth_exponent(turns, tokens),
            "upper_half": growth_exponent([turns[i] for i in upper], [tokens[i] for i in upper]),
        }
    lo = turns[upper[0]]
    print(f"\ngrowth exponent k (tokens ~ T^k): {'T=1..' + str(args.max_turns):>10}{f'T={lo}..{args.max_turns}':>10}")
    for layout, k in exponents.items():
        print(f"  {layout:<29}{k['all']:>10.2f}{k['upper_half']:>10.2f}")
    last = rows[-1]
    print(
        f"  at T={last['turns']}: unmerged / merged = {last['unmerged_over_merged']:.2f}x, merged / unique = "
        f"{last['merged_over_unique']:.3f} (worst over T: {max(r['merged_over_unique'] for r in rows):.3f}); "
        f"trained tokens equal in both layouts: {all(r['trained_tokens_equal'] for r in rows)}"
    )
    return {
        "config": config(args),
        "by_turns": rows,
        "growth_exponent": exponents,
        "ratio_at_max_turns": last["unmerged_over_merged"],
        "merged_over_unique_max": max(r["merged_over_unique"] for r in rows),
    }


if __name__ == "__main__":
    script_main(parse_args, run)
