"""Hand-computed cases for validate_steps, pad_for_data_parallel, prompt_minibatches and the
micro-batch planner."""

import math
import re

import numpy as np
import pytest
import torch
from helpers import make_step

from megatron_stepwise import (
    StepwiseBatchError,
    make_padding_step,
    pad_for_data_parallel,
    plan_microbatches,
    prompt_minibatches,
    validate_steps,
)
from megatron_stepwise.algo.planner import pad_to_multiple, plan_stats, row_cost


def _valid_batch():
    return [
        make_step("a", 0, [1, 2], [3, 4], last=False, lp=[-0.1, -0.2]),
        make_step("a", 0, [1, 2, 3, 4, 9], [5], lp=[-0.3]),
        make_step("a", 1, [1, 2], [7], lp=[-0.4]),
        make_step("b", 0, [6], [8, 8], mask=[1, 0]),
    ]


def _expect(steps, step, trajectory, field, **kw):
    pattern = rf"step {step} \(trajectory {re.escape(trajectory)}\): field '{field}'"
    with pytest.raises(StepwiseBatchError, match=pattern):
        validate_steps(steps, **kw)


# ------------------------------------------------------------------------- validate_steps


def test_valid_batch_with_padding_passes():
    validate_steps(_valid_batch(), vocab_size=10)
    validate_steps(pad_for_data_parallel(_valid_batch(), 3), vocab_size=10)
    validate_steps([])


def test_loss_mask_length_mismatch():
    steps = _valid_batch()
    steps[1].loss_mask = torch.tensor([1, 1])
    _expect(steps, 1, "a#0", "loss_mask")


def test_rollout_logprobs_length_mismatch():
    steps = _valid_batch()
    steps[2].rollout_logprobs = torch.tensor([-0.1, -0.2])
    _expect(steps, 2, "a#1", "rollout_logprobs")


def test_weight_versions_length_mismatch():
    steps = _valid_batch()
    steps[0].weight_versions = torch.tensor([3])
    _expect(steps, 0, "a#0", "weight_versions")


def test_non_contiguous_trajectory():
    steps = [
        make_step("a", 0, [1], [2], last=False),
        make_step("a", 1, [1], [3]),
    ]
    # a#0 stops without a last step when a#1 starts.
    _expect(steps, 0, "a#0", "is_last_step")
    steps = [make_step("a", 0, [1], [2]), make_step("a", 1, [1], [3]), make_step("a", 0, [1, 2], [4])]
    _expect(steps, 2, "a#0", "trajectory_id")


def test_trajectory_without_last_step_at_end_of_batch():
    steps = _valid_batch()
    steps[3].is_last_step = False
    _expect(steps, 3, "b#0", "is_last_step")


def test_last_step_that_is_not_the_final_row():
    steps = [
        make_step("a", 0, [1], [2], last=False),
        make_step("a", 0, [1, 2], [3], last=True),
        make_step("a", 0, [1, 2, 3], [4], last=False),
    ]
    with pytest.raises(StepwiseBatchError, match=r"step 1 \(trajectory a#0\): field 'is_last_step'.*step 2 continues"):
        validate_steps(steps)


def test_two_last_steps():
    steps = [
        make_step("a", 0, [1], [2], last=True),
        make_step("a", 0, [1, 2], [3], last=False),
        make_step("a", 0, [1, 2, 3], [4], last=True),
    ]
    with pytest.raises(StepwiseBatchError, match=r"step 0 \(trajectory a#0\): field 'is_last_step'.*again at step 2"):
        validate_steps(steps)


def test_prompt_groups_not_contiguous():
    steps = [make_step("a", 0, [1], [2]), make_step("b", 0, [1], [2]), make_step("a", 1, [1], [3])]
    with pytest.raises(StepwiseBatchError, match=r"step 2 \(trajectory a#1\): field 'trajectory_id' prompt group 'a'"):
        validate_steps(steps)


def test_loss_mask_values_other_than_zero_one():
    steps = _valid_batch()
    steps[3].loss_mask = torch.tensor([1, 2])
    with pytest.raises(
        StepwiseBatchError, match=r"step 3 \(trajectory b#0\): field 'loss_mask' has value 2 at position 1"
    ):
        validate_steps(steps)
    steps[3].loss_mask = torch.tensor([-1, 0])
    _expect(steps, 3, "b#0", "loss_mask")


