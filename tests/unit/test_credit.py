"""Turn-level credit: unbiased against the exact gradient of a tabular task, bit-exact reductions
to the outcome estimators, and merged rows carrying each turn's own advantage (docs/credit.md)."""

import pytest
import torch
from helpers import make_step
from oracles import per_turn_index_normalised

from megatron_stepwise import (
    StepwiseBatchError,
    compute_advantages,
    make_padding_step,
    merge_steps,
    merge_with_advantages,
)
from megatron_stepwise.algo.advantages import get_estimator, rloo
from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.algo.prepare import prepare
from megatron_stepwise.algo.turn_credit import DISCOUNT_BASES, returns_to_go
from megatron_stepwise.envs.credit_task import (
    KeyTurnTask,
    exact_gradient,
    expected_update,
    sampled_gradients,
    trajectory_probs,
)

TASK = KeyTurnTask(max_turns=3, key_turn=1, key_bonus=1.0, filler_reward=0.2)
# A fixed policy that stops, takes the key action and fillers with clearly different odds per turn.
THETA = torch.tensor([[-0.5, 0.3, 0.6], [0.2, 0.1, 0.4], [0.0, -0.3, 0.5]], dtype=torch.float64)
GROUPS, GROUP_SIZE = 5000, 4  # 20,000 sampled trajectories per estimator
EPS = 1e-6


def _total(actions, lengths, rewards):
    return rewards.sum(1)


def _turn(name, **options):
    fn = get_estimator(name)
    if name != "turn_state_rloo":
        return lambda r, lengths, g, states: fn(r, lengths, g, eps=EPS, **options)
    return lambda r, lengths, g, states: fn(r, lengths, g, eps=EPS, states=states, **options)


def _outcome_rloo(r, lengths, g, states):
    return rloo(r.sum(1), g, eps=EPS)[:, None].expand(-1, r.size(1))


# name -> (estimator, the expected update it is documented to be unbiased for)
UNBIASED = {
    "rloo (outcome broadcast)": (_outcome_rloo, lambda: exact_gradient(TASK, THETA, _total)),
    "turn_rloo": (_turn("turn_rloo"), lambda: exact_gradient(TASK, THETA, _total)),
    "turn_state_rloo": (_turn("turn_state_rloo"), lambda: exact_gradient(TASK, THETA, _total)),
    "turn_dr_grpo": (
        _turn("turn_dr_grpo"),
        lambda: exact_gradient(TASK, THETA, _total) * (GROUP_SIZE - 1) / GROUP_SIZE,
    ),
    "turn_rloo gamma 0.8": (
        _turn("turn_rloo", gamma=0.8),
        lambda: expected_update(TASK, THETA, lambda r, lengths: returns_to_go(r, 0.8)),
    ),
    "turn_discount gamma 0.8": (
        _turn("turn_discount", gamma=0.8, base="rloo"),
        lambda: exact_gradient(TASK, THETA, lambda a, lengths, r: r.sum(1) * 0.8 ** (lengths - 1.0)),
    ),
}


def _z_scores(estimator, target, seed=0):
    """(mean - target) / standard error, per parameter, over GROUPS independent group estimates."""
    per_group = sampled_gradients(TASK, THETA, estimator, GROUPS, GROUP_SIZE, torch.Generator().manual_seed(seed))
    se = per_group.std(0) / GROUPS**0.5
    return (per_group.mean(0) - target) / se


def test_enumeration_is_a_distribution_and_sampling_matches_it():
    actions, lengths = TASK.enumerate()
    probs = trajectory_probs(THETA, actions, lengths)
    assert len(actions) == len({tuple(a[:n].tolist()) for a, n in zip(actions, lengths)})
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-12)
    sampled, sampled_lengths = TASK.sample(THETA, 20000, torch.Generator().manual_seed(1))
    mean_total = float(TASK.turn_rewards(sampled, sampled_lengths).sum(1).mean())
    exact_total = float((probs * TASK.turn_rewards(actions, lengths).sum(1)).sum())
    assert mean_total == pytest.approx(exact_total, abs=0.02)  # sd of the total < 0.7, so 0.02 is > 4 SE


@pytest.mark.parametrize("name", sorted(UNBIASED))
def test_documented_unbiased_estimators_match_the_exact_gradient(name):
    estimator, target = UNBIASED[name]
    z = _z_scores(estimator, target())
    assert bool((z.abs() < 3).all()), f"{name}: z-scores per parameter {z}"


