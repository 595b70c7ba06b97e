"""The embedded engine's prefix cache (rollout/engines/embedded/prefix_cache.py) and session-affine routing
(rollout/fleet/engine_router.py): a cached prefix changes no sampled token and no log-prob; weight loads,
flush_cache and a released kv_cache empty it; a session's turns stay on its engine unless that
engine is dead or too busy."""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_lm

from megatron_stepwise.hf.presets import tiny_config
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm
from megatron_stepwise.rollout.engines.embedded.prefix_cache import PrefixCache
from megatron_stepwise.rollout.engines.protocol import GenerateResult, SamplingParams
from megatron_stepwise.rollout.fleet.engine_router import EngineRouter, EngineSlot

TOK, CONFIG = tiny_lm("tiny_char")


async def multi_turn(engine, params, turns=3, prompts=5):
    """Agent-like traffic: each turn's prompt is the previous prompt + response + an observation;
    from turn 1 on, a new trajectory joins each batch (a miss next to hits)."""
    seqs = [[1, 30 + i, 31, 32 + i][: 2 + i % 3] for i in range(prompts)]
    out = []
    for turn in range(turns):
        seqs.append([3 + turn, 70, 71])  # shares no first token with the others
        res = await asyncio.gather(*(engine.generate(s, params(i, turn)) for i, s in enumerate(seqs)))
        out.append(res)
        seqs = [s + r.output_ids + [5, 40 + turn] for s, r in zip(seqs, res)]
    return out


@pytest.mark.parametrize("greedy", [False, True], ids=["seeded-T1", "greedy"])
def test_cached_prefixes_change_no_token_and_no_logprob(greedy):
    def params(i, turn):
        if greedy:
            return SamplingParams(temperature=0.0, max_new_tokens=5 + i)
        return SamplingParams(temperature=1.0, max_new_tokens=5 + i, sampling_seed=100 * turn + i)

    async def go(budget):
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0, prefix_cache_tokens=budget)
        try:
            return await multi_turn(engine, params), engine.cache_stats()
        finally:
            await engine.close()

    (off, off_stats), (on, on_stats) = asyncio.run(go(0)), asyncio.run(go(10_000))
    for turn, (a, b) in enumerate(zip(off, on)):
        for x, y in zip(a, b):
            assert x.output_ids == y.output_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5, rel=0)
            assert x.cached_tokens == 0
        # every trajectory from turn 1 on hits: all its previous turn but the last sampled token
        assert [y.cached_tokens > 0 for y in b] == [turn > 0] * (len(b) - 1) + [False]
    assert off_stats["prompt_tokens"] == on_stats["prompt_tokens"] and off_stats["cached_tokens"] == 0
    assert on_stats["cached_tokens"] == sum(y.cached_tokens for t in on for y in t) > on_stats["computed_tokens"]
    assert on_stats["entries"] == len(on[-1])  # one entry per trajectory: a newer turn drops the older


def test_moe_routed_experts_of_cached_positions_are_returned():
    """Routing replay needs every position's experts: a hit returns the stored ones for its prefix."""
    cfg = tiny_config(model_type="qwen3_moe", vocab_size=len(TOK))

    async def go(budget):
        engine = LocalEngine(cfg, eos_token_ids=[], seed=2, record_routed_experts=True, prefix_cache_tokens=budget)
        try:
            return await multi_turn(engine, lambda i, t: SamplingParams(temperature=0.0, max_new_tokens=4), 2, 3)
        finally:
            await engine.close()

    off, on = asyncio.run(go(0)), asyncio.run(go(10_000))
    assert any(y.cached_tokens for y in on[1])
    for x, y in zip(off[1], on[1]):
        assert x.output_ids == y.output_ids and torch.equal(x.routed_experts, y.routed_experts)


def test_weight_loads_flush_and_released_kv_cache_empty_the_cache():
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    prompt = [1, 30, 31, 32]

    async def go():
        first = await engine.generate(prompt, greedy)
        again = await engine.generate(prompt + first.output_ids, greedy)
        assert again.cached_tokens == len(prompt) + 3 and engine.cache_stats()["entries"] == 1
        await engine.update_weights_from_tensors(build_causal_lm(CONFIG, seed=5).state_dict())
        assert engine.cache_stats()["entries"] == 0
        fresh = await engine.generate(prompt, greedy)  # new weights: computed, not served
        assert fresh.cached_tokens == 0 and engine.cache_stats()["entries"] == 1
        await engine.flush_cache()
        assert engine.cache_stats()["entries"] == 0
        await engine.generate(prompt, greedy)
        await engine.release_memory_occupation(["kv_cache"])
        assert engine.cache_stats()["entries"] == 0
        await engine.resume_memory_occupation(["kv_cache"])
        assert engine.model_info()["prefix_cache"]["tokens"] == 0
        await engine.close()

    asyncio.run(go())


