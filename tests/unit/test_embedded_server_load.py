"""The embedded engine's HTTP server under abuse (rollout/engines/embedded/server.py): a body over the
limit is refused with a 413 naming it, a client that disconnects stops its generation (counted),
and /health reports overload in its JSON while staying 200 for the router's liveness check."""

import asyncio
import json

import aiohttp
import pytest
from helpers import tiny_lm

from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.server import default_max_request_bytes, start_server
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from megatron_stepwise.rollout.engines.sglang import SGLangClient

TOK, CONFIG = tiny_lm("tiny_word")
DEADLINE_S = 120.0


pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def serving(fn, engine=None, **server_options):
    engine = engine or LocalEngine(CONFIG, tokenizer=TOK, seed=0)
    runner, port = await start_server(engine, "127.0.0.1", 0, **server_options)
    try:
        async with aiohttp.ClientSession() as http:
            return await fn(engine, http, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()
        await engine.close()


async def until(condition, what):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not condition():
        assert loop.time() < deadline, f"not within {DEADLINE_S} s: {what}"
        await asyncio.sleep(0.01)


def body(n_tokens: int) -> bytes:
    return json.dumps({"input_ids": [5] * n_tokens, "sampling_params": {"max_new_tokens": 1}}).encode()


@pytest.mark.timeout(120)
def test_a_body_over_the_limit_gets_a_413_naming_the_limit():
    async def scenario(engine, http, url):
        limit = default_max_request_bytes(engine)
        # sized from the context window (1024 tokens here): far below the 1 GiB accepted before
        assert 1 << 20 < limit < 4 << 20
        big = body(limit // 2)  # ~2 bytes a token: just over the limit
        assert len(big) > limit
        async with http.post(url + "/generate", data=big) as resp:
            assert resp.status == 413
            msg = (await resp.json())["error"]["message"]
            assert f"{limit} bytes" in msg and "/generate" in msg and "--max-request-bytes" in msg

        async def chunks():  # no Content-Length: refused while reading, not after
            for i in range(0, len(big), 1 << 16):
                yield big[i : i + (1 << 16)]

        async with http.post(url + "/generate", data=chunks()) as resp:
            assert resp.status == 413
        async with http.post(url + "/generate", data=body(8)) as resp:  # and it serves on
            assert resp.status == 200 and len((await resp.json())["output_ids"]) == 1

    asyncio.run(serving(scenario))


@pytest.mark.timeout(120)
def test_the_limit_is_configurable_and_weight_uploads_keep_their_own():
    async def scenario(engine, http, url):
        async with http.post(url + "/generate", data=body(600)) as resp:
            assert resp.status == 413 and "1000 bytes" in (await resp.json())["error"]["message"]
        async with http.post(url + "/generate", data=body(8)) as resp:
            assert resp.status == 200

    asyncio.run(serving(scenario, max_request_bytes=1000))
    with pytest.raises(ValueError, match="max_request_bytes"):
        asyncio.run(serving(lambda *a: None, max_request_bytes=0))


@pytest.mark.timeout(180)
def test_a_client_that_disconnects_stops_its_generation():
    async def scenario(engine, http, url):
        await engine.pause_after("bye", 2)
        payload = {"input_ids": [1, 5, 8], "rid": "bye", "sampling_params": {"max_new_tokens": 1000}}
        task = asyncio.create_task(http.post(url + "/generate", json=payload))
        await until(
            lambda: engine.scheduler.inflight.get("bye") is not None and engine.scheduler.inflight["bye"].decoded == 2,
            "held",
        )
        task.cancel()  # the client goes away mid-generation
        await asyncio.gather(task, return_exceptions=True)
        await until(lambda: engine.scheduler_stats()["cancelled_requests"] == 1, "the server saw the disconnect")
        await engine.resume()
        await until(lambda: engine.scheduler_stats()["running"] == 0, "the row left the batch")
        assert "bye" not in engine.scheduler.inflight
        async with http.get(url + "/get_model_info") as resp:
            assert (await resp.json())["scheduler"]["cancelled_requests"] == 1

    asyncio.run(serving(scenario, engine=LocalEngine(CONFIG, tokenizer=TOK, seed=0, eos_token_ids=[])))


@pytest.mark.timeout(180)
def test_health_reports_overload_and_stays_200_for_the_router():
    async def scenario(engine, http, url):
        await engine.pause()
        payload = {"input_ids": [1, 5, 8, 9, 10, 11], "sampling_params": {"max_new_tokens": 2}}
        tasks = [asyncio.create_task(http.post(url + "/generate", json=payload)) for _ in range(3)]
        await until(lambda: engine.scheduler_stats()["queued"] == 3, "three requests queued")
        async with http.get(url + "/health") as resp:
            assert resp.status == 200  # alive: the router's check (SGLangClient.health) must not kill it
            health = await resp.json()
        assert health["status"] == "overloaded" and health["queued"] == 3 and health["queued_prompt_tokens"] == 18
        async with http.get(url + "/health_generate") as resp:  # readiness: not now
            assert resp.status == 503 and (await resp.json())["status"] == "overloaded"
            assert resp.headers["Retry-After"] == "1"
        client = SGLangClient(url, timeout_s=30)
        try:
            assert await client.health()
        finally:
            await client.close()
        await engine.resume()
        for t in await asyncio.gather(*tasks):
            assert t.status == 200
            t.release()
        async with http.get(url + "/health") as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "ok"
        async with http.get(url + "/health_generate") as resp:
            assert resp.status == 200

    engine = LocalEngine(CONFIG, tokenizer=TOK, seed=0, overload_queued_tokens=10)
    asyncio.run(serving(scenario, engine=engine))


@pytest.mark.timeout(180)
def test_admission_turns_a_flood_away_with_503_and_retry_after_and_admits_another_client():
    prompt = [1, 5, 8, 9, 10, 11]
    flood = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 100}}  # costs 106 tokens

    async def scenario(engine, http, url):
        await engine.pause()  # nothing finishes: what is admitted stays in flight
        held = [
            asyncio.create_task(http.post(url + "/generate", json=flood, headers={"X-Client-Id": "A"}))
            for _ in range(2)
        ]
        await until(lambda: engine.scheduler_stats()["queued"] == 2, "two floods queued")
        async with http.post(url + "/generate", json=flood, headers={"X-Client-Id": "A"}) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            msg = (await resp.json())["error"]["message"]
            assert "212 of 250 tokens in flight (--max-tokens-in-flight)" in msg and "needs 106" in msg
        small = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}
        other = asyncio.create_task(http.post(url + "/generate", json=small, headers={"X-Client-Id": "B"}))
        await until(lambda: engine.scheduler_stats()["queued"] == 3, "the other client admitted")
        async with http.get(url + "/health") as resp:
            assert (await resp.json())["admission"] == {
                "tokens_in_flight": 220,
                "max_tokens_in_flight": 250,
                "clients_in_flight": 2,
                "refused_requests": 1,
            }
        # SGLangClient waits a 503 out (Retry-After) instead of failing the engine
        client = SGLangClient(url, timeout_s=60)
        try:
            retried = asyncio.create_task(client.generate(prompt, SamplingParams(max_new_tokens=150)))
            await until(lambda: client.overload_retries >= 1, "the client told to retry")
            await engine.resume()
            assert len((await retried).output_ids) > 0
        finally:
            await client.close()
        for t in await asyncio.gather(*held, other):
            assert t.status == 200
            t.release()

    engine = LocalEngine(CONFIG, tokenizer=TOK, seed=0, eos_token_ids=[])
    asyncio.run(serving(scenario, engine=engine, max_tokens_in_flight=250))
