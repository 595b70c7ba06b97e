"""EntropyWatch: a collapsing policy is named in the log, once, and its ratio is logged."""

from __future__ import annotations

import logging

from megatron_stepwise.metrics.collapse import EntropyWatch


def test_a_collapse_warns_once_and_learning_does_not(caplog):
    watch = EntropyWatch(floor=0.3)
    seen = []
    with caplog.at_level(logging.WARNING, logger="megatron_stepwise.metrics.collapse"):
        for i, entropy in enumerate([3.2, 2.9, 2.5, 0.9, 0.5]):
            metrics = {"train/entropy": entropy}
            watch.observe(i, metrics)
            seen.append(metrics["train/entropy_ratio"])
    assert seen[0] == 1.0 and abs(seen[3] - 0.9 / 3.2) < 1e-12
    warnings = [r.getMessage() for r in caplog.records]
    assert (
        len(warnings) == 1 and "iteration 3" in warnings[0] and "collapsing" in warnings[0] and "eval/*" in warnings[0]
    )


def test_no_entropy_no_ratio():
    watch = EntropyWatch()
    metrics = {"reward/mean": 0.5}
    watch.observe(0, metrics)
    assert "train/entropy_ratio" not in metrics and watch.initial is None
