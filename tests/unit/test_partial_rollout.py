"""Partial rollouts on the embedded engine: a weight update in the middle of a turn.

Generation is held after an exact number of tokens (`pause_after`), new weights are loaded,
generation resumes: every request keeps the tokens it had, continues to its full length, and
each token carries the version (and the exact log-prob) of the weights that were loaded when it
was drawn. The pause points are exact whatever the machine's speed.
"""

import asyncio
import copy

import pytest
import torch
from helpers import tiny_lm
from oracles import teacher_forced_logprobs

from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm
from megatron_stepwise.rollout.engines.protocol import SamplingParams

_, CONFIG = tiny_lm("tiny_char")
PROMPTS = [[1, 30, 31, 32], [1, 40, 41], [1, 50, 51, 52, 53, 54, 55]]
NEW_TOKENS = 40
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
DEADLINE_S = 120.0


async def wait_held(engine, rid, num_tokens, task):
    """Wait until the engine holds request `rid` after exactly `num_tokens` tokens (armed with
    `pause_after`); the count it reports never passes the pause point."""
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while (n := await engine.decoded_tokens(rid)) != num_tokens:
        if task.done():
            task.result()  # raises the request's error
            pytest.fail(f"request {rid} finished before it was held at {num_tokens} tokens")
        assert n is None or n < num_tokens, n
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"request {rid} not held at {num_tokens} tokens after {DEADLINE_S} s (at {n})")
        await asyncio.sleep(0.01)


async def _update_mid_generation(engine, new_weights, rids, hold_at):
    # The three requests share one batch (one token each per decode step): holding the first
    # after `hold_at` tokens holds every one of them after `hold_at` tokens.
    await engine.pause_after(rids[0], hold_at)  # armed before the requests exist
    tasks = [asyncio.create_task(engine.generate(p, PARAMS, rid=rid)) for p, rid in zip(PROMPTS, rids)]
    await wait_held(engine, rids[0], hold_at, tasks[0])
    held = [await engine.decoded_tokens(rid) for rid in rids]
    version = await engine.update_weights_from_tensors(new_weights)  # returns once no decode step runs
    await engine.resume()
    return version, held, await asyncio.gather(*tasks)


def test_weight_update_mid_turn_continues_with_new_weights_and_versions():
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=3)
    old_model = copy.deepcopy(engine.model)
    new_model = build_causal_lm(CONFIG, seed=11)
    new_weights = {k: v.clone() for k, v in new_model.state_dict().items()}
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    # The same engine without the update draws the same first tokens (same seed, same batch):
    # what each request had drawn when it was held.
    reference = LocalEngine(CONFIG, eos_token_ids=[], seed=3)

    async def uninterrupted():
        try:
            return await asyncio.gather(*(reference.generate(p, PARAMS, rid=r) for p, r in zip(PROMPTS, rids)))
        finally:
            await reference.close()

    drawn = [r.output_ids for r in asyncio.run(uninterrupted())]

    version, held, results = asyncio.run(_update_mid_generation(engine, new_weights, rids, hold_at=5))
    assert held == [5] * len(PROMPTS)
    prefixes = [out[:k] for out, k in zip(drawn, held)]

    assert version == 1
    for prompt, prefix, r in zip(PROMPTS, prefixes, results):
        k = len(prefix)
        assert 5 <= k < NEW_TOKENS
        # continued, not restarted: the tokens drawn before the pause are kept, the turn runs to full length
        assert r.output_ids[:k] == prefix and len(r.output_ids) == NEW_TOKENS and r.finish_reason == "length"
        assert r.token_weight_versions == [0] * k + [1] * (NEW_TOKENS - k)
        assert r.weight_version == 1
        got = torch.tensor(r.logprobs)
        old = teacher_forced_logprobs(old_model, prompt, r.output_ids)
        new = teacher_forced_logprobs(new_model, prompt, r.output_ids)
        torch.testing.assert_close(got[:k], old[:k], atol=1e-4, rtol=0)
        torch.testing.assert_close(got[k:], new[k:], atol=1e-4, rtol=0)
        # the two models disagree on these tokens, so the check above tells them apart
        assert (old[k:] - new[k:]).abs().max() > 1e-2


def test_two_updates_in_one_turn_give_three_version_runs():
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=5)
    models = [build_causal_lm(CONFIG, seed=s) for s in (21, 22)]

    holds = (4, 12)  # the first update after 4 tokens, the second 8 tokens later

    async def scenario():
        await engine.pause_after("a", holds[0])
        task = asyncio.create_task(engine.generate(PROMPTS[0], PARAMS, rid="a"))
        cuts = []
        for i, m in enumerate(models):
            await wait_held(engine, "a", holds[i], task)
            await engine.update_weights_from_tensors({k: v.clone() for k, v in m.state_dict().items()})
            cuts.append(await engine.decoded_tokens("a"))
            if i + 1 < len(holds):
                await engine.pause_after("a", holds[i + 1])  # armed while still held
            await engine.resume()
        return cuts, await task

    (c1, c2), r = asyncio.run(scenario())
    assert 0 < c1 < c2 < NEW_TOKENS
    assert r.token_weight_versions == [0] * c1 + [1] * (c2 - c1) + [2] * (NEW_TOKENS - c2)
    got = torch.tensor(r.logprobs)
    for model, (a, b) in zip(models, ((c1, c2), (c2, NEW_TOKENS))):
        torch.testing.assert_close(
            got[a:b], teacher_forced_logprobs(model, PROMPTS[0], r.output_ids)[a:b], atol=1e-4, rtol=0
        )
