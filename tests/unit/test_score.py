"""Teacher scoring (`Engine.score`, on-policy distillation): the embedded engine's log-probs of
given tokens from one forward, the same over HTTP as SGLang's prompt-scoring request
(`logprob_start_len`, `meta_info.input_token_logprobs`), SGLang's temperature caveat, and a fleet
routing score requests."""

import asyncio
import math

import aiohttp
import pytest
import torch
from helpers import tiny_lm
from in_process_fleet import in_process_fleet

from megatron_stepwise.hf.presets import tiny_config
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm
from megatron_stepwise.rollout.engines.embedded.server import start_server
from megatron_stepwise.rollout.engines.protocol import EngineError, EngineReleasedError, SamplingParams
from megatron_stepwise.rollout.engines.sglang import EngineRequestError, SGLangClient

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOK, CONFIG = tiny_lm("tiny_word")
VOCAB = CONFIG["vocab_size"]
IDS = [1, 5, 8, 17, 2, 1, 6, 9, 12, 19, 4, 7]  # below VOCAB - 1 (21 - 1), which SGLang reports as 0


def run(coro):
    return asyncio.run(coro)


def reference(model, ids, start, temperature):
    """log_softmax(logits / T) of ids[i] given ids[:i], i >= start, from a plain HF forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)[start - 1 : -1]
    return logp.gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(
    "config", [CONFIG, tiny_config(model_type="qwen3_moe", vocab_size=VOCAB)], ids=["dense", "moe"]
)
def test_score_is_the_temperature_scaled_log_softmax_of_a_plain_forward(config, temperature):
    engine = LocalEngine(config, eos_token_ids=[], seed=3)
    model = build_causal_lm(config, seed=3)  # the same weights, built apart from the engine
    for start in (1, 5, len(IDS) - 1):
        got = run(engine.score(IDS, start, temperature))
        assert len(got) == len(IDS) - start
        torch.testing.assert_close(torch.tensor(got), reference(model, IDS, start, temperature), atol=1e-5, rtol=0)
    assert not torch.allclose(
        torch.tensor(run(engine.score(IDS, 1, 1.0))), torch.tensor(run(engine.score(IDS, 1, 0.7)))
    )


@pytest.mark.parametrize(
    "config", [CONFIG, tiny_config(model_type="qwen3_moe", vocab_size=VOCAB)], ids=["dense", "moe"]
)
def test_requests_that_wait_share_one_padded_forward_and_score_as_alone(config):
    """Rows of other lengths, starts and temperatures, sent together: fewer forwards than requests,
    each row's log-probs those of its own plain forward (the padding after it changes nothing)."""
    engine = LocalEngine(config, eos_token_ids=[], seed=3)
    model = build_causal_lm(config, seed=3)
    rows = [(IDS, 1, 1.0), (IDS[:5], 2, 0.7), (IDS[3:], 4, 1.0), (IDS[:2], 1, 0.5), (IDS[::-1], 6, 1.3)]

    async def together():
        return await asyncio.gather(*(engine.score(ids, start, t) for ids, start, t in rows))

    got = run(together())
    assert engine.scores.forwards < len(rows)
    for values, (ids, start, t) in zip(got, rows):
        torch.testing.assert_close(torch.tensor(values), reference(model, ids, start, t), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "ids, start, temperature, fragment",
    [
        (IDS, 0, 1.0, "start must be an integer with 1 <= start < len(input_ids)"),
        (IDS, len(IDS), 1.0, "start must be"),
        (IDS, True, 1.0, "start must be"),
        (IDS, 2.0, 1.0, "start must be"),
        (IDS, 2, 0, "temperature must be a finite number >= 0.0001"),
        (IDS, 2, math.nan, "temperature must be"),
        (IDS, 2, "1", "temperature must be"),
        ([1, 2, VOCAB + 5], 1, 1.0, f"input_ids contain ids outside the vocabulary [0, {VOCAB})"),
        ([1, -1, 3], 1, 1.0, "outside the vocabulary"),
        ([], 1, 1.0, "input_ids is empty"),
    ],
)
def test_score_refuses_bad_arguments_naming_them(ids, start, temperature, fragment):
    engine = LocalEngine(CONFIG, seed=0)
    with pytest.raises(ValueError) as e:
        run(engine.score(ids, start, temperature))
    assert fragment in str(e.value)


