"""Learning comparison: turn-level credit vs the outcome broadcast on the tabular key-turn task.

A softmax table policy (`megatron_stepwise/envs/credit_task.py`: the policy chooses when to
stop, fillers pay at once, the key action at `key_turn` pays only at the end) is trained by
plain gradient ascent on sampled policy gradients, from uniform logits, with each estimator in
turn and the same seeds. Reported per estimator and seed: iterations until the exact expected
total reward (by enumeration, no sampling noise) reaches the threshold, and the final reward.
`--bias` instead measures each estimator's bias at a fixed policy against the exact gradient of
the expected total reward (20,000 trajectories, the test's setting: tests/unit/test_credit.py).

`--echo` trains the real tiny CPU system instead (`configs/tiny_cpu.yaml`: Megatron DP2, embedded
engines, the 3-turn echo task whose turns are scored one by one), once per estimator and seed,
and reports the iteration at which the 5-iteration mean trajectory reward first reaches
`--echo-threshold`.

    python tools/bench/bench_credit.py                       # learning: 3 seeds, three tasks
    python tools/bench/bench_credit.py --bias                # measured bias per estimator
    python tools/bench/bench_credit.py --echo                # tiny CPU runs: rloo vs turn_rloo, 3 seeds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from harness import train_run

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_stepwise.algo.advantages import get_estimator, is_turn_estimator  # noqa: E402
from megatron_stepwise.envs.credit_task import KeyTurnTask, exact_gradient, sampled_gradients, trajectory_probs  # noqa: E402

EPS = 1e-6


def expected_reward(task: KeyTurnTask, theta: torch.Tensor) -> float:
    actions, lengths = task.enumerate()
    return float((trajectory_probs(theta, actions, lengths) * task.turn_rewards(actions, lengths).sum(1)).sum())


def best_reward(task: KeyTurnTask) -> float:
    actions, lengths = task.enumerate()
    return float(task.turn_rewards(actions, lengths).sum(1).max())


def bound(name: str):
    """The estimator as `(rewards, lengths, group) -> advantages [n, turns]`."""
    fn = get_estimator(name)
    if name == "turn_state_rloo":
        return lambda r, lengths, g, states: fn(r, lengths, g, eps=EPS, states=states)
    if is_turn_estimator(name):
        return lambda r, lengths, g, states: fn(r, lengths, g, eps=EPS)
    return lambda r, lengths, g, states: fn(r.sum(1), g, eps=EPS)[:, None].expand(-1, r.size(1))


def train(task: KeyTurnTask, name: str, seed: int, args) -> tuple[int | None, float]:
    """(first iteration whose exact reward >= threshold, or None; final exact reward)."""
    theta = torch.zeros(task.max_turns, 3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    threshold = args.threshold * best_reward(task)
    reached = None
    for it in range(args.iterations):
        if reached is None and expected_reward(task, theta) >= threshold:
            reached = it
        grad = sampled_gradients(task, theta, bound(name), args.groups, args.group_size, gen).mean(0)
        theta = theta + args.lr * grad
    return reached, expected_reward(task, theta)


def _naive(rewards, lengths, group, states=None):
    """Per-turn-index normalisation (the biased construction; tests/oracles.py has the same)."""
    n, turns = rewards.shape
    alive = (torch.arange(turns)[None, :] < lengths[:, None]).double()
    sums = torch.zeros(int(group.max()) + 1, turns, dtype=torch.float64).index_add_(0, group, rewards * alive)
    counts = torch.zeros_like(sums).index_add_(0, group, alive)
    centred = (rewards - (sums[group] - rewards * alive) / (counts[group] - alive).clamp(min=1)) * alive
    return centred.flip(1).cumsum(1).flip(1)


def measure_bias(groups: int = 5000, group_size: int = 4) -> None:
    """Bias of every estimator against the exact gradient of E[total reward] at the test's policy."""
    task = KeyTurnTask(3, 1, 1.0, 0.2)
    theta = torch.tensor([[-0.5, 0.3, 0.6], [0.2, 0.1, 0.4], [0.0, -0.3, 0.5]], dtype=torch.float64)
    exact = exact_gradient(task, theta, lambda a, lengths, r: r.sum(1))
    print(f"key-turn task (3 turns), {groups} groups x {group_size}; exact gradient norm {float(exact.norm()):.4f}")
    print(f"{'estimator':<28} {'max |z|':>8} {'|bias|/|grad|':>14} {'cosine':>7} {'mean SE':>8}")
    cases = [
        (name, bound(name))
        for name in ("rloo", "grpo", "dr_grpo", "turn_rloo", "turn_dr_grpo", "turn_grpo", "turn_state_rloo")
    ]
    cases += [
        (
            "turn_rloo gamma 0.8",
            lambda r, lengths, g, states: get_estimator("turn_rloo")(r, lengths, g, eps=EPS, gamma=0.8),
        ),
        (
            "turn_discount gamma 0.8",
            lambda r, lengths, g, states: get_estimator("turn_discount")(r, lengths, g, eps=EPS, gamma=0.8),
        ),
        ("per-turn-index (naive)", _naive),
    ]
    for name, est in cases:
        per_group = sampled_gradients(task, theta, est, groups, group_size, torch.Generator().manual_seed(0))
        mean, se = per_group.mean(0), per_group.std(0) / groups**0.5
        cos = float((mean * exact).sum() / (mean.norm() * exact.norm()))
        print(
            f"{name:<28} {float(((mean - exact) / se).abs().max()):>8.1f} "
            f"{float((mean - exact).norm() / exact.norm()):>14.3f} {cos:>7.3f} {float(se.mean()):>8.4f}"
        )


