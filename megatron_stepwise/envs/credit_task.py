"""A tabular multi-turn task whose exact policy gradient is known by enumeration.

The policy is a softmax table `theta[turn, action]` over three actions per turn: 0 stops the
trajectory (so the policy chooses when to stop), 1 is the key action, 2 a filler. A filler turn
pays `filler_reward` at once; the key action pays nothing then, but taking it at turn `key_turn`
adds `key_bonus` to the trajectory's last turn; with `reward_noise`, every sampled turn's reward
also gets +-reward_noise at random (zero mean, so every expectation is unchanged: the turns'
rewards are noisy, as judged or tool-checked steps are). A trajectory ends when it stops or after
`max_turns` turns; its outcome is the sum of its turn rewards. Every trajectory can be
enumerated (fewer than 3^max_turns), so the gradient of any objective written as an expectation
over trajectories is exact (autograd through the enumeration), and sampled estimators can be
compared against it (tests/unit/test_credit.py) or trained with (tools/bench/bench_credit.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

STOP, KEY, FILLER = 0, 1, 2
NUM_ACTIONS = 3


@dataclass(frozen=True)
class KeyTurnTask:
    max_turns: int = 3
    key_turn: int = 1
    key_bonus: float = 1.0
    filler_reward: float = 0.2
    reward_noise: float = 0.0

    def turn_rewards(
        self, actions: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """float64 [n, max_turns]: each turn's reward (0 past the length), the key bonus on the last
        turn; the noise is drawn only with a `generator` (sampling), never in the enumeration."""
        alive = torch.arange(self.max_turns)[None, :] < lengths[:, None]
        rewards = (alive & (actions == FILLER)).double() * self.filler_reward
        if generator is not None and self.reward_noise:
            signs = torch.randint(0, 2, rewards.shape, generator=generator).double() * 2 - 1
            rewards = rewards + signs * self.reward_noise * alive
        got_key = (lengths > self.key_turn) & (actions[:, self.key_turn] == KEY)
        rewards[torch.arange(actions.size(0)), lengths - 1] += got_key.double() * self.key_bonus
        return rewards

    def lengths(self, actions: torch.Tensor) -> torch.Tensor:
        """Turns taken: up to and including the first stop, at most max_turns."""
        stopped = (actions == STOP).long().cumsum(1)
        return ((stopped - (actions == STOP).long()) == 0).sum(1)

    def sample(self, theta: torch.Tensor, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(actions long [n, max_turns] (entries past the length are unused), lengths long [n])."""
        probs = torch.softmax(theta.double(), -1)
        actions = torch.stack(
            [torch.multinomial(probs[t], n, replacement=True, generator=generator) for t in range(self.max_turns)],
            dim=1,
        )
        return actions, self.lengths(actions)

    def enumerate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every distinct trajectory once: (actions [m, max_turns], lengths [m]); unused turns hold STOP."""
        rows = []
        for length in range(1, self.max_turns + 1):
            last_choices = (STOP,) if length < self.max_turns else (STOP, KEY, FILLER)
            for head in itertools.product((KEY, FILLER), repeat=length - 1):
                for last in last_choices:
                    rows.append(list(head) + [last] + [STOP] * (self.max_turns - length))
        actions = torch.tensor(rows, dtype=torch.long)
        return actions, self.lengths(actions)


def score(theta: torch.Tensor, actions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """float64 [n, max_turns, turns, actions]: grad of log pi(a_t | t) w.r.t. theta, per turn
    (0 past the length): onehot(a_t) - pi_t on row t."""
    n, turns = actions.shape
    probs = torch.softmax(theta.double(), -1)
    onehot = torch.nn.functional.one_hot(actions, NUM_ACTIONS).double()
    per_turn = (onehot - probs[None]) * (torch.arange(turns)[None, :] < lengths[:, None])[..., None]
    out = torch.zeros(n, turns, turns, NUM_ACTIONS, dtype=torch.float64)
    out[:, torch.arange(turns), torch.arange(turns)] = per_turn
    return out


def trajectory_probs(theta: torch.Tensor, actions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Probability of each (enumerated) trajectory under the softmax policy; differentiable."""
    logp = torch.log_softmax(theta.double(), -1)
    per_turn = logp[torch.arange(actions.size(1))[None, :], actions]
    alive = torch.arange(actions.size(1))[None, :] < lengths[:, None]
    return torch.exp((per_turn * alive).sum(1))


def exact_gradient(task: KeyTurnTask, theta: torch.Tensor, value_of) -> torch.Tensor:
    """d/dtheta of E[value_of(actions, lengths, rewards)] by enumeration (value_of returns float64 [m])."""
    actions, lengths = task.enumerate()
    theta = theta.detach().double().requires_grad_(True)
    objective = (
        trajectory_probs(theta, actions, lengths) * value_of(actions, lengths, task.turn_rewards(actions, lengths))
    ).sum()
    (grad,) = torch.autograd.grad(objective, theta)
    return grad


def expected_update(task: KeyTurnTask, theta: torch.Tensor, credit) -> torch.Tensor:
    """E[sum_t grad log pi(a_t) * credit[:, t]] by enumeration, `credit(rewards, lengths)` -> [m, turns]
    a per-trajectory function (e.g. discounted returns-to-go): the target of an estimator that is
    no objective's gradient."""
    actions, lengths = task.enumerate()
    probs = trajectory_probs(theta, actions, lengths)
    c = credit(task.turn_rewards(actions, lengths), lengths)
    return (probs[:, None, None] * (score(theta, actions, lengths) * c[:, :, None, None]).sum(1)).sum(0)


def history_states(actions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """long [n, turns]: one id per distinct history (the actions before the turn), -1 past the length."""
    turns = actions.size(1)
    digits = (actions + 1) * (NUM_ACTIONS + 1) ** torch.arange(turns)[None, :]
    before = torch.cat([torch.zeros(actions.size(0), 1, dtype=torch.long), digits.cumsum(1)[:, :-1]], 1)
    return torch.where(torch.arange(turns)[None, :] < lengths[:, None], before, -1)


def sampled_gradients(
    task: KeyTurnTask, theta: torch.Tensor, estimator, groups: int, group_size: int, generator: torch.Generator
) -> torch.Tensor:
    """One policy-gradient estimate per group, float64 [groups, turns, actions]: the mean over the
    group's trajectories of sum_t A[i, t] grad log pi(a_t). `estimator(rewards, lengths, group,
    states=...)` returns the advantages [n, turns] (a registered turn estimator with its options
    bound); `states` are the histories' ids (`history_states`), for state-grouped estimators."""
    actions, lengths = task.sample(theta, groups * group_size, generator)
    rewards = task.turn_rewards(actions, lengths, generator)
    group = torch.arange(groups).repeat_interleave(group_size)
    adv = estimator(rewards, lengths, group, states=history_states(actions, lengths))
    alive = torch.arange(task.max_turns)[None, :] < lengths[:, None]
    per_traj = (score(theta, actions, lengths) * (adv * alive)[:, :, None, None]).sum(1)
    return per_traj.view(groups, group_size, task.max_turns, NUM_ACTIONS).mean(1)