def test_empty_response_with_trainable_mask():
    steps = _valid_batch()
    steps[2].response_ids = torch.zeros(0, dtype=torch.long)
    steps[2].rollout_logprobs = None
    with pytest.raises(
        StepwiseBatchError,
        match=r"step 2 \(trajectory a#1\): field 'loss_mask' has 1 entries equal to 1 but response_ids is empty",
    ):
        validate_steps(steps)


def test_empty_response_without_mask_is_allowed():
    steps = _valid_batch()
    steps[2] = make_step("a", 1, [1, 2], [], mask=[], lp=[])
    validate_steps(steps)


def test_negative_token_ids():
    steps = _valid_batch()
    steps[1].prompt_ids = torch.tensor([1, 2, 3, -4, 9])
    with pytest.raises(
        StepwiseBatchError,
        match=r"step 1 \(trajectory a#0\): field 'prompt_ids' has negative token id -4 at position 3",
    ):
        validate_steps(steps)
    steps = _valid_batch()
    steps[3].response_ids = torch.tensor([8, -1])
    _expect(steps, 3, "b#0", "response_ids")  # negative ids are rejected even without vocab_size


def test_out_of_vocabulary_ids_only_with_vocab_size():
    steps = _valid_batch()
    steps[3].response_ids = torch.tensor([8, 10])
    validate_steps(steps)
    with pytest.raises(
        StepwiseBatchError,
        match=r"step 3 \(trajectory b#0\): field 'response_ids' has token id 10 at position 1, outside the vocabulary \(size 10\)",
    ):
        validate_steps(steps, vocab_size=10)
    steps = _valid_batch()
    steps[2].prompt_ids = torch.tensor([1, 12])
    _expect(steps, 2, "a#1", "prompt_ids", vocab_size=10)


def test_non_finite_logprobs_and_reward():
    steps = _valid_batch()
    steps[1].rollout_logprobs = torch.tensor([float("nan")])
    _expect(steps, 1, "a#0", "rollout_logprobs")
    steps = _valid_batch()
    steps[0].rollout_logprobs = torch.tensor([-0.1, -math.inf])
    with pytest.raises(
        StepwiseBatchError,
        match=r"step 0 \(trajectory a#0\): field 'rollout_logprobs' has non-finite value -inf at position 1",
    ):
        validate_steps(steps)
    steps = _valid_batch()
    steps[3].reward = float("inf")
    _expect(steps, 3, "b#0", "reward")


def test_errors_found_past_the_first_chunk():
    # Response checks run over chunks of steps; the step index must be global.
    steps = [make_step(f"p{i}", 0, [1], [2, 3]) for i in range(2500)]
    steps[2100].loss_mask = torch.tensor([0, 3])
    _expect(steps, 2100, "p2100#0", "loss_mask")


def test_not_a_step():
    with pytest.raises(StepwiseBatchError, match="step 1: expected a Step"):
        validate_steps([make_step("a", 0, [1], [2]), "oops"])


# ------------------------------------------------------------------ pad_for_data_parallel


def test_pad_appends_fewest_loss_neutral_rows():
    steps = _valid_batch()  # 4 rows
    padded = pad_for_data_parallel(steps, 3)
    assert len(padded) == 6 and padded[:4] == steps
    pads = padded[4:]
    assert [p.trajectory_id.prompt_id for p in pads] == ["__pad__0", "__pad__1"]
    assert all(p.is_padding and p.is_last_step and p.num_trainable == 0 for p in pads)
    assert pad_for_data_parallel(steps, 4) == steps
    assert pad_for_data_parallel(steps, 1) == steps
    assert len(pad_for_data_parallel([], 8)) == 0


def test_pad_ids_stay_unique_when_padding_again():
    once = pad_for_data_parallel(_valid_batch(), 3)  # __pad__0, __pad__1
    twice = pad_for_data_parallel(once + _valid_batch()[3:], 4)  # 7 rows -> 1 more pad
    assert twice[-1].trajectory_id.prompt_id == "__pad__2"
    ids = [s.trajectory_id for s in twice if s.is_padding]
    assert len(ids) == len(set(ids)) == 3
    assert pad_for_data_parallel(_valid_batch(), 3, first_index=10)[-1].trajectory_id.prompt_id == "__pad__11"


