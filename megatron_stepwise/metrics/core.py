"""Per-iteration metrics: rollout statistics at trajectory level, and the run's metrics log.

Reward statistics, pass@k and group filters look at trajectories (their last steps), never at
step rows (docs/architecture.md, invariant 9): a trajectory that took 8 turns counts once, like
one that took 1. Padding rows never count.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import Counter, defaultdict
from typing import Any, Optional, Sequence

from megatron_stepwise.algo.groups import GroupSummary, PromptGroup, RolloutGroup
from megatron_stepwise.rundir.jsonl import read_jsonl_records
from megatron_stepwise.rundir.paths import RunDir
from megatron_stepwise.steps import Step


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one group: the chance that k of its n samples, drawn without
    replacement, include at least one of its c successes (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_at_k(answers: Sequence[Any], correct: Sequence[bool], k: int, max_subsets: int = 20000) -> float:
    """maj@k (cons@k) of one group: the expected correctness of the majority answer of k samples
    drawn without replacement (a tie counts as the share of correct answers among the tied ones),
    computed over every k-subset; None-answers never win a vote. Too many subsets is an error."""
    n = len(answers)
    if not 0 < k <= n or len(correct) != n:
        raise ValueError(f"maj@k needs 0 < k <= n answers with one correctness each, got n={n}, k={k}")
    if math.comb(n, k) > max_subsets:
        raise ValueError(f"maj@{k} of {n} samples has {math.comb(n, k)} subsets (> {max_subsets})")
    right = {a for a, ok in zip(answers, correct) if ok and a is not None}
    total = 0.0
    for subset in itertools.combinations(range(n), k):
        votes = Counter(answers[i] for i in subset if answers[i] is not None)
        if not votes:
            continue
        top = max(votes.values())
        tied = [a for a, v in votes.items() if v == top]
        total += sum(a in right for a in tied) / len(tied)
    return total / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k of pass@k reported for groups of n: powers of two below n, and n."""
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k < n]
    return ks + [n]


def group_outcomes(groups: Sequence[RolloutGroup]) -> dict[str, list[Step]]:
    """{prompt_id: last steps of its valid trajectories} of the groups that have one."""
    last = {g.prompt_id: [t[-1] for t, bad in zip(g.trajectories, g.invalid) if bad is None] for g in groups}
    return {pid: steps for pid, steps in last.items() if steps}


def pass_metrics(groups: Sequence[Sequence[float]], success_threshold: float, prefix: str = "reward/") -> dict:
    """Unbiased pass@k for the k of `pass_ks` of the smallest group (a trajectory succeeds when
    its reward >= `success_threshold`), averaged over groups."""
    n = min(len(g) for g in groups)
    return {
        f"{prefix}pass@{k}": sum(pass_at_k(len(g), sum(r >= success_threshold for r in g), k) for g in groups)
        / len(groups)
        for k in pass_ks(n)
    }


def reward_metrics(groups: Sequence[GroupSummary], success_threshold: float) -> dict[str, float]:
    """Mean/std/max/min of the valid trajectories' rewards, pass@k over the groups that have a
    valid trajectory, the share of groups without a signal; {} when none is valid."""
    valid = [g.valid_rewards for g in groups if g.valid_rewards]
    values = [r for rs in valid for r in rs]
    if not values:
        return {}
    mean = sum(values) / len(values)
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in values) / len(values)),
        "reward/max": max(values),
        "reward/min": min(values),
        **pass_metrics(valid, success_threshold),
        "reward/zero_variance_groups": sum(not g.has_reward_variance for g in groups) / len(groups),
    }


