"""Prompt groups: the unit a rollout yields and the trainer decides on.

A `RolloutGroup` is one prompt's trajectories (`samples_per_prompt` of them), each a list of
steps ending on its one `is_last_step`. The structure is checked once, where the group is
made (the agent loop); filters, dynamic sampling, mini-batching and `algo.prepare` then read a
group's trajectories, outcome rewards and sizes without re-deriving them from a flat step list.
A flat list (the plugin API's input) is grouped once, by `groups_of`, from `step_structure`.
A group pickles columnar (one `StepBatch`, flat token tensors with offsets), never as per-step
tensors: agent workers send groups to the driver that way, and the async buffer keeps them.

`PromptGroup` is what every group-shaped object offers: its prompt id and its `summary()`. A
`RolloutGroup` (rows through rank 0) and an agent worker's `HeldGroup` (rows kept where they were
made) are the two; a `GroupSummary` is its own summary. The filters, the buffer and the metrics
read the summary, so they take either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence, runtime_checkable

from megatron_stepwise.step_structure import StepStructure, step_structure
from megatron_stepwise.steps import Step, StepBatch, StepwiseBatchError


@runtime_checkable
class PromptGroup(Protocol):
    """One prompt group, whatever holds its rows: its prompt id, and its `summary()` (outcomes,
    turns, lengths; what filters and metrics read)."""

    @property
    def prompt_id(self) -> str: ...

    def summary(self) -> "GroupSummary": ...


@dataclass
class RolloutGroup:
    """One prompt's trajectories, each its steps in turn order, ending on its one `is_last_step`
    (checked here). What a rollout yields, and what `algo.prepare` turns into a batch.

    >>> from megatron_stepwise.steps import TrajectoryID
    >>> s = lambda k, last, r=0.0: Step(TrajectoryID("a", k), [1, 2], [3], [1], reward=r, is_last_step=last)
    >>> g = RolloutGroup("a", [[s(0, False), s(0, True, 1.0)], [s(1, True)]])
    >>> g.rewards, g.turns, g.summary().has_reward_variance
    ([1.0, 0.0], [2, 1], True)
    """

    prompt_id: str
    trajectories: list[list[Step]]

    def __post_init__(self) -> None:
        for k, trajectory in enumerate(self.trajectories):
            where = f"prompt group {self.prompt_id!r}, trajectory {k}"
            if not trajectory:
                raise StepwiseBatchError(f"{where}: no steps")
            if any(s.trajectory_id.prompt_id != self.prompt_id for s in trajectory):
                raise StepwiseBatchError(f"{where}: a step of another prompt ({trajectory[0].trajectory_id})")
            if not trajectory[-1].is_last_step or any(s.is_last_step for s in trajectory[:-1]):
                raise StepwiseBatchError(f"{where}: field 'is_last_step' must be True on its last step only")

    @property
    def steps(self) -> list[Step]:
        return [s for t in self.trajectories for s in t]

    @property
    def rewards(self) -> list[float]:
        """Each trajectory's outcome reward (its last step's)."""
        return [t[-1].reward for t in self.trajectories]

    @property
    def invalid(self) -> list[Optional[str]]:
        """Per trajectory: why it is invalid (an infrastructure failure), or None (`Step`)."""
        return [t[-1].invalid_reason for t in self.trajectories]

    @property
    def turns(self) -> list[int]:
        return [len(t) for t in self.trajectories]

    def summary(self) -> "GroupSummary":
        last = [t[-1] for t in self.trajectories]
        steps = self.steps
        return GroupSummary(
            prompt_id=self.prompt_id,
            rewards=self.rewards,
            invalid=self.invalid,
            turns=self.turns,
            stop_reasons=[s.stop_reason for s in last],
            envs=[str(s.metadata["env"]) if "env" in s.metadata else None for s in last],
            prompt_lens=[int(s.prompt_ids.numel()) for s in steps],
            response_lens=[int(s.response_ids.numel()) for s in steps],
            trainable=[s.num_trainable for s in steps],
            drift=[bool(s.metadata["retokenize_drift"]) if "retokenize_drift" in s.metadata else None for s in steps],
        )

    # Columnar on the wire (see `pack_groups`).
    def __getstate__(self) -> dict:
        return pack_groups([self])

    def __setstate__(self, state: dict) -> None:
        (group,) = unpack_groups(state)
        self.prompt_id, self.trajectories = group.prompt_id, group.trajectories

    @classmethod
    def checked(cls, prompt_id: str, trajectories: list[list[Step]]) -> "RolloutGroup":
        """A group whose structure was already checked (off the wire, from `step_structure`)."""
        group = cls.__new__(cls)
        group.prompt_id, group.trajectories = prompt_id, trajectories
        return group


@dataclass
class GroupSummary:
    """A group without its tokens: what the group filters, dynamic sampling and the rollout
    metrics read. An agent worker that keeps a group's rows sends only this to the driver.
    Per trajectory: outcome, turns, last stop reason and environment; per step, in the
    group's order: prompt, response and trained lengths, and re-tokenisation drift (None
    where it was not measured).

    >>> g = GroupSummary("a", rewards=[1.0, 0.0], invalid=[None, None], turns=[2, 1],
    ...     stop_reasons=["stop", "length"], envs=[None, None], prompt_lens=[2, 4, 2],
    ...     response_lens=[1, 1, 1], trainable=[1, 1, 1], drift=[None, None, None])
    >>> g.has_reward_variance, g.num_steps, g.generated_tokens, g.observation_lens()
    (True, 3, 3, [1])
    """

    prompt_id: str
    rewards: list[float]
    invalid: list[Optional[str]]
    turns: list[int]
    stop_reasons: list[str]
    envs: list[Optional[str]]
    prompt_lens: list[int]
    response_lens: list[int]
    trainable: list[int]
    drift: list[Optional[bool]]

    @property
    def has_reward_variance(self) -> bool:
        return has_variance(self.rewards, self.invalid)

    @property
    def valid_rewards(self) -> list[float]:
        return [r for r, bad in zip(self.rewards, self.invalid) if bad is None]

    @property
    def num_steps(self) -> int:
        return len(self.prompt_lens)

    @property
    def generated_tokens(self) -> int:
        return sum(self.response_lens)

    def observation_lens(self) -> list[int]:
        """Tokens added between consecutive turns: next prompt minus (prompt + response)."""
        out, start = [], 0
        for n in self.turns:
            for prev, cur in zip(range(start, start + n), range(start + 1, start + n)):
                out.append(max(self.prompt_lens[cur] - self.prompt_lens[prev] - self.response_lens[prev], 0))
            start += n
        return out

    def summary(self) -> "GroupSummary":
        return self


def has_variance(rewards: Sequence[float], invalid: Sequence[Optional[str]]) -> bool:
    """Two valid trajectories with different rewards: an invalid one's reward is no outcome."""
    return len({r for r, bad in zip(rewards, invalid) if bad is None}) > 1


