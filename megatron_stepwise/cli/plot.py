"""`megatron-stepwise plot RUN_DIR`: reward, evaluation, length and timing curves to PNG.

The evaluation panel draws every eval set's mean reward and its largest pass@k (eval/* and
eval/<set>/*), including the final evaluation logged after the last iteration."""

from __future__ import annotations

import argparse
import os
import re

PANELS = (
    ("Reward (trajectory level)", ("reward/mean", "reward/pass@1")),
    ("Evaluation (per eval set)", "eval"),
    ("Lengths (tokens)", ("rollout/response_len_mean", "rollout/prompt_len_mean", "rollout/observation_len_mean")),
    ("Turns per trajectory", ("rollout/turns_mean",)),
    ("Time per phase (s)", ("time/rollout", "time/train", "time/weight_sync", "time/checkpoint")),
    ("Loss terms", ("train/pg_loss", "train/kl", "train/entropy")),
    ("Throughput (tokens/s)", ("perf/train_tokens_per_s", "perf/rollout_tokens_per_s")),
)
_EVAL_KEY = re.compile(r"^eval/(?:[^/]+/)?reward/(mean|pass@(\d+))$")


def eval_keys(records) -> list[str]:
    """Each eval set's reward/mean and its largest pass@k, as logged."""
    keys = sorted({k for r in records for k in r if _EVAL_KEY.match(k)})
    best: dict[str, tuple[int, str]] = {}
    for key in keys:
        k = _EVAL_KEY.match(key).group(2)
        if k is not None:
            prefix = key.rsplit("/pass@", 1)[0]
            best[prefix] = max(best.get(prefix, (0, "")), (int(k), key))
    return [k for k in keys if k.endswith("/mean")] + sorted(v[1] for v in best.values())


def plot_run(run_dir: str, out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_stepwise.metrics.core import read_final_eval
    from megatron_stepwise.rundir.jsonl import read_metrics
    from megatron_stepwise.rundir.paths import RunDir

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: metrics.jsonl is empty, nothing to plot")
    final = read_final_eval(run_dir) if os.path.isdir(run_dir) else None
    if final is not None:  # the final policy's evaluation: one more point on the eval curves
        records = [*records, final]
    out = out or str(RunDir(run_dir).curves)
    fig, axes = plt.subplots(2, 4, figsize=(20, 8))
    for ax in axes.flat[len(PANELS) :]:
        ax.set_visible(False)
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in eval_keys(records) if keys == "eval" else keys:
            pts = [(r["iteration"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker=".", label=key)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="render reward, length and timing curves of a run to PNG")
    p.add_argument("run_dir", help="run directory holding metrics.jsonl")
    p.add_argument("--out", help="PNG path (default: RUN_DIR/curves.png)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import sys

    try:
        path = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