def rollout_metrics(rollout: Sequence[PromptGroup], *, success_threshold: float = 1.0) -> dict[str, float]:
    """Trajectory-level reward, pass@k, turns, lengths and stop reasons of one rollout, given as
    its prompt groups (any `PromptGroup`: they are read through their summaries).
    Reward figures and pass@k are over valid trajectories only; `rollout/invalid_share` counts
    the others (an infrastructure failure's reward is no outcome)."""
    groups = [g.summary() for g in rollout]
    n_trajectories = sum(len(g.rewards) for g in groups)
    if not n_trajectories:
        return {}
    invalid = [bad for g in groups for bad in g.invalid if bad is not None]
    turns = [n for g in groups for n in g.turns]
    out: dict[str, float] = {
        "rollout/invalid_share": len(invalid) / n_trajectories,
        "rollout/trajectories": float(n_trajectories),
        "rollout/steps": float(sum(g.num_steps for g in groups)),
        "rollout/turns_mean": sum(turns) / len(turns),
        "rollout/turns_max": float(max(turns)),
    }
    resp = [n for g in groups for n in g.response_lens]
    prompt = [n for g in groups for n in g.prompt_lens]
    out.update(reward_metrics(groups, success_threshold))
    out["rollout/response_len_mean"] = sum(resp) / len(resp)
    out["rollout/response_len_max"] = float(max(resp))
    out["rollout/prompt_len_mean"] = sum(prompt) / len(prompt)
    out["rollout/prompt_len_max"] = float(max(prompt))
    obs = [n for g in groups for n in g.observation_lens()]
    if obs:
        out["rollout/observation_len_mean"] = sum(obs) / len(obs)
    out["rollout/trainable_tokens"] = float(sum(n for g in groups for n in g.trainable))
    drift = [d for g in groups for d in g.drift if d is not None]
    if drift:
        # Turn boundaries where re-tokenising the chat lost the sampled ids (agent loop, either
        # context mode); in retokenize mode the prefix merge breaks exactly there. Only measured
        # steps count (token mode measures rollout.drift_sample_rate of the trajectories); with
        # none measured the metric is absent rather than a 0 that would read as "no drift".
        out["rollout/retokenize_drift_rate"] = sum(drift) / len(drift)
    stops = [r for g in groups for r in g.stop_reasons]
    for reason, n in Counter(stops).items():
        out[f"stop_reason/{reason}"] = n / len(stops)
    by_env: dict[str, list[float]] = defaultdict(list)
    for g in groups:
        for env, r, bad in zip(g.envs, g.rewards, g.invalid):
            if env is not None and bad is None:
                by_env[env].append(r)
    for env, rs in by_env.items():
        out[f"reward/env/{env}"] = sum(rs) / len(rs)
    return out


def mean_metrics(items: Sequence[dict[str, Any]], prefix: str = "") -> dict[str, float]:
    """Average each metric over an iteration's optimizer steps (finite numbers only)."""
    out: dict[str, float] = {}
    for key in {k for m in items for k in m}:
        values = [m[key] for m in items if key in m and isinstance(m[key], (int, float)) and math.isfinite(m[key])]
        if values:
            out[prefix + key] = sum(values) / len(values)
    return out


class MetricsLogger:
    """One JSON line per iteration in `<run_dir>/metrics.jsonl`; optional TensorBoard and W&B."""

    def __init__(
        self,
        run_dir: str,
        *,
        tensorboard: bool = False,
        wandb_project: Optional[str] = None,
        wandb_name: Optional[str] = None,
        config: Optional[dict] = None,
        resume_iteration: int = 0,
    ):
        os.makedirs(run_dir, exist_ok=True)
        self.path = str(RunDir(run_dir).metrics)
        _truncate_after(self.path, resume_iteration)
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError(
                    "logging.tensorboard=true needs the tensorboard package (pip install tensorboard)"
                ) from e
            self._tb = SummaryWriter(str(RunDir(run_dir).tensorboard))
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError(
                    "logging.wandb.project is set but the wandb package is missing (pip install wandb)"
                ) from e
            # The run's files go under the run directory (<run_dir>/wandb/...), next to metrics.jsonl;
            # WANDB_MODE=offline keeps them there for `wandb sync`.
            self._wandb = wandb.init(project=wandb_project, name=wandb_name, config=config, resume="allow", dir=run_dir)

    def log(self, iteration: int, metrics: dict[str, Any]) -> None:
        values = {k: _number(v) for k, v in metrics.items()}
        record = {"iteration": iteration, **{k: _plain(v) for k, v in values.items()}}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        # TensorBoard and W&B get the same keys and values as the JSON line; numbers stay numbers
        # there (a non-finite one too: JSON spells it "nan" / "inf").
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    # float64 tensor summaries: the value itself, not its float32 rounding
                    self._tb.add_scalar(k, v, iteration, new_style=True, double_precision=True)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({"iteration": iteration, **values}, step=iteration)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def write_eval(run_dir: str, name: str, iteration: int, metrics: dict[str, Any]) -> str:
    """An evaluation outside the per-iteration lines (the final one, `eval` runs): one JSON
    object in <run_dir>/eval/<name>.json, `iteration` being the policy's iteration count."""
    path = str(RunDir(run_dir).eval_result(name))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"iteration": iteration, **{k: _plain(v) for k, v in metrics.items()}}, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
    return path