def pack_groups(groups: Sequence[RolloutGroup]) -> dict:
    """Groups as one StepBatch plus their prompt ids and trajectory lengths: what travels, so
    several groups cost one set of tensors, not one per step (nor one per group)."""
    return {
        "batch": StepBatch.from_groups([g.trajectories for g in groups], keep_metadata=True),
        "prompt_ids": [g.prompt_id for g in groups],
        "lengths": [[len(t) for t in g.trajectories] for g in groups],
    }


def unpack_groups(state: dict) -> list[RolloutGroup]:
    steps = state["batch"].to_steps(copy=False)  # fresh from the wire: nothing else holds it
    groups, start = [], 0
    for prompt_id, lengths in zip(state["prompt_ids"], state["lengths"]):
        trajectories = []
        for n in lengths:
            trajectories.append(steps[start : start + n])
            start += n
        groups.append(RolloutGroup.checked(prompt_id, trajectories))  # checked where it was made
    return groups


def flat_steps(groups: Iterable[RolloutGroup]) -> list[Step]:
    """Every group's steps, group after group (the order a flat rollout has)."""
    return [s for g in groups for s in g.steps]


def groups_of(steps: Sequence[Step]) -> list[RolloutGroup]:
    """The prompt groups of a flat rollout (the plugin API's input), in order of first
    appearance; padding rows are not part of any group."""
    return grouped(steps)[0]


def grouped(steps: Sequence[Step]) -> tuple[list[RolloutGroup], list[int]]:
    """`groups_of`, and where each step of `flat_steps(groups)` sits in `steps`: the one place a
    flat list becomes groups (from its `step_structure`, checked for its last steps)."""
    structure = step_structure(steps)
    _check_last_steps(structure, steps)
    groups, order = [], []
    for trajs in structure.groups:
        rows = [structure.trajectories[t] for t in trajs if not steps[structure.trajectories[t][0]].is_padding]
        if not rows:
            continue
        groups.append(
            RolloutGroup.checked(steps[rows[0][0]].trajectory_id.prompt_id, [[steps[i] for i in r] for r in rows])
        )
        order += [i for r in rows for i in r]
    return groups, order


def _check_last_steps(structure: StepStructure, steps: Sequence[Step]) -> None:
    """Every trajectory has exactly one step marked `is_last_step`, and it is its final step
    (its outcome reward is that step's); else the error names the step."""
    for rows in structure.trajectories:
        marked = next((i for i in rows if steps[i].is_last_step), None)
        if marked is not None and marked != rows[-1]:
            after = rows[rows.index(marked) + 1]
            raise StepwiseBatchError(
                f"step {after}: field 'is_last_step': trajectory {steps[after].trajectory_id} continues "
                f"after its last step (step {marked})"
            )
    for rows in structure.trajectories:
        if not steps[rows[-1]].is_last_step:
            raise StepwiseBatchError(
                f"step {rows[-1]}: field 'is_last_step': trajectory {steps[rows[-1]].trajectory_id} has no "
                "step marked last, so it has no outcome reward"
            )
