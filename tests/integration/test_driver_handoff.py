"""Handoff.from_driver: rank 0 produces, every rank receives; a rank-0 error reaches every rank
as an error (never a hang), even when the exception itself cannot be pickled."""

import os
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_stepwise.loop.handoff import Handoff


class _Position:
    """Stands in for the prompt dataset: rank 0's position must reach every rank."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"position": self.value}

    def load_state_dict(self, state):
        self.value = state["position"]


class _UnpicklableError(RuntimeError):
    def __init__(self, msg):
        super().__init__(msg)
        self.lock = threading.Lock()  # like the Ray / HTTP client errors a rollout can raise


def _worker(rank: int, store_path: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    position = _Position(10 * rank + 7)
    handoff = Handoff(position)
    got = handoff.from_driver(lambda: ["steps of rank 0"], "rollout", iteration=3)
    out = {"result": got, "position": position.value}

    def fail():
        raise _UnpicklableError("engine 1 closed the connection")

    try:
        handoff.from_driver(fail, "rollout", iteration=3)
    except RuntimeError as e:
        out["error"] = str(e)
    dist.barrier()  # both ranks got here: nobody is left in the broadcast
    dist.destroy_process_group()
    results[rank] = out


@pytest.mark.distributed
def test_rank0_result_position_and_unpicklable_error_reach_every_rank():
    # the Manager's server is spawned: forked from this process (Ray's threads may run in it) it can deadlock
    with tempfile.TemporaryDirectory() as tmp, mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        r = results[rank]
        assert r["result"] == ["steps of rank 0"] and r["position"] == 7  # rank 0's data position
        assert r["error"] == (
            "rollout failed on rank 0 at iteration 3: _UnpicklableError: engine 1 closed the connection"
        )


def _frozen_driver_worker(rank: int, store_path: str, results, unfreeze) -> None:
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    from megatron_stepwise.compose.components import cpu_group

    # The world keeps a long timeout: only the trainer's CPU group's own must apply.
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=2, timeout=timedelta(minutes=10)
    )
    group = cpu_group(SimpleNamespace(parallel=SimpleNamespace(timeout_minutes=0.05)))  # 3 s
    out = {"timeout": group._get_backend(torch.device("cpu")).options._timeout}
    if rank == 0:
        # Frozen: never enters the broadcast, until rank 1 has given up on it (or a long deadline).
        out["unfrozen_by_rank1"] = unfreeze.wait(300)
    else:
        start = time.monotonic()
        try:
            Handoff(_Position(0), group).from_driver(lambda: None, "rollout", iteration=0)
        except RuntimeError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["waited"] = time.monotonic() - start
        unfreeze.set()
    results[rank] = out


@pytest.mark.distributed
@pytest.mark.timeout(600)  # with gloo's 30-minute default, rank 1 would wait that long: fail instead
def test_a_frozen_driver_fails_the_other_ranks_after_the_configured_timeout():
    """The trainer's object group gets parallel.timeout_minutes, not gloo's 30-minute default
    (torch's new_group ignores the world's timeout)."""
    from datetime import timedelta

    with tempfile.TemporaryDirectory() as tmp, mp.get_context("spawn").Manager() as manager:  # spawned, never forked
        results, unfreeze = manager.dict(), manager.Event()
        mp.spawn(_frozen_driver_worker, args=(os.path.join(tmp, "store"), results, unfreeze), nprocs=2, join=True)
        results = dict(results)
    assert results[0]["timeout"] == results[1]["timeout"] == timedelta(seconds=3)
    # Rank 1 gave up while rank 0 was still frozen (rank 0 is released only by rank 1's failure),
    # and not before the configured 3 s (a timeout cannot fire early, however busy the machine).
    assert "error" in results[1] and results[0]["unfrozen_by_rank1"], (results[0], results[1])
    assert results[1]["waited"] >= 2.5, results[1]


def _rollout_shards(dp: int):
    """The same synthetic rollout cut into `dp` shards by the real micro-batch planner."""
    from megatron_stepwise.algo.planner import plan_microbatches
    from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps
    from megatron_stepwise.steps import StepBatch

    batch = StepBatch.from_steps(make_agent_steps(AgentWorkload(num_prompts=16, samples_per_prompt=4, seed=3)))
    plan = plan_microbatches(batch.lengths.tolist(), dp_size=dp, max_tokens=16384)
    return [batch.select([r for micro in rank for r in micro]) for rank in plan]


def _sharded_worker(rank: int, store_path: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=4)
    out = {}
    for dp in (1, 2, 4):
        position = _Position(rank)
        # model-parallel peers (here: 4 // dp ranks in a row) share a data-parallel rank
        handoff = Handoff(position, dp_rank=rank // (4 // dp))
        got = handoff.to_ranks(lambda: _rollout_shards(dp), "rollout", iteration=1)
        out[dp] = {
            "rows": got.trajectory_ids,
            "tokens": int(got.tokens.numel()),
            "position": position.value,
            "bytes": handoff.bytes_received,
            "sent": handoff.bytes_sent,
        }
    try:
        handoff.to_ranks(lambda: 1 / 0, "rollout", iteration=2)
    except RuntimeError as e:
        out["error"] = str(e)
    dist.barrier()
    dist.destroy_process_group()
    results[rank] = out


@pytest.mark.distributed
def test_each_rank_receives_only_its_data_parallel_shard():
    # the Manager's server is spawned: forked from this process (Ray's threads may run in it) it can deadlock
    with tempfile.TemporaryDirectory() as tmp, mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.spawn(_sharded_worker, args=(os.path.join(tmp, "store"), results), nprocs=4, join=True)
        results = dict(results)
    for dp in (1, 2, 4):
        shards = _rollout_shards(dp)
        for rank in range(4):
            r, mine = results[rank][dp], shards[rank // (4 // dp)]
            assert r["rows"] == mine.trajectory_ids and r["tokens"] == mine.tokens.numel()
            assert r["position"] == 0  # rank 0's data position reaches every rank
    # bytes a rank receives shrink as 1/DP (rank 0 keeps its own shard and receives nothing)
    whole = results[1][1]["bytes"]
    for dp in (2, 4):
        received = [results[rank][dp]["bytes"] for rank in range(1, 4)]
        assert all(abs(b * dp / whole - 1) < 0.1 for b in received), (dp, received, whole)
    # rank 0 sends each DP shard once, to one rank of its replica, which passes it on: at DP2 rank 0
    # sends shard 1 to rank 2 and broadcasts shard 0 to rank 1 (not every shard to every rank)
    shards = [results[rank][2]["bytes"] for rank in (1, 2)]
    assert results[0][2]["sent"] == sum(shards) and results[2][2]["sent"] == results[3][2]["bytes"]
    assert results[0][4]["sent"] == sum(results[rank][4]["bytes"] for rank in (1, 2, 3))
    assert all(
        results[rank]["error"] == "rollout failed on rank 0 at iteration 2: ZeroDivisionError: division by zero"
        for rank in range(4)
    )
