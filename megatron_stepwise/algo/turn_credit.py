"""Turn-level advantage estimators: each turn credited with the rewards from it on.

A turn estimator sees a group's trajectories as a matrix of per-turn rewards
`rewards[j, t]` (float64, zero past `lengths[j]`), where the last turn's reward is the outcome
minus the earlier turns' own rewards (so the rewards add up to the outcome), and returns one
advantage per turn. Registered here (docs/credit.md has the formulas and the proofs):

- `turn_rloo`     G_t - mean over the other trajectories of their G at the same turn index (a
                  trajectory that already ended counts with its last turn's G); unbiased at gamma 1
- `turn_dr_grpo`  the same with the mean over the whole group (Dr.GRPO); unbiased up to (n-1)/n
- `turn_grpo`     the same divided by that column's std (GRPO); biased, trades bias for variance
- `turn_state_rloo` G_t - the mean G of other trajectories' turns at the same state (GiGPO-style
                  step groups, kept unbiased); turn_rloo's baseline where none reached it
- `turn_discount` the outcome times gamma^(turns - 1) (AReaL-style), then an outcome estimator

With zero intermediate rewards and gamma 1 each but `turn_state_rloo` is bit-exactly the outcome
estimator it extends.
"""

from __future__ import annotations

import torch

from megatron_stepwise.algo.advantages import dr_grpo, get_estimator, grpo, is_turn_estimator, register_estimator, rloo
from megatron_stepwise.steps import StepwiseBatchError

#: The option every turn estimator takes, and the outcome estimators `turn_discount` may wrap.
GAMMA = "gamma"
DISCOUNT_BASES = ("rloo", "dr_grpo", "grpo", "maxrl")


def check_gamma(gamma: float) -> float:
    """`gamma` as a float in (0, 1], or an error naming the option."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 < gamma <= 1.0:  # NaN too
        raise StepwiseBatchError(f"algo.estimator_options.gamma={gamma!r} must be a number in (0, 1]")
    return float(gamma)


def returns_to_go(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G[j, t] = rewards[j, t] + gamma * G[j, t + 1], for a [n_traj, turns] reward matrix."""
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.size(0), dtype=rewards.dtype)
    for t in range(rewards.size(1) - 1, -1, -1):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
    return out


