"""A diverging run stops itself: the first non-finite loss or grad norm of a step, named."""

import math

import pytest

from megatron_stepwise.loop.divergence import RunDiverged, check_finite

GOOD = {"loss": 0.5, "pg_loss": 0.5, "grad_norm": 1.2, "update_successful": 1.0, "entropy": 2.0}


def test_finite_steps_pass():
    check_finite(GOOD, iteration=3, clip_grad=1.0)


@pytest.mark.parametrize(
    "name,value", [("loss", math.nan), ("pg_loss", math.inf), ("grad_norm", math.nan), ("grad_norm", -math.inf)]
)
def test_a_non_finite_loss_or_grad_norm_is_one_error_naming_it(name, value):
    with pytest.raises(RunDiverged, match=rf"train/{name} is {value} at iteration 7;.*optim.lr") as e:
        check_finite({**GOOD, name: value}, iteration=7, clip_grad=1.0)
    assert "\n" not in str(e.value)


def test_the_loss_is_named_before_the_grad_norm_it_caused():
    with pytest.raises(RunDiverged, match="train/loss is nan"):
        check_finite({**GOOD, "grad_norm": math.nan, "loss": math.nan}, iteration=0, clip_grad=1.0)


def test_not_computed_grad_norms_and_skipped_steps_are_not_divergence():
    # clip_grad=0: Megatron computes no norm (reported as NaN); an inf one is still divergence
    check_finite({**GOOD, "grad_norm": math.nan}, iteration=0, clip_grad=0.0)
    with pytest.raises(RunDiverged):
        check_finite({**GOOD, "grad_norm": math.inf}, iteration=0, clip_grad=0.0)
    # fp16 loss scaling skipped the step: no weight changed
    check_finite(
        {**GOOD, "loss": math.inf, "grad_norm": math.nan, "update_successful": 0.0}, iteration=0, clip_grad=1.0
    )
    # other metrics are not watched (a max-type metric may legitimately be inf)
    check_finite({**GOOD, "logprob_gap_max": math.inf}, iteration=0, clip_grad=1.0)


def test_a_divergence_at_the_first_step_after_a_resume_blames_the_checkpoint_not_advises_it():
    with pytest.raises(RunDiverged) as e:
        check_finite({**GOOD, "loss": math.nan}, iteration=12, clip_grad=1.0, resumed_from=12)
    msg = str(e.value)
    assert "first step after resuming from the checkpoint of iteration 12" in msg
    assert "checkpoint.load_optimizer=false" in msg and "resume from the last checkpoint" not in msg
    with pytest.raises(RunDiverged, match="resume from the last checkpoint"):  # later on, the old advice holds
        check_finite({**GOOD, "loss": math.nan}, iteration=14, clip_grad=1.0, resumed_from=12)
