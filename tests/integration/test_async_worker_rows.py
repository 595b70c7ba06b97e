"""Asynchronous training with the rows kept in the agent workers (`rollout.handoff: workers`).

Real Ray actors over an embedded engine (tiny CPU config), the real AsyncRollouts, Handoff and
RowFetcher on a one-rank gloo group; the trainer's weight version stays 0 (no training), so
`async.max_staleness` 3 admits the groups of 4 steps. What the end-to-end run cannot show: each
step's shard is fetched from the workers (rank 0 receives summaries only), a trained group's
rows are dropped by its holder, and an agent worker frozen (SIGSTOP) while it holds rows of the
step and rolls out others costs nothing but time: the fetch gives it up after
`rollout.agent_worker_timeout_s`, it is replaced, its groups are rolled out again (held ones) or
re-issued (in flight), and training goes on.
"""

import asyncio
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_stepwise.algo.planner import plan_microbatches
from megatron_stepwise.algo.reductions import row_denominators
from megatron_stepwise.algo.rows import RowTable
from megatron_stepwise.algo.shards import ShardDecision, shard_rows
from megatron_stepwise.compose import components
from megatron_stepwise.config import load_config
from megatron_stepwise.loop.async_source import AsyncRollouts
from megatron_stepwise.loop.handoff import Handoff
from megatron_stepwise.loop.sources import Driver
from megatron_stepwise.rundir.paths import BANK
from megatron_stepwise.workers.agent_workers import AgentWorkers
from megatron_stepwise.workers.worker_rows import RemoteShard

pytestmark = [pytest.mark.usefixtures("ray_session")]
STEPS = 4
STALL_S = 3.0  # rollout.agent_worker_timeout_s: a frozen worker is given up after it


def _decide(rows: RowTable) -> list[ShardDecision]:
    """decide_shards at DP1 without a model: the real planner and the token_mean denominators."""
    (micros,) = plan_microbatches(rows.lengths.tolist(), dp_size=1, max_tokens=16384)
    mine, local = shard_rows(micros)
    index = torch.as_tensor(mine, dtype=torch.long)
    return [
        ShardDecision(
            local,
            mine,
            0,
            1,
            int(rows.trained.sum()),
            0,
            0,
            0,
            False,
            False,
            rows.traj_index[index],
            rows.group_index[index],
            row_denominators(rows, "token_mean")[index],
        )
    ]


@pytest.fixture(scope="module")
def fleet_setup():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        cfg = load_config(
            "configs/tiny_cpu_async.yaml",
            [
                "rollout.num_engines=1",
                "rollout.agent_workers=2",
                f"logging.run_dir={tmp}/run",  # the rollout bank's files
                f"rollout.agent_worker_timeout_s={STALL_S}",
                "async.max_staleness=3",
                "data.prompts_per_minibatch=2",
                "data.prompts_per_iteration=4",
                "data.samples_per_prompt=4",
            ],
            world_size=1,
        )
        tok = components.load_tokenizer(cfg)
        loop = asyncio.new_event_loop()
        fleet = components.build_fleet(cfg, components.policy_model(cfg, tok), tok)
        loop.run_until_complete(fleet.wait_ready())
        try:
            yield cfg, loop, fleet, tok
        finally:
            loop.run_until_complete(fleet.shutdown())
            loop.close()
            dist.destroy_process_group()


def _held_groups(workers) -> list[int]:
    import ray

    return ray.get([w.handle.held_groups.remote() for w in workers.workers], timeout=60)


