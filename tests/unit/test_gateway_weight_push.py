"""A weight push with a gateway call in flight: the call does not fail, and every token it
sampled records the weight version that sampled it (the call held at a known token whatever the
machine's speed: the engine's `pause_after`)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from megatron_stepwise.gateway.server import GatewaySettings
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from tests.gateway_fixtures import Served
from tests.helpers import tiny_lm

TOK, CONFIG = tiny_lm("tiny_bpe")
HOLD_AT, NEW_TOKENS, DEADLINE_S = 4, 12, 120.0


class HoldFirst:
    """Forwards to `engine`, arming a pause after the first request's HOLD_AT-th token."""

    def __init__(self, engine):
        self.engine, self.rid = engine, None

    async def generate(self, input_ids, sampling, rid=None, session=None):
        if self.rid is None:
            self.rid = rid
            await self.engine.pause_after(rid, HOLD_AT)
        return await self.engine.generate(input_ids, sampling, rid=rid, session=session)


@pytest.mark.parametrize("mode", ["retract", "abort"])
def test_a_push_mid_call_fails_nothing_and_versions_every_token(mode):
    engine = LocalEngine(CONFIG, tokenizer=TOK, eos_token_ids=[], seed=0)  # never stops early
    held = HoldFirst(engine)
    settings = GatewaySettings(sampling=SamplingParams(max_new_tokens=NEW_TOKENS), max_input_length=1024)
    served = Served(held, TOK, settings, engine=engine)
    new_weights = {k: v.clone() for k, v in build_causal_lm(CONFIG, seed=11).state_dict().items()}
    try:
        url = served.open("push")

        async def push_mid_call():
            client = openai.AsyncOpenAI(base_url=url, api_key=served.gateway.api_key, max_retries=0)
            call = asyncio.create_task(
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            )
            deadline = asyncio.get_running_loop().time() + DEADLINE_S
            while held.rid is None or await engine.decoded_tokens(held.rid) != HOLD_AT:
                assert not call.done(), "the call ended before it was held"
                assert asyncio.get_running_loop().time() < deadline, "the call was never held"
                await asyncio.sleep(0.01)
            if mode == "abort":
                await engine.pause("abort")  # ends it now: the gateway continues it from its tokens
            await engine.update_weights_from_tensors(new_weights, weight_version=1)
            await engine.resume()
            return await call

        answer = served.run(push_mid_call())
        assert answer.usage.completion_tokens == NEW_TOKENS and answer.choices[0].finish_reason == "length"
        (step,) = served.gateway.finish(url, 0.0)
        versions = step.weight_versions.tolist()
        assert versions[:NEW_TOKENS] == [0] * HOLD_AT + [1] * (NEW_TOKENS - HOLD_AT)
        received = served.recording.calls
        assert step.prompt_ids.tolist() == received[0][0]
        assert step.response_ids.tolist()[:NEW_TOKENS] == [t for c in received for t in c[1]]
        assert len(received) == (2 if mode == "abort" else 1)  # abort: one continuation, one step
        assert not step.invalid_reason
    finally:
        served.close()
