"""The test fault injection point (megatron_stepwise/fault_injection.py): inert unless its variable
is set; set, a row fetch pauses at it until the test's `go` file appears, bounded by a deadline."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_stepwise import fault_injection
from megatron_stepwise.fault_injection import FETCH_VARIABLE, FaultPauseTimeout, FilePause
from megatron_stepwise.workers.worker_rows import RemoteShard, RowFetcher

pytestmark = pytest.mark.timeout(60)


def _poll(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.01)


def test_unset_it_is_inert():
    assert FilePause.from_env(FETCH_VARIABLE, {}) is None
    assert FilePause.from_env(FETCH_VARIABLE, {FETCH_VARIABLE: ""}) is None
    assert fault_injection.FETCH_PAUSE is None  # the suite runs without it
    fault_injection.before_fetch(3)  # returns at once


def test_set_a_fetch_pauses_until_its_round_is_released(tmp_path):
    pause = FilePause.from_env(FETCH_VARIABLE, {FETCH_VARIABLE: str(tmp_path / "pause")})
    (tmp_path / "pause").mkdir()
    (tmp_path / "pause" / "go.1").touch()  # round 1 is let through
    pause.wait(1, rank="0")
    waiter = threading.Thread(target=pause.wait, args=(2, "1"), daemon=True)
    waiter.start()
    _poll(lambda: (tmp_path / "pause" / "fetching.1.2").exists(), "the paused fetch's marker")
    assert waiter.is_alive()  # paused: round 2 is not released
    (tmp_path / "pause" / "go.2").touch()
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert sorted(p.name for p in (tmp_path / "pause").iterdir()) == ["fetching.0.1", "fetching.1.2", "go.1", "go.2"]


def test_a_pause_never_released_fails_naming_the_variable(tmp_path):
    pause = FilePause(tmp_path, FETCH_VARIABLE, deadline_s=0.2)
    with pytest.raises(
        FaultPauseTimeout, match=rf"^{FETCH_VARIABLE}={tmp_path}: go.4 did not appear there within 0.2 s"
    ):
        pause.wait(4, rank="0")


def test_the_row_fetch_pauses_there_before_it_reaches_ray(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # rank 0's name for the marker
    monkeypatch.setattr(fault_injection, "FETCH_PAUSE", FilePause(tmp_path, FETCH_VARIABLE, deadline_s=0.2))
    shard = RemoteShard(decision=None, key=5, pieces=[], order=[], ray_address="10.0.0.1:1")
    with pytest.raises(FaultPauseTimeout, match="go.5"):
        RowFetcher().fetch(shard)
    assert (tmp_path / "fetching.0.5").exists()


def test_the_rollout_pause_is_inert_unless_set_and_holds_rank0_before_its_rollout(tmp_path, monkeypatch):
    from megatron_stepwise.fault_injection import ROLLOUT_VARIABLE

    assert FilePause.from_env(ROLLOUT_VARIABLE, {}) is None and fault_injection.ROLLOUT_PAUSE is None
    fault_injection.before_rollout(3)  # returns at once
    monkeypatch.setattr(
        fault_injection,
        "ROLLOUT_PAUSE",
        FilePause.from_env(ROLLOUT_VARIABLE, {ROLLOUT_VARIABLE: str(tmp_path)}, point="rollout"),
    )
    (tmp_path / "go.5").touch()
    fault_injection.before_rollout(5)  # released already
    assert (tmp_path / "rollout.0.5").exists()
