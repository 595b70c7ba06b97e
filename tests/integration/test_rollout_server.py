"""The embedded engine over real HTTP on 127.0.0.1 (ephemeral ports), driven by SGLangClient."""

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import threading

import aiohttp
import pytest
import torch
from helpers import run_launch, tiny_lm

from megatron_stepwise import weight_transport
from megatron_stepwise.envs.echo import EchoEnv, echo_dataset
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm, save_safetensors_dir
from megatron_stepwise.rollout.engines.embedded.server import start_server
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from megatron_stepwise.rollout.engines.sglang import EngineRequestError, SGLangClient

TOK, CONFIG = tiny_lm("tiny_word")


async def serving(fn, seed=0):
    engine = LocalEngine(CONFIG, tokenizer=TOK, seed=seed)
    runner, port = await start_server(engine, "127.0.0.1", 0)
    client = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=60)
    try:
        return await fn(engine, client, port)
    finally:
        await client.close()
        await runner.cleanup()
        await engine.close()


def test_generate_over_http_matches_the_model():
    async def scenario(engine, client, port):
        assert await client.health()
        prompt = [1, 5, 8, 17, 2, 1, 6]
        r = await client.generate(prompt, SamplingParams(temperature=0.8, max_new_tokens=6), rid="t0")
        assert 1 <= len(r.output_ids) <= 6 and r.finish_reason in ("stop", "length")
        ids = torch.tensor([prompt + r.output_ids])
        with torch.no_grad():
            logp = torch.log_softmax(engine.model(input_ids=ids).logits[0] / 0.8, -1)
        expected = logp[torch.arange(len(prompt) - 1, ids.shape[1] - 1), torch.tensor(r.output_ids)]
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-4, rtol=0)
        # A raw SGLang-style request: batch input, response shape as SGLang's.
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"http://127.0.0.1:{port}/generate",
                json={
                    "input_ids": [prompt, prompt[:3]],
                    "return_logprob": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 3},
                },
            ) as resp:
                data = await resp.json()
            assert isinstance(data, list) and len(data) == 2
            meta = data[0]["meta_info"]
            assert meta["finish_reason"]["type"] in ("stop", "length") and meta["weight_version"] == "0"
            assert [e[1] for e in meta["output_token_logprobs"]] == data[0]["output_ids"]
            async with http.post(
                f"http://127.0.0.1:{port}/generate",
                json={"input_ids": prompt, "sampling_params": {"temperature": 1, "min_p": 0.1}},
            ) as resp:
                assert resp.status == 400 and "min_p" in (await resp.json())["error"]["message"]
            async with http.post(
                f"http://127.0.0.1:{port}/generate", json={"input_ids": prompt, "return_hidden_states": True}
            ) as resp:
                assert resp.status == 400 and "return_hidden_states" in await resp.text()

    asyncio.run(serving(scenario))


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": 1e-300},  # logits / T overflows: NaN probabilities in the batched sampler
        {"top_k": 2.0},  # a float slice index in the sampler
        {"temperature": "0.7"},
        {"top_p": float("nan")},
        {"max_new_tokens": 2.5},
        {"no_stop_trim": "yes"},
    ],
)
def test_bad_sampling_params_get_a_400_and_the_engine_keeps_serving(bad):
    """Once, one such request failed the engine's batch loop and left the engine unhealthy for good."""
    prompt = [1, 5, 8, 17, 2, 1, 6]

    async def scenario(engine, client, port):
        async with aiohttp.ClientSession() as http:
            sp = {"temperature": 0.7, "max_new_tokens": 4, **bad}
            # allow_nan: the JSON a hostile client can send (NaN is not strict JSON, Python reads it)
            body = {"input_ids": prompt, "sampling_params": sp}
            async with http.post(
                f"http://127.0.0.1:{port}/generate", data=json.dumps(body), headers={"Content-Type": "application/json"}
            ) as resp:
                message = (await resp.json())["error"]["message"]
                assert resp.status == 400, message
                assert f"sampling_params.{next(iter(bad))}" in message
        assert await client.health()
        r = await client.generate(prompt, SamplingParams(temperature=0.7, max_new_tokens=4), rid="after")
        assert 1 <= len(r.output_ids) <= 4 and r.finish_reason in ("stop", "length")

    asyncio.run(serving(scenario))


