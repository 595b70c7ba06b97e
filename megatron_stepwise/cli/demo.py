"""`megatron-stepwise demo`: the step-wise batch pipeline on a synthetic multi-turn agent batch.

validate -> prompt mini-batches -> prepare (prefix merge, advantages, columnar batch) ->
micro-batch plan: the trainer's own functions, with a readable summary of what each stage did.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, TypeVar

from megatron_stepwise.algo.batching import prompt_minibatches
from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.algo.planner import DEFAULT_ATTENTION_WEIGHT, plan_microbatches, plan_stats
from megatron_stepwise.algo.prepare import add_counts, prepare
from megatron_stepwise.algo.validate import validate_steps
from megatron_stepwise.cli.arg_types import int_at_least
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps
from megatron_stepwise.steps import StepwiseBatchError

T = TypeVar("T")


_positive_int = int_at_least(1)


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the step-wise batch pipeline on a synthetic agent batch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prompts", type=_positive_int, default=16, help="prompts in the batch (default 16)")
    p.add_argument("--samples", type=_positive_int, default=4, help="trajectories per prompt (default 4)")
    p.add_argument("--max-turns", type=_positive_int, default=6, help="turns per trajectory: 1..N (default 6)")
    p.add_argument(
        "--drift",
        type=_probability,
        default=0.15,
        help="probability that a turn's re-tokenised prompt breaks the prefix (default 0.15)",
    )
    p.add_argument(
        "--prompts-per-minibatch", type=_positive_int, default=4, help="prompts per optimizer step (default 4)"
    )
    p.add_argument("--dp", type=_positive_int, default=4, help="data-parallel ranks (default 4)")
    p.add_argument(
        "--max-tokens", type=_positive_int, default=16384, help="token budget per micro-batch (default 16384)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    t = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t) * 1e3


def _stage(n: int, name: str, text: str, ms: float) -> None:
    lines = text.split("\n")
    print(f"[{n}/4] {name:<13}{lines[0]:<74}{ms:8.1f} ms")
    for line in lines[1:]:
        print(f"{'':19}{line}")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (StepwiseBatchError, ValueError) as e:  # e.g. a budget smaller than one step
        print(f"megatron-stepwise demo: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    w = AgentWorkload(
        num_prompts=args.prompts,
        samples_per_prompt=args.samples,
        turns=(1, args.max_turns),
        drift_prob=args.drift,
        seed=args.seed,
    )
    print("megatron-stepwise demo: the step-wise batch pipeline on a synthetic multi-turn agent batch")
    print(
        f"  {w.num_prompts} prompts x {w.samples_per_prompt} samples, {w.turns[0]}-{w.turns[1]} turns; tokens per "
        f"prompt {w.prompt_len[0]}-{w.prompt_len[1]}, observation {w.obs_len[0]}-{w.obs_len[1]}, "
        f"response {w.response_len[0]}-{w.response_len[1]}"
    )
    print(
        f"  each turn is one Step (its prompt = the whole history so far); {w.drift_prob:.0%} of turns "
        f"re-tokenise with drift (seed {w.seed})\n"
    )
    steps = make_agent_steps(w)

    _, ms = _timed(lambda: validate_steps(steps, vocab_size=w.vocab_size))
    trajs = sum(s.is_last_step for s in steps)
    _stage(1, "validate", f"{len(steps)} steps, {trajs} trajectories, {w.num_prompts} prompt groups: OK", ms)

    mbs, ms = _timed(lambda: prompt_minibatches(steps, args.prompts_per_minibatch))
    _stage(
        2,
        "mini-batches",
        f"{len(mbs)} x {args.prompts_per_minibatch} prompts = {len(mbs)} optimizer steps; "
        f"rows {', '.join(str(len(m)) for m in mbs)}",
        ms,
    )

    settings = {"merge_steps": True, "max_tokens": args.max_tokens}
    prepared, ms = _timed(lambda: [prepare(groups_of(mb), **settings) for mb in mbs])
    batches = [b for b, _ in prepared if b is not None]
    c = add_counts(m for _, m in prepared)
    _stage(
        3,
        "prepare",
        f"prefix merge: {c['batch/rows_before_merge']} -> {c['batch/rows_after_merge']} rows, "
        f"{c['batch/tokens_before_merge']:,} -> {c['batch/tokens_after_merge']:,} tokens "
        f"({c['batch/tokens_before_merge'] / c['batch/tokens_after_merge']:.2f}x fewer)\n"
        f"GRPO advantages over {c['advantages/num_groups']} groups, broadcast to every step; "
        f"{c['advantages/zero_variance_groups']} groups without signal",
        ms,
    )

    lengths = [batch.lengths.tolist() for batch in batches]

    def plan_all():
        plans = []
        for k, ls in enumerate(lengths):
            try:
                plans.append(plan_microbatches(ls, dp_size=args.dp, max_tokens=args.max_tokens))
            except StepwiseBatchError as e:
                raise StepwiseBatchError(f"mini-batch {k}: {e} (raise --max-tokens)") from None
        return plans

    plans, ms = _timed(plan_all)
    stats = [plan_stats(ls, plan) for ls, plan in zip(lengths, plans)]
    _stage(
        4,
        "plan",
        f"balance {args.dp} DP ranks by cost = tokens + tokens^2 / {1 / DEFAULT_ATTENTION_WEIGHT:.0f} (attention);\n"
        f"pack each rank into micro-batches of <= {args.max_tokens:,} tokens",
        ms,
    )

    print("\nmini-batch 0, tokens per micro-batch on each rank:")
    for rank, micros in enumerate(plans[0]):
        sizes = [sum(lengths[0][i] for i in mb) for mb in micros]
        print(
            f"  rank {rank}: {' + '.join(f'{s:,}' for s in sizes):<60} = {sum(sizes):>8,} tokens, "
            f"cost {stats[0].rank_costs[rank]:>10,.0f}"
        )

    print(
        f"\n{'mini-batch':>10} {'rows':>5} {'micro/rank':>10} {'packed eff':>10} {'pad-to-longest eff':>18} "
        f"{'DP max/mean':>11}"
    )
    for k, (ls, s) in enumerate(zip(lengths, stats)):
        print(
            f"{k:>10} {len(ls):>5} {s.micro_per_rank:>10} {s.packed_efficiency:>10.4f} "
            f"{s.padded_efficiency:>18.4f} {s.dp_balance:>11.4f}"
        )
    real = sum(s.real_tokens for s in stats)
    print(
        f"\nefficiency = real tokens / computed tokens. Packed micro-batches compute only real tokens "
        f"(plus one\ndummy row per empty micro-batch): {real / sum(s.packed_tokens for s in stats):.4f}. "
        f"Padding every row to the longest in its\nmicro-batch (same micro-batches) would compute "
        f"{sum(s.padded_tokens for s in stats):,} tokens for {real:,} real: "
        f"{real / sum(s.padded_tokens for s in stats):.4f}."
    )
    return 0
