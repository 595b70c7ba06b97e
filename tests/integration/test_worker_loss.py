"""An agent worker that dies or freezes holding rows (`rollout.handoff: workers`) costs the run
nothing but time: the synchronous source replaces it, rolls its groups out again with their own
seeds and hands the round off anew (`agents/regenerated_groups`).

Real Ray actors over an embedded engine (tiny CPU config), the real SyncRollouts, Handoff and
RowFetcher on a one-rank gloo group. The fault is injected when the victim surely holds rows: the
fetch is about to start and the worker says it holds groups (polled, then SIGKILL or SIGSTOP).
"""

import asyncio
import os
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from megatron_stepwise.algo.planner import plan_microbatches
from megatron_stepwise.algo.reductions import row_denominators
from megatron_stepwise.algo.rows import RowTable
from megatron_stepwise.algo.shards import ShardDecision, shard_rows
from megatron_stepwise.compose import components
from megatron_stepwise.config import load_config
from megatron_stepwise.loop.handoff import Handoff
from megatron_stepwise.loop.sources import Driver, SyncRollouts
from megatron_stepwise.workers.agent_workers import AgentWorkers

pytestmark = [pytest.mark.usefixtures("ray_session")]
ITERATIONS = 3
STALL_S = 3.0  # rollout.agent_worker_timeout_s in these tests: a frozen worker is given up after it


def _decide(rows: RowTable) -> list[ShardDecision]:
    """decide_shards at DP1 without a model: the real planner and the token_mean denominators."""
    (micros,) = plan_microbatches(rows.lengths.tolist(), dp_size=1, max_tokens=16384)
    mine, local = shard_rows(micros)
    index = torch.as_tensor(mine, dtype=torch.long)
    denominators = row_denominators(rows, "token_mean")[index]
    trained = int(rows.trained.sum())
    return [
        ShardDecision(
            local,
            mine,
            0,
            1,
            trained,
            0,
            0,
            0,
            False,
            False,
            rows.traj_index[index],
            rows.group_index[index],
            denominators,
        )
    ]


@pytest.fixture(scope="module")
def one_rank():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def fleet_setup(one_rank):
    cfg = load_config(
        "configs/tiny_cpu.yaml",
        ["rollout.num_engines=1", "rollout.agent_workers=2", f"rollout.agent_worker_timeout_s={STALL_S}"],
        world_size=1,
    )
    tok = components.load_tokenizer(cfg)
    loop = asyncio.new_event_loop()
    fleet = components.build_fleet(cfg, components.policy_model(cfg, tok), tok)
    loop.run_until_complete(fleet.wait_ready())
    yield cfg, loop, fleet, tok
    loop.run_until_complete(fleet.shutdown())
    loop.close()


def _run(fleet_setup, fault=None):
    """ITERATIONS synchronous rounds; `fault(workers)` runs once, in iteration 1, just before the
    rows are fetched. Returns (each round's shard tokens and advantages, the last round's metrics)."""
    cfg, loop, fleet, tok = fleet_setup
    workers = AgentWorkers(cfg, fleet, 2)
    dataset = components.build_dataset(cfg)
    source = SyncRollouts(
        cfg, dataset=dataset, handoff=Handoff(dataset), vocab_size=len(tok), decide=_decide, dp_size=1
    )
    assert source.fetcher is not None  # rows stay in the workers
    try:
        loop.run_until_complete(workers.wait_ready())
        source.start(Driver(loop, fleet, workers))
        fetch = source.fetcher.resolve
        out, metrics = [], {}
        for iteration in range(ITERATIONS):
            if fault is not None and iteration == 1:
                fired = []

                def resolve(payload, fetch=fetch, fired=fired):
                    if not fired:  # once: the retries of this round fetch normally
                        fired.append(True)
                        fault(workers)
                    return fetch(payload)

                source.fetcher.resolve = resolve
            elif fault is not None:
                source.fetcher.resolve = fetch
            rnd = source.take(iteration)
            out.append([(m.batch.tokens.clone(), m.batch.token_fields["advantages"].clone()) for m in rnd.shards])
            metrics = rnd.metrics
        return out, metrics
    finally:
        workers.close()


def _holding_victim(workers, deadline_s=120.0):
    """The first worker that holds rows, and its pid (polled: the workers say what they hold)."""
    import ray

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for w in workers.workers:
            if ray.get(w.handle.held_groups.remote(), timeout=60) > 0:
                return w, ray.get(w.handle.pid.remote(), timeout=60)
        time.sleep(0.05)
    raise AssertionError("no agent worker held rows before the deadline")


@pytest.fixture(scope="module")
def reference(fleet_setup):
    return _run(fleet_setup)[0]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y) and x
        for (tokens_x, adv_x), (tokens_y, adv_y) in zip(x, y):
            assert torch.equal(tokens_x, tokens_y) and torch.equal(adv_x, adv_y)


def test_a_worker_killed_while_it_holds_rows_costs_nothing_but_time(fleet_setup, reference):
    killed = []

    def kill(workers):
        victim, pid = _holding_victim(workers)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    rounds, metrics = _run(fleet_setup, kill)
    assert killed
    _same(reference, rounds)  # the lost groups sampled again exactly as before
    assert metrics["agents/worker_restarts"] == 1 and metrics["agents/regenerated_groups"] >= 1


def test_a_frozen_worker_holding_rows_is_treated_as_dead_after_the_bound(fleet_setup, reference):
    stopped = []

    def freeze(workers):
        victim, pid = _holding_victim(workers)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    start = time.monotonic()
    try:
        rounds, metrics = _run(fleet_setup, freeze)
    finally:
        for pid in stopped:  # ours: the worker this test froze (Ray killed it already, or it ends now)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert stopped
    _same(reference, rounds)
    assert metrics["agents/worker_restarts"] == 1 and metrics["agents/regenerated_groups"] >= 1
    assert time.monotonic() - start < 300  # bounded by STALL_S, not hung