def test_pad_rejects_bad_dp_size():
    with pytest.raises(ValueError, match="dp_size"):
        pad_for_data_parallel(_valid_batch(), 0)


# ---------------------------------------------------------------------- prompt_minibatches


def _prompt_batch():
    return [
        make_step("a", 0, [1], [2], last=False),
        make_step("a", 0, [1, 2], [3]),
        make_step("a", 1, [1], [4]),
        make_step("b", 0, [1], [5]),
        make_step("c", 0, [1], [6]),
        make_step("c", 1, [1], [7]),
        make_step("d", 0, [1], [8]),
    ]


def test_minibatches_hold_all_steps_of_k_prompts():
    steps = _prompt_batch()
    mbs = prompt_minibatches(steps, 2)
    assert mbs == [steps[:4], steps[4:]]
    assert prompt_minibatches(steps, 4) == [steps]
    assert [len(m) for m in prompt_minibatches(steps, 1)] == [3, 1, 2, 1]
    assert prompt_minibatches([], 3) == []


def test_padding_steps_do_not_count_as_prompts():
    steps = _prompt_batch()
    pad0, pad1 = make_padding_step(0), make_padding_step(1)
    with_pads = steps[:4] + [pad0] + steps[4:] + [pad1]
    mbs = prompt_minibatches(with_pads, 2)
    # The middle pad stays with the mini-batch it sits in; the trailing one joins the last.
    assert mbs == [steps[:4] + [pad0], steps[4:] + [pad1]]


def test_minibatch_prompt_count_not_a_multiple():
    with pytest.raises(StepwiseBatchError, match=r"4 prompts, which is not a multiple of prompts_per_minibatch=3"):
        prompt_minibatches(_prompt_batch(), 3)
    with pytest.raises(StepwiseBatchError, match="no real prompt"):
        prompt_minibatches([make_padding_step(0)], 1)
    with pytest.raises(ValueError, match="prompts_per_minibatch"):
        prompt_minibatches(_prompt_batch(), 0)


def test_minibatch_rejects_split_prompt_group():
    steps = _prompt_batch()
    steps.append(make_step("a", 2, [1], [9]))
    with pytest.raises(StepwiseBatchError, match=r"step 7 \(trajectory a#2\): field 'trajectory_id'"):
        prompt_minibatches(steps, 1)


# ---------------------------------------------------------------------- plan_microbatches


def test_plan_hand_computed():
    # Costs = lengths (no attention term). LPT: 5->r0, 3->r1, 3->r1, 2->r0, 1->r1: loads 7 / 7.
    # M = ceil(7 / 6) = 2 micro-batches per rank; worst-fit spreads each rank's rows.
    plan = plan_microbatches([5, 3, 3, 2, 1], dp_size=2, max_tokens=6, attention_weight=0.0)
    assert plan == [[[0], [3]], [[1, 4], [2]]]


def test_plan_exchange_beats_plain_greedy():
    # Longest-first greedy gives {3, 2, 2} / {3, 2} = 7 / 5; one swap makes it 6 / 6.
    plan = plan_microbatches([3, 3, 2, 2, 2], dp_size=2, max_tokens=100, attention_weight=0.0)
    assert sorted(sum([3, 3, 2, 2, 2][i] for mb in rank for i in mb) for rank in plan) == [6, 6]
    assert sorted(sorted(i for mb in rank for i in mb) for rank in plan) == [[0, 1], [2, 3, 4]]


def _rank_sets(plan):
    return sorted(sorted(i for mb in rank for i in mb) for rank in plan)


def test_plan_attention_term_changes_balance():
    lengths = [12, 6, 6, 4, 4, 4]
    # By tokens: 12->r0, 6->r1, 6->r1, 4->r0, 4->r1, 4->r0 = 20 / 16 (no single swap helps).
    by_tokens = plan_microbatches(lengths, dp_size=2, max_tokens=100, attention_weight=0.0)
    assert _rank_sets(by_tokens) == [[0, 3, 5], [1, 2, 4]]
    # With weight 1 the long row costs 12 + 144 = 156, the others 42, 42, 20, 20, 20:
    # it gets a rank of its own (156 / 144).
    costs = row_cost(lengths, 1.0)
    assert costs.tolist() == [156.0, 42.0, 42.0, 20.0, 20.0, 20.0]
    by_cost = plan_microbatches(lengths, dp_size=2, max_tokens=100, attention_weight=1.0)
    assert _rank_sets(by_cost) == [[0], [1, 2, 3, 4, 5]]


