"""Partial rollouts on the embedded engine: a weight update in the middle of a turn.

Generation is paused after a few tokens, new weights are loaded, generation resumes: every
request keeps the tokens it had, continues to its full length, and each token carries the
version (and the exact log-prob) of the weights that were loaded when it was drawn.
"""

import asyncio
import copy

import torch

from megatron_stepwise.envs.tiny_tokenizers import load_tokenizer
from megatron_stepwise.rollout.engine import SamplingParams
from megatron_stepwise.rollout.hf_model import build_causal_lm, tiny_qwen2_config
from megatron_stepwise.rollout.local import LocalEngine

TOK = load_tokenizer("tiny_char")
CONFIG = tiny_qwen2_config(len(TOK))
PROMPTS = [[1, 30, 31, 32], [1, 40, 41], [1, 50, 51, 52, 53, 54, 55]]
NEW_TOKENS = 40


def teacher_forced_logprobs(model, prompt, output, temperature=1.0):
    """log_softmax(logits / T) of each output token given everything before it (one unpadded pass)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0]


async def _update_mid_generation(engine, new_weights, rids, min_tokens):
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
    tasks = [asyncio.create_task(engine.generate(p, params, rid=rid)) for p, rid in zip(PROMPTS, rids)]
    while not all(rid in engine._inflight and len(engine._inflight[rid].output_ids) >= min_tokens for rid in rids):
        await asyncio.sleep(0.001)
    await engine.pause()
    version = await engine.update_weights_from_tensors(new_weights)  # returns once no decode step runs
    prefixes = [list(engine._inflight[rid].output_ids) for rid in rids]
    await engine.resume()
    return version, prefixes, await asyncio.gather(*tasks)


def test_weight_update_mid_turn_continues_with_new_weights_and_versions():
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=3)
    old_model = copy.deepcopy(engine.model)
    new_model = build_causal_lm(CONFIG, seed=11)
    new_weights = {k: v.clone() for k, v in new_model.state_dict().items()}
    rids = [f"r{i}" for i in range(len(PROMPTS))]

    version, prefixes, results = asyncio.run(_update_mid_generation(engine, new_weights, rids, min_tokens=5))

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

    async def scenario():
        params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
        task = asyncio.create_task(engine.generate(PROMPTS[0], params, rid="a"))
        cuts = []
        for i, m in enumerate(models):
            while "a" not in engine._inflight or len(engine._inflight["a"].output_ids) < 4 * (i + 1) + (cuts[-1] if cuts else 0):
                await asyncio.sleep(0.001)
            await engine.pause()
            await engine.update_weights_from_tensors({k: v.clone() for k, v in m.state_dict().items()})
            cuts.append(len(engine._inflight["a"].output_ids))
            await engine.resume()
        return cuts, await task

    (c1, c2), r = asyncio.run(scenario())
    assert 0 < c1 < c2 < NEW_TOKENS
    assert r.token_weight_versions == [0] * c1 + [1] * (c2 - c1) + [2] * (NEW_TOKENS - c2)
    got = torch.tensor(r.logprobs)
    for model, (a, b) in zip(models, ((c1, c2), (c2, NEW_TOKENS))):
        torch.testing.assert_close(got[a:b], teacher_forced_logprobs(model, PROMPTS[0], r.output_ids)[a:b],
                                   atol=1e-4, rtol=0)
