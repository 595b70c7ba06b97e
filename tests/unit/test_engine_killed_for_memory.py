"""An engine that Ray's memory monitor kills is a dead engine, not the end of the run.

Ray answers the pending calls of an actor it killed for memory with `OutOfMemoryError`, a
`RayError` that is no `RayActorError`: the fleet must restart that engine (a weight update
completes and is replayed on the replacement; a request is retried on another engine), as for
any other death. The real fleet over stand-in engine handles (no Ray actors).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import ray.exceptions

from megatron_stepwise.rollout.engines.protocol import GenerateResult, SamplingParams
from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

KILLED = "1 worker(s) were killed due to the node running low on memory"


class Engine:
    """Answers at once; `killed_on` (a method, or "generate") raises as a memory-killed actor's calls do."""

    def __init__(self, name: str, killed_on: str = ""):
        self.name, self.killed_on = name, killed_on
        self.loaded: list = []
        self.call = SimpleNamespace(remote=self._call)
        self.generate = SimpleNamespace(remote=self._generate)

    async def _call(self, method, *args):
        if method == self.killed_on:
            raise ray.exceptions.OutOfMemoryError(KILLED)
        if method == "update_weights_from_disk":
            self.loaded.append(args)
        return True

    async def _generate(self, input_ids, sampling, rid=None, session=None):
        if self.killed_on == "generate":
            raise ray.exceptions.OutOfMemoryError(KILLED)
        return GenerateResult(output_ids=[7], logprobs=[-0.1], finish_reason="stop", weight_version=0, engine=self.name)


def _run_until(loop, condition, what: str, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s  # restarts run in the background
    while not condition() and time.monotonic() < deadline:
        loop.run_until_complete(asyncio.sleep(0.05))
    assert condition(), what


def _fleet(spawned: list, killed: dict) -> RolloutFleet:
    def spawn(spec, index, incarnation):
        engine = Engine(f"e{index}.{incarnation}", killed.get((index, incarnation), ""))
        spawned.append(engine)
        return engine

    specs = [EngineSpec(kind="local", model_config={}) for _ in range(2)]
    return RolloutFleet(specs, spawn=spawn, request_timeout_s=30, engine_call_timeout_s=30)


def test_an_engine_killed_for_memory_during_a_weight_update_is_restarted_and_the_update_replayed():
    spawned: list[Engine] = []
    loop = asyncio.new_event_loop()
    try:
        fleet = _fleet(spawned, {(1, 0): "update_weights_from_disk"})
        version = loop.run_until_complete(asyncio.wait_for(fleet.update_weights_from_disk("/w/v1"), 120))
        assert version == 1 and fleet.metrics()["engine_failures"] == 1
        _run_until(loop, lambda: fleet.num_alive == 2, "the killed engine was not restarted")
        assert fleet.metrics()["restarts"] == 1
        assert spawned[-1].name == "e1.1" and spawned[-1].loaded == [("/w/v1", 1)]  # replayed on the replacement
        assert spawned[0].loaded == [("/w/v1", 1)]
    finally:
        loop.close()


def test_a_request_on_an_engine_killed_for_memory_is_retried_on_another():
    spawned: list[Engine] = []
    loop = asyncio.new_event_loop()
    try:
        fleet = _fleet(spawned, {(0, 0): "generate", (1, 0): "generate"})  # both first engines die
        result = loop.run_until_complete(
            asyncio.wait_for(fleet.generate([1, 2], SamplingParams(max_new_tokens=1), rid="r0"), 120)
        )
        assert result.engine.endswith(".1") and result.output_ids == [7]
        assert fleet.metrics()["engine_failures"] == 2
    finally:
        loop.close()
