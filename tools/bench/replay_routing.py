"""Routing policies replayed on multi-turn agent traffic: prefix-hit rate, load imbalance, re-pins.

Replays each trace through the real `EngineRouter` with each policy of
rollout/fleet/session_routing.py (round_robin, sticky, budget_sticky) over N simulated engines, each
with an LRU prefix cache of `--cache-tokens` and a service-time model (`--prefill-s` per uncached
prompt token, `--decode-s` per generated token, requests in flight sharing the engine): see
tools/bench/routing_sim.py. Traces (tools/bench/routing_traces.py): a synthetic one of long agent sessions,
and the rollout dumps of every run directory given with `--dumps`. Then the same synthetic trace
with one engine killed half-way through its arrivals: how many attempts and simulated seconds
each orphaned session needs to be served again.

    python tools/bench/replay_routing.py                          # writes results/routing_replay.json
    python tools/bench/replay_routing.py --dumps runs/tiny_cpu    # + a run's rollout dumps
    python tools/bench/replay_routing.py --quick                  # a small trace, seconds

Prints one table per trace (and the kill table); `--out` writes the JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness import bench_parser, config, write_json  # noqa: E402
from routing_sim import SimConfig, cache_ceiling, replay  # noqa: E402
from routing_traces import describe, dump_trace, synthetic_trace  # noqa: E402

from megatron_stepwise.rollout.fleet.session_routing import POLICIES, make_policy  # noqa: E402

ORDER = ("round_robin", "sticky", "budget_sticky")
assert set(ORDER) == set(POLICIES)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "120 sessions over 4 engines")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--sessions", type=int, default=1024, help="synthetic sessions")
    p.add_argument("--group-size", type=int, default=8, help="synthetic sessions per prompt (arrive together)")
    p.add_argument("--arrival-rate", type=float, default=0.75, help="synthetic groups arriving per simulated second")
    p.add_argument("--block-tokens", type=int, default=64, help="prefix-cache block of the synthetic trace")
    p.add_argument("--dumps", nargs="*", default=[], help="run directories whose rollouts/iter_*.parquet to replay")
    p.add_argument("--dump-block-tokens", type=int, default=1, help="prefix-cache block of dumped traces")
    p.add_argument("--cache-tokens", type=int, default=262144, help="prefix cache of each engine")
    p.add_argument("--prefill-s", type=float, default=5e-5, help="seconds per uncached prompt token")
    p.add_argument("--decode-s", type=float, default=4e-4, help="seconds per generated token")
    p.add_argument("--sticky-slack", type=int, default=16)
    p.add_argument("--token-budget", type=int, default=131072, help="budget_sticky: outstanding tokens per engine")
    p.add_argument("--window-s", type=float, default=60.0, help="window of the windowed imbalance")
    p.add_argument("--detect-s", type=float, default=0.5, help="seconds until a request to a dead engine fails")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/routing_replay.json", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.engines, args.sessions, args.arrival_rate = 4, 120, 0.4
    return args


def policies(args: argparse.Namespace) -> list:
    return [make_policy(name, args.sticky_slack, args.token_budget) for name in ORDER]


def sim_config(args: argparse.Namespace, **kill: Any) -> SimConfig:
    return SimConfig(
        engines=args.engines,
        cache_tokens=args.cache_tokens,
        prefill_s=args.prefill_s,
        decode_s=args.decode_s,
        window_s=args.window_s,
        detect_s=args.detect_s,
        **kill,
    )


def run_trace(name: str, trace: list, args: argparse.Namespace, **kill: Any) -> dict[str, Any]:
    start = time.perf_counter()
    results = {p.name: replay(trace, p, sim_config(args, **kill)) for p in policies(args)}
    out = {"trace": describe(trace, name), "ceiling_hit_rate": cache_ceiling(trace), "policies": results}
    out["replay_wall_s"] = round(time.perf_counter() - start, 1)
    return out


def print_table(result: dict[str, Any]) -> None:
    t = result["trace"]
    print(
        f"\n{t['name']}: {t['sessions']} sessions, {t['requests']} requests, prompt median {t['prompt_tokens_median']} "
        f"/ max {t['prompt_tokens_max']} tokens; hit-rate ceiling (one engine, unlimited cache) "
        f"{result['ceiling_hit_rate']:.3f}"
    )
    print(
        f"{'policy':<15}{'hit rate':>9}{'max/mean load':>15}{'windowed':>10}{'re-pins':>9}"
        f"{'p50 s':>8}{'p99 s':>8}{'makespan s':>12}"
    )
    for name, r in result["policies"].items():
        print(
            f"{name:<15}{r['hit_rate']:>9.3f}{r['imbalance']:>15.3f}{r['imbalance_windowed']:>10.3f}{r['repins']:>9}"
            f"{r['latency_p50_s']:>8.2f}{r['latency_p99_s']:>8.2f}{r['makespan_s']:>12.1f}"
        )


def print_kill_table(result: dict[str, Any]) -> None:
    first = next(iter(result["policies"].values()))["kill"]
    print(f"\nengine {first['engine']} killed at {first['at_s']:.0f} s (simulated)")
    print(
        f"{'policy':<15}{'orphans':>8}{'served again':>13}{'in flight':>10}{'failed tries':>13}"
        f"{'tries max':>10}{'s since kill p50/max':>22}{'req latency p50/max':>21}{'hit rate':>9}"
    )
    for name, r in result["policies"].items():
        k = r["kill"]
        print(
            f"{name:<15}{k['orphaned_sessions']:>8}{k['orphans_served_again']:>13}{k['in_flight_at_kill']:>10}"
            f"{k['failed_attempts']:>13}{k['attempts_max']:>10}"
            f"{k['since_kill_s_p50']:>11.2f}/{k['since_kill_s_max']:<10.2f}{k['latency_s_p50']:>10.2f}/"
            f"{k['latency_s_max']:<10.2f}{r['hit_rate']:>9.3f}"
        )


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    args = parse_args(["--quick"] if quick else [])
    for key, value in options.items():
        setattr(args, key, value)
    synthetic = synthetic_trace(
        sessions=args.sessions,
        group_size=args.group_size,
        arrival_rate=args.arrival_rate,
        block_tokens=args.block_tokens,
        seed=args.seed,
    )
    out: dict[str, Any] = {"config": config(args), "traces": {}}
    out["traces"]["synthetic"] = run_trace(f"synthetic agent sessions, {args.engines} engines", synthetic, args)
    print_table(out["traces"]["synthetic"])
    if not args.quick:  # few long sessions per engine: where stickiness alone leaves engines uneven
        few = argparse.Namespace(**{**vars(args), "engines": 4, "sessions": 128, "arrival_rate": 0.4})
        trace = synthetic_trace(
            sessions=few.sessions,
            group_size=few.group_size,
            arrival_rate=few.arrival_rate,
            block_tokens=few.block_tokens,
            seed=few.seed,
        )
        out["traces"]["synthetic_few"] = run_trace("synthetic, few sessions per engine, 4 engines", trace, few)
        print_table(out["traces"]["synthetic_few"])
    for run_dir in args.dumps:
        trace = dump_trace(run_dir, block_tokens=args.dump_block_tokens, seed=args.seed)
        out["traces"][f"dumps:{run_dir}"] = run_trace(f"dumps of {run_dir}", trace, args)
        print_table(out["traces"][f"dumps:{run_dir}"])
    kill_at = synthetic[len(synthetic) // 2].start_s  # half-way through the arrivals
    out["kill"] = run_trace("synthetic, one engine killed", synthetic, args, kill_engine=0, kill_at_s=kill_at)
    print_kill_table(out["kill"])
    return out


def check_dumps(run_dirs: list[str]) -> None:
    """Before any replay: every `--dumps` directory holds rollout dumps (else one line, exit 2)."""
    from megatron_stepwise.rundir.dump_table import DumpError, dumped_iterations

    for run_dir in run_dirs:
        if not dumped_iterations(run_dir):
            raise DumpError(f"--dumps {run_dir}: no rollouts/iter_*.parquet there (train with trainer.dump_rollouts=N)")


def main() -> None:
    args = parse_args()
    try:
        check_dumps(args.dumps)
        result = run(**config(args))
    except ValueError as e:  # a bad dump directory or option: one line, exit 2
        print(f"replay_routing: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    write_json(result, args.out)


if __name__ == "__main__":
    main()