def test_per_turn_index_normalisation_is_biased_when_the_policy_stops():
    """The naive oracle fails the same test, and by far: each extra turn costs the intermediate
    rewards' group mean, a hidden penalty on continuing."""
    z = _z_scores(
        lambda r, lengths, g, states: per_turn_index_normalised(r, lengths, g), exact_gradient(TASK, THETA, _total)
    )
    assert float(z.abs().max()) > 10, f"z-scores per parameter {z}"


def _variable_length_groups(intermediate):
    """Two groups of four trajectories with 1-3 turns; intermediate turns carry `intermediate`."""
    steps = []
    lengths = {("a", 0): 3, ("a", 1): 1, ("a", 2): 2, ("a", 3): 3, ("b", 0): 2, ("b", 1): 2, ("b", 2): 1, ("b", 3): 3}
    outcomes = [0.7, 0.1, 1.3, -0.4, 0.9, 0.9, 0.25, 0.6]
    for (pid, k), outcome in zip(lengths, outcomes):
        n = lengths[(pid, k)]
        for t in range(n):
            last = t == n - 1
            steps.append(make_step(pid, k, mask=[1, 0, 1][: t + 1], last=last, reward=outcome if last else 0.0))
            steps[-1].turn_reward = 0.0 if last else intermediate
    return steps


@pytest.mark.parametrize("outcome_name", ["rloo", "grpo", "dr_grpo"])
def test_return_to_go_estimators_reduce_bit_exactly_to_their_outcome_estimator(outcome_name):
    steps = _variable_length_groups(intermediate=0.0)
    expected = compute_advantages(steps, outcome_name)
    got = compute_advantages(steps, f"turn_{outcome_name}", gamma=1.0)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    # With intermediate rewards, turns of one trajectory get different advantages.
    shaped = compute_advantages(_variable_length_groups(intermediate=0.3), f"turn_{outcome_name}")
    assert not all(torch.equal(g, e) for g, e in zip(shaped, expected))


@pytest.mark.parametrize("base", DISCOUNT_BASES)
def test_turn_discount_reduces_bit_exactly_at_gamma_1(base):
    steps = _variable_length_groups(intermediate=0.0)
    got = compute_advantages(steps, "turn_discount", gamma=1.0, base=base)
    assert all(torch.equal(g, e) for g, e in zip(got, compute_advantages(steps, base)))


def test_turn_rloo_hand_computed():
    """Group of three: rewards per turn [0.5, 1] / [2] / [0.5, 0.5, 0]; outcome = their sum."""
    steps = [
        make_step("g", 0, mask=[1], last=False),
        make_step("g", 0, mask=[1, 1], last=True, reward=1.5),
        make_step("g", 1, mask=[1], last=True, reward=2.0),
        make_step("g", 2, mask=[1], last=False),
        make_step("g", 2, mask=[1], last=False),
        make_step("g", 2, mask=[1], last=True, reward=1.0),
    ]
    for i, r in [(0, 0.5), (3, 0.5), (4, 0.5)]:
        steps[i].turn_reward = r
    # Held returns-to-go per turn index: traj 0 [1.5, 1, 1], traj 1 [2, 2, 2], traj 2 [1, 0.5, 0].
    expected = [1.5 - 1.5, 1 - 1.25, 2 - 1.25, 1 - 1.75, 0.5 - 1.5, 0 - 1.5]
    got = compute_advantages(steps, "turn_rloo")
    assert [float(a[0]) for a in got] == pytest.approx(expected)
    assert got[1].tolist() == pytest.approx([expected[1]] * 2)  # the step's own mask


def _prefix_trajectory(pid, k, turn_rewards, outcome):
    steps, prompt = [], [1, 2]
    for t, r in enumerate(turn_rewards):
        resp = [10 + t, 20 + t]
        last = t == len(turn_rewards) - 1
        steps.append(make_step(pid, k, prompt, resp, [1, 1], last=last, reward=outcome if last else 0.0))
        steps[-1].turn_reward = r
        prompt = prompt + resp + [5]  # observation
    return steps


