"""The route/log-prob pairing of trained tokens (algo/route_pairing.py): carried by steps, merge
and dumps, checked by `replay`, which names every mismatching row and token.

Synthetic steps whose forward ids are known: a token at row position q was sampled from the
forward with id 100 + q (its log-prob), and that forward computed the route of position q - 1.
"""

import pytest
import torch

from megatron_stepwise.algo.merge import merge_steps
from megatron_stepwise.algo.route_pairing import check_route_pairing
from megatron_stepwise.algo.validate import validate_steps
from megatron_stepwise.cli.main import main as cli
from megatron_stepwise.rundir.dump_table import dump_path
from megatron_stepwise.rundir.dumps import Captured, read_dump, write_dump
from megatron_stepwise.steps import Step, StepBatch, StepwiseBatchError, TrajectoryID

L, K = 2, 2


def paired_step(prompt, response, *, last, reported=None) -> Step:
    """A step whose engine ran positions [0, reported) (default: all but the last token)."""
    n = len(prompt) + len(response)
    reported = n - 1 if reported is None else reported
    routes = torch.full((n,), -1, dtype=torch.long)
    routes[:reported] = 100 + torch.arange(1, reported + 1)  # position p's route: forward 100 + p + 1
    return Step(
        trajectory_id=TrajectoryID("a", 0),
        prompt_ids=prompt,
        response_ids=response,
        loss_mask=[1] * len(response),
        rollout_logprobs=[-0.5] * len(response),
        is_last_step=last,
        routed_experts=torch.zeros(n, L, K, dtype=torch.int16),
        route_forwards=routes,
        logprob_forwards=100 + torch.arange(len(prompt), n),  # the token at q: forward 100 + q
    )


def test_paired_steps_pass_and_a_rewritten_route_is_named():
    s = paired_step([1, 2, 3], [4, 5, 6], last=True)
    batch = StepBatch.from_steps([s])
    pairing = check_route_pairing(batch)
    assert pairing.ok and pairing.checked == 3 and pairing.unknown == 0
    s.route_forwards[3] = 999  # a recompute re-recorded the route of position 3 (token 1's)
    pairing = check_route_pairing(StepBatch.from_steps([s]))
    assert pairing.total_mismatches == 1 and pairing.mismatches == [(0, 1, 104, 999)]


def test_steps_without_provenance_count_as_unknown_not_as_mismatches():
    s = paired_step([1, 2], [3, 4], last=True)
    s.route_forwards = s.logprob_forwards = None
    pairing = check_route_pairing(StepBatch.from_steps([s]))
    assert pairing.ok and pairing.checked == 0 and pairing.unknown == 2


def test_merge_gives_each_turns_positions_the_routes_of_its_own_forwards():
    # turn 1's prompt is exactly turn 0's prompt + response, and turn 0 ran its last token (an
    # engine that feeds it): position 5 was computed by both turns; turn 1's first token was
    # sampled from turn 1's forward of it. Earliest-reported would pair it with turn 0's.
    first = paired_step([1, 2, 3], [4, 5, 6], last=False, reported=6)
    second = paired_step([1, 2, 3, 4, 5, 6], [7, 8], last=True)
    second.route_forwards[:6] += 1000  # turn 1 recomputed the history: other forwards
    second.logprob_forwards[:] += 1000
    second.route_forwards[6:7] += 1000
    assert check_route_pairing(StepBatch.from_steps([first, second])).ok
    (row,), _ = merge_steps([first, second])
    assert row.metadata["merged_steps"] == 2
    assert row.route_forwards[:5].tolist() == (100 + torch.arange(1, 6)).tolist()  # turn 0's own, kept
    assert int(row.route_forwards[5]) == 1106  # turn 1's: its first token's logits came from there
    pairing = check_route_pairing(StepBatch.from_steps([row]))
    assert pairing.ok and pairing.checked == 5


def test_validation_names_a_provenance_field_of_the_wrong_length():
    s = paired_step([1, 2], [3, 4], last=True)
    s.route_forwards = s.route_forwards[:3]
    with pytest.raises(StepwiseBatchError, match=r"step 0 .*'route_forwards' has 3 positions but the step has 4"):
        validate_steps([s])
    s = paired_step([1, 2], [3, 4], last=True)
    s.logprob_forwards = s.logprob_forwards[:1]
    with pytest.raises(StepwiseBatchError, match=r"'logprob_forwards' has length 1 but response_ids has length 2"):
        validate_steps([s])


def _dump(tmp_path, steps, iteration=2):
    batch = StepBatch.from_steps(steps)
    write_dump(
        dump_path(tmp_path, iteration),
        [Captured(batch, [{"turn": 0}] * batch.num_rows)],
        iteration=iteration,
        weight_version=iteration,
        config={},
        train_metrics=[],
    )
    return batch


def test_a_dump_carries_the_pairing_bit_for_bit(tmp_path):
    plain = paired_step([1, 2], [3, 4], last=True)
    plain.trajectory_id = TrajectoryID("b", 0)
    plain.route_forwards = plain.logprob_forwards = None  # a row without provenance: -1 in the batch
    batch = _dump(tmp_path, [paired_step([1, 2, 3], [4, 5], last=True), plain])
    (got,) = read_dump(tmp_path, 2).minibatches
    for key in ("route_forwards", "logprob_forwards"):
        assert got.token_fields[key].dtype == torch.long and torch.equal(got.token_fields[key], batch.token_fields[key])
    assert check_route_pairing(got).checked == 2


def test_replay_refuses_a_dump_whose_routes_and_logprobs_come_from_different_forwards(tmp_path, capsys):
    bad = paired_step([1, 2, 3], [4, 5, 6], last=True)
    bad.route_forwards[4] = 7  # the route of position 4, before response token 2
    _dump(tmp_path, [bad])
    # (--trust-dump-code only keeps this process's Hugging Face settings as they are; the check
    # comes before anything the flag governs)
    assert cli(["replay", str(tmp_path), "--iteration", "2", "--trust-dump-code"]) == 1
    err = capsys.readouterr().err
    assert "iteration 2: 1 of 3 trained tokens have a route and a log-prob from different engine forward passes" in err
    assert "mini-batch 0, row 0 (trajectory a#0), response token 2: its log-prob came from forward 105" in err
    assert "Traceback" not in err
