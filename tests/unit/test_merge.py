"""Hand-computed cases for the prefix merge."""

import pytest
import torch
from helpers import make_step

from megatron_stepwise import MergeStats, TrajectoryID, make_padding_step, merge_steps, validate_steps


def _three_turns():
    return [
        make_step("a", 0, [1, 2], [3, 4], [1, 1], last=False, lp=[-0.1, -0.2], stop="tool_call", meta={"turn": 0}),
        # obs_delta [9, 9]
        make_step("a", 0, [1, 2, 3, 4, 9, 9], [5], [1], last=False, lp=[-0.3], stop="tool_call", meta={"turn": 1}),
        # obs_delta [7]; the final EOS was appended after the fact (mask 0, log-prob 0)
        make_step(
            "a",
            0,
            [1, 2, 3, 4, 9, 9, 5, 7],
            [6, 0],
            [1, 0],
            lp=[-0.4, 0.0],
            last=True,
            reward=1.0,
            stop="stop",
            meta={"turn": 2},
        ),
    ]


def test_merge_hand_computed():
    merged, stats = merge_steps(_three_turns())
    assert len(merged) == 1
    row = merged[0]
    assert row.trajectory_id == TrajectoryID("a", 0)
    assert row.prompt_ids.tolist() == [1, 2]
    assert row.response_ids.tolist() == [3, 4, 9, 9, 5, 7, 6, 0]
    assert row.loss_mask.tolist() == [1, 1, 0, 0, 1, 0, 1, 0]
    assert row.rollout_logprobs.tolist() == pytest.approx([-0.1, -0.2, 0, 0, -0.3, 0, -0.4, 0])
    assert row.weight_versions is None
    assert (row.reward, row.is_last_step, row.stop_reason) == (1.0, True, "stop")
    assert row.metadata == {"turn": 2, "merged_steps": 3}
    # Tokens: (2+2) + (6+1) + (8+2) = 21 before, 2 + 8 = 10 after; 4 trainable tokens.
    assert stats == MergeStats(rows_before=3, rows_after=1, tokens_before=21, tokens_after=10, trainable_tokens=4)
    assert stats.token_ratio == pytest.approx(2.1)
    validate_steps(merged)


def test_merge_does_not_modify_its_input():
    steps = _three_turns()
    before = [(s.prompt_ids.clone(), s.response_ids.clone(), s.loss_mask.clone(), dict(s.metadata)) for s in steps]
    merge_steps(steps)
    for s, (p, r, m, md) in zip(steps, before):
        assert torch.equal(s.prompt_ids, p) and torch.equal(s.response_ids, r) and torch.equal(s.loss_mask, m)
        assert s.metadata == md


def test_drift_in_previous_response_starts_a_new_row():
    steps = _three_turns()
    # Re-tokenised history for turn 2 differs in the last token of turn 1's response.
    steps[2].prompt_ids = torch.tensor([1, 2, 3, 4, 9, 9, 8, 7])
    merged, stats = merge_steps(steps)
    assert [r.response_ids.tolist() for r in merged] == [[3, 4, 9, 9, 5], [6, 0]]
    assert [r.prompt_ids.tolist() for r in merged] == [[1, 2], [1, 2, 3, 4, 9, 9, 8, 7]]
    assert [r.is_last_step for r in merged] == [False, True]
    assert [r.metadata["merged_steps"] for r in merged] == [2, 1]
    assert stats.broken_prefixes == 1 and stats.rows_after == 2


def test_drift_in_previous_prompt_starts_a_new_row():
    steps = _three_turns()
    # Turn 1's history was re-tokenised differently (disagrees with step 0's prompt); turn 2
    # builds on that new history.
    steps[1].prompt_ids = torch.tensor([1, 5, 3, 4, 9, 9])
    steps[2].prompt_ids = torch.tensor([1, 5, 3, 4, 9, 9, 5, 7])
    merged, stats = merge_steps(steps)
    # Step 1 cannot join step 0, but step 2 continues step 1 exactly.
    assert [r.prompt_ids.tolist() for r in merged] == [[1, 2], [1, 5, 3, 4, 9, 9]]
    assert merged[1].response_ids.tolist() == [5, 7, 6, 0]
    assert merged[1].loss_mask.tolist() == [1, 0, 1, 0]
    assert stats.broken_prefixes == 1


