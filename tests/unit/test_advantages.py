"""Step-wise outcome advantages, checked against hand-computed values."""

import math

import pytest
import torch
from helpers import make_step

from megatron_stepwise import StepwiseBatchError, compute_advantages, make_padding_step
from megatron_stepwise.algo.advantages import get_estimator, list_estimators, register_estimator


def _batch():
    """Group 'a': three trajectories with 3, 1 and 2 steps; group 'b': one trajectory (singleton).

    Masks are right-aligned (trailing 0s: an appended EOS) and left-aligned (leading 0s), and
    every earlier step's mask differs from its trajectory's last step's mask. Padding rows sit
    in the middle and at the end. Intermediate steps carry rewards that must be ignored.
    """
    return [
        make_step("a", 0, mask=[1, 1, 0], last=False, reward=9.0),  # right-aligned
        make_step("a", 0, mask=[0, 0, 1, 1], last=False, reward=-9.0),  # left-aligned
        make_step("a", 0, mask=[1, 0], last=True, reward=1.0),
        make_step("a", 1, mask=[0, 1, 1, 1, 0], last=True, reward=0.0),
        make_step("a", 2, mask=[0, 1], last=False),
        make_step("a", 2, mask=[1, 1, 1], last=True, reward=1.0),
        make_padding_step(0),
        make_step("b", 0, mask=[1, 1], last=False),
        make_step("b", 0, mask=[0, 1], last=True, reward=5.0),
        make_padding_step(1),
    ]


# Group a rewards (trajectory outcomes): [1, 0, 1]; mean 2/3; unbiased var = ((1/3)^2*2 + (2/3)^2)/2 = 1/3.
MEAN = 2 / 3
STD = math.sqrt(1 / 3)
HAND = {
    "grpo": [(1 - MEAN) / (STD + 1e-6), (0 - MEAN) / (STD + 1e-6), (1 - MEAN) / (STD + 1e-6)],
    "dr_grpo": [1 - MEAN, 0 - MEAN, 1 - MEAN],
    "rloo": [1 - 0.5, 0 - 1.0, 1 - 0.5],  # r minus the mean of the other two
    "maxrl": [(1 - MEAN) / (MEAN + 1e-6), (0 - MEAN) / (MEAN + 1e-6), (1 - MEAN) / (MEAN + 1e-6)],
}


@pytest.mark.parametrize("estimator", sorted(HAND))
def test_outcome_estimators_broadcast_each_steps_own_mask(estimator):
    steps = _batch()
    metrics = {}
    adv = compute_advantages(steps, estimator, metrics=metrics)
    a0, a1, a2 = HAND[estimator]
    expected = [
        [a0, a0, 0],
        [0, 0, a0, a0],
        [a0, 0],
        [0, a1, a1, a1, 0],
        [0, a2],
        [a2, a2, a2],
        [],
        [0, 0],  # singleton group 'b': no baseline -> 0
        [0, 0],
        [],
    ]
    assert len(adv) == len(steps)
    for i, (got, want) in enumerate(zip(adv, expected)):
        assert got.dtype == torch.float32
        assert got.shape == (len(want),), f"step {i}"
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float32), atol=1e-6), f"step {i}: {got} != {want}"
    assert metrics == {
        "num_trajectories": 4,
        "num_groups": 2,
        "singleton_groups": 1,
        "zero_variance_groups": 0,
        "invalid_trajectories": 0,
    }


def test_broadcast_uses_own_mask_not_last_steps_mask():
    """The PR 1507 bug: copying the last step's masked tensor would zero step 0's first tokens."""
    steps = _batch()
    adv = compute_advantages(steps, "dr_grpo")
    own = steps[0].loss_mask.bool()
    assert (adv[0][own] != 0).all()
    # The bug would place values on the last step's mask pattern, which here differs.
    last_mask = steps[2].loss_mask.tolist() + [0]
    assert adv[0].ne(0).long().tolist() != last_mask
    # Left-aligned step: leading zeros stay zero, trailing trained tokens get the value.
    assert adv[1].tolist()[:2] == [0.0, 0.0] and (adv[1][2:] != 0).all()


