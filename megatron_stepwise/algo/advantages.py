"""Step-wise outcome advantages.

A group is all trajectories of one prompt_id; an outcome estimator turns the trajectories'
rewards into one scalar each, given to every step of the trajectory times that step's own loss
mask. Padding steps get zeros; a singleton group gets 0 (`metrics['singleton_groups']`).
Temporal estimators (`gae`, `reinforce++`) are refused on multi-step trajectories; turn-level
estimators live in `algo/turn_credit.py`. Users add estimators with `@register_estimator`.

Why the mask is the step's own, why temporal estimators are refused, and the registration
signature: docs/credit.md, 'Outcome estimators'.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch

from megatron_stepwise.algo.groups import RolloutGroup, flat_steps, grouped
from megatron_stepwise.algo.registry import Registry
from megatron_stepwise.steps import Step, StepwiseBatchError

OutcomeEstimator = Callable[..., torch.Tensor]
TemporalEstimator = Callable[..., list]


_ESTIMATORS = Registry("algo.estimator", "advantage estimator", StepwiseBatchError)  # flag: the kind
OUTCOME, TEMPORAL, TURN, TOKEN = "outcome", "temporal", "turn", "token"


def register_estimator(
    name: str, *, temporal: bool = False, turn: bool = False, token: bool = False
) -> Callable[[Callable], Callable]:
    """Register an advantage estimator under `name` (decorator).

    Outcome estimators (the default) have the signature
    `fn(rewards: float64 [n_traj], group: long [n_traj], *, eps, **options) -> [n_traj]`,
    where `group` holds dense group ids 0..G-1; they only ever see groups of 2 or more.
    Turn estimators (`turn=True`) have the signature
    `fn(rewards: float64 [n_traj, turns], lengths: long [n_traj], group, *, eps, **options)
    -> [n_traj, turns]`: per-turn rewards (0 past a trajectory's length; the last turn's is the
    outcome minus the earlier turns') in, one advantage per turn out; groups of 2 or more only.
    One that takes a `states` keyword also gets long [n_traj, turns] state ids (equal ids: the
    same state; a step's `metadata["state_key"]`, else its prompt; -1 past the length).
    Temporal estimators (`temporal=True`) have the signature
    `fn(steps, *, eps, **options) -> list[Tensor]` and are only called on batches where every
    trajectory is a single step. Token estimators (`token=True`, e.g. `opd`) have the same
    signature and take any trajectories: each token's advantage is its own (algo/distill.py).
    """
    if temporal + turn + token > 1:
        raise ValueError(f"estimator {name!r}: temporal, turn and token are exclusive")
    return _ESTIMATORS.register(name, TEMPORAL if temporal else TURN if turn else TOKEN if token else OUTCOME)


def get_estimator(name: str) -> Callable:
    return _ESTIMATORS.lookup(name)[0]


def option_problems(name: str, options: dict) -> list[tuple[str, str]]:
    """(config key, problem) for each of `algo.estimator_options` that estimator `name` does not
    take: its keyword-only parameters (not `eps`, `states`). One with a named `**options` takes
    anything; `**_` only swallows what is passed to every estimator, which names none of its own."""
    params = inspect.signature(get_estimator(name)).parameters.values()
    if any(p.kind is p.VAR_KEYWORD and p.name != "_" for p in params):
        return []
    known = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in ("eps", "states")]
    takes = f"it takes {', '.join(known)}" if known else "it takes none"
    return [
        (f"algo.estimator_options.{key}", f"is not an option of {name} ({takes})")
        for key in sorted(set(options) - set(known))
    ]


def list_estimators() -> list[str]:
    return _ESTIMATORS.names()


def is_temporal_estimator(name: str) -> bool:
    return _ESTIMATORS.lookup(name)[1] == TEMPORAL


def is_token_estimator(name: str) -> bool:
    return _ESTIMATORS.lookup(name)[1] == TOKEN


def is_turn_estimator(name: str) -> bool:
    return _ESTIMATORS.lookup(name)[1] == TURN


# ----------------------------------------------------------------------------- group statistics


def group_mean(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over each element's group, returned per element."""
    n_groups = int(group.max()) + 1 if group.numel() else 0
    counts = torch.zeros(n_groups, dtype=values.dtype).index_add_(0, group, torch.ones_like(values))
    sums = torch.zeros(n_groups, dtype=values.dtype).index_add_(0, group, values)
    return (sums / counts)[group]


def group_count(group: torch.Tensor) -> torch.Tensor:
    """Size of each element's group, returned per element (long)."""
    return torch.bincount(group)[group]


def group_std(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Unbiased sample std (as `torch.std`) over each element's group, per element."""
    n = group_count(group).to(values.dtype)
    centred = values - group_mean(values, group)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    sq = torch.zeros(n_groups, dtype=values.dtype).index_add_(0, group, centred * centred)[group]
    return torch.sqrt(sq / (n - 1))


# ----------------------------------------------------------------------------- built-in estimators


@register_estimator("grpo")
def grpo(rewards: torch.Tensor, group: torch.Tensor, *, eps: float, **_) -> torch.Tensor:
    """(r - mean) / (std + eps), std the unbiased sample std."""
    return (rewards - group_mean(rewards, group)) / (group_std(rewards, group) + eps)


@register_estimator("dr_grpo")
def dr_grpo(rewards: torch.Tensor, group: torch.Tensor, *, eps: float, **_) -> torch.Tensor:
    """r - mean (Dr.GRPO drops the std normalisation)."""
    return rewards - group_mean(rewards, group)


@register_estimator("rloo")
def rloo(rewards: torch.Tensor, group: torch.Tensor, *, eps: float, **_) -> torch.Tensor:
    """Leave-one-out baseline: r - mean(others) = (r - mean) * n / (n - 1)."""
    n = group_count(group).to(rewards.dtype)
    return (rewards - group_mean(rewards, group)) * n / (n - 1)


@register_estimator("maxrl")
def maxrl(rewards: torch.Tensor, group: torch.Tensor, *, eps: float, **_) -> torch.Tensor:
    """(r - mean) / (mean + eps), meant for binary rewards."""
    mean = group_mean(rewards, group)
    return (rewards - mean) / (mean + eps)


@register_estimator("reinforce++", temporal=True)
def reinforce_pp(steps: Sequence[Step], *, eps: float, gamma: float = 1.0, **_) -> list[torch.Tensor]:
    """REINFORCE++ on single-step trajectories with an outcome reward.

    The reward sits on the last trained token; token t's return is gamma^(k) * r where k counts
    the trained tokens after t. Returns are whitened over all trained tokens of the batch.
    """
    returns: list[torch.Tensor] = []
    for s in steps:
        mask = s.loss_mask.to(torch.float64)
        after = mask.flip(0).cumsum(0).flip(0) - mask  # trained tokens strictly after t
        returns.append(float(s.reward) * torch.pow(torch.tensor(gamma, dtype=torch.float64), after) * mask)
    flat = torch.cat(returns) if returns else torch.zeros(0, dtype=torch.float64)
    all_mask = torch.cat([s.loss_mask for s in steps]).bool() if steps else torch.zeros(0, dtype=torch.bool)
    if int(all_mask.sum()) < 2:
        return [torch.zeros(s.response_ids.numel(), dtype=torch.float32) for s in steps]
    trained = flat[all_mask]
    mean, std = trained.mean(), trained.std()
    return [((r - mean) / (std + eps) * s.loss_mask).to(torch.float32) for r, s in zip(returns, steps)]


@register_estimator("gae", temporal=True)
def gae(steps: Sequence[Step], *, eps: float, **_) -> list[torch.Tensor]:
    raise StepwiseBatchError(
        "algo.estimator='gae' needs per-token values from a critic, which megatron-stepwise does not "
        "train; use an outcome estimator (grpo, dr_grpo, rloo, maxrl)"
    )


# ----------------------------------------------------------------------------- step-wise driver


def compute_advantages(
    steps: Sequence[Step], estimator: str = "grpo", *, eps: float = 1e-6, metrics: Optional[dict] = None, **options
) -> list[torch.Tensor]:
    """One float32 tensor per step (its response length): the trajectory's scalar times the step's
    mask; padding steps get zeros. The plugin API's entry: the flat steps are grouped once
    (`groups_of`) and `group_advantages` computes on the groups."""
    groups, order = grouped(steps)
    out = [torch.zeros(s.response_ids.numel(), dtype=torch.float32) for s in steps]
    for i, a in zip(order, group_advantages(groups, estimator, eps=eps, metrics=metrics, **options)):
        out[i] = a
    return out


def group_advantages(
    groups: Sequence[RolloutGroup],
    estimator: str = "grpo",
    *,
    eps: float = 1e-6,
    metrics: Optional[dict] = None,
    **options,
) -> list[torch.Tensor]:
    """`compute_advantages` of the groups' steps, in `flat_steps(groups)` order.

    Invalid trajectories (`Step.invalid_reason`: an infrastructure failure, not an outcome) are
    left out like padding: zero advantage, and no part of their group's mean or std.

    `metrics`, if given, is filled with counts: num_trajectories, num_groups, singleton_groups,
    zero_variance_groups (groups of 2+ whose rewards are all equal: no signal), invalid_trajectories.
    """
    estimate, kind = _ESTIMATORS.lookup(estimator)
    steps = flat_steps(groups)
    # Trajectories numbered group after group; the valid ones, and their groups renumbered densely.
    lengths = torch.tensor([n for g in groups for n in g.turns], dtype=torch.long)
    traj_of_step = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    last_step_of_traj = (torch.cumsum(lengths, 0) - 1).tolist()
    valid = [(k, bad is None) for k, g in enumerate(groups) for bad in g.invalid]
    real_trajs = [t for t, (_, ok) in enumerate(valid) if ok]
    rewards = torch.tensor([steps[last_step_of_traj[t]].reward for t in real_trajs], dtype=torch.float64)
    group = _renumber([valid[t][0] for t in real_trajs])
    _fill_metrics(metrics, real_trajs, rewards, group)
    if metrics is not None:
        metrics["invalid_trajectories"] = len(valid) - len(real_trajs)

    if kind == TURN:
        per_step = _turn_scalars(estimate, estimator, steps, traj_of_step, real_trajs, rewards, group, eps, options)
        return _times_own_mask(per_step, steps)
    if kind in (TEMPORAL, TOKEN):
        for t in real_trajs if kind == TEMPORAL else ():
            if int(lengths[t]) > 1:
                i = last_step_of_traj[t]
                raise StepwiseBatchError(
                    f"algo.estimator={estimator!r} is a temporal estimator and cannot be used with "
                    f"multi-step trajectories (trajectory {steps[i].trajectory_id} has {int(lengths[t])} steps): "
                    "it assigns credit along one token sequence, but step-wise training splits a trajectory "
                    "into one sequence per turn with only an outcome reward; use grpo, dr_grpo, rloo or maxrl"
                )
        # Invalid steps take no part in the estimate's batch statistics.
        real = set(real_trajs)
        keep = [i for i, t in enumerate(traj_of_step.tolist()) if t in real]
        out = [torch.zeros(s.response_ids.numel(), dtype=torch.float32) for s in steps]
        for i, o in zip(keep, estimate([steps[i] for i in keep], eps=eps, **options)):
            out[i] = o
        return out

    scalars = torch.zeros(len(real_trajs), dtype=torch.float64)
    if real_trajs:
        multi = group_count(group) > 1
        if bool(multi.any()):
            sub_group = _renumber(group[multi].tolist())
            value = estimate(rewards[multi], sub_group, eps=eps, **options)
            scalars[multi] = torch.as_tensor(value, dtype=torch.float64)

    per_traj = torch.zeros(len(last_step_of_traj), dtype=torch.float64)
    per_traj[torch.tensor(real_trajs, dtype=torch.long)] = scalars
    return _times_own_mask(per_traj[traj_of_step].tolist(), steps)


def _times_own_mask(per_step: list[float], steps: Sequence[Step]) -> list[torch.Tensor]:
    """Each step gets its scalar at ITS OWN trained positions (padding: zeros)."""
    return [
        torch.zeros(s.response_ids.numel(), dtype=torch.float32)
        if s.is_padding
        else (v * s.loss_mask.to(torch.float32))
        for v, s in zip(per_step, steps)
    ]


def _turn_scalars(
    estimate: Callable,
    name: str,
    steps: Sequence[Step],
    traj_of_step: torch.Tensor,
    real_trajs: list[int],
    outcomes: torch.Tensor,
    group: torch.Tensor,
    eps: float,
    options: dict,
) -> list[float]:
    """One advantage per step from a turn estimator: the per-turn reward matrix of the real
    trajectories (the last turn's reward is the outcome minus the earlier turns' own rewards),
    the estimator on the groups of 2 or more, and each step's entry at its own turn."""
    row_of_traj = {t: j for j, t in enumerate(real_trajs)}
    turn_of_step: list[int] = []
    rewards_of: list[list[float]] = [[] for _ in real_trajs]
    for i, (s, t) in enumerate(zip(steps, traj_of_step.tolist())):
        j = row_of_traj.get(t)
        turn_of_step.append(len(rewards_of[j]) if j is not None else -1)
        if j is None:
            continue
        if s.metadata.get("merged_steps", 1) > 1:
            raise StepwiseBatchError(
                f"step {i}: field 'metadata.merged_steps': algo.estimator={name!r} gives each turn its own "
                "advantage, so it needs the unmerged steps; compute advantages before merge_steps "
                "(merge_with_advantages carries them to the merged rows)"
            )
        rewards_of[j].append(s.turn_reward)
    lengths = torch.tensor([len(r) for r in rewards_of], dtype=torch.long)
    matrix = torch.zeros(len(real_trajs), int(lengths.max()) if len(real_trajs) else 0, dtype=torch.float64)
    for j, r in enumerate(rewards_of):
        earlier = sum(r[:-1])  # 0.0 when the earlier turns carry no reward: the last turn's is exactly R
        matrix[j, : len(r)] = torch.tensor(r[:-1] + [float(outcomes[j]) - earlier], dtype=torch.float64)
    if "states" in inspect.signature(estimate).parameters:
        options = {**options, "states": _state_ids(steps, traj_of_step, row_of_traj, turn_of_step, matrix.shape)}
    advantages = torch.zeros_like(matrix)
    multi = group_count(group) > 1 if len(real_trajs) else torch.zeros(0, dtype=torch.bool)
    if bool(multi.any()):
        if "states" in options:
            options["states"] = options["states"][multi]
        value = estimate(matrix[multi], lengths[multi], _renumber(group[multi].tolist()), eps=eps, **options)
        advantages[multi] = torch.as_tensor(value, dtype=torch.float64)
    turns = torch.tensor(turn_of_step, dtype=torch.long)
    rows = torch.tensor([row_of_traj.get(t, 0) for t in traj_of_step.tolist()], dtype=torch.long)
    per_step = torch.zeros(len(steps), dtype=torch.float64)
    real = turns >= 0  # padding steps keep 0
    per_step[real] = advantages[rows[real], turns[real]]
    return per_step.tolist()


def _state_ids(
    steps: Sequence[Step], traj_of_step: torch.Tensor, row_of_traj: dict, turn_of_step: list[int], shape: tuple
) -> torch.Tensor:
    """long [n_traj, turns]: equal ids for turns at the same state, -1 past a trajectory's length.
    A step's state is its `metadata["state_key"]` when the environment or caller set one, else
    its prompt (the whole history the policy saw)."""
    ids: dict = {}
    states = torch.full(shape, -1, dtype=torch.long)
    for s, t, turn in zip(steps, traj_of_step.tolist(), turn_of_step):
        if turn >= 0:
            key = s.metadata.get("state_key")
            key = ("key", key) if key is not None else ("prompt", s.prompt_ids.numpy().tobytes())
            states[row_of_traj[t], turn] = ids.setdefault(key, len(ids))
    return states


def _renumber(keys: Sequence) -> torch.Tensor:
    """Dense ids 0..n-1 for the keys, in order of first appearance."""
    ids: dict = {}
    return torch.tensor([ids.setdefault(k, len(ids)) for k in keys], dtype=torch.long)


def _fill_metrics(metrics: Optional[dict], real_trajs: list, rewards: torch.Tensor, group: torch.Tensor) -> None:
    if metrics is None:
        return
    metrics["num_trajectories"] = len(real_trajs)
    if not len(real_trajs):
        metrics.update(num_groups=0, singleton_groups=0, zero_variance_groups=0)
        return
    counts = torch.bincount(group)
    n_groups = int(counts.numel())
    lo = torch.full((n_groups,), float("inf"), dtype=torch.float64).scatter_reduce(0, group, rewards, "amin")
    hi = torch.full((n_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(0, group, rewards, "amax")
    metrics["num_groups"] = n_groups
    metrics["singleton_groups"] = int((counts == 1).sum())
    metrics["zero_variance_groups"] = int(((counts > 1) & (lo == hi)).sum())
