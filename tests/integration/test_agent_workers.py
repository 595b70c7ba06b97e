"""Agent workers (`rollout.agent_workers`): the agent loop in Ray actors, routing their own turns.

Real Ray actors over a real fleet of embedded engines (tiny random Qwen2, echo environment).
Faults are injected deterministically: an engine paused so groups are surely in flight, a worker
or engine killed, then the outcome is checked; nothing depends on how fast the machine is.
"""

import asyncio
import os
import time

import pytest

from megatron_stepwise.compose import components
from megatron_stepwise.config import load_config
from megatron_stepwise.workers.agent_workers import AgentWorkers, AgentWorkersNotStarted, resolve_agent_workers

pytestmark = [pytest.mark.usefixtures("ray_session")]


def _config(*overrides):
    return load_config("configs/tiny_cpu.yaml", ["rollout.num_engines=1", *overrides], world_size=1)


@pytest.fixture(scope="module")
def setup():
    """(config, event loop, fleet, samples, the in-process rollout of the samples with seed 5)."""
    cfg = _config()
    tok = components.load_tokenizer(cfg)
    loop = asyncio.new_event_loop()
    fleet = components.build_fleet(cfg, components.policy_model(cfg, tok), tok)
    loop.run_until_complete(fleet.wait_ready())
    samples = components.build_dataset(cfg).next(6)
    reference = loop.run_until_complete(components.build_agent_loop(cfg, fleet, tok).rollout(samples, seed=5))
    yield cfg, loop, fleet, samples, reference
    loop.run_until_complete(fleet.shutdown())
    loop.close()


def _same(a, b):
    assert [s.trajectory_id for s in a] == [s.trajectory_id for s in b]
    for x, y in zip(a, b):
        assert x.prompt_ids.tolist() == y.prompt_ids.tolist()
        assert x.response_ids.tolist() == y.response_ids.tolist()
        assert x.loss_mask.tolist() == y.loss_mask.tolist()
        assert (x.reward, x.is_last_step, x.stop_reason) == (y.reward, y.is_last_step, y.stop_reason)
        assert x.metadata["turn"] == y.metadata["turn"]


def _wait(loop, predicate, deadline_s=120.0):
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached before the deadline"
        loop.run_until_complete(asyncio.sleep(0.05))


def test_workers_roll_out_exactly_what_the_in_process_loop_does(setup):
    cfg, loop, fleet, samples, reference = setup
    requests_before = fleet.metrics()["requests"]
    workers = AgentWorkers(cfg, fleet, 2)
    try:
        loop.run_until_complete(workers.wait_ready())
        done = []
        steps = loop.run_until_complete(workers.rollout(samples, seed=5, on_trajectory_done=done.append))
        _same(reference, steps)
        assert len(done) == len(samples) * cfg.data.samples_per_prompt and all(t[-1].is_last_step for t in done)
        # the workers routed every turn themselves and reported them to the fleet's counters
        assert fleet.metrics()["requests"] - requests_before == len(steps)
        with pytest.raises(ValueError, match="duplicate prompt_id"):
            loop.run_until_complete(workers.rollout([samples[0], samples[0]]))
        # at this process's priority: Ray's default worker niceness (15) starves them behind any busy process
        import ray

        for w in workers.workers:
            assert os.getpriority(os.PRIO_PROCESS, ray.get(w.handle.pid.remote())) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        workers.close()


def test_a_worker_killed_mid_rollout_is_restarted_and_its_groups_reissued(setup):
    import ray

    cfg, loop, fleet, samples, reference = setup
    workers = AgentWorkers(cfg, fleet, 2)
    engine = fleet.engine(0)
    try:
        loop.run_until_complete(workers.wait_ready())
        victim = workers.workers[0]
        pid = ray.get(victim.handle.pid.remote())
        ray.get(engine.call.remote("pause"))  # turns queue on the engine: groups stay in flight
        task = loop.create_task(workers.rollout(samples, seed=5))
        _wait(loop, lambda: victim.busy > 0 and all(w.busy > 0 for w in workers.workers))
        ray.kill(victim.handle, no_restart=True)
        ray.get(engine.call.remote("resume"))
        steps = loop.run_until_complete(task)
        _same(reference, steps)  # re-issued groups sample as they would have
        m = workers.metrics()
        assert m["agents/worker_restarts"] == 1 and m["agents/reissued_groups"] >= 1
        assert ray.get(victim.handle.pid.remote()) != pid  # a new process serves that slot
    finally:
        ray.get(engine.call.remote("resume"))
        workers.close()


