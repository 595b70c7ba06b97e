"""Continuous batching in the embedded engine (rollout/engines/embedded/engine.py): a request arriving while
a batch decodes joins it at the next step, finished rows leave it, a short prompt passes long ones
in the queue, a cancelled caller stops its generation, and none of it changes a token or a log-prob.

Arrivals are staggered deterministically: `pause_after` holds the engine at a known token count,
the next request is queued while it is held, then decoding resumes."""

import asyncio

import pytest
from helpers import tiny_lm

from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.protocol import SamplingParams

TOK, CONFIG = tiny_lm("tiny_char")
DEADLINE_S = 120.0


pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def until(condition, what, deadline_s=DEADLINE_S):
    """Poll `condition()` (sync or async) until true, failing with `what` after the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while True:
        got = condition()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        assert loop.time() < deadline, f"not within {deadline_s} s: {what}"
        await asyncio.sleep(0.005)


async def arrived(engine, rid):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while await engine.decoded_tokens(rid) is None:
        assert loop.time() < deadline, f"request {rid} never arrived"
        await asyncio.sleep(0.005)


async def held_at(engine, rid, n):
    """Until the engine is paused with request `rid` at exactly n tokens (set by pause_after)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while (got := await engine.decoded_tokens(rid)) != n:
        assert got is None or got < n, f"request {rid} went past {n} tokens: {got}"
        assert loop.time() < deadline, f"request {rid} did not reach {n} tokens (at {got})"
        await asyncio.sleep(0.005)


@pytest.mark.timeout(300)
def test_a_request_arriving_mid_batch_joins_it_and_finishes_first():
    async def scenario():
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=200)
        await engine.pause_after("long", 5)
        long = asyncio.create_task(engine.generate([1, 30, 31, 32], greedy, rid="long"))
        await held_at(engine, "long", 5)
        short = asyncio.create_task(
            engine.generate([1, 40, 41], SamplingParams(temperature=0.0, max_new_tokens=3), rid="short")
        )
        await arrived(engine, "short")
        await engine.resume()
        assert len((await short).output_ids) == 3
        # the short request did not wait for the long one: it joined its batch at the next step
        assert not long.done() and 5 < await engine.decoded_tokens("long") < 200
        assert engine.scheduler_stats()["joined_running_batch"] == 1
        assert len((await long).output_ids) == 200
        await engine.close()

    asyncio.run(scenario())


async def staggered(engine, params, trajectories=4, turns=3):
    """Agent-like traffic whose trajectories start one by one, each while the previous one's first
    turn is held mid-decode (at 2 tokens): every trajectory and every later turn joins a running
    batch whose rows have other lengths, prefix-cache hits and misses mixed."""

    async def trajectory(j):
        ids, out = [1, 30 + j, 31, 32 + j][: 2 + j % 3], []
        for turn in range(turns):
            r = await engine.generate(ids, params(j, turn), rid=f"t{j}/{turn}")
            out.append(r)
            ids = ids + r.output_ids + [5, 40 + turn]
        return out

    tasks = []
    for j in range(trajectories):
        last = j + 1 == trajectories
        if not last:
            await engine.pause_after(f"t{j}/0", 2)
        tasks.append(asyncio.create_task(trajectory(j)))
        await arrived(engine, f"t{j}/0")
        if j:
            await engine.resume()  # the previous trajectory was held: both decode from here
        if not last:
            await held_at(engine, f"t{j}/0", 2)
    return await asyncio.gather(*tasks)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("greedy", [False, True], ids=["seeded-T1", "greedy"])
def test_staggered_arrivals_change_no_token_and_no_logprob(greedy):
    def params(j, turn):
        if greedy:
            return SamplingParams(temperature=0.0, max_new_tokens=6 + 3 * j)
        return SamplingParams(temperature=1.0, max_new_tokens=6 + 3 * j, sampling_seed=100 * turn + j)

    async def alone():
        """The unbatched path: every request on its own, no prefix cache."""
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0, prefix_cache_tokens=0, max_batch_size=1)
        out = []
        for j in range(4):
            ids, turns = [1, 30 + j, 31, 32 + j][: 2 + j % 3], []
            for turn in range(3):
                r = await engine.generate(ids, params(j, turn))
                turns.append(r)
                ids = ids + r.output_ids + [5, 40 + turn]
            out.append(turns)
        await engine.close()
        return out

    async def continuous():
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0, prefix_cache_tokens=10_000)
        try:
            return await staggered(engine, params), engine.scheduler_stats(), engine.cache_stats()
        finally:
            await engine.close()

    ref = asyncio.run(alone())
    got, sched, cache = asyncio.run(continuous())
    for a, b in zip(ref, got):
        for x, y in zip(a, b):
            assert x.output_ids == y.output_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5, rel=0)
    assert sched["joined_running_batch"] >= 3  # the staggered first turns at least
    assert cache["cached_tokens"] > 0  # later turns were served from the prefix cache


@pytest.mark.timeout(300)
def test_a_short_prompt_passes_long_prompts_queued_before_it():
    """The prefill budget admits the oldest request whatever its size, then later ones that fit:
    a short prompt behind long ones starts at once instead of waiting for a free slot."""

    async def scenario():
        engine = LocalEngine(
            CONFIG, eos_token_ids=[], seed=0, max_batch_size=2, max_prefill_tokens=64, prefix_cache_tokens=0
        )
        await engine.pause()
        long_params = SamplingParams(temperature=0.0, max_new_tokens=30)
        longs = [
            asyncio.create_task(engine.generate([1] + [20 + i] * 99, long_params, rid=f"long{i}")) for i in range(3)
        ]
        short = asyncio.create_task(
            engine.generate([1, 40, 41], SamplingParams(temperature=0.0, max_new_tokens=2), rid="short")
        )
        for rid in ("long0", "long1", "long2", "short"):
            await arrived(engine, rid)
        assert engine.scheduler_stats()["queued_prompt_tokens"] == 303
        await engine.resume()
        assert len((await short).output_ids) == 2
        # long0 (the oldest) and short shared the first batch; long1 had not started
        assert await engine.decoded_tokens("long0") >= 1 and await engine.decoded_tokens("long1") == 0
        assert [len(r.output_ids) for r in await asyncio.gather(*longs)] == [30, 30, 30]
        await engine.close()

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_a_cancelled_caller_stops_its_generation_and_is_counted():
    async def scenario():
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
        params = SamplingParams(temperature=0.0, max_new_tokens=1000)
        await engine.pause_after("gone", 3)
        task = asyncio.create_task(engine.generate([1, 30, 31], params, rid="gone"))
        await held_at(engine, "gone", 3)
        await engine.pause()
        queued_task = asyncio.create_task(engine.generate([1, 40], params, rid="never"))
        await arrived(engine, "never")
        task.cancel()
        queued_task.cancel()
        await engine.resume()
        await until(lambda: engine.scheduler_stats()["running"] == 0, "the cancelled row left the batch")
        stats = engine.scheduler_stats()
        assert stats["cancelled_requests"] == 2 and stats["queued"] == 0
        assert await engine.decoded_tokens("gone") is None and await engine.decoded_tokens("never") is None
        # the engine serves on, and a cancelled rid can be used again
        again = await engine.generate([1, 30, 31], SamplingParams(temperature=0.0, max_new_tokens=4), rid="gone")
        assert len(again.output_ids) == 4 and await engine.health()
        await engine.close()

    asyncio.run(scenario())