def test_shorter_next_prompt_does_not_merge():
    steps = [
        make_step("a", 0, [1, 2], [3, 4], [1, 1], last=False),
        make_step("a", 0, [1, 2, 3], [5], [1]),  # a truncated history
    ]
    merged, stats = merge_steps(steps)
    assert len(merged) == 2 and stats.broken_prefixes == 1


def test_different_trajectories_never_merge():
    steps = [
        make_step("a", 0, [1], [2], [1]),
        make_step("a", 1, [1, 2], [3], [1]),  # prefix-consistent but another sample
        make_step("b", 0, [1, 2, 3], [4], [1]),
    ]
    merged, stats = merge_steps(steps)
    assert len(merged) == 3 and stats.broken_prefixes == 0
    assert [r.metadata["merged_steps"] for r in merged] == [1, 1, 1]


def test_padding_rows_pass_through_and_are_not_counted():
    pad = make_padding_step(0)
    merged, stats = merge_steps(_three_turns() + [pad])
    assert merged[-1] is pad and len(merged) == 2
    assert (stats.rows_before, stats.rows_after, stats.padding_rows) == (3, 1, 1)
    assert stats.tokens_after == 10


def test_weight_versions_of_obs_delta_are_not_sampled():
    steps = _three_turns()
    for v, s in enumerate(steps):
        s.weight_versions = torch.full((s.response_ids.numel(),), 5 + v)
    row = merge_steps(steps)[0][0]
    assert row.weight_versions.tolist() == [5, 5, -1, -1, 6, -1, 7, 7]


def test_no_merge_when_only_one_side_has_logprobs_or_versions():
    steps = _three_turns()
    steps[1].rollout_logprobs = None
    merged, _ = merge_steps(steps)
    assert [r.metadata["merged_steps"] for r in merged] == [1, 1, 1]
    steps = _three_turns()
    steps[2].weight_versions = torch.tensor([1, 1])
    merged, _ = merge_steps(steps)
    assert [r.metadata["merged_steps"] for r in merged] == [2, 1]


def test_without_logprobs_merged_row_has_none():
    steps = _three_turns()
    for s in steps:
        s.rollout_logprobs = None
    row = merge_steps(steps)[0][0]
    assert row.rollout_logprobs is None and row.loss_mask.tolist() == [1, 1, 0, 0, 1, 0, 1, 0]


def test_max_tokens_caps_merged_rows():
    # Merged rows are prompt[last] + response[last]: 7 tokens through step 1, 10 through step 2.
    merged, _ = merge_steps(_three_turns(), max_tokens=9)
    assert [r.num_tokens for r in merged] == [7, 10]
    merged, _ = merge_steps(_three_turns(), max_tokens=10)
    assert [r.num_tokens for r in merged] == [10]


def test_empty_input():
    merged, stats = merge_steps([])
    assert merged == [] and stats == MergeStats(0, 0, 0, 0, 0)


def test_merging_a_groups_trajectories_gives_the_flat_lists_rows():
    """`merge_trajectories` (groups' trajectories, nothing derived) and `merge_steps` (a flat list)
    are one merge: the same rows, stats and carried advantages, row for row."""
    from megatron_stepwise.algo.advantages import compute_advantages
    from megatron_stepwise.algo.groups import groups_of
    from megatron_stepwise.algo.merge import merge_trajectories, merge_with_advantages
    from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps

    steps = make_agent_steps(AgentWorkload(num_prompts=3, samples_per_prompt=3, turns=(1, 4), drift_prob=0.3, seed=2))
    advantages = compute_advantages(steps, "rloo")
    flat_rows, flat_adv, flat_stats = merge_with_advantages(steps, advantages, max_tokens=None)
    trajectories = [t for g in groups_of(steps) for t in g.trajectories]
    rows, adv, stats = merge_trajectories(trajectories, max_tokens=None, advantages=advantages)
    assert stats == flat_stats and stats.broken_prefixes > 0 and stats.rows_after < stats.rows_before
    assert len(rows) == len(trajectories)
    assert [r.trajectory_id for t in rows for r in t] == [r.trajectory_id for r in flat_rows]
    for a, b in zip([r for t in rows for r in t], flat_rows):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert all(torch.equal(a, b) for a, b in zip(adv, flat_adv))
    assert merge_trajectories(trajectories, max_tokens=None)[1] is None
