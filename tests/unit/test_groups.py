"""RolloutGroup: structure checked where a group is made, read without re-deriving it, and
pickled columnar (one StepBatch), never as per-step tensors."""

import pickle

import pytest
import torch
from helpers import make_step

from megatron_stepwise.algo.groups import RolloutGroup, flat_steps, groups_of, pack_groups, unpack_groups
from megatron_stepwise.steps import StepBatch, StepwiseBatchError, make_padding_step


def _group(pid="p", rewards=(0.0, 1.0), turns=(2, 1)):
    trajectories = []
    for k, (n, r) in enumerate(zip(turns, rewards)):
        trajectories.append(
            [
                make_step(
                    pid,
                    k,
                    resp=[3 + t, 4],
                    last=t == n - 1,
                    reward=r if t == n - 1 else 0.0,
                    lp=[-0.5, -1.5],
                    versions=[1, 2],
                    meta={"turn": t},
                )
                for t in range(n)
            ]
        )
    return RolloutGroup(pid, trajectories)


def test_reads_outcomes_and_sizes_without_a_flat_scan():
    g = _group(rewards=(0.5, 0.5, 1.0), turns=(2, 1, 3))
    assert g.rewards == [0.5, 0.5, 1.0] and g.summary().has_reward_variance
    assert g.summary().num_steps == 6 and g.summary().generated_tokens == 12
    assert not _group(rewards=(0.0, 0.0)).summary().has_reward_variance


def test_pickles_as_one_step_batch_and_back():
    g = _group(turns=(3, 2))
    state = g.__getstate__()
    assert isinstance(state["batch"], StepBatch) and state["lengths"] == [[3, 2]]
    back = pickle.loads(pickle.dumps(g))
    assert back.prompt_id == "p" and [len(t) for t in back.trajectories] == [3, 2]
    for a, b in zip(g.steps, back.steps):
        assert a.trajectory_id == b.trajectory_id and a.is_last_step == b.is_last_step and a.reward == b.reward
        for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "weight_versions"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.metadata == b.metadata


def test_several_groups_pack_into_one_batch_and_back():
    groups = [_group("a", turns=(2, 1)), _group("b", rewards=(1.0, 1.0), turns=(1, 3))]
    state = pack_groups(groups)
    assert state["prompt_ids"] == ["a", "b"] and state["batch"].num_rows == 7
    back = unpack_groups(pickle.loads(pickle.dumps(state)))
    assert [g.prompt_id for g in back] == ["a", "b"]
    assert [[len(t) for t in g.trajectories] for g in back] == [[2, 1], [1, 3]]
    assert [g.rewards for g in back] == [g.rewards for g in groups]
    assert [s.trajectory_id for s in flat_steps(back)] == [s.trajectory_id for s in flat_steps(groups)]


def test_pickle_is_columnar_not_one_tensor_per_step():
    small, large = _group(turns=(1, 1)), _group(turns=(40, 40))

    # Per-step tensors would pickle 5 tensors per step; a StepBatch a fixed number in all.
    def tensors(g):
        return pickle.dumps(g).count(b"torch._utils\n_rebuild_tensor")

    assert tensors(large) == tensors(small)


@pytest.mark.parametrize(
    "bad, field",
    [
        (lambda: RolloutGroup("p", [[make_step("p", 0, resp=[1], last=False)]]), "is_last_step"),
        (lambda: RolloutGroup("p", [[make_step("p", 0, resp=[1]), make_step("p", 0, resp=[1])]]), "is_last_step"),
        (lambda: RolloutGroup("p", [[make_step("q", 0, resp=[1])]]), "another prompt"),
        (lambda: RolloutGroup("p", [[]]), "no steps"),
    ],
)
def test_structure_errors_name_the_group_and_trajectory(bad, field):
    with pytest.raises(StepwiseBatchError, match=f"prompt group 'p', trajectory 0: .*{field}"):
        bad()


def test_groups_of_a_flat_rollout_skips_padding_and_keeps_order():
    a, b = _group("a"), _group("b", rewards=(1.0, 1.0))
    flat = flat_steps([a, b]) + [make_padding_step(0)]
    groups = groups_of(flat)
    assert [g.prompt_id for g in groups] == ["a", "b"]
    assert flat_steps(groups) == flat[:-1]
    with pytest.raises(StepwiseBatchError, match="is_last_step"):
        groups_of(flat[:1])  # ends inside trajectory 0 of "a" (2 steps)


def test_a_batch_from_groups_equals_the_batch_of_their_flat_steps():
    """`StepBatch.from_groups` reads the groups' structure; `from_steps` derives it from the flat
    list: the same columns, ids included (a group without trajectories numbers nothing)."""
    groups = [_group("a", turns=(2, 1)), _group("b", rewards=(1.0, 1.0), turns=(1, 3))]
    mine = StepBatch.from_groups([groups[0].trajectories, [], groups[1].trajectories], keep_metadata=True)
    flat = StepBatch.from_steps(flat_steps(groups), keep_metadata=True)
    assert mine.row_fields["group_index"].tolist() == [0, 0, 0, 1, 1, 1, 1]
    for name in ("tokens", "offsets", "prompt_lens"):
        assert torch.equal(getattr(mine, name), getattr(flat, name)), name
    for fields in ("token_fields", "row_fields"):
        a, b = getattr(mine, fields), getattr(flat, fields)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), fields
    assert mine.trajectory_ids == flat.trajectory_ids and mine.metadata == flat.metadata
