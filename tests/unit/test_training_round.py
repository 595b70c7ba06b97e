"""`TrainingRound` (loop/training_round.py): the round the trainer and the offline replay both run:
score every shard from the round's one policy snapshot, then one optimizer step per shard and
epoch, each checked."""

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest

import megatron_stepwise
from megatron_stepwise.loop.training_round import TrainingRound


class FakePlugin:
    """Records the plugin calls a round makes, in order; a step's loss is its position."""

    def __init__(self, log):
        self.log = log

    def compute_logprobs_flat(self, chunks, shard):
        self.log.append(("logprobs", chunks, shard.name))
        return f"{chunks}:{shard.name}"

    def train_minibatch(self, chunks, optimizer, shard, *, lr_scheduler=None):
        assert (chunks, optimizer, lr_scheduler) == ("policy", "opt", "sched")
        self.log.append(("step", shard.name, dict(shard.token_fields)))
        return {"loss": float(sum(1 for e in self.log if e[0] == "step"))}


def _shards(*names):
    return [SimpleNamespace(name=n, token_fields={}) for n in names]


def _round(log, **kw):
    return TrainingRound(FakePlugin(log), "policy", "opt", "sched", **kw)


def test_a_round_scores_every_shard_from_one_snapshot_then_steps_epoch_by_epoch():
    log, seen, timed = [], [], []
    shards = _shards("a", "b")

    @contextlib.contextmanager
    def clock(key):
        timed.append(key)
        yield

    steps = _round(log, epochs=2, ref_chunks="ref").run(shards, clock=clock, inspect=lambda s: seen.append(list(log)))
    scored = {"old_logprobs": "policy:{}", "ref_logprobs": "ref:{}"}
    want_scoring = [("logprobs", c, n) for n in "ab" for c in ("policy", "ref")]
    assert log[:4] == want_scoring and seen == [want_scoring]  # all scored before the dump and the first step
    assert [(e[1], e[2]) for e in log[4:]] == [
        (n, {k: v.format(n) for k, v in scored.items()}) for n in ("a", "b", "a", "b")
    ]
    assert [m["loss"] for m in steps] == [1.0, 2.0, 3.0, 4.0]
    assert timed == ["time/old_logprobs", "time/dump", "time/train"]


def test_one_step_from_the_snapshot_needs_no_old_logprobs():
    log = []
    _round(log, epochs=1).run(_shards("a"))
    assert log == [("step", "a", {})]  # the current policy is the old one: no forward pass


def test_the_check_sees_every_step_and_ends_the_round_at_the_first_refusal():
    log, checked = [], []

    def check(metrics):
        checked.append(metrics["loss"])
        if metrics["loss"] == 2.0:
            raise FloatingPointError("loss is nan")

    with pytest.raises(FloatingPointError):
        _round(log, epochs=1, check=check).run(_shards("a", "b", "c"))
    assert checked == [1.0, 2.0] and [e[1] for e in log if e[0] == "step"] == ["a", "b"]


def test_the_loop_trains_mini_batches_in_one_place():
    # the trainer and replay (offline/) both run TrainingRound: no other module above the plugin
    # drives optimizer steps
    package = Path(megatron_stepwise.__file__).parent
    rooms = ("loop", "offline", "workers", "compose", "cli")
    driving = sorted(
        str(p.relative_to(package))
        for room in rooms
        for p in (package / room).rglob("*.py")
        if "train_minibatch(" in p.read_text()
    )
    assert driving == ["loop/training_round.py"]
