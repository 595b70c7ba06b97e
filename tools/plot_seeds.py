"""Curves and a table of several runs of one recipe (e.g. three seeds of configs/smollm2_math_cpu.yaml).

Reads each run directory's metrics.jsonl (and eval/final.json, the final policy's evaluation) and
draws held-out accuracy (`eval/reward/pass@1`, evaluated before an iteration: the value logged at
iteration i is the policy after i iterations) and the training reward per iteration, one line per
run; prints held-out accuracy at the start and the end and each run's wall time.

    python tools/plot_seeds.py runs/smollm2_seed1 runs/smollm2_seed2 runs/smollm2_seed3 --out docs/smollm2_curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

EVAL_KEY = "eval/reward/pass@1"


def read_run(run_dir: Path, eval_key: str = EVAL_KEY) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["iteration"], r[eval_key]) for r in records if eval_key in r]
    final = run_dir / "eval" / "final.json"
    if final.is_file():
        data = json.loads(final.read_text())
        metrics = data.get("metrics", data)
        if eval_key in metrics:
            evals.append((int(data.get("iteration", len(records))), metrics[eval_key]))
    return {
        "name": run_dir.name,
        "iterations": len(records),
        "evals": evals,
        "reward": [(r["iteration"], r["reward/mean"]) for r in records],
        "wall_s": sum(r.get("time/iteration", 0.0) + r.get("time/eval", 0.0) for r in records),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", default="curves_seeds.png")
    p.add_argument("--eval-key", default=EVAL_KEY, help="the held-out metric drawn (e.g. eval/reward/mean)")
    p.add_argument("--eval-title", default="held-out accuracy (64 problems, greedy)")
    p.add_argument("--train-title", default="training reward (36 trajectories, T=0.6)")
    args = p.parse_args()
    runs = [read_run(r, args.eval_key) for r in args.runs]
    print(f"{'run':<20}{'iterations':>11}{'held-out acc start':>20}{'end':>8}{'gain':>8}{'wall (min)':>12}")
    for r in runs:
        start, end = r["evals"][0][1], r["evals"][-1][1]
        print(
            f"{r['name']:<20}{r['iterations']:>11}{start:>20.3f}{end:>8.3f}{end - start:>+8.3f}{r['wall_s'] / 60:>12.1f}"
        )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in runs:
        left.plot(*zip(*r["evals"]), marker="o", label=r["name"])
        right.plot(*zip(*r["reward"]), alpha=0.8, label=r["name"])
    left.set(title=args.eval_title, xlabel="iterations trained", ylim=(0, 1))
    right.set(title=args.train_title, xlabel="iteration", ylim=(0, 1))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
