"""Which steps of a flat list form which trajectory and which prompt group (`step_structure`).

Below `steps.py` (which uses it): it reads only `Step.trajectory_id`, so it imports nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class StepStructure:
    """Which steps of a flat list form which trajectory, and which trajectories which prompt
    group: derived once per plugin API call that takes a flat list (`groups_of`,
    `compute_advantages`, `StepBatch.from_steps`, `merge_steps`, `prompt_minibatches`); groups
    know their own. Ids are dense, in order of first appearance; a padding step is a trajectory
    and a group of its own (its `__pad__` prompt id).

    >>> from megatron_stepwise.steps import Step, TrajectoryID
    >>> s = lambda p, k, last=True: Step(TrajectoryID(p, k), [1], [2], [1], is_last_step=last)
    >>> st = step_structure([s("a", 0, False), s("a", 0), s("b", 0), s("a", 1)])
    >>> st.traj_of_step, st.trajectories, st.groups, st.group_of_step
    ([0, 0, 1, 2], [[0, 1], [2], [3]], [[0, 2], [1]], [0, 0, 1, 0])
    """

    traj_of_step: list[int]
    group_of_step: list[int]
    trajectories: list[list[int]]  # each trajectory's step indices, in order
    groups: list[list[int]]  # each group's trajectory indices, in order


def step_structure(steps: Sequence[Any]) -> StepStructure:
    """The trajectories and prompt groups of a flat list of steps (see `StepStructure`)."""
    traj_ids: dict[Any, int] = {}  # TrajectoryID -> id
    group_ids: dict[str, int] = {}
    traj_of_step, group_of_step = [], []
    trajectories: list[list[int]] = []
    groups: list[list[int]] = []
    for i, s in enumerate(steps):
        t = traj_ids.setdefault(s.trajectory_id, len(traj_ids))
        g = group_ids.setdefault(s.trajectory_id.prompt_id, len(group_ids))
        if t == len(trajectories):
            trajectories.append([])
            if g == len(groups):
                groups.append([])
            groups[g].append(t)
        trajectories[t].append(i)
        traj_of_step.append(t)
        group_of_step.append(g)
    return StepStructure(traj_of_step, group_of_step, trajectories, groups)