def read_final_eval(run_dir: str) -> Optional[dict[str, Any]]:
    """<run_dir>/eval/final.json, or None."""
    try:
        with open(RunDir(run_dir).eval_result("final")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def summarize_run(records: Sequence[dict[str, Any]], run_dir: str, *, window: int = 5) -> str:
    """The lines a run ends with: how far it got and how reward and eval reward moved (means
    over the first and last `window` iterations, so that one noisy iteration does not speak for
    the run), and where its outputs are."""
    final = read_final_eval(run_dir) if os.path.isdir(run_dir) else None
    evals = [r for r in [*records, final or {}] if isinstance(r.get("eval/reward/mean"), (int, float))]
    if not records:
        return f"no iteration recorded in {run_dir}"

    def mean_over(rows: Sequence[dict[str, Any]], key: str) -> float:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else float("nan")

    k = max(1, min(window, len(records) // 2))
    lines = [
        f"done: {len(records)} iterations; reward/mean {mean_over(records[:k], 'reward/mean'):.3f} -> "
        f"{mean_over(records[-k:], 'reward/mean'):.3f} (mean of the first / last {k})"
    ]
    if evals:
        first, last = evals[0], evals[-1]
        lines.append(
            f"eval/reward/mean {first['eval/reward/mean']:.3f} (iteration {first['iteration']}) -> "
            f"{last['eval/reward/mean']:.3f} (iteration {last['iteration']})"
        )
    lines.append(f"metrics: {RunDir(run_dir).metrics} (curves: megatron-stepwise plot {run_dir})")
    return "\n".join(lines)


def iteration_line(done: int, total: int, metrics: dict[str, Any]) -> str:
    """The one line a run prints per iteration when it shows no progress bar."""

    def num(key: str, fmt: str = ".3f") -> str:
        v = metrics.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    line = (
        f"iteration {done}/{total}: reward {num('reward/mean')} pass@1 {num('reward/pass@1')} "
        f"response_len {num('rollout/response_len_mean', '.1f')} loss {num('train/pg_loss', '.4f')} "
        f"{num('time/iteration', '.1f')} s"
    )
    if isinstance(metrics.get("eval/reward/mean"), (int, float)):
        line += f" | eval reward {num('eval/reward/mean')}"
    return line


def _truncate_after(path: str, iteration: int) -> None:
    """On resume, drop lines of iterations that will be re-run (written after the checkpoint) and
    any torn line; every kept line ends with its newline, so the next record starts on its own."""
    if not os.path.exists(path):
        return
    keep = [
        line for line, record in read_jsonl_records(path, require_iteration=True) if record["iteration"] < iteration
    ]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(line + "\n" for line in keep)
    os.replace(tmp, path)


def _number(v: Any) -> Any:
    """A tensor or numpy scalar as a Python number; anything else unchanged."""
    return v.item() if hasattr(v, "item") else v


def _plain(v: Any) -> Any:
    v = _number(v)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