def test_score_is_refused_while_the_weights_are_released_and_by_an_unhealthy_engine():
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
    good = {k: v.clone() for k, v in engine.model.state_dict().items()}
    run(engine.release_memory_occupation(["weights"]))
    with pytest.raises(EngineReleasedError, match="weights memory is released"):
        run(engine.score(IDS, 2))
    run(engine.resume_memory_occupation(["weights"]))
    run(engine.update_weights_from_tensors(good))
    assert len(run(engine.score(IDS, 2))) == len(IDS) - 2

    async def failed():
        with torch.no_grad():  # weights gone bad behind the loader's back: the model thread fails
            engine.model.get_input_embeddings().weight.fill_(float("nan"))
        with pytest.raises(Exception):
            await engine.generate(IDS, SamplingParams(temperature=1.0, max_new_tokens=4))
        with pytest.raises(EngineError, match="unhealthy"):
            await engine.score(IDS, 2)

    run(failed())


async def wait_decoded(engine, rid, n, deadline_s=120.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while await engine.decoded_tokens(rid) != n:
        assert loop.time() < deadline, f"request {rid} did not reach {n} tokens in {deadline_s} s"
        await asyncio.sleep(0.005)


@pytest.mark.timeout(300)  # a hang (a pause never lifted) fails instead of blocking the suite
def test_scoring_between_decode_steps_leaves_a_running_generation_unchanged():
    async def scenario():
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0, prefix_cache_tokens=0)
        params = SamplingParams(temperature=1.0, max_new_tokens=24, sampling_seed=7)
        alone = await engine.generate(IDS[:5], params)
        expected = reference(engine.model, IDS, 3, 0.7)
        await engine.pause_after("held", 6)
        task = asyncio.create_task(engine.generate(IDS[:5], params, rid="held"))
        await wait_decoded(engine, "held", 6)
        mid = await engine.score(IDS, 3, 0.7)  # scored while the generation is held half way
        assert not task.done()
        await engine.resume()
        racing = await asyncio.gather(task, *(engine.score(IDS, 3, 0.7) for _ in range(4)))
        await engine.close()
        return alone, expected, mid, racing[0], racing[1:]

    alone, expected, mid, together, scores = run(scenario())
    assert together.output_ids == alone.output_ids and together.logprobs == pytest.approx(alone.logprobs, abs=1e-6)
    assert together.finish_reason == "length" and len(together.output_ids) == 24
    for s in [mid, *scores]:
        torch.testing.assert_close(torch.tensor(s), expected, atol=1e-5, rtol=0)


# ---- over HTTP: the embedded server answers SGLang's prompt-scoring request -------------------


async def serving(fn):
    engine = LocalEngine(CONFIG, tokenizer=TOK, seed=0)
    runner, port = await start_server(engine, "127.0.0.1", 0)
    client = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=60)
    try:
        async with aiohttp.ClientSession() as http:
            return await fn(engine, client, http, f"http://127.0.0.1:{port}/generate")
    finally:
        await client.close()
        await runner.cleanup()
        await engine.close()


def _scoring(ids, k, **extra):
    return {
        "input_ids": ids,
        "return_logprob": True,
        "logprob_start_len": k,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.5},
        **extra,
    }


