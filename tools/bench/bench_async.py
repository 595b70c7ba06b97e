"""Synchronous vs asynchronous training of the tiny CPU experiment, side by side.

Runs `megatron-stepwise train` on configs/tiny_cpu.yaml and configs/tiny_cpu_async.yaml for the
same number of iterations (each iteration = the same 2 optimizer steps of 4 prompt groups x 8
trajectories), then prints per mode: seconds per iteration (wall clock of the training loop,
without start-up), the reward curve (mean trajectory reward over the first and last fifth of the
run, and its best 5-iteration window), and for async the staleness of the trained tokens, the
importance weights and the buffer's counters. No asserts: numbers are printed.

    python tools/bench/bench_async.py            # 60 iterations per mode (~4 min on 2 idle cores)
    python tools/bench/bench_async.py --quick    # 20 iterations per mode (~1.5 min)
    python tools/bench/bench_async.py --modes async-driver,async-workers   # async with 2 agent workers:
        # rows through rank 0 (rollout.handoff=driver) vs kept in the workers, bytes rank 0 sends

On a shared machine the two runs see different background load: run it twice before trusting
a small difference.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from harness import REPO, train_run

MODES = {
    "sync": ("configs/tiny_cpu.yaml", []),
    "async": ("configs/tiny_cpu_async.yaml", []),
    # async training with 2 agent workers, the rows through rank 0 or kept in the workers
    "async-driver": ("configs/tiny_cpu_async.yaml", ["rollout.agent_workers=2", "rollout.handoff=driver"]),
    "async-workers": ("configs/tiny_cpu_async.yaml", ["rollout.agent_workers=2", "rollout.handoff=workers"]),
}


def run_mode(mode: str, config: str, iterations: int, out: Path, extra: list[str]) -> dict:
    overrides = [f"trainer.iterations={iterations}", "logging.progress=false", "checkpoint.every=0", *extra]
    rows, wall = train_run(config, out / mode, overrides, f"{mode} run", env={"OMP_NUM_THREADS": "1"}, echo=mode)
    return {"rows": rows, "wall": wall}


def summarise(result: dict) -> dict:
    rows = result["rows"]
    n = len(rows)
    fifth = max(1, n // 5)
    rewards = [r["reward/mean"] for r in rows]
    it_times = [r["time/iteration"] for r in rows[1:]] or [rows[0]["time/iteration"]]  # skip the warm-up
    windows = [statistics.mean(rewards[i : i + 5]) for i in range(max(1, n - 4))]
    s = {
        "iterations": n,
        "s/iteration (mean)": statistics.mean(it_times),
        "s/iteration (median)": statistics.median(it_times),
        "loop seconds": sum(r["time/iteration"] for r in rows),
        "process wall seconds": result["wall"],
        "reward first 1/5": statistics.mean(rewards[:fifth]),
        "reward last 1/5": statistics.mean(rewards[-fifth:]),
        "reward best 5-it window": max(windows),
        "optimizer steps": sum(r.get("train/optimizer_steps", 0) for r in rows),
        "train s/iteration": statistics.mean(r.get("time/train", 0.0) for r in rows[1:] or rows),
    }
    # time/rollout: the rollout itself (sync), or the wait for finished groups (async)
    rollout_key = "wait-for-groups s/iteration" if "async/token_staleness_mean" in rows[-1] else "rollout s/iteration"
    s[rollout_key] = statistics.mean(r["time/rollout"] for r in rows[1:] or rows)
    if "async/token_staleness_mean" in rows[-1]:
        s["token staleness mean"] = statistics.mean(r["async/token_staleness_mean"] for r in rows)
        s["token staleness max"] = max(r["async/token_staleness_max"] for r in rows)
        s["trajectories spanning 2 versions"] = statistics.mean(r["async/trajectories_spanning_versions"] for r in rows)
        s["TIS weight mean"] = statistics.mean(r["train/tis_weight_mean"] for r in rows)
        s["TIS weight max"] = max(r["train/tis_weight_max"] for r in rows)
        s["TIS capped fraction"] = statistics.mean(r["train/tis_capped_frac"] for r in rows)
        s["groups dropped stale"] = rows[-1].get("async/groups_stale_dropped", 0)
        s["groups requeued stale"] = rows[-1].get("async/groups_stale_requeued", 0)
    if "handoff/rank0_bytes_sent" in rows[-1]:  # shards of rows, or manifests, to the other replica
        s["rank 0 bytes sent/iteration"] = statistics.mean(r["handoff/rank0_bytes_sent"] for r in rows)
    return s


def curve(rows: list[dict], points: int = 8) -> str:
    n = len(rows)
    idx = sorted({round(i * (n - 1) / (points - 1)) for i in range(points)}) if n > 1 else [0]
    return "  ".join(f"it{i}:{rows[i]['reward/mean']:.2f}" for i in idx)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--quick", action="store_true", help="20 iterations per mode")
    p.add_argument("--out", default=str(REPO / "runs" / "bench_async"), help="run directories go here")
    p.add_argument("--modes", default="sync,async", help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs")
    args = p.parse_args()
    iterations = 20 if args.quick else args.iterations
    out = Path(args.out)
    results = {}
    for mode in args.modes.split(","):
        config, extra = MODES[mode]
        results[mode] = run_mode(mode, config, iterations, out, [*extra, *args.overrides])
    summaries = {m: summarise(r) for m, r in results.items()}

    keys = list(dict.fromkeys(k for s in summaries.values() for k in s))
    width = max(len(k) for k in keys)
    print("\n" + " " * width + "".join(f"{m:>12}" for m in summaries))
    for k in keys:
        cells = "".join(
            f"{summaries[m][k]:>12.3f}" if isinstance(summaries[m].get(k), float) else f"{summaries[m].get(k, '-'):>12}"
            for m in summaries
        )
        print(f"{k:<{width}}{cells}")
    for m, r in results.items():
        print(f"\n{m} reward curve: {curve(r['rows'])}")
    if {"sync", "async"} <= set(summaries):
        a, s = summaries["async"], summaries["sync"]
        print(
            f"\nasync / sync seconds per iteration: {a['s/iteration (mean)']:.3f} / {s['s/iteration (mean)']:.3f}"
            f" = {a['s/iteration (mean)'] / s['s/iteration (mean)']:.2f}x"
            f"  (speed-up {s['s/iteration (mean)'] / a['s/iteration (mean)']:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