def test_padding_steps_do_not_enter_group_statistics():
    # With padding given prompt_id of a real group it would still be excluded by is_padding.
    base = [make_step("g", 0, mask=[1], last=True, reward=1.0), make_step("g", 1, mask=[1], last=True, reward=0.0)]
    with_pad = base[:1] + [make_padding_step(0)] + base[1:] + [make_padding_step(1)]
    a = compute_advantages(base, "grpo")
    b = compute_advantages(with_pad, "grpo")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[2])
    assert b[1].numel() == 0 and b[3].numel() == 0


def test_zero_variance_and_singleton_metrics():
    steps = [
        make_step("z", 0, mask=[1], last=True, reward=1.0),
        make_step("z", 1, mask=[1, 1], last=True, reward=1.0),
        make_step("s", 0, mask=[1], last=True, reward=1.0),
    ]
    m = {}
    adv = compute_advantages(steps, "grpo", metrics=m)
    assert all(float(a.abs().sum()) == 0 for a in adv)
    assert m["zero_variance_groups"] == 1 and m["singleton_groups"] == 1 and m["num_groups"] == 2


def test_temporal_estimators_refused_on_multi_step_trajectories():
    for name in ("gae", "reinforce++"):
        with pytest.raises(StepwiseBatchError, match=r"algo.estimator=.*temporal.*a#0 has 3 steps"):
            compute_advantages(_batch(), name)


def test_reinforce_pp_on_single_step_trajectories():
    steps = [
        make_step("p", 0, mask=[1, 1, 0], last=True, reward=1.0),
        make_step("p", 1, mask=[0, 1], last=True, reward=0.0),
        make_padding_step(0),
    ]
    adv = compute_advantages(steps, "reinforce++", gamma=0.5)
    # Returns at trained tokens: step 0 -> [0.5, 1.0], step 1 -> [0.0]; whitened over the three.
    r = torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64)
    w = ((r - r.mean()) / (r.std() + 1e-6)).float()
    assert torch.allclose(adv[0], torch.tensor([w[0], w[1], 0.0]), atol=1e-6)
    assert torch.allclose(adv[1], torch.tensor([0.0, w[2]]), atol=1e-6)
    assert adv[2].numel() == 0


def test_gae_needs_a_critic():
    with pytest.raises(StepwiseBatchError, match="critic"):
        compute_advantages([make_step("p", 0, mask=[1], last=True)], "gae")


def test_malformed_trajectories_are_named():
    with pytest.raises(StepwiseBatchError, match=r"step 1: field 'is_last_step'.*no step marked last"):
        compute_advantages([make_step("p", 0, mask=[1], last=True), make_step("q", 0, mask=[1], last=False)])
    with pytest.raises(StepwiseBatchError, match=r"step 1: .*continues after its last step \(step 0\)"):
        compute_advantages([make_step("p", 0, mask=[1], last=True), make_step("p", 0, mask=[1], last=True)])
    with pytest.raises(StepwiseBatchError, match=r"algo.estimator='nope'.*known: .*grpo"):
        compute_advantages([make_step("p", 0, mask=[1], last=True)], "nope")


def test_registry_accepts_user_estimators():
    @register_estimator("test_rank")
    def rank(rewards, group, *, eps, scale=1.0):
        return scale * (rewards - rewards.min())

    assert "test_rank" in list_estimators() and get_estimator("test_rank") is rank
    steps = [make_step("p", 0, mask=[1, 0], last=True, reward=2.0), make_step("p", 1, mask=[1], last=True, reward=5.0)]
    adv = compute_advantages(steps, "test_rank", scale=2.0)
    assert adv[0].tolist() == [0.0, 0.0] and adv[1].tolist() == [6.0]
