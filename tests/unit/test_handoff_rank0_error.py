"""A rank's own failure is the error it raises even when telling the other ranks fails too (a rank
cut off by its node's network: the collective's timeout used to replace it): rank 0's rollout, or a
replica leader's fetch of its rows."""

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


def _fetching_handoff(monkeypatch, agreement_error: Exception) -> Handoff:
    """A one-rank hand-off whose agreement after the fetch fails as a cut-off rank's collective does."""
    import megatron_stepwise.loop.handoff as module

    class Position:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    monkeypatch.setattr(module.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(module.dist, "get_world_size", lambda group=None: 1)
    h = Handoff(Position())
    h._replica_info = ([0], [0], [None])

    def agree(failure, what, iteration):
        raise agreement_error

    monkeypatch.setattr(h, "_agree", agree)
    return h


def test_a_failed_fetch_stays_the_error_when_telling_the_other_ranks_fails(monkeypatch):
    from megatron_stepwise.workers.worker_rows import RowsLost

    h = _fetching_handoff(monkeypatch, RuntimeError("[gloo] Timed out waiting 60000ms for recv operation\nmore"))

    def fetch(payload):
        raise RowsLost(
            "fetching the rows of round 2: agent worker agent-0 on 10.0.0.2 died (ActorDiedError: its node died)", ["a"]
        )

    with pytest.raises(RuntimeError) as e:
        h.to_ranks(lambda: [["rows"]], "rollout", 2, resolve=fetch)
    assert str(e.value) == (
        "rollout at iteration 2: fetching the rows failed on DP rank 0 (global rank 0): RowsLost: fetching the rows "
        "of round 2: agent worker agent-0 on 10.0.0.2 died (ActorDiedError: its node died) (and telling the other ranks failed: "
        "RuntimeError: [gloo] Timed out waiting 60000ms for recv operation)"
    )


def test_a_fetched_round_the_ranks_cannot_agree_on_says_so(monkeypatch):
    h = _fetching_handoff(monkeypatch, RuntimeError("[gloo] Timed out waiting 60000ms for recv operation"))
    with pytest.raises(RuntimeError) as e:
        h.to_ranks(lambda: [["rows"]], "rollout", 2, resolve=lambda payload: payload)
    assert str(e.value) == (
        "rollout at iteration 2: agreeing on the fetched rows failed: "
        "RuntimeError: [gloo] Timed out waiting 60000ms for recv operation"
    )


def test_a_rank_gone_while_rank0_hands_over_a_good_result_is_one_named_error(monkeypatch):
    """Rank 0's rollout succeeded, then the rank it sends a shard to is gone (its node killed):
    one line saying what was under way, not gloo's bare socket error."""
    import megatron_stepwise.loop.handoff as module

    h = _fetching_handoff(monkeypatch, AssertionError("not reached"))
    h._replica_info = ([0, 1], [0, 1], [None, None])  # two replicas: rank 0 sends rank 1 its shard
    monkeypatch.setattr(module.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(module.dist, "broadcast", lambda tensor, src, group=None: None)

    class Gone:
        def wait(self):
            raise RuntimeError(
                "[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:30407: Connection reset by peer\nGLHF"
            )

    monkeypatch.setattr(module.dist, "isend", lambda tensor, dst, group=None: Gone())
    with pytest.raises(RuntimeError) as e:
        h.to_ranks(lambda: [["a"], ["b"]], "rollout", 2)
    assert str(e.value) == (
        "rollout at iteration 2: handing the result to the ranks failed (a rank is gone or cut off): "
        "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:30407: Connection reset by peer"
    )


def test_bad_input_on_rank0_is_an_input_error_on_every_rank():
    """A dataset rewritten during the run (a UserError) ends the run with exit 2 and one line per
    rank; before, RuntimeError wrapped it: exit 1, three tracebacks."""
    from megatron_stepwise.data.files import DatasetError
    from megatron_stepwise.errors import UserError

    h = _handoff()
    h.produce_seconds = 0.0
    error, payload = h._run(lambda: (_ for _ in ()).throw(DatasetError("env.dataset: d.jsonl changed")))
    assert payload[0] == "user_error"
    for rank_error in (error, None):  # rank 0 holds the error itself, the others only its text
        with pytest.raises(UserError, match="^rollout stopped on rank 0 at iteration 8: DatasetError: env.dataset"):
            with h._keeping_rank0_error("rollout", 8):
                h._open(payload, rank_error, "rollout", 8)


def test_exception_groups_are_told_by_their_leaves():
    from megatron_stepwise.loop.handoff import HandedOverFailure, kind_of
    from megatron_stepwise.workers.agent_workers import WorkerCrashLoop

    crashes = ExceptionGroup("unhandled errors in a TaskGroup", [WorkerCrashLoop("a"), WorkerCrashLoop("b")])
    assert kind_of(crashes) == "failure" and kind_of(WorkerCrashLoop("a")) == "failure"
    assert kind_of(ExceptionGroup("x", [WorkerCrashLoop("a"), RuntimeError("engine")])) == "error"
    h = _handoff()
    h.produce_seconds = 0.0
    error, payload = h._run(lambda: (_ for _ in ()).throw(crashes))
    for rank_error in (error, None):
        with pytest.raises(HandedOverFailure, match="^rollout failed on rank 0 at iteration 2: WorkerCrashLoop: a"):
            with h._keeping_rank0_error("rollout", 2):
                h._open(payload, rank_error, "rollout", 2)
