"""What rollout dumps cost: the tiny CPU experiment with and without `trainer.dump_rollouts`, in one run.

Runs `megatron-stepwise train configs/tiny_cpu.yaml` for the same iterations and seed with
dumps off and with a dump every iteration (the worst case), alternating the two `--repeats`
times, and prints side by side: the command's wall time, the mean seconds per iteration (from
metrics.jsonl, the first iteration left out as warm-up), the mean `time/dump` (gathering the
trainer's log-probs and writing the Parquet file) and the dump's size per iteration. The same
seed trains the same steps, so the loss column must match. No asserts: numbers are printed.

    python tools/bench/bench_dumps.py                  # 12 iterations, 2 repeats (~3 min on 2 cores)
    python tools/bench/bench_dumps.py --iterations 6 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from harness import train_run


def run(run_dir: Path, iterations: int, dump_every: int) -> dict:
    overrides = [
        f"trainer.iterations={iterations}",
        "logging.progress=false",
        "checkpoint.every=0",
        "trainer.eval_every=0",
        f"trainer.dump_rollouts={dump_every}",
    ]
    what = f"run with trainer.dump_rollouts={dump_every}"
    rows, wall = train_run("configs/tiny_cpu.yaml", run_dir, overrides, what, env={"OMP_NUM_THREADS": "1"})
    dumps = sorted((run_dir / "rollouts").glob("*.parquet"))
    steady = rows[1:] or rows
    return {
        "wall": wall,
        "iteration_s": statistics.mean(r["time/iteration"] for r in steady),
        "dump_s": statistics.mean(r.get("time/dump", 0.0) for r in steady),
        "dump_bytes": statistics.mean(p.stat().st_size for p in dumps) if dumps else 0,
        "rows": statistics.mean(r["batch/rows_before_merge"] for r in rows),
        "loss_last": rows[-1]["train/loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"off": [], "every iteration": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, every in (("off", 0), ("every iteration", 1)):
                res = run(Path(tmp) / f"{every}_{r}", args.iterations, every)
                results[name].append(res)
                print(f"[{name} #{r}] wall {res['wall']:.1f} s, {res['iteration_s']:.3f} s/iteration", flush=True)
    mean = {name: {k: statistics.mean(x[k] for x in runs) for k in runs[0]} for name, runs in results.items()}
    off, on = mean["off"], mean["every iteration"]
    print(
        f"\ntiny CPU experiment, {args.iterations} iterations x {args.repeats} repeats, "
        f"{off['rows']:.0f} trained rows per iteration"
    )
    print(f"{'dumps':<18}{'wall s':>9}{'s/iteration':>13}{'time/dump s':>13}{'dump KiB':>10}{'last loss':>14}")
    for name, m in mean.items():
        print(
            f"{name:<18}{m['wall']:>9.1f}{m['iteration_s']:>13.3f}{m['dump_s']:>13.4f}"
            f"{m['dump_bytes'] / 1024:>10.1f}{m['loss_last']:>14.6g}"
        )
    print(
        f"ratio on/off: wall {on['wall'] / off['wall']:.3f}x, s/iteration {on['iteration_s'] / off['iteration_s']:.3f}x; "
        f"time/dump = {100 * on['dump_s'] / on['iteration_s']:.1f}% of an iteration"
    )


if __name__ == "__main__":
    main()
