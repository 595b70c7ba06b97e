"""Imported by a test run through `trainer.imports`: rank 0's fleet takes SLOW_FLEET_START_S longer
to answer its health checks, as a large model's engines or a busy node's would."""

import asyncio
import os

from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

DELAY_S = float(os.environ["SLOW_FLEET_START_S"])
_wait_ready = RolloutFleet.wait_ready


async def _slow_wait_ready(self, *args, **kwargs):
    await asyncio.sleep(DELAY_S)
    return await _wait_ready(self, *args, **kwargs)


RolloutFleet.wait_ready = _slow_wait_ready
