"""Rank 0's own failure is the error it raises even when telling the other ranks fails too (a rank
cut off by its node's network: the collective's timeout used to replace it)."""

from __future__ import annotations

import pytest

from megatron_stepwise.loop.handoff import Handoff


def _handoff() -> Handoff:
    h = Handoff.__new__(Handoff)  # no process group needed: only the error handling is under test
    h._produce_error = None
    return h


def test_a_failed_send_after_rank0_failed_raises_rank0s_error():
    h = _handoff()
    with pytest.raises(RuntimeError) as e:
        with h._keeping_rank0_error("rollout", 3):
            h._produce_error = ValueError("engine 0 needs 1 CPU; no live Ray node has them")
            raise RuntimeError("[gloo] Timed out waiting 60000ms for send operation to complete\nmore")
    msg = str(e.value)
    assert msg.startswith("rollout failed on rank 0 at iteration 3: ValueError: engine 0 needs 1 CPU")
    assert "telling the other ranks failed: RuntimeError: [gloo] Timed out waiting 60000ms" in msg
    assert "more" not in msg and isinstance(e.value.__cause__, ValueError)


def test_without_a_failure_on_rank0_a_collective_error_is_unchanged():
    h = _handoff()
    with pytest.raises(RuntimeError, match="^Timed out$"):
        with h._keeping_rank0_error("rollout", 3):
            raise RuntimeError("Timed out")


def test_rank0s_error_raised_as_usual_is_not_wrapped():
    h = _handoff()
    cause = ValueError("x")
    with pytest.raises(RuntimeError, match="^rollout failed on rank 0 at iteration 3: ValueError: x$"):
        with h._keeping_rank0_error("rollout", 3):
            h._produce_error = cause
            raise RuntimeError("rollout failed on rank 0 at iteration 3: ValueError: x") from cause


def test_an_exception_group_is_described_by_what_failed_inside_it():
    from megatron_stepwise.loop.handoff import describe

    died = RuntimeError("prompt groups [3]: their agent worker died 2 times")
    group = ExceptionGroup("unhandled errors in a TaskGroup", [died, RuntimeError(str(died)), KeyError("k")])
    assert describe(group) == f"RuntimeError: {died}; KeyError: 'k'"
    assert describe(ExceptionGroup("outer", [group])) == describe(group)
