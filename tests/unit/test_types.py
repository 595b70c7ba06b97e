import pytest
import torch
from helpers import make_step

from megatron_stepwise import Step, StepBatch, StepwiseBatchError, TrajectoryID, make_padding_step


def test_trajectory_id_is_frozen_and_hashable():
    a, b = TrajectoryID("p", 1), TrajectoryID("p", 1)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(Exception):
        a.sample_index = 2  # type: ignore[misc]


def test_step_normalises_to_tensors_and_rejects_bad_types():
    s = make_step("p", 0, [1, 2], [3, 4], [1, 0], lp=[-0.5, -1.0])
    assert s.prompt_ids.dtype == torch.long and s.rollout_logprobs.dtype == torch.float32
    assert s.num_tokens == 4 and s.num_trainable == 1
    with pytest.raises(StepwiseBatchError, match="response_ids"):
        make_step("p", 0, [1], ["a"], [1])
    with pytest.raises(StepwiseBatchError, match="trajectory_id"):
        Step("p#0", [1], [2], [1])  # type: ignore[arg-type]


def test_padding_step_is_loss_neutral():
    p = make_padding_step(3)
    assert p.is_padding and p.is_last_step and p.num_trainable == 0
    assert p.trajectory_id != make_padding_step(4).trajectory_id


def test_step_batch_round_trip_and_select():
    steps = [
        make_step("a", 0, [1, 2], [3], [1], last=False, lp=[-0.1]),
        make_step("a", 0, [1, 2, 3, 9], [4, 5], [1, 0], reward=1.0, lp=[-0.2, -0.3]),
        make_step("b", 0, [7], [8, 8, 8], [1, 1, 1], reward=0.5),
    ]
    steps[0].turn_reward = 0.25  # the environment's reward for that turn alone
    batch = StepBatch.from_steps(steps)
    assert batch.num_rows == 3
    assert batch.offsets.tolist() == [0, 3, 9, 13]
    assert batch.tokens.tolist() == [1, 2, 3, 1, 2, 3, 9, 4, 5, 7, 8, 8, 8]
    assert batch.token_fields["loss_mask"].tolist() == [0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1]
    assert batch.row_fields["traj_index"].tolist() == [0, 0, 1]
    assert batch.row_fields["group_index"].tolist() == [0, 0, 1]
    back = batch.to_steps()
    for x, y in zip(steps, back):
        assert x.prompt_ids.tolist() == y.prompt_ids.tolist()
        assert x.response_ids.tolist() == y.response_ids.tolist()
        assert x.loss_mask.tolist() == y.loss_mask.tolist()
        assert x.reward == y.reward and x.is_last_step == y.is_last_step
        assert x.turn_reward == y.turn_reward
    assert [s.turn_reward for s in back] == [0.25, 0.0, 0.0]
    sub = batch.select([2, 0])
    assert sub.to_steps()[1].turn_reward == 0.25
    assert sub.tokens.tolist() == [7, 8, 8, 8, 1, 2, 3]
    assert sub.trajectory_ids == [TrajectoryID("b", 0), TrajectoryID("a", 0)]
    assert sub.token_fields["rollout_logprobs"][-1].item() == pytest.approx(-0.1)


def test_unknown_rollout_logprobs_are_marked_unknown_not_zero():
    tid = TrajectoryID("p", 0)
    steps = [
        Step(tid, [1, 2], [3, 4], [1, 1], rollout_logprobs=[0.0, -0.5]),  # a known log-prob of 0 is real
        Step(tid, [1, 2, 3, 4, 9], [5, 6], [1, 0], is_last_step=True),  # the engine reported none
    ]
    batch = StepBatch.from_steps(steps)
    known = batch.rollout_logprobs_known()
    assert known.tolist() == [False, False, True, True, False, False, False, False, False, False, False]
    assert batch.first_row_without_rollout_logprobs() == 1
    back = batch.to_steps()
    assert back[0].rollout_logprobs.tolist() == [0.0, -0.5]
    assert back[1].rollout_logprobs is None
    assert batch.select([1, 0]).first_row_without_rollout_logprobs() == 0
    assert batch.select([0]).first_row_without_rollout_logprobs() is None


def test_response_fields_are_set_and_read_per_step_response():
    tid = TrajectoryID("p", 0)
    batch = StepBatch.from_steps(
        [
            Step(tid, [5, 6], [7, 8, 9], [1, 1, 0]),
            Step(tid, [1], [2, 3], [0, 1]),
            Step(tid, [4, 4, 4], [], [], is_last_step=True),
        ]
    )
    batch.set_response_field("advantages", [torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, -1.0]), torch.zeros(0)])
    adv = batch.token_fields["advantages"]
    assert adv.dtype == torch.float32
    assert adv.tolist() == [0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0]  # 0 at prompt positions
    assert [v.tolist() for v in batch.response_values(adv)] == [[0.5, 0.5, 0.0], [0.0, -1.0], []]
    batch.set_response_field("ids", [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.zeros(0)], dtype=torch.long)
    assert batch.token_fields["ids"].dtype == torch.long
    with pytest.raises(StepwiseBatchError, match=r"field 'x': got 2 tensors for 3 steps"):
        batch.set_response_field("x", [torch.zeros(3), torch.zeros(2)])
    with pytest.raises(StepwiseBatchError, match=r"step 1: field 'x' has 1 values for 2 response tokens"):
        batch.set_response_field("x", [torch.zeros(3), torch.zeros(1), torch.zeros(0)])