@pytest.mark.timeout(300)
def test_sglang_client_scores_over_the_embedded_server_as_the_engine_does():
    ids = IDS + [VOCAB - 1, 3]  # SGLang reports the id vocab_size - 1 as 0: the client accepts that

    async def scenario(engine, client, http, url):
        for start in (1, 6, len(ids) - 1):
            assert await client.score(ids, start) == pytest.approx(await engine.score(ids, start, 1.0), abs=1e-6)
        with pytest.raises(EngineRequestError, match="SGLang 0.5.23 returns prompt log-probs without temperature"):
            await client.score(ids, 2, 0.7)
        with pytest.raises(ValueError, match="start must be"):
            await client.score(ids, 0)
        async with http.post(url, json=_scoring(ids, 2, return_text_in_logprobs=True)) as resp:
            data = await resp.json()
        return data, await engine.score(ids, 3, 1.0)

    data, at_t1 = run(serving(scenario))
    meta = data["meta_info"]
    entries = meta["input_token_logprobs"]
    # SGLang's layout: an entry per token from logprob_start_len on, the first with no log-prob
    assert [e[1] for e in entries] == ids[2:-2] + [0, 3]
    assert entries[0][0] is None and [e[0] for e in entries[1:]] == pytest.approx(at_t1, abs=1e-6)  # temperature 1
    assert [e[2] for e in entries] == [TOK.decode([t]) for t in ids[2:-2] + [0, 3]]
    assert data["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["prompt_tokens"] == len(ids)


@pytest.mark.timeout(300)
def test_prompt_log_prob_requests_follow_sglang_at_the_edges_and_refuse_what_the_engine_cannot_do():
    ids = IDS[:6]

    async def post(http, url, body):
        async with http.post(url, json=body) as resp:
            return resp.status, await resp.json()

    async def scenario(engine, client, http, url):
        out = {}
        out["end"] = await post(http, url, _scoring(ids, len(ids)))
        out["last"] = await post(http, url, _scoring(ids, len(ids) - 1))
        out["over"] = await post(http, url, _scoring(ids, len(ids) + 1))
        out["below"] = await post(http, url, _scoring(ids, -2))
        out["generating"] = await post(http, url, {**_scoring(ids, 1), "sampling_params": {"max_new_tokens": 3}})
        out["no_logprob"] = await post(http, url, {**_scoring(ids, 1), "return_logprob": False})
        out["generate"] = await post(
            http, url, {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
        )
        out["batch"] = await post(http, url, _scoring([ids, ids[:3]], [1, 0]))
        out["scores"] = [await engine.score(ids, 2, 1.0), await engine.score(ids[:3], 1, 1.0)]
        return out

    out = run(serving(scenario))
    assert out["end"][0] == 200 and out["end"][1]["meta_info"]["input_token_logprobs"] == []
    assert out["last"][0] == 200 and out["last"][1]["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]
    assert out["over"][0] == 400 and "logprob_start_len=7 is higher than the 6 input tokens" in str(out["over"][1])
    assert out["below"][0] == 400 and "logprob_start_len must be an integer >= -1" in str(out["below"][1])
    assert out["generating"][0] == 400 and "max_new_tokens=0" in str(out["generating"][1])
    assert out["no_logprob"][0] == 200 and "input_token_logprobs" not in out["no_logprob"][1]["meta_info"]
    generated = out["generate"][1]["meta_info"]
    assert out["generate"][0] == 200 and generated["input_token_logprobs"] == []  # -1: output log-probs only
    assert len(generated["output_token_logprobs"]) == 2
    status, (first, second) = out["batch"]
    assert status == 200
    assert [e[1] for e in first["meta_info"]["input_token_logprobs"]] == ids[1:]
    assert [e[0] for e in first["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(out["scores"][0], abs=1e-6)
    assert [e[1] for e in second["meta_info"]["input_token_logprobs"]] == ids[:3]
    assert [e[0] for e in second["meta_info"]["input_token_logprobs"]][1:] == pytest.approx(out["scores"][1], abs=1e-6)


# ---- a fleet routes score requests ----------------------------------------------------------------


def test_a_fleet_routes_score_requests_and_counts_their_tokens():
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=2)
    fleet = in_process_fleet(engine, CONFIG)

    async def scenario():
        got = await fleet.score(IDS, 4, 0.7)
        with pytest.raises(ValueError, match="start must be"):
            await fleet.score(IDS, 0)
        await engine.close()
        return got

    got = run(scenario())
    torch.testing.assert_close(torch.tensor(got), reference(engine.model, IDS, 4, 0.7), atol=1e-5, rtol=0)
    metrics = fleet.metrics()
    assert metrics["scored_tokens"] == len(IDS) - 4 and metrics["requests"] == 1
    assert metrics["generated_tokens"] == 0 and metrics["prompt_tokens"] == 0 and metrics["retries"] == 0
