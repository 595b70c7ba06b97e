"""A fleet that loses every engine restarts them (bounded) or ends with one line naming why.

The real `RolloutFleet` over fake engine handles (no Ray actors): a handle's requests succeed,
or fail as a dead Ray actor does.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import ray.exceptions

from megatron_stepwise.rollout.engines.protocol import (
    FleetLost,
    GenerateResult,
    NoLiveEngine,
    SamplingParams,
    engine_loss,
)
from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
from megatron_stepwise.rollout.fleet.fleet import RolloutFleet


class FakeEngine:
    """`generate.remote` / `call.remote` as on an engine actor; a dead one raises RayActorError."""

    def __init__(self, name: str, dead: bool = False):
        self.name, self.dead = name, dead
        self.generate = SimpleNamespace(remote=self._generate)
        self.call = SimpleNamespace(remote=self._call)

    async def _generate(self, input_ids, sampling, rid=None, session=None):
        if self.dead:
            raise ray.exceptions.RayActorError()
        return GenerateResult(output_ids=[7], logprobs=[-0.1], finish_reason="stop", weight_version=0, engine=self.name)

    async def _call(self, method, *args):
        if self.dead:
            raise ray.exceptions.RayActorError()
        return True if method == "health" else None


SPECS = [EngineSpec(kind="local", model_config={}) for _ in range(2)]


def fleet_with(spawn, **kwargs) -> RolloutFleet:
    return RolloutFleet(SPECS, spawn=spawn, request_timeout_s=30, **kwargs)


def generate(fleet):
    return fleet.generate([1, 2], SamplingParams(max_new_tokens=1), rid="r0")


def test_losing_every_engine_restarts_them_and_the_request_is_served():
    spawned = []

    def spawn(spec, index, incarnation):
        spawned.append((index, incarnation))
        return FakeEngine(f"e{index}.{incarnation}", dead=incarnation == 0)  # the first ones all die

    async def scenario():
        fleet = fleet_with(spawn, max_retries=1)
        result = await generate(fleet)
        return fleet, result

    fleet, result = asyncio.run(scenario())
    assert result.engine.endswith(".1") and fleet.num_alive >= 1
    assert fleet.metrics()["restarts"] >= 1 and fleet.metrics()["engine_failures"] == 2


def test_engines_whose_restart_fails_end_the_request_with_one_line_naming_each_cause():
    def spawn(spec, index, incarnation):
        if incarnation > 0:
            raise RuntimeError("no GPU left on the node\n  (a long traceback here)")
        return FakeEngine(f"e{index}", dead=True)

    with pytest.raises(FleetLost) as e:
        asyncio.run(generate(fleet_with(spawn)))
    message = str(e.value)
    assert "\n" not in message
    assert "engine 0: died, and its restart failed (RuntimeError: no GPU left on the node)" in message
    assert "engine 1: died, and its restart failed" in message


def test_restarts_are_bounded_per_engine():
    spawned = []

    def spawn(spec, index, incarnation):
        spawned.append(incarnation)
        return FakeEngine(f"e{index}.{incarnation}", dead=True)  # dies on every request, healthy never

    async def scenario():
        fleet = fleet_with(spawn, max_restarts=2, max_retries=10)
        # a restarted engine passes its health check only if alive: these never do
        with pytest.raises(FleetLost, match=r"every rollout engine is gone \(engine 0: .*; engine 1: .*\)"):
            await generate(fleet)
        await fleet.wait_restarts()
        return fleet

    fleet = asyncio.run(scenario())
    assert max(spawned) <= 2 and fleet.num_alive == 0


def test_an_engine_that_keeps_dying_after_restarts_is_removed_at_the_limit():
    def spawn(spec, index, incarnation):
        engine = FakeEngine(f"e{index}.{incarnation}")
        # healthy when checked, dead for every request
        engine.generate = SimpleNamespace(remote=lambda *a, **k: _dead())
        return engine

    async def _dead():
        raise ray.exceptions.RayActorError()

    async def scenario():
        fleet = fleet_with(spawn, max_restarts=2, max_retries=20)
        with pytest.raises(FleetLost, match="died again after 2 restarts"):
            await generate(fleet)
        return fleet

    fleet = asyncio.run(scenario())
    assert fleet.metrics()["restarts"] == 4 and fleet.metrics()["removed_engines"] == 2


def test_the_engine_loss_is_found_inside_exception_groups_and_causes():
    lost = FleetLost("every rollout engine is gone (engine 0: died)")
    wrapped = RuntimeError("task failed")
    wrapped.cause = lost  # as Ray's RayTaskError carries the remote error
    group = ExceptionGroup("rollout", [ValueError("x"), ExceptionGroup("inner", [NoLiveEngine("no live"), wrapped])])
    assert engine_loss(group) is lost
    assert isinstance(engine_loss(ExceptionGroup("g", [NoLiveEngine("no live")])), NoLiveEngine)
    assert engine_loss(ExceptionGroup("g", [ValueError("x")])) is None