def _entry(n):
    return [(torch.zeros(1, n, 2), torch.zeros(1, n, 2))]


def test_store_keeps_the_longest_prefix_and_evicts_the_least_recently_used():
    store = PrefixCache(10)
    store.insert([1, 2, 3], _entry(3))
    store.insert([1, 2, 3, 4, 5], _entry(5))  # covers [1, 2, 3]: that entry goes
    store.insert([1, 2, 9], _entry(3))
    assert len(store.entries) == 2 and store.tokens == 8
    entry, n = store.lookup([1, 2, 3, 4, 7], limit=4)
    assert n == 4 and entry.tokens.tolist() == [1, 2, 3, 4, 5]
    assert store.lookup([1, 2, 3, 4, 5, 6], limit=3)[1] == 3  # never more than the limit
    assert store.lookup([7, 1, 2], limit=2) == (None, 0)
    store.insert([6, 6, 6], _entry(3))  # 11 > 10 tokens: the least recently used ([1, 2, 9]) goes
    assert [e.tokens.tolist() for e in store.entries.values()] == [[1, 2, 3, 4, 5], [6, 6, 6]]
    store.insert(list(range(11)), _entry(11))  # larger than the whole budget: not kept
    assert store.tokens == 8 and store.stats()["evicted_tokens"] == 3


class _Engine:
    """A Ray-handle look-alike: `generate.remote(...)` is awaited by the router."""

    def __init__(self, index):
        self.index = index
        self.generate = SimpleNamespace(remote=self._generate)

    async def _generate(self, input_ids, sampling, rid, session):
        return GenerateResult(output_ids=[1], logprobs=[0.0], finish_reason="stop", engine=str(self.index))


def test_a_session_sticks_to_its_engine_while_alive_and_not_much_busier():
    slots = [EngineSlot(i, _Engine(i)) for i in range(3)]
    router = EngineRouter(slots, max_retries=0, request_timeout_s=5, on_dead=lambda s, i: None, sticky_slack=2)
    params = SamplingParams(max_new_tokens=1)

    def turn(session):
        return int(asyncio.run(router.generate([1, 2], params, session=session)).engine)

    slots[0].outstanding = slots[1].outstanding = 1
    assert turn("a") == 2  # a new session: the least busy engine
    slots[2].outstanding = 3
    assert turn("a") == 2  # two more than the least busy: still its engine
    slots[2].outstanding = 4
    assert turn("a") == 0  # three more: the least busy one, which the session now sticks to
    slots[0].outstanding = 2
    assert turn("a") == 0
    slots[0].alive = False  # never a dead engine: the least busy live one
    router.forget(0)
    assert turn("a") == 1
    assert router.counters.requests == 5 and router.counters.prompt_tokens == 10
    small = EngineRouter(slots, max_retries=0, request_timeout_s=5, on_dead=lambda s, i: None, max_sessions=2)
    for s in ("x", "y", "z"):
        small.remember(s, 1)
    assert list(small.sticky) == ["y", "z"]  # the least recently served session is forgotten


def test_the_cache_budget_is_the_config_key_rollout_embedded_cache_tokens(monkeypatch):
    from megatron_stepwise.compose import components
    from megatron_stepwise.config import load_config
    from megatron_stepwise.config.errors import ConfigError
    from megatron_stepwise.rollout.fleet import fleet

    with pytest.raises(ConfigError, match="rollout.embedded_cache_tokens"):
        load_config("configs/tiny_cpu.yaml", ["rollout.embedded_cache_tokens=-1"], world_size=1)
    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.embedded_cache_tokens=123"], world_size=1)
    specs = []
    monkeypatch.setattr(fleet, "RolloutFleet", lambda s, **kw: specs.extend(s))  # no Ray: the specs only
    tok = components.load_tokenizer(cfg)
    components.build_fleet(cfg, components.policy_model(cfg, tok), tok)
    assert specs and {s.prefix_cache_tokens for s in specs} == {123}
    actor = fleet.EngineActor(fleet.EngineSpec(kind="local", model_config=CONFIG, prefix_cache_tokens=123), "e0")
    assert actor.engine.cache_stats()["max_tokens"] == 123