def test_merged_rows_carry_each_turns_own_advantage():
    steps = (
        _prefix_trajectory("p", 0, [0.5, 0.4, 0.0], 1.7)
        + _prefix_trajectory("p", 1, [0.0, 1.0], 1.0)
        + _prefix_trajectory("p", 2, [0.3, 0.0, 0.0], 0.3)
    )
    per_step = compute_advantages(steps, "turn_rloo")
    rows, merged, stats = merge_with_advantages(steps, per_step)
    assert stats.rows_after == 3
    row = rows[0]  # response: r0 (2), obs (1), r1 (2), obs (1), r2 (2)
    a = [float(per_step[i][0]) for i in range(3)]
    assert len(set(a)) == 3
    assert merged[0].tolist() == pytest.approx([a[0], a[0], 0, a[1], a[1], 0, a[2], a[2]])
    assert row.loss_mask.tolist() == [1, 1, 0, 1, 1, 0, 1, 1]
    # prepare() (what the trainer runs) gives the merged batch exactly these advantages.
    batch, _ = prepare(groups_of(steps), estimator="turn_rloo", merge_steps=True)
    unmerged, _ = prepare(groups_of(steps), estimator="turn_rloo", merge_steps=False)
    trained = lambda b: b.token_fields["advantages"][b.token_fields["loss_mask"] == 1]  # noqa: E731
    assert batch.num_rows == 3 and torch.equal(trained(batch), trained(unmerged))
    # Outcome estimators: advantages before merging equal advantages of the merged rows (the old order).
    rows, _ = merge_steps(steps)
    batch, _ = prepare(groups_of(steps), estimator="grpo", merge_steps=True)
    assert torch.equal(
        batch.token_fields["advantages"],
        torch.cat(
            [x for r, a in zip(rows, compute_advantages(rows, "grpo")) for x in (torch.zeros(r.prompt_ids.numel()), a)]
        ),
    )


def test_turn_estimators_refuse_merged_rows_naming_the_step():
    rows, _ = merge_with_advantages(
        _prefix_trajectory("p", 0, [0.5, 0.0], 1.0) + _prefix_trajectory("p", 1, [0.0, 0.0], 0.0), [torch.zeros(2)] * 4
    )[::2]
    with pytest.raises(StepwiseBatchError, match=r"step 0: field 'metadata.merged_steps'.*turn_rloo.*before merge"):
        compute_advantages(rows, "turn_rloo")


@pytest.mark.parametrize(
    "options, key",
    [
        ({"gamma": 0.0}, "gamma"),
        ({"gamma": 1.5}, "gamma"),
        ({"gamma": "high"}, "gamma"),
        ({"base": "reinforce++"}, "base"),
    ],
)
def test_bad_turn_options_are_one_clear_error(options, key):
    steps = _variable_length_groups(intermediate=0.0)
    with pytest.raises(StepwiseBatchError, match=rf"algo.estimator_options.{key}="):
        compute_advantages(steps, "turn_discount", **options)


def test_padding_and_singleton_groups_get_zero_and_change_nothing():
    steps = _variable_length_groups(intermediate=0.4)
    base = compute_advantages(steps, "turn_rloo")
    single = [make_step("solo", 0, mask=[1], last=False), make_step("solo", 0, mask=[1, 1], last=True, reward=3.0)]
    single[0].turn_reward = 1.0
    got = compute_advantages(steps[:5] + [make_padding_step(0)] + steps[5:] + single, "turn_rloo")
    assert all(torch.equal(g, b) for g, b in zip(got[:5] + got[6:-2], base))
    assert got[5].numel() == 0 and all(not bool(a.any()) for a in got[-2:])
    assert compute_advantages([], "turn_rloo") == []


def test_turn_state_rloo_baselines_a_turn_with_other_trajectories_at_the_same_state():
    """Trajectories 0 and 1 reach the same second prompt (same history); trajectory 2 does not.
    At a shared state the baseline is the others' return there; elsewhere turn_rloo's."""
    t0 = _prefix_trajectory("g", 0, [0.5, 0.0], 2.5)  # G = [2.5, 2.0]
    t1 = _prefix_trajectory("g", 1, [0.5, 0.0], 1.5)  # same prompts as t0: G = [1.5, 1.0]
    t2 = _prefix_trajectory("g", 2, [0.0], 0.25)  # one turn: G = [0.25]
    t2[0].prompt_ids = torch.tensor([1, 3])  # another first state
    got = [float(a[0]) for a in compute_advantages(t0 + t1 + t2, "turn_state_rloo")]
    # turn 0: t0 and t1 share a state: 2.5 - 1.5 and 1.5 - 2.5; t2 alone: turn_rloo's 0.25 - (2.5 + 1.5) / 2
    # turn 1: t0 and t1 share a state: 2.0 - 1.0 and 1.0 - 2.0
    assert got == pytest.approx([1.0, 1.0, -1.0, -1.0, 0.25 - 2.0])
    # An environment's state key wins over the prompt: one key for every turn groups them all.
    for s in t0 + t1 + t2:
        s.metadata["state_key"] = "same"
    got = [float(a[0]) for a in compute_advantages(t0 + t1 + t2, "turn_state_rloo")]
    # t0 turn 0: the other trajectories' turns at "same": t1's 1.5, 1.0 and t2's 0.25
    assert got[0] == pytest.approx(2.5 - (1.5 + 1.0 + 0.25) / 3)