def _run(fleet_setup, fault=None):
    """STEPS async steps; `fault(workers, remote_shard)` runs once, in step 1, just before its rows
    are fetched. Returns (each step's fetched shard, the iteration's metrics, the workers' held
    group counts at the end, the source's buffer, the bank files the workers wrote)."""
    cfg, loop, fleet, tok = fleet_setup
    workers = AgentWorkers(cfg, fleet, 2)
    dataset = components.build_dataset(cfg)
    source = AsyncRollouts(
        cfg,
        dataset=dataset,
        handoff=Handoff(dataset),
        vocab_size=len(tok),
        version=lambda: 0,
        dp_size=1,
        decide=_decide,
    )
    assert source.fetcher is not None  # async with agent workers: the rows stay in the workers
    try:
        loop.run_until_complete(workers.wait_ready())
        source.start(Driver(loop, fleet, workers))
        written, record = [], source.bank.record  # the bank files rank 0 hears of (before the loop runs)
        source.bank.record = lambda file, draw=None: written.append(file) or record(file, draw=draw)
        fetch, fired = source.fetcher.resolve, []

        def resolve(payload):
            if fault is not None and step == 1 and not fired:  # once: the retry fetches normally
                fired.append(True)
                fault(workers, payload.shards[0])
            return fetch(payload)

        source.fetcher.resolve = resolve
        shards = []
        for step in range(STEPS):
            rnd = source.take(0)
            (shard,) = rnd.shards
            assert rnd.metrics["agents/rows_held"] == 1.0
            shards.append(shard)
        metrics = source.iteration_metrics()
        # the trained groups' rows are dropped (a fire-and-forget call: polled); ready ones stay
        deadline = time.monotonic() + 120
        while sum(_held_groups(workers)) > source.buffer.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        return shards, metrics, _held_groups(workers), source.buffer, written
    finally:
        source.close()
        workers.close()


def _check_shards(shards):
    for shard in shards:
        # 2 groups x 4 trajectories, every row fetched from the workers with its advantages
        assert len(set(shard.batch.trajectory_ids)) == 8
        assert shard.batch.num_rows == len(shard.decision.rows) > 0
        assert shard.batch.token_fields["advantages"].numel() == shard.batch.tokens.numel()


def test_async_steps_fetch_their_rows_from_the_workers_which_then_drop_them(fleet_setup):
    shards, metrics, held, buffer, written = _run(fleet_setup)
    _check_shards(shards)
    assert metrics["agents/rows_held"] == 1.0 and metrics["async/groups_trained"] == 2 * STEPS
    # staleness from the workers' summaries: every trained token came from version 0
    assert metrics["async/token_staleness_max"] == 0 and metrics["async/token_staleness/0"] == 1.0
    assert metrics["agents/regenerated_groups"] == 0
    assert sum(held) == buffer.ready  # nothing trained is still held
    # the rollout bank follows the rows: the worker holding each group wrote its file and rank 0
    # recorded the name; a trained group's file is gone at once (no checkpoint lists it)
    assert len(written) == buffer.counters.finished and None not in written
    bank = Path(fleet_setup[0].run_dir) / BANK
    left = {p.name for p in bank.glob("draw_*.parquet")}
    assert left == {g.rollout.bank.name for g in buffer.ready_groups()}, (left, buffer.ready)


def test_a_worker_frozen_while_it_holds_the_steps_rows_is_replaced_and_its_groups_rolled_out_again(fleet_setup):
    import ray

    stopped = []

    def freeze(workers, remote: RemoteShard):
        victim = remote.pieces[0][0]  # a worker holding rows of this step
        (worker,) = [w for w in workers.workers if workers._name(w.index, w.incarnation) == victim]
        pid = ray.get(worker.handle.pid.remote(), timeout=60)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    start = time.monotonic()
    try:
        shards, metrics, held, buffer, _ = _run(fleet_setup, freeze)
    finally:
        for pid in stopped:  # ours: the worker this test froze (Ray killed it already, or it ends now)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert stopped
    _check_shards(shards)
    assert metrics["async/groups_trained"] == 2 * STEPS
    assert metrics["agents/worker_restarts"] == 1 and metrics["agents/regenerated_groups"] >= 1
    assert time.monotonic() - start < 300  # bounded by STALL_S, not hung