def test_an_engine_a_worker_finds_dead_is_reported_and_restarted_by_the_fleet():
    cfg = _config("rollout.num_engines=2")
    tok = components.load_tokenizer(cfg)
    loop = asyncio.new_event_loop()
    fleet = components.build_fleet(cfg, components.policy_model(cfg, tok), tok)
    workers = AgentWorkers(cfg, fleet, 1)
    try:
        loop.run_until_complete(fleet.wait_ready())
        loop.run_until_complete(workers.wait_ready())
        fleet.kill_engine(0)
        samples = components.build_dataset(cfg).next(8)
        steps = loop.run_until_complete(workers.rollout(samples[:4], seed=1))
        assert sum(s.is_last_step for s in steps) == 4 * cfg.data.samples_per_prompt  # nothing lost
        loop.run_until_complete(fleet.wait_restarts())
        m = fleet.metrics()
        assert m["engine_failures"] == 1 and m["restarts"] == 1 and m["alive_engines"] == 2
        assert fleet.engine_table()[0].incarnation == 1
        # the next batch of work (new sessions: old ones stick to engine 1) reaches the restarted engine
        again = loop.run_until_complete(workers.rollout(samples[4:], seed=2))
        assert {s.metadata["engine"] for s in again} >= {"engine0.1"}
    finally:
        workers.close()
        loop.run_until_complete(fleet.shutdown())
        loop.close()


def test_agent_workers_default_to_the_driver_process_only_for_the_embedded_engine():
    assert resolve_agent_workers(_config()) == 0
    assert resolve_agent_workers(_config("rollout.agent_workers=3")) == 3
    sglang = _config("rollout.engine=sglang", "rollout.sglang.servers=[127.0.0.1:1]")
    assert resolve_agent_workers(sglang, ray_nodes=4) == 8


def test_workers_are_refused_at_once_while_colocated_engines_are_released(setup):
    """Colocated mode: a rollout through the workers while the engines' memory is Megatron's fails
    at once with the engine's own error (not retried, no engine declared dead), and works again
    once the memory is back."""
    from megatron_stepwise.rollout.engines.protocol import EngineReleasedError

    cfg, loop, fleet, samples, reference = setup
    workers = AgentWorkers(cfg, fleet, 1)
    try:
        loop.run_until_complete(workers.wait_ready())
        loop.run_until_complete(fleet.release_memory_occupation(["kv_cache"]))
        with pytest.raises(BaseExceptionGroup) as failed:  # as the in-process loop's task group raises it
            loop.run_until_complete(workers.rollout(samples[:2], seed=5))
        assert failed.group_contains(EngineReleasedError, match="kv_cache memory is released")
        loop.run_until_complete(fleet.resume_memory_occupation(["kv_cache"]))
        m = fleet.metrics()
        assert m["engine_failures"] == 0 and m["retries"] == 0
        _same(reference, loop.run_until_complete(workers.rollout(samples, seed=5)))
    finally:
        workers.close()


def test_workers_that_cannot_start_are_a_clear_error_naming_the_keys():
    """Ray keeps an actor it has no CPUs for pending forever: waiting for it ends in an error
    that says so and names the keys, not a bare timeout."""

    class Pending:  # an actor handle whose constructor never runs
        class ready:
            @staticmethod
            def remote():
                return asyncio.get_running_loop().create_future()

    cfg = _config("rollout.agent_worker_cpus=3")
    workers = AgentWorkers(cfg, fleet=None, n=2, spawn=lambda cfg, index, concurrency, name: Pending())
    with pytest.raises(
        AgentWorkersNotStarted,
        match=r"2 agent workers did not start within 0 s.*2 x 3 free CPUs.*"
        r"rollout.agent_workers, rollout.agent_worker_cpus",
    ):
        asyncio.run(workers.wait_ready(timeout_s=0.2))
