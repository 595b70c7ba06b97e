"""A run whose iterations train nothing stops with a named error instead of exiting 0."""

import logging

import pytest

from megatron_stepwise.metrics.starvation import NothingTrained, StarvationWatch

CONTEXT_LIMITED = {"stop_reason/context_limit": 1.0, "train/optimizer_steps": 0}
FILTERED = {"stop_reason/stop": 1.0, "train/optimizer_steps": 0}
TRAINED = {"stop_reason/stop": 0.5, "stop_reason/context_limit": 0.5, "train/optimizer_steps": 2}


@pytest.mark.parametrize(
    "metrics,words",
    [(CONTEXT_LIMITED, ["context_limit", "rollout.max_input_length=16"]), (FILTERED, ["algo.filters"])],
    ids=["context_limit", "nothing_trainable"],
)
def test_iterations_that_train_nothing_stop_the_run_naming_the_cause(caplog, metrics, words):
    watch = StarvationWatch(max_input_length=16, patience=3)
    with caplog.at_level(logging.WARNING):
        watch.observe(0, dict(metrics))
        watch.observe(1, dict(metrics))
        with pytest.raises(NothingTrained) as e:
            watch.observe(2, dict(metrics))
    message = str(e.value)
    assert "iterations 0-2" in message and all(w in message for w in words) and "\n" not in message
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # one warning, at the first


def test_a_trained_iteration_resets_the_count():
    watch = StarvationWatch(max_input_length=16, patience=2)
    for it, metrics in enumerate([CONTEXT_LIMITED, TRAINED, CONTEXT_LIMITED, TRAINED, FILTERED, TRAINED]):
        watch.observe(it, dict(metrics))  # never two idle iterations in a row
    with pytest.raises(NothingTrained):
        watch.observe(6, dict(FILTERED)) or watch.observe(7, dict(CONTEXT_LIMITED))


def test_the_trainer_consults_the_watch_and_train_exits_2_on_it():
    """The hooks: the loop observes every iteration, `train` treats the error as the user's (exit 2:
    cli/main.py ends every UserError so)."""
    import inspect

    from megatron_stepwise.errors import UserError
    from megatron_stepwise.loop.trainer import Trainer

    assert "self.starvation.observe(" in inspect.getsource(Trainer.run)
    assert issubclass(NothingTrained, UserError)


def test_max_idle_iterations_zero_never_stops_the_run(caplog):
    watch = StarvationWatch(max_input_length=16, patience=0)  # trainer.max_idle_iterations=0
    with caplog.at_level(logging.WARNING):
        for it in range(10):
            watch.observe(it, dict(FILTERED))
    assert len(watch.idle) == 10
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
