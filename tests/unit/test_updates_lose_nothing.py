"""Weight updates in the middle of generation lose nothing (partial rollouts, embedded engine).

20 generations run concurrently in one embedded engine behind an in-process fleet while the fleet
updates the weights several times. In pause-continue mode (`pause_mode` retract or in_place) no
request is aborted (`aborted_by_update` 0): every one runs to its full length with tokens of
several versions. `pause_mode: abort` would end every one of them, and the counter says so. With
a staleness bound, an update drops exactly the requests that arrived before `version -
max_staleness` (`dropped_stale`, abort_reason "stale") instead of re-prefilling them; the newer
ones continue.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import tiny_lm
from in_process_fleet import in_process_fleet

from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm, save_safetensors_dir
from megatron_stepwise.rollout.engines.protocol import SamplingParams

_, CONFIG = tiny_lm("tiny_char")
CONCURRENT = 20
NEW_TOKENS = 24
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
DEADLINE_S = 300.0


def prompts(n: int, base: int = 0) -> list[list[int]]:
    return [[1, 10 + (base + i) % 40, 11 + i % 7, 12] for i in range(n)]


async def held(engine, rid: str, n: int, tasks) -> None:
    """Wait until the engine holds `rid` after exactly `n` tokens (armed with `pause_after`)."""
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not (await engine.decoded_tokens(rid) == n and engine.paused):
        for t in tasks:
            if t.done():
                t.result()
                pytest.fail(f"a request finished before {rid} was held at {n} tokens")
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"{rid} not held at {n} tokens after {DEADLINE_S} s")
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def weight_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return [str(save_safetensors_dir(build_causal_lm(CONFIG, seed=s), root / f"w{s}")) for s in (11, 12, 13)]


async def updates_during_generation(pause_mode: str, weight_dirs: list[str]):
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=3, max_batch_size=CONCURRENT)
    fleet = in_process_fleet(engine, CONFIG, partial_rollouts=True, pause_mode=pause_mode)
    rids = [f"r{i}" for i in range(CONCURRENT)]
    try:
        for k, at in enumerate((4, 9, 15)):  # one update while every request is mid-way, three times
            await engine.pause_after(rids[0], at)
            if k == 0:
                tasks = [
                    asyncio.create_task(fleet.generate(p, PARAMS, rid=rid)) for p, rid in zip(prompts(CONCURRENT), rids)
                ]
            await held(engine, rids[0], at, tasks)
            assert engine.scheduler_stats()["running"] == CONCURRENT  # all of them decoding together
            await fleet.update_weights_from_disk(weight_dirs[k])
            if pause_mode == "abort":
                break  # nothing left in flight
        results = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
        return results, fleet.metrics(), engine.scheduler_stats()
    finally:
        await engine.close()


@pytest.mark.parametrize("pause_mode", ["retract", "in_place"])
def test_pause_continue_updates_abort_no_request(pause_mode, weight_dirs):
    results, metrics, stats = asyncio.run(updates_during_generation(pause_mode, weight_dirs))
    assert metrics["weight_updates"] == 3
    assert metrics["aborted_by_update"] == 0 and stats["aborted_by_pause"] == 0
    assert metrics["dropped_stale"] == 0
    for r in results:
        assert r.finish_reason == "length" and len(r.output_ids) == NEW_TOKENS
        assert set(r.token_weight_versions) == {0, 1, 2, 3}  # every update reached it mid-way


def test_abort_mode_updates_are_counted(weight_dirs):
    results, metrics, stats = asyncio.run(updates_during_generation("abort", weight_dirs))
    assert all(r.finish_reason == "abort" and r.abort_reason == "pause" for r in results)
    assert all(len(r.output_ids) == 4 for r in results)  # the tokens so far are kept
    assert metrics["aborted_by_update"] == CONCURRENT == stats["aborted_by_pause"]


def test_staleness_bound_drops_requests_by_start_version(weight_dirs):
    async def scenario():
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=3, max_batch_size=CONCURRENT)
        fleet = in_process_fleet(engine, CONFIG, partial_rollouts=True, max_staleness=1)
        half = CONCURRENT // 2
        try:
            await engine.pause_after("old0", 4)
            old = [asyncio.create_task(fleet.generate(p, PARAMS, rid=f"old{i}")) for i, p in enumerate(prompts(half))]
            await held(engine, "old0", 4, old)
            await fleet.update_weights_from_disk(weight_dirs[0])  # v1: v0 requests are within the bound
            await engine.pause_after("new0", 3)
            new = [
                asyncio.create_task(fleet.generate(p, PARAMS, rid=f"new{i}"))
                for i, p in enumerate(prompts(half, base=20))
            ]
            await held(engine, "new0", 3, old + new)
            assert engine.scheduler_stats()["running"] == CONCURRENT
            await fleet.update_weights_from_disk(weight_dirs[1])  # v2: v0 requests are past it
            return (
                await asyncio.wait_for(asyncio.gather(*old), DEADLINE_S),
                await asyncio.wait_for(asyncio.gather(*new), DEADLINE_S),
                fleet.metrics(),
            )
        finally:
            await engine.close()

    old, new, metrics = asyncio.run(scenario())
    assert all(r.finish_reason == "abort" and r.abort_reason == "stale" for r in old)
    assert all(set(r.token_weight_versions) == {0, 1} for r in old)  # dropped before any v2 token
    assert all(r.finish_reason == "length" and set(r.token_weight_versions) == {1, 2} for r in new)
    assert metrics["dropped_stale"] == CONCURRENT // 2
    assert metrics["aborted_by_update"] == 0


# ---- the SGLang client's side (against the embedded engine's SGLang-speaking server) ----------


@pytest.mark.parametrize("how", ["stale", "pause"])
def test_sglang_client_names_why_an_update_ended_a_request(how, weight_dirs):
    from megatron_stepwise.rollout.engines.embedded.server import start_server
    from megatron_stepwise.rollout.engines.sglang import SGLangClient

    async def scenario():
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=3)
        runner, port = await start_server(engine, "127.0.0.1", 0)
        client = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=120)
        try:
            await engine.pause_after("s0", 3)
            tasks = [asyncio.create_task(client.generate(p, PARAMS, rid=f"s{i}")) for i, p in enumerate(prompts(4))]
            await held(engine, "s0", 3, tasks)
            if how == "pause":  # pause_mode abort: the pause ends them
                await client.pause("abort")
            else:  # sent at version 0; after the update to 2, a bound of 1 leaves them behind
                await client.pause()
                await client.update_weights_from_disk(weight_dirs[0], weight_version=2)
                assert await client.abort_stale(2 - 1) == 4
            results = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
            await client.resume()
            return results
        finally:
            await client.close()
            await runner.cleanup()
            await engine.close()

    results = asyncio.run(scenario())
    assert all(r.finish_reason == "abort" and r.abort_reason == how for r in results)