def held_returns(returns: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """returns[j, min(t, lengths[j] - 1)]: a trajectory that ended keeps its last turn's return."""
    turns = torch.arange(returns.size(1)).expand_as(returns)
    return returns.gather(1, torch.minimum(turns, (lengths - 1)[:, None]))


def _per_turn_column(base):
    """A turn estimator applying the outcome estimator `base` to each turn index's column of
    held returns-to-go (the same group ids, so n is the group size in every column)."""

    def estimate(
        rewards: torch.Tensor, lengths: torch.Tensor, group: torch.Tensor, *, eps: float, gamma: float = 1.0, **_
    ) -> torch.Tensor:
        held = held_returns(returns_to_go(rewards, check_gamma(gamma)), lengths)
        return torch.stack([base(held[:, t], group, eps=eps) for t in range(held.size(1))], dim=1)

    estimate.__doc__ = f"Per turn index, {base.__name__} of the held returns-to-go (docs/credit.md)."
    return estimate


register_estimator("turn_rloo", turn=True)(_per_turn_column(rloo))
register_estimator("turn_dr_grpo", turn=True)(_per_turn_column(dr_grpo))
register_estimator("turn_grpo", turn=True)(_per_turn_column(grpo))


@register_estimator("turn_discount", turn=True)
def turn_discount(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    group: torch.Tensor,
    *,
    eps: float,
    gamma: float = 0.9,
    base: str = "rloo",
    **options,
) -> torch.Tensor:
    """AReaL-style: the outcome discounted by gamma per extra turn, gamma^(T - 1) * R, then the
    outcome estimator `base`; every turn of a trajectory gets its scalar."""
    gamma = check_gamma(gamma)
    if base not in DISCOUNT_BASES:
        raise StepwiseBatchError(f"algo.estimator_options.base={base!r} must be one of {', '.join(DISCOUNT_BASES)}")
    outcome = returns_to_go(rewards, 1.0)[:, 0]  # the sum of the turn rewards: exactly R when the earlier ones are 0
    discounted = outcome * torch.pow(torch.tensor(gamma, dtype=torch.float64), (lengths - 1).to(torch.float64))
    scalar = get_estimator(base)(discounted, group, eps=eps, **options)
    return scalar[:, None].expand(-1, rewards.size(1))


def check_turn_options(estimator: str, options: dict) -> list[tuple[str, str]]:
    """(config key, problem) pairs, empty if fine, for a turn estimator's `algo.estimator_options`."""
    if not is_turn_estimator(estimator):
        return []
    problems = []
    known = (GAMMA, "base") if estimator == "turn_discount" else (GAMMA,)
    for key in sorted(set(options) - set(known)):
        problems.append(
            (f"algo.estimator_options.{key}", f"is not an option of {estimator} (known: {', '.join(known)})")
        )
    try:
        check_gamma(options.get(GAMMA, 1.0))
    except StepwiseBatchError as e:
        problems.append((f"algo.estimator_options.{GAMMA}", str(e).split("=", 1)[1]))
    if estimator == "turn_discount" and options.get("base", "rloo") not in DISCOUNT_BASES:
        problems.append(
            ("algo.estimator_options.base", f"{options['base']!r} must be one of {', '.join(DISCOUNT_BASES)}")
        )
    return problems


@register_estimator("turn_state_rloo", turn=True)
def turn_state_rloo(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    group: torch.Tensor,
    *,
    eps: float,
    states: torch.Tensor,
    gamma: float = 1.0,
    **_,
) -> torch.Tensor:
    """GiGPO-style step groups, kept unbiased: G_t minus the mean G of the OTHER trajectories'
    turns at the same state (`states`: long [n, turns], equal ids = equal states, -1 past the
    length); where no other trajectory reached that state, `turn_rloo`'s baseline."""
    returns = returns_to_go(rewards, check_gamma(gamma))
    held = held_returns(returns, lengths)
    alive = torch.arange(rewards.size(1))[None, :] < lengths[:, None]
    n = rewards.size(0)
    # Dense ids of (group, state) and of (trajectory, state) over the alive turns.
    key = torch.unique(
        torch.stack([group[:, None].expand_as(states)[alive], states[alive]], 1), dim=0, return_inverse=True
    )[1]
    own = torch.unique(
        torch.stack([torch.arange(n)[:, None].expand_as(states)[alive], key], 1), dim=0, return_inverse=True
    )[1]
    g = returns[alive]
    sums = torch.zeros(int(key.max()) + 1 if key.numel() else 0, dtype=g.dtype).index_add_(0, key, g)
    counts = torch.zeros_like(sums).index_add_(0, key, torch.ones_like(g))
    own_sums = torch.zeros(int(own.max()) + 1 if own.numel() else 0, dtype=g.dtype).index_add_(0, own, g)
    own_counts = torch.zeros_like(own_sums).index_add_(0, own, torch.ones_like(g))
    others = counts[key] - own_counts[own]
    by_state = (sums[key] - own_sums[own]) / others.clamp(min=1)
    # Fallback: the other trajectories' held returns at this turn index (turn_rloo's baseline).
    group_size = torch.bincount(group)[group].to(g.dtype)
    column_sums = torch.zeros(int(group.max()) + 1, held.size(1), dtype=g.dtype).index_add_(0, group, held)
    by_turn = ((column_sums[group] - held) / (group_size - 1)[:, None])[alive]
    out = torch.zeros_like(rewards)
    out[alive] = g - torch.where(others > 0, by_state, by_turn)
    return out
