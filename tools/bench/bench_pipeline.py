"""Benchmark of the host-side step-wise batch pipeline (prints measured figures; never asserts).

Workload: the issue's synthetic agent batch (512 prompts x 8 samples, 1-8 turns, observations
50-2000 tokens, responses 20-500), built by `megatron_stepwise.data.synthetic`.

The timed pipeline is what a training iteration runs on the host, in the same order
(`trainer_pipeline`, shared with `tools/bench/bench_host.py`):
validate (`validate_steps` on the rollout, as both mini-batch sources do) -> minibatch
(`prompt_minibatches`) -> prepare (`algo.prepare.prepare` on each mini-batch's groups, as the trainer
calls it: prefix merge, GRPO advantages, the columnar StepBatch) -> plan (what the plugin's
`prepare_minibatch` does on the host before packing: `packed_lengths` of each prepared batch,
then `plan_microbatches` with the micro-batch alignment). Group filters (config-dependent) and
the per-rank `pack_rows` are not part of it.

It reports
1. time of those phases on ONE core (`torch.set_num_threads(1)`): the first run in the process
   (cold: fresh memory is page-faulted in) and the median of the following runs (warm: the
   steady state of a training loop, which frees the previous iteration's batches);
2. rows and tokens before/after the prefix merge (the counts `prepare` returns, summed over
   mini-batches with `add_counts`);
3. for three layouts of the same rollouts -- ours (the prepared, merged rows, packed),
   step-wise unmerged, and the peers' earlier layout where each step's response also carried
   the next observation -- real and computed tokens when packed, when padded to the longest
   row of each of the same micro-batches, and when padded to the longest row of length-sorted
   micro-batches (the best case for padding), plus the longest padded row;
4. DP balance (max / mean rank cost) of our planner against round-robin, sorted greedy on
   tokens, and longest-first greedy on cost without the exchange pass.

    python tools/bench/bench_pipeline.py [--quick] [--out results.json]

`run(quick)` returns the same figures as a dict (what `tools/bench/suite.py` collects).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import PhaseTimer, add_seed_and_out, bench_parser, repeat_runs, run_args, warm_median, write_json  # noqa: E402

from megatron_stepwise.algo import planner  # noqa: E402
from megatron_stepwise.algo.batching import prompt_minibatches  # noqa: E402
from megatron_stepwise.algo.groups import groups_of  # noqa: E402
from megatron_stepwise.algo.merge import merge_steps  # noqa: E402
from megatron_stepwise.algo.planner import packed_lengths  # noqa: E402
from megatron_stepwise.algo.prepare import add_counts, prepare  # noqa: E402
from megatron_stepwise.algo.validate import validate_steps  # noqa: E402
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "64 prompts, 2 warm repeats")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32768, help="token budget per micro-batch")
    p.add_argument("--prompts-per-minibatch", type=int, default=64)
    p.add_argument(
        "--seq-align",
        type=int,
        default=1,
        help="per-row alignment: 1, or 2*CP with context parallelism (rows packed as `packed_lengths`)",
    )
    p.add_argument("--micro-align", type=int, default=128, help="alignment of a packed micro-batch (TP x 128)")
    p.add_argument("--drift", type=float, default=0.0, help="re-tokenisation drift probability per turn")
    p.add_argument("--repeats", type=int, default=5, help="warm runs after the cold one")
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.repeats = 64, 2
    try:
        context_parallel(args.seq_align)
    except ValueError as e:
        p.error(str(e))
    return args


def context_parallel(seq_align: int) -> int:
    """The CP size whose per-row padding (`packed_lengths`: a multiple of 2*CP) is `seq_align`."""
    if seq_align == 1:
        return 1
    if seq_align < 1 or seq_align % 2:
        raise ValueError(f"--seq-align must be 1 or 2*CP (even), got {seq_align}")
    return seq_align // 2


# ------------------------------------------------------------------------------- timing


def trainer_pipeline(
    steps,
    phase: PhaseTimer,
    *,
    vocab_size: int,
    prompts_per_minibatch: int,
    settings: dict[str, Any],
    dp: int,
    max_tokens: int,
    micro_align: int = 1,
    cp: int = 1,
) -> tuple[list, list, list, list]:
    """One iteration's host work, each phase timed by `phase`, calling what runs in training:
    the sources' `validate_steps` and `prompt_minibatches` (loop/sources.py, loop/async_source.py),
    the trainer's `prepare` per mini-batch (`settings`: its keyword arguments; the flat steps are
    grouped first, `groups_of`; a mini-batch without a trained token is skipped, as there), and the plugin's host-side planning of each prepared batch
    (mcore/train/plugin.py prepare_minibatch: `packed_lengths` -> `plan_microbatches`).
    Returns (mini-batches, prepare's (batch, metrics) per mini-batch, the batches, their plans)."""
    phase("validate", lambda: validate_steps(steps, vocab_size=vocab_size))
    mbs = phase("minibatch", lambda: prompt_minibatches(steps, prompts_per_minibatch) if steps else [])
    prepared = phase("prepare", lambda: [prepare(groups_of(mb), **settings) for mb in mbs])
    batches = [b for b, _ in prepared if b is not None]
    plans = phase(
        "plan",
        lambda: [
            planner.plan_microbatches(
                packed_lengths(b.lengths, cp).tolist(), dp_size=dp, max_tokens=max_tokens, micro_align=micro_align
            )
            for b in batches
        ],
    )
    return mbs, prepared, batches, plans


def prepare_settings(args) -> dict[str, Any]:
    return {"estimator": "grpo", "merge_steps": True, "max_tokens": args.max_tokens}


def run_pipeline(steps, args) -> tuple[dict[str, float], dict[str, float], Any]:
    """Wall-clock and CPU seconds of each phase."""
    phase = PhaseTimer()
    result = trainer_pipeline(
        steps,
        phase,
        vocab_size=32000,
        prompts_per_minibatch=args.prompts_per_minibatch,
        settings=prepare_settings(args),
        dp=args.dp,
        max_tokens=args.max_tokens,
        micro_align=args.micro_align,
        cp=context_parallel(args.seq_align),
    )
    times, cpu = phase.wall, phase.cpu
    times["total"] = sum(times.values())
    cpu["total"] = sum(cpu.values())
    return times, cpu, result


def merge_report(mbs, prepared, batches, args) -> dict[str, Any]:
    """Rows and tokens before/after the merge from `prepare`'s counts; trainable tokens from the
    prepared batches; broken prefixes (which `prepare` does not count) from an untimed
    `merge_steps` of the same mini-batches."""
    counts = add_counts(m for _, m in prepared)
    before, after = counts.get("batch/tokens_before_merge", 0), counts.get("batch/tokens_after_merge", 0)
    return {
        "rows_before": counts.get("batch/rows_before_merge", 0),
        "rows_after": counts.get("batch/rows_after_merge", 0),
        "tokens_before": before,
        "tokens_after": after,
        "token_ratio": before / after if after else 1.0,
        "trainable_tokens": sum(int(b.token_fields["loss_mask"].sum()) for b in batches),
        "broken_prefixes": sum(merge_steps(mb, max_tokens=args.max_tokens)[1].broken_prefixes for mb in mbs),
        "skipped_minibatches": len(prepared) - len(batches),
    }


# ------------------------------------------------------------------------------ layouts


def peer_layout_lengths(steps) -> list[int]:
    """Row lengths when a step's response also carries the observation that followed it:
    prompt[i] + response[i] + obs = prompt[i+1] for every step but a trajectory's last."""
    out = []
    for s, nxt in zip(steps, steps[1:] + [None]):
        same = nxt is not None and nxt.trajectory_id == s.trajectory_id
        out.append(nxt.prompt_ids.numel() if same else s.num_tokens)
    return out


def sorted_padded_tokens(lengths: list[int], max_tokens: int) -> int:
    """Computed tokens of the best case for padding: rows sorted by length, each micro-batch
    filled while rows x longest <= max_tokens."""
    total, longest, rows = 0, 0, 0
    for n in sorted(lengths, reverse=True):
        if rows and (rows + 1) * longest > max_tokens:
            total += rows * longest
            rows = 0
        if rows == 0:
            longest = n
        rows += 1
    return total + rows * longest


def layout_report(minibatch_lengths: list[list[int]], args) -> dict[str, Any]:
    real = packed = padded = best_padded = micro = 0
    balance, longest = [], 0
    for lengths in minibatch_lengths:
        plan = planner.plan_microbatches(
            lengths, dp_size=args.dp, max_tokens=args.max_tokens, seq_align=args.seq_align, micro_align=args.micro_align
        )
        st = planner.plan_stats(lengths, plan, seq_align=args.seq_align, micro_align=args.micro_align)
        real += st.real_tokens
        packed += st.packed_tokens
        padded += st.padded_tokens
        best_padded += sorted_padded_tokens(lengths, args.max_tokens)
        micro += st.micro_per_rank
        balance.append(st.dp_balance)
        longest = max(longest, st.longest_row)
    return {
        "rows": sum(len(x) for x in minibatch_lengths),
        "real_tokens": real,
        "packed_tokens": packed,
        "packed_efficiency": real / packed,
        "padded_same_micro_tokens": padded,
        "padded_same_micro_efficiency": real / padded,
        "padded_sorted_tokens": best_padded,
        "padded_sorted_efficiency": real / best_padded,
        "longest_padded_row": longest,
        "micro_batches_per_rank": micro,
        "dp_balance_worst": max(balance),
        "dp_balance_mean": statistics.mean(balance),
    }


# ------------------------------------------------------------------------- DP balancing


def assignment_balance(lengths: list[int], rank_of: np.ndarray, args) -> tuple[float, int]:
    """(max/mean rank cost, micro-batches per rank) when ranks get `rank_of` and are packed alike."""
    tokens = planner.pad_to_multiple(np.asarray(lengths, dtype=np.int64), args.seq_align)
    capacity = args.max_tokens // args.micro_align * args.micro_align
    plan = planner._pack_ranks(planner._rows_by_rank(rank_of, tokens, args.dp), tokens.tolist(), capacity)
    st = planner.plan_stats(lengths, plan, seq_align=args.seq_align, micro_align=args.micro_align)
    return st.dp_balance, st.micro_per_rank


def balance_report(minibatch_lengths: list[list[int]], args) -> dict[str, dict[str, float]]:
    strategies = {
        "round_robin": lambda L, c: np.arange(len(L)) % args.dp,
        "sorted_greedy_tokens": lambda L, c: planner._lpt(np.asarray(L, dtype=np.float64), args.dp),
        "greedy_cost_no_exchange": lambda L, c: planner._lpt(c, args.dp),
        "ours": lambda L, c: planner._balance_ranks(c, args.dp),
    }
    out = {}
    for name, assign in strategies.items():
        bal, micro = [], 0
        for lengths in minibatch_lengths:
            cost = planner.row_cost(planner.pad_to_multiple(np.asarray(lengths, dtype=np.int64), args.seq_align))
            b, m = assignment_balance(lengths, assign(lengths, cost), args)
            bal.append(b)
            micro += m
        out[name] = {"worst": max(bal), "mean": statistics.mean(bal), "micro_batches_per_rank": micro}
    return out


# --------------------------------------------------------------------------------- main


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    """The CLI's defaults (or `--quick`), with keyword overrides; prints the tables, returns the figures."""
    return bench(run_args(parse_args, quick, options))


def main() -> None:
    args = parse_args()
    write_json(bench(args), args.out)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    w = AgentWorkload(num_prompts=args.prompts, samples_per_prompt=args.samples, drift_prob=args.drift, seed=args.seed)
    t = time.perf_counter()
    steps = make_agent_steps(w)
    gen_s = time.perf_counter() - t
    n_tokens = sum(s.num_tokens for s in steps)
    print(
        f"workload: {w.num_prompts} prompts x {w.samples_per_prompt} samples, turns {w.turns}, obs {w.obs_len}, "
        f"response {w.response_len}, prompt {w.prompt_len}, drift {w.drift_prob}: {len(steps):,} steps, "
        f"{n_tokens:,} tokens (built in {gen_s:.1f} s)"
    )
    opts = prepare_settings(args)
    print(
        f"config: dp={args.dp}, max_tokens={args.max_tokens:,}, {args.prompts_per_minibatch} prompts per "
        f"mini-batch, seq_align={args.seq_align}, micro_align={args.micro_align}, prepare(merge_steps="
        f"{opts['merge_steps']}, estimator={opts['estimator']}), 1 thread\n"
    )

    runs, cpu_runs, (mbs, prepared, batches, _) = repeat_runs(lambda: run_pipeline(steps, args), args.repeats)
    cold, cold_cpu = runs[0], cpu_runs[0]
    warm, warm_cpu = warm_median(runs), warm_median(cpu_runs)
    print(f"{'':12}{'cold (1st run)':>22}{'warm (median of ' + str(len(runs[1:] or runs)) + ')':>24}")
    print(f"{'phase':<12}{'wall':>11}{'cpu':>11}{'wall':>12}{'cpu':>12}")
    for k in cold:
        print(
            f"{k:<12}{cold[k] * 1e3:>8.1f} ms{cold_cpu[k] * 1e3:>8.1f} ms"
            f"{warm[k] * 1e3:>9.1f} ms{warm_cpu[k] * 1e3:>9.1f} ms"
        )
    print(
        "  cold = first run in the process (fresh memory is page-faulted in); warm = later runs, each after\n"
        "  the previous run's batch was freed, as in a training loop. cpu = CPU time of this process\n"
        "  (one thread), robust to other processes sharing the cores; wall includes waiting for a core."
    )

    merge = merge_report(mbs, prepared, batches, args)
    print(
        f"\nmerge (prepare's counts over {len(mbs)} mini-batches): rows {merge['rows_before']:,} -> "
        f"{merge['rows_after']:,}, tokens {merge['tokens_before']:,} -> {merge['tokens_after']:,} "
        f"({merge['token_ratio']:.2f}x fewer), trainable {merge['trainable_tokens']:,}, "
        f"broken prefixes {merge['broken_prefixes']}, mini-batches skipped (nothing to train) "
        f"{merge['skipped_minibatches']}"
    )

    # Layouts of the same rollouts, each split into the same prompt mini-batches: ours are the
    # rows of the prepared batches (what the plugin plans and packs), the others the steps.
    peer = iter(peer_layout_lengths(steps))
    layouts = {
        "ours_merged": [b.lengths.tolist() for b in batches],
        "stepwise_unmerged": [[s.num_tokens for s in mb] for mb in mbs],
        "obs_in_response": [[next(peer) for _ in mb] for mb in mbs],
    }
    reports = {name: layout_report(lengths, args) for name, lengths in layouts.items()}
    base = reports["ours_merged"]["packed_tokens"]
    print(
        f"\n{'layout':<20}{'rows':>7}{'real tok':>13}{'packed':>13}{'eff':>7}{'pad same mb':>14}{'eff':>7}"
        f"{'pad sorted':>13}{'eff':>7}{'longest':>9}{'micro/rank':>11}{'packed vs ours':>15}{'pad sorted vs ours':>19}"
    )
    for name, r in reports.items():
        print(
            f"{name:<20}{r['rows']:>7,}{r['real_tokens']:>13,}{r['packed_tokens']:>13,}"
            f"{r['packed_efficiency']:>7.3f}{r['padded_same_micro_tokens']:>14,}"
            f"{r['padded_same_micro_efficiency']:>7.3f}{r['padded_sorted_tokens']:>13,}"
            f"{r['padded_sorted_efficiency']:>7.3f}{r['longest_padded_row']:>9,}"
            f"{r['micro_batches_per_rank']:>11}{r['packed_tokens'] / base:>14.2f}x"
            f"{r['padded_sorted_tokens'] / base:>18.2f}x"
        )
    print(
        "  eff = real / computed tokens; 'vs ours' = computed tokens relative to ours_merged packed;"
        "\n  micro/rank summed over mini-batches; longest = longest row (the padded sequence length)"
    )

    # Balance gets harder with fewer rows per rank: also show 4x the DP size on the same mini-batches.
    balance = {}
    for dp in (args.dp, 4 * args.dp):
        dp_args = argparse.Namespace(**{**vars(args), "dp": dp})
        for name in ("ours_merged", "stepwise_unmerged"):
            balance[f"{name} dp={dp}"] = balance_report(layouts[name], dp_args)
    print(
        f"\nDP balance, max/mean rank cost (cost = tokens + tokens^2/24576), worst | mean over "
        f"{len(mbs)} mini-batches, and micro-batches per rank (summed)"
    )
    for layout, rows in balance.items():
        print(f"  {layout}")
        for name, b in rows.items():
            print(f"    {name:<26}{b['worst']:>9.4f} | {b['mean']:.4f}   micro/rank {b['micro_batches_per_rank']}")

    return {
        "config": vars(args),
        "workload": {"steps": len(steps), "tokens": n_tokens},
        "time_s": {"cold": cold, "warm_median": warm, "all_runs": runs},
        "cpu_s": {"cold": cold_cpu, "warm_median": warm_cpu, "all_runs": cpu_runs},
        "merge": merge,
        "layouts": reports,
        "dp_balance": balance,
    }


if __name__ == "__main__":
    main()
