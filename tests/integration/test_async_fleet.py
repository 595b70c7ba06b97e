"""Partial rollouts through the Ray fleet: a weight update pauses in-flight turns instead of
waiting for them, and the steps of an agent loop carry the versions of their tokens.

Marked slow: starting Ray and an engine actor takes ~20 s on a 2-core machine.
"""

import asyncio

import pytest
from helpers import tiny_lm

from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

_, CONFIG = tiny_lm("tiny_word")
TURN = SamplingParams(max_new_tokens=48)  # no EOS in the config: the turn runs to its full length
HOLD_AT = 8  # the engine is held after this many tokens of the turn, whatever the machine's speed
DEADLINE_S = 120.0


async def start_held_turn(fleet, engine, rid):
    """Start a turn that the engine holds (paused) after exactly HOLD_AT tokens, and wait for that."""
    await engine.call.remote("pause_after", rid, HOLD_AT)  # armed before the request exists
    turn = asyncio.create_task(fleet.generate([1, 5, 8, 2], TURN, rid=rid))
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while (n := await engine.call.remote("decoded_tokens", rid)) != HOLD_AT:
        if turn.done():
            turn.result()  # raises the turn's error
            pytest.fail(f"turn {rid} finished before it was held at {HOLD_AT} tokens")
        assert n is None or n < HOLD_AT, n  # the engine never decodes past the pause point
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"turn {rid} not held at {HOLD_AT} tokens after {DEADLINE_S} s (at {n})")
        await asyncio.sleep(0.01)
    return turn


@pytest.mark.timeout(600)  # a hang (a pause never lifted) fails instead of blocking the suite
def test_partial_rollout_update_pauses_in_flight_turns_and_drain_mode_waits():
    new_weights = build_causal_lm(CONFIG, seed=9).state_dict()

    async def scenario():
        fleet = RolloutFleet([EngineSpec(model_config=CONFIG, seed=0, num_cpus=0.5)], request_timeout_s=300)
        await fleet.wait_ready()
        engine = fleet.engine(0)  # the actor, to drive the embedded engine's `pause_after` / `decoded_tokens`
        out = {}
        # Partial rollouts: the update reaches the turn while the engine holds it after HOLD_AT
        # tokens; the update's own resume lets it continue with the new weights.
        fleet.partial_rollouts = True
        turn = await start_held_turn(fleet, engine, "long-partial")
        version = await asyncio.wait_for(fleet.update_weights_from_tensors(new_weights), DEADLINE_S)
        out["partial"] = (version, await asyncio.wait_for(turn, DEADLINE_S))
        # Drain mode: the update is requested while the turn is held mid-way; it must wait for
        # the turn to finish (on the old weights) before touching the engine.
        fleet.partial_rollouts = False
        turn = await start_held_turn(fleet, engine, "long-drain")
        update = asyncio.create_task(fleet.update_weights_from_tensors(new_weights))
        await asyncio.sleep(0)  # the update starts and waits for the in-flight turn
        held = (update.done(), turn.done())
        await engine.call.remote("resume")
        version = await asyncio.wait_for(update, DEADLINE_S)
        out["drain"] = (version, held, turn.done(), await turn)
        await fleet.shutdown()
        return out

    out = asyncio.run(scenario())
    version, r = out["partial"]
    n = TURN.max_new_tokens
    # partial rollouts: the update did not wait for the turn, which continued with version 1
    assert version == 1 and r.finish_reason == "length" and len(r.output_ids) == n
    assert r.token_weight_versions == [0] * HOLD_AT + [1] * (n - HOLD_AT) and r.weight_version == 1
    # drain mode (synchronous training): the update waited until the turn had finished
    version, held, done, r = out["drain"]
    assert held == (False, False)
    assert version == 2 and done and r.token_weight_versions == [1] * n and r.weight_version == 1
