"""A weight update never waits forever on one engine: a frozen one (SIGSTOPped, deadlocked) is
treated as dead after `engine_call_timeout_s`, killed and restarted, and the update replayed on
its replacement. The real fleet over stand-in engine handles (no Ray)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
from megatron_stepwise.rollout.fleet.fleet import RolloutFleet


class Engine:
    """Answers every call at once, except `freeze_on` calls, which never return."""

    def __init__(self, freeze_on: str = ""):
        self.freeze_on = freeze_on
        self.loaded: list = []
        self.call = SimpleNamespace(remote=self._call)

    async def _call(self, method, *args):
        if method == self.freeze_on:
            await asyncio.Event().wait()  # a frozen process: no answer, no error
        if method == "update_weights_from_disk":
            self.loaded.append(args)
        return True


def test_a_frozen_engine_is_restarted_and_the_update_completes():
    spawned: list[Engine] = []

    def spawn(spec, index, incarnation):
        # engine 1's first incarnation freezes while loading; its replacement does not
        engine = Engine("update_weights_from_disk" if (index, incarnation) == (1, 0) else "")
        spawned.append(engine)
        return engine

    loop = asyncio.new_event_loop()
    try:
        fleet = loop.run_until_complete(_fleet(spawn))
        start = time.monotonic()
        version = loop.run_until_complete(asyncio.wait_for(fleet.update_weights_from_disk("/w/v1"), 120))
        assert version == 1 and time.monotonic() - start < 60  # the bound (0.5 s), not forever
        metrics = fleet.metrics()
        assert metrics["frozen_engines"] == 1 and metrics["engine_failures"] == 1

        deadline = time.monotonic() + 60  # the restart runs in the background
        while fleet.num_alive < 2 and time.monotonic() < deadline:
            loop.run_until_complete(asyncio.sleep(0.05))
        assert fleet.num_alive == 2 and fleet.metrics()["restarts"] == 1
        replacement = spawned[-1]
        assert replacement is not spawned[1] and replacement.loaded == [("/w/v1", 1)]  # the update replayed
        assert spawned[0].loaded == [("/w/v1", 1)]
    finally:
        loop.close()


async def _fleet(spawn) -> RolloutFleet:
    specs = [EngineSpec(kind="local", model_config={}) for _ in range(2)]
    return RolloutFleet(specs, spawn=spawn, engine_call_timeout_s=0.5)