def test_weight_updates_over_http(tmp_path):
    target = build_causal_lm(CONFIG, seed=9)
    reference = LocalEngine(CONFIG, tokenizer=TOK, seed=9)
    prompt = [1, 5, 9, 2, 1, 6]
    greedy = SamplingParams(temperature=0, max_new_tokens=5, stop_token_ids=[])

    async def scenario(engine, client, port):
        want = (await reference.generate(prompt, greedy)).output_ids
        assert await client.update_weights_from_tensors(dict(target.state_dict())) == 1
        r = await client.generate(prompt, greedy)
        assert r.output_ids == want and r.weight_version == 1 and r.token_weight_versions == [1] * len(want)
        save_safetensors_dir(build_causal_lm(CONFIG, seed=0), tmp_path / "ckpt")
        assert await client.update_weights_from_disk(str(tmp_path / "ckpt"), weight_version=5) == 5
        with pytest.raises(EngineRequestError, match="not a parameter"):
            await client.update_weights_from_tensors({"model.bogus": torch.zeros(1)})
        with pytest.raises(EngineRequestError, match="no \\*.safetensors"):
            await client.update_weights_from_disk(str(tmp_path))
        # Distributed: the trainer (rank 0) broadcasts while the HTTP request is in flight.
        state = dict(target.state_dict())
        names = sorted(state)
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            mport = s.getsockname()[1]

        def trainer():
            group = weight_transport.open_group("127.0.0.1", mport, 2, timeout_s=60)
            weight_transport.broadcast(group, [state[n] for n in names])

        thread = threading.Thread(target=trainer)
        thread.start()
        await client.init_weights_update_group("127.0.0.1", mport, 1, 2, backend="gloo")
        v = await client.update_weights_from_distributed(
            names, ["float32"] * len(names), [list(state[n].shape) for n in names], weight_version=6
        )
        thread.join(60)
        assert v == 6 and (await client.generate(prompt, greedy)).output_ids == want
        await client.pause()
        task = asyncio.create_task(client.generate(prompt, greedy))
        await asyncio.sleep(0.3)
        assert not task.done()
        await client.flush_cache()
        await client.resume()
        assert (await task).output_ids == want

    asyncio.run(serving(scenario))


def test_agent_loop_drives_the_http_server():
    async def scenario(engine, client, port):
        loop = AgentLoop(
            client,
            TOK,
            EchoEnv,
            AgentLoopConfig(
                max_turns=3, max_input_length=100, n_samples_per_prompt=2, sampling=SamplingParams(max_new_tokens=4)
            ),
        )
        steps = await loop.rollout(echo_dataset(3, seed=1))
        loop.close()
        return steps

    steps = asyncio.run(serving(scenario))
    assert sum(s.is_last_step for s in steps) == 6 and all(s.prompt_ids.numel() <= 100 for s in steps)


