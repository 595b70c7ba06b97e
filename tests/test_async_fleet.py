"""Partial rollouts through the Ray fleet: a weight update pauses in-flight turns instead of
waiting for them, and the steps of an agent loop carry the versions of their tokens.

Marked slow: starting Ray and an engine actor takes ~20 s on a 2-core machine.
"""

import asyncio

import pytest

from megatron_stepwise.envs.tiny_tokenizers import load_tokenizer
from megatron_stepwise.rollout.engine import SamplingParams
from megatron_stepwise.rollout.fleet import EngineSpec, RolloutFleet
from megatron_stepwise.rollout.hf_model import build_causal_lm, tiny_qwen2_config

pytestmark = pytest.mark.slow

TOK = load_tokenizer("tiny_word")
CONFIG = tiny_qwen2_config(len(TOK))
LONG = SamplingParams(max_new_tokens=900)  # no EOS in the config: the turn runs to its full length


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    import ray

    yield
    ray.shutdown()


def test_partial_rollout_update_pauses_in_flight_turns_and_drain_mode_waits():
    new_weights = build_causal_lm(CONFIG, seed=9).state_dict()

    async def scenario():
        fleet = RolloutFleet([EngineSpec(model_config=CONFIG, seed=0, num_cpus=0.5)], request_timeout_s=300)
        await fleet.wait_ready()
        results = {}
        for partial in (True, False):
            fleet.partial_rollouts = partial
            turn = asyncio.create_task(fleet.generate([1, 5, 8, 2], LONG, rid=f"long-{partial}"))
            await asyncio.sleep(1.0)  # the turn is being decoded on the engine
            version = await fleet.update_weights_from_tensors(new_weights)
            done_when_updated = turn.done()
            results[partial] = (version, done_when_updated, await turn)
        await fleet.shutdown()
        return results

    results = asyncio.run(scenario())
    version, done, r = results[True]
    k = r.token_weight_versions.count(0)
    # partial rollouts: the update did not wait for the turn, which continued with version 1
    # (whether the update's reply beats the turn's end is timing, so `done` is not checked here)
    assert version == 1
    assert 0 < k < LONG.max_new_tokens and r.token_weight_versions == [0] * k + [1] * (LONG.max_new_tokens - k)
    # drain mode (synchronous training): the update waited until the turn had finished
    version, done, r = results[False]
    assert version == 2 and done and set(r.token_weight_versions) == {1}
