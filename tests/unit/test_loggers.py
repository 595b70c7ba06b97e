"""TensorBoard and offline W&B hold exactly the per-iteration metrics of metrics.jsonl.

Read back with tensorboard's own event reader and from W&B's offline run directory
(tests/logger_readers.py). The end-to-end version (a real tiny training run) is in
tests/integration/test_user_data_e2e.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from logger_readers import tensorboard_scalars, wandb_offline_history

from megatron_stepwise.metrics.core import MetricsLogger
from megatron_stepwise.rundir.jsonl import read_metrics

pytest.importorskip("tensorboard", reason="the tensorboard package (test extra) is not installed")
pytest.importorskip("wandb", reason="the wandb package (test extra) is not installed")


def _same(a, b) -> bool:
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or a == b


def _wandb_rows(run_dir: str, expected: int, deadline_s: float = 60.0) -> list[dict]:
    """The offline run's history rows, polled: W&B's service process may still be writing its
    transaction log when `finish()` returns on a busy machine."""
    import time

    end = time.monotonic() + deadline_s
    rows = wandb_offline_history(run_dir)
    while len(rows) < expected and time.monotonic() < end:
        time.sleep(0.2)
        rows = wandb_offline_history(run_dir)
    return rows


def assert_loggers_match_jsonl(run_dir: str) -> int:
    """Every numeric key of every metrics.jsonl line is in TensorBoard and W&B with the same value
    at the same iteration (and nothing else is); returns how many values were compared."""
    lines = read_metrics(run_dir)
    tb = tensorboard_scalars(run_dir)
    wb = {row["iteration"]: row for row in _wandb_rows(run_dir, len(lines))}
    assert sorted(wb) == [line["iteration"] for line in lines]
    compared = 0
    expected_tags = set()
    for line in lines:
        it = line["iteration"]
        assert set(wb[it]) == set(line), (it, set(wb[it]) ^ set(line))
        for key, value in line.items():
            if key == "iteration" or isinstance(value, str) and value not in ("nan", "inf", "-inf"):
                continue
            if isinstance(value, (list, dict)) or value is None:
                continue
            expected_tags.add(key)
            assert _same(tb[key][it], value), (key, it, tb[key][it], value)
            assert _same(wb[it][key], value), (key, it, wb[it][key], value)
            compared += 1
    assert set(tb) == expected_tags
    return compared


@pytest.mark.launches  # wandb starts its service process
def test_tensorboard_and_offline_wandb_equal_metrics_jsonl(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = str(tmp_path)
    log = MetricsLogger(run_dir, tensorboard=True, wandb_project="stepwise-test", wandb_name="t")
    for it in range(4):
        log.log(
            it,
            {
                "reward/mean": 0.25 * it,
                "rollout/trajectories": 64,
                "train/loss": torch.tensor(1.5 - it),
                "train/grad_norm": float("nan") if it == 2 else 0.1 * it,
                "weight_version": it + 1,
                "timing/rollout_s": 1.0 / 3.0,
            },
        )
    log.close()
    assert assert_loggers_match_jsonl(run_dir) == 4 * 6
    assert read_metrics(run_dir)[2]["train/grad_norm"] == "nan"  # JSON has no NaN; the loggers keep the float