def test_serve_cli_binds_loopback_and_answers():
    """`megatron-stepwise serve` as a real process on an ephemeral port."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_stepwise.cli", "serve", "--model-config", "tiny_word", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        line = ""
        for line in proc.stdout:
            if "serving the embedded engine" in line:
                break
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, f"server did not report a loopback address: {line!r}"

        async def talk():
            client = SGLangClient(f"http://127.0.0.1:{match.group(1)}")
            try:
                assert await client.health()
                r = await client.generate([1, 5, 8, 2, 1, 6], SamplingParams(max_new_tokens=3))
                info = await client.model_info()
                return r, info
            finally:
                await client.close()

        r, info = asyncio.run(talk())
        assert 1 <= len(r.output_ids) <= 3 and info["vocab_size"] == len(TOK)
    finally:
        proc.terminate()
        proc.wait(10)


def test_an_api_key_guards_every_endpoint_but_health(monkeypatch):
    """With MEGATRON_STEPWISE_API_KEY set (SGLang's --api-key convention), a request without the
    Bearer key cannot generate, replace the weights or abort; the client sends the key itself."""
    monkeypatch.setenv("MEGATRON_STEPWISE_API_KEY", "s3cret")
    engine = LocalEngine(CONFIG, tokenizer=TOK, seed=0)

    async def scenario():
        from megatron_stepwise.rollout.engines.auth import api_key_from_env

        runner, port = await start_server(engine, "127.0.0.1", 0, api_key=api_key_from_env())
        url = f"http://127.0.0.1:{port}"
        client = SGLangClient(url, timeout_s=60)  # reads the key from the environment
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/health") as resp:
                    assert resp.status == 200  # probes need no key
                for path, body in [
                    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
                    ("/update_weights_from_disk", {"model_path": "/tmp"}),
                    ("/abort_request", {"rid": "x"}),
                    ("/pause_generation", {}),
                ]:
                    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                        async with http.post(url + path, json=body, headers=headers) as resp:
                            assert resp.status == 401, (path, headers)
            r = await client.generate([1, 5, 8], SamplingParams(max_new_tokens=2))
            assert len(r.output_ids) >= 1 and await client.weight_version() == 0
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(scenario())
    asyncio.run(engine.close())


def test_a_malformed_header_gets_a_400_or_401_and_the_key_stays_out_of_the_log(caplog):
    """aiohttp logs a request it cannot parse with the offending header line, and answered it
    with that line: the key after `Bearer` must reach neither the log nor the answer; undecodable
    bytes in the key are a 401, not a 500."""
    key = "TOPSECRETKEY123"
    engine = LocalEngine(CONFIG, tokenizer=TOK, seed=0)
    requests = {  # raw request -> the status it must get
        b"Authorization: Bearer " + key.encode() + b"\x01\r\n": 400,  # invalid header char
        b"Authorization: Bearer " + key.encode() + b"\r\nBad Header\r\n": 400,  # invalid header line
        b"Authorization: Bearer " + key.encode() + "\u00e9".encode() + b"\r\nContent-Length: 2\r\n\r\n{}": 401,
    }

    async def scenario():
        runner, port = await start_server(engine, "127.0.0.1", 0, api_key=key)
        statuses = []
        try:
            for head, _ in requests.items():
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                raw = b"POST /generate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + head
                writer.write(raw if raw.endswith(b"{}") else raw + b"\r\n")
                await writer.drain()
                answer = await asyncio.wait_for(reader.read(), 60)  # the whole answer: the server closes
                statuses.append(int(answer.split()[1]))
                assert key.encode() not in answer, answer  # aiohttp's own 400 quoted the header line
                writer.close()
        finally:
            await runner.cleanup()
        return statuses

    with caplog.at_level(logging.DEBUG):
        assert asyncio.run(scenario()) == list(requests.values())
    asyncio.run(engine.close())
    assert "Invalid header" in caplog.text  # logged, as aiohttp does...
    assert key not in caplog.text and "Bearer <redacted>" in caplog.text  # ...without the key


def test_serving_beyond_loopback_needs_a_key_or_an_explicit_opt_out(monkeypatch):
    monkeypatch.delenv("MEGATRON_STEPWISE_API_KEY", raising=False)
    engine = LocalEngine(CONFIG, tokenizer=TOK, seed=0)
    with pytest.raises(ValueError, match="beyond loopback\\) needs an API key: set MEGATRON_STEPWISE_API_KEY"):
        asyncio.run(start_server(engine, "0.0.0.0", 0))
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_STEPWISE_API_KEY"}
    out = run_launch(
        [
            sys.executable,
            "-m",
            "megatron_stepwise.cli",
            "serve",
            "--model-config",
            "tiny_word",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 2 and "needs an API key" in out.stderr and "Traceback" not in out.stderr
    asyncio.run(engine.close())


def test_launched_sglang_servers_get_the_key(monkeypatch):
    from megatron_stepwise.rollout.engines.sglang import SGLangServerConfig

    monkeypatch.setenv("MEGATRON_STEPWISE_API_KEY", "k")
    cmd = SGLangServerConfig(model_path="m").command()
    assert cmd[cmd.index("--api-key") + 1] == "k"
    monkeypatch.delenv("MEGATRON_STEPWISE_API_KEY")
    assert "--api-key" not in SGLangServerConfig(model_path="m").command()


# What sglang-router 0.3.2 adds to every /generate it forwards (SGLang's defaults, plus `model`).
ROUTER_FIELDS = {
    "model": "default",
    "background": False,
    "log_metrics": True,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
    "return_hidden_states": False,
    "return_text_in_logprobs": False,
}


@pytest.mark.parametrize(
    "extra, status, fragment",
    [
        (ROUTER_FIELDS, 200, None),
        (
            {
                "session_id": "s1",
                "priority": 3,
                "routing_key": "k",
                "custom_labels": {"a": "b"},
                "lora_path": None,
                "image_data": [],
                "top_logprobs_num": 0,
            },
            200,
            None,
        ),  # hints, and unsupported ones left at the default
        ({"return_text_in_logprobs": True}, 200, None),
        ({"log_metrics": "yes"}, 400, "log_metrics must be bool"),
        ({"priority": 1.5}, 400, "priority must be int"),
        ({"top_logprobs_num": 5}, 400, "top_logprobs_num=5 is not supported"),
        ({"lora_path": "/adapters/a"}, 400, "lora_path="),
        ({"return_logprobs": True}, 400, "unknown field(s) ['return_logprobs']"),
    ],
)
def test_generate_takes_sglangs_fields(extra, status, fragment):
    """Every GenerateReqInput field is accepted (hints ignored); a malformed value, a feature the
    engine lacks, or a field SGLang does not have is a 400 naming it."""
    prompt = [1, 5, 8, 17, 2, 1, 6]

    async def scenario(engine, client, port):
        async with aiohttp.ClientSession() as http:
            body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 3}, **extra}
            async with http.post(f"http://127.0.0.1:{port}/generate", json=body) as resp:
                return resp.status, await resp.json()

    got, data = asyncio.run(serving(scenario))
    assert got == status, data
    if fragment:
        assert fragment in data["error"]["message"]
    elif extra.get("return_text_in_logprobs"):
        assert [e[2] for e in data["meta_info"]["output_token_logprobs"]] == [
            TOK.decode([t]) for t in data["output_ids"]
        ]


P = [1, 5, 8]


def _gen(**fields):
    return "/generate", {"input_ids": P, "sampling_params": {"max_new_tokens": 2}, **fields}


# (endpoint, body, what the 400 must say). Each was once a 200 with the value coerced (a float or
# a string taken as a token id, "false" read as true, 2.5 as version 2...), a 500, or a 400 whose
# message named no field.
BAD_REQUESTS = [
    (*_gen(input_ids=[1.5, 2]), "input_ids must be a non-empty list of integer token ids"),
    (*_gen(input_ids=["1", "2"]), "input_ids must be"),
    (*_gen(input_ids=[True, 2]), "input_ids must be"),
    (*_gen(input_ids=[[1], [2.0]]), "input_ids[1] must be"),
    (*_gen(input_ids=[[1, 2], 3]), "input_ids[1] must be"),
    (*_gen(input_ids=None, text=["a", None]), "text must be a string or a non-empty list of strings"),
    (*_gen(rid=5), "rid must be a string"),
    (*_gen(rid={"a": 1}), "rid must be a string"),
    (*_gen(return_logprob="no"), "return_logprob must be true or false"),
    (*_gen(return_logprob=1), "return_logprob must be true or false"),
    (*_gen(return_text_in_logprobs="yes"), "return_text_in_logprobs must be true or false"),
    (*_gen(return_routed_experts="false"), "return_routed_experts must be true or false"),
    (*_gen(stream=0), "stream must be true or false"),
    (*_gen(logprob_start_len=-1.0), "logprob_start_len must be an integer"),
    (*_gen(routed_experts_start_len=False), "routed_experts_start_len must be an integer"),
    (*_gen(sampling_params="abc"), "sampling_params must be a JSON object"),
    (*_gen(sampling_params={"stop_token_ids": [1.5]}), "sampling_params.stop_token_ids must be integers"),
    (*_gen(sampling_params={"stop_token_ids": "1"}), "sampling_params.stop_token_ids must be a list"),
    (*_gen(sampling_params={"stop": {"a": 1}}), "sampling_params.stop must be a list"),
    ("/update_weights_from_disk", {"model_path": 5}, "model_path must be a string"),
    (
        "/update_weights_from_disk",
        {"model_path": "/nonexistent", "weight_version": 1.9},
        "weight_version must be an integer from 0 to 9223372036854775807 (or a string of its digits), got 1.9",
    ),
    (
        "/update_weights_from_disk",
        {"model_path": "/nonexistent", "abort_all_requests": "no"},
        "abort_all_requests must be true or false",
    ),
    (
        "/update_weights_from_tensor",
        {"load_format": "safetensors", "serialized_named_tensors": ["aGVsbG8="]},
        "serialized_named_tensors[0] is not a safetensors blob",
    ),
    (
        "/update_weights_from_tensor",
        {"load_format": "safetensors", "serialized_named_tensors": ["!!!"]},
        "serialized_named_tensors[0] is not base64",
    ),
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": [1], "rank_offset": 1, "world_size": 2},
        "master_port must be an integer",
    ),
    (
        "/init_weights_update_group",
        {"master_address": 5, "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"},
        "master_address must be a string",
    ),
    (
        "/update_weights_from_distributed",
        {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "group_name": ["x"]},
        "group_name must be a string",
    ),
    ("/destroy_weights_update_group", {"group_name": ["x"]}, "group_name must be a string"),
    ("/update_weight_version", {"new_version": 2.5}, "new_version must be an integer from 0 to"),
    ("/update_weight_version", {"new_version": True}, "new_version must be an integer from 0 to"),
    (
        "/update_weight_version",
        {"new_version": "3", "abort_all_requests": "no"},
        "abort_all_requests must be true or false",
    ),
    ("/pause_generation", {"mode": ["abort"]}, "mode must be a string"),
    ("/abort_request", {"abort_all": "no"}, "abort_all must be true or false"),
    ("/abort_request", {"rid": 5}, "rid must be a string"),
    ("/abort_request", {"rid": ["x"]}, "rid must be a string"),
    ("/generate", "[" * 100_000, "request body is not valid JSON: nested too deeply"),
]


def test_every_bad_request_value_is_a_400_naming_the_field():
    """No coercion (a float, a string or a bool where an integer or flag is meant), no 500."""

    async def scenario(engine, client, port):
        wrong = []
        async with aiohttp.ClientSession() as http:
            for path, body, fragment in BAD_REQUESTS:
                data = body if isinstance(body, str) else json.dumps(body)
                async with http.post(
                    f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
                ) as resp:
                    text = await resp.text()
                if resp.status != 400 or fragment not in text:
                    wrong.append((path, data[:80], resp.status, text[:200]))
        assert await client.health()  # and the engine still serves
        r = await client.generate(P, SamplingParams(temperature=0.7, max_new_tokens=2), rid="after")
        assert 1 <= len(r.output_ids) <= 2
        return wrong

    wrong = asyncio.run(serving(scenario))
    assert not wrong, "\n".join(map(str, wrong))