def test_plan_equal_micro_counts_with_empty_micro_batches():
    assert plan_microbatches([4], dp_size=2, max_tokens=10) == [[[0]], [[]]]
    assert plan_microbatches([], dp_size=3, max_tokens=10) == [[[]], [[]], [[]]]
    plan = plan_microbatches([9, 9, 9, 1], dp_size=2, max_tokens=10, attention_weight=0.0)
    assert [len(r) for r in plan] == [2, 2]


def test_plan_row_over_budget_names_row_and_numbers():
    with pytest.raises(StepwiseBatchError, match=r"row 1 has 7 tokens, more than max_tokens=6"):
        plan_microbatches([3, 7], dp_size=1, max_tokens=6)
    with pytest.raises(
        StepwiseBatchError, match=r"row 0 has 5 tokens \(8 after aligning to 4\), more than max_tokens=7"
    ):
        plan_microbatches([5, 3], dp_size=1, max_tokens=7, seq_align=4)


def test_plan_alignment_respects_budget():
    # Aligned to 4: [8, 4, 4]; micro_align 4 and max_tokens 10 leave 8 usable per micro-batch.
    plan = plan_microbatches([5, 3, 2], dp_size=1, max_tokens=10, seq_align=4, micro_align=4)
    assert plan == [[[0], [1, 2]]]


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dp_size"):
        plan_microbatches([1], dp_size=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        plan_microbatches([1], dp_size=1, max_tokens=0)
    with pytest.raises(ValueError, match=r"lengths\[1\] = -2 is negative"):
        plan_microbatches([1, -2], dp_size=1, max_tokens=4)


def test_plan_is_deterministic_across_input_types():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 500, 300)
    a = plan_microbatches(lengths, dp_size=4, max_tokens=2048)
    assert a == plan_microbatches(lengths.tolist(), dp_size=4, max_tokens=2048)
    assert a == plan_microbatches(torch.from_numpy(lengths), dp_size=4, max_tokens=2048)


def test_plan_falls_back_to_tighter_packing_before_adding_micro_batches():
    # 20 tokens, budget 10: two micro-batches are possible ({6, 4}, {5, 3, 2}) but worst-fit
    # (6, 5, 4->b1, 3->b0, 2 -> 11) overflows; best-fit finds them.
    plan = plan_microbatches([6, 5, 4, 3, 2], dp_size=1, max_tokens=10, attention_weight=0.0)
    assert plan == [[[0, 2], [1, 3, 4]]]
    # Rows just over half the budget: every row needs its own micro-batch.
    plan = plan_microbatches([6, 6, 6], dp_size=1, max_tokens=10)
    assert plan == [[[0], [1], [2]]]


def test_pad_to_multiple():
    assert pad_to_multiple(5, 4) == 8 and pad_to_multiple(8, 4) == 8 and pad_to_multiple(0, 4) == 0
    assert pad_to_multiple(np.array([1, 4, 5]), 4).tolist() == [4, 4, 8]
    assert pad_to_multiple(7, 1) == 7
    with pytest.raises(ValueError):
        pad_to_multiple(3, 0)


def test_plan_stats_hand_computed():
    lengths = [5, 3, 3, 2, 1]
    plan = [[[0], [3]], [[1, 4], [2]]]
    st = plan_stats(lengths, plan, attention_weight=0.0)
    assert st.real_tokens == 14 and st.packed_tokens == 14 and st.packed_efficiency == 1.0
    # Padded to the longest row of each micro-batch: 5 + 2 + 2*3 + 3 = 16.
    assert st.padded_tokens == 16 and st.padded_efficiency == pytest.approx(14 / 16)
    assert st.rank_tokens == [7, 7] and st.dp_balance == 1.0 and st.micro_per_rank == 2
    aligned = plan_stats(lengths, plan, micro_align=4)
    assert aligned.packed_tokens == 8 + 4 + 4 + 4
    # An empty micro-batch computes one dummy row of alignment tokens.
    st = plan_stats([4], [[[0]], [[]]], seq_align=2, micro_align=8)
    assert st.packed_tokens == 8 + 8 and st.empty_micro == 1 and st.dp_balance == pytest.approx(2.0)