def echo_run(estimator: str, seed: int, args, root: str) -> list[float]:
    """One tiny CPU training run; its per-iteration mean trajectory reward."""
    run_dir = os.path.join(root, f"{estimator}_{seed}")
    overrides = [
        f"algo.estimator={estimator}",
        f"trainer.seed={seed}",
        f"trainer.iterations={args.echo_iterations}",
        "checkpoint.every=100000",
    ]
    rows, _ = train_run("configs/tiny_cpu.yaml", run_dir, overrides, f"echo run {estimator} seed {seed}")
    return [r["reward/mean"] for r in rows if "reward/mean" in r]


def compare_on_echo(args) -> None:
    window = 5
    print(
        f"tiny CPU runs (configs/tiny_cpu.yaml), {args.echo_iterations} iterations; first iteration whose "
        f"{window}-iteration mean reward >= {args.echo_threshold}"
    )
    print(f"{'estimator':<12} {'seed':>5} {'iteration':>10} {'reward first 5 -> last 5':>26}")
    with tempfile.TemporaryDirectory() as root:
        for estimator in args.echo_estimators.split(","):
            for seed in range(1, args.seeds + 1):
                rewards = echo_run(estimator, seed, args, root)
                means = [statistics.mean(rewards[i - window + 1 : i + 1]) for i in range(window - 1, len(rewards))]
                hit = next((i + window - 1 for i, m in enumerate(means) if m >= args.echo_threshold), None)
                print(
                    f"{estimator:<12} {seed:>5} {hit if hit is not None else '>' + str(len(rewards) - 1):>10} "
                    f"{statistics.mean(rewards[:window]):>12.3f} -> {statistics.mean(rewards[-window:]):.3f}",
                    flush=True,
                )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=400)
    p.add_argument("--groups", type=int, default=8, help="prompt groups per iteration")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--threshold", type=float, default=0.9, help="share of the best achievable total reward")
    p.add_argument(
        "--pairs", default="rloo:turn_rloo,grpo:turn_grpo", help="outcome:turn estimator pairs (turn_state_rloo too)"
    )
    p.add_argument("--bias", action="store_true", help="measure each estimator's bias instead of learning")
    p.add_argument("--echo", action="store_true", help="compare on the tiny CPU system instead")
    p.add_argument("--echo-estimators", default="rloo,turn_rloo")
    p.add_argument("--echo-iterations", type=int, default=60)
    p.add_argument("--echo-threshold", type=float, default=0.7)
    args = p.parse_args(argv)
    if args.bias:
        return measure_bias()
    if args.echo:
        return compare_on_echo(args)
    tasks = {
        "3 turns, key at turn 1": KeyTurnTask(3, 1, 1.0, 0.2),
        "6 turns, key at turn 2": KeyTurnTask(6, 2, 1.0, 0.2),
        "6 turns, key at turn 2, turn rewards +-1 noise": KeyTurnTask(6, 2, 1.0, 0.2, reward_noise=1.0),
    }
    print(
        f"{args.groups} groups x {args.group_size} trajectories per iteration, lr {args.lr}, "
        f"threshold {args.threshold:.0%} of the best total reward, seeds 0..{args.seeds - 1}"
    )
    for title, task in tasks.items():
        print(
            f"\n{title} (best total reward {best_reward(task):.2f}, uniform policy "
            f"{expected_reward(task, torch.zeros(task.max_turns, 3)):.3f})"
        )
        print(f"{'estimator':<14} {'iterations to threshold per seed':<36} {'median':>7} {'final reward per seed'}")
        for pair in args.pairs.split(","):
            for name in pair.split(":"):
                runs = [train(task, name, seed, args) for seed in range(args.seeds)]
                its = [r for r, _ in runs]
                shown = ", ".join(str(i) if i is not None else f">{args.iterations}" for i in its)
                med = statistics.median(i if i is not None else float("inf") for i in its)
                finals = ", ".join(f"{f:.3f}" for _, f in runs)
                print(f"{name:<14} {shown:<36} {med:>7} {finals}")


if __name__ == "__main__":
    main()
