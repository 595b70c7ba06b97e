"""Colocated mode (`rollout.colocate`): engines release their memory while Megatron trains.

With the embedded engine on CPU: the release/resume protocol and its refusals (engine, HTTP
server + SGLang client, Ray fleet), and the trainer's order on every iteration, release ->
train -> resume(weights) -> update -> resume(kv_cache) -> generate, with the same rewards,
losses and weights as a run without colocation. The SGLang requests themselves are checked
against the pinned wheel in test_sglang_contract.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
from helpers import REPO, TESTS, run_launch, tiny_lm

from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.hf_model import checkpoint_state
from megatron_stepwise.rollout.engines.protocol import EngineReleasedError, SamplingParams, memory_tags

TOK, CONFIG = tiny_lm("tiny_char")
PROMPT = [1, 30, 31, 32]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6, sampling_seed=11)


def param_bytes(engine: LocalEngine) -> int:
    return sum(p.untyped_storage().nbytes() for p in engine.model.parameters())


def test_memory_tags_follow_sglang():
    assert memory_tags(None) == memory_tags([]) == ("kv_cache", "weights", "cuda_graph")
    assert memory_tags(["weights", "kv_cache"]) == ("kv_cache", "weights")
    with pytest.raises(ValueError, match="unknown memory tag.*'weight'"):
        memory_tags(["weight"])


def test_engine_release_frees_the_weights_and_takes_them_back_in_sglang_order():
    async def scenario():
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
        before = await engine.generate(PROMPT, SAMPLING)
        state = checkpoint_state(engine.model)
        held = param_bytes(engine)
        await engine.release_memory_occupation(["weights", "kv_cache"])
        freed = param_bytes(engine)
        with pytest.raises(EngineReleasedError, match="cannot generate while its kv_cache and weights"):
            await engine.generate(PROMPT, SAMPLING)
        with pytest.raises(EngineReleasedError, match=r"resume_memory_occupation\(\['weights'\]\) -> update"):
            await engine.update_weights_from_tensors(state)
        with pytest.raises(ValueError, match="already released"):
            await engine.release_memory_occupation(["weights"])
        with pytest.raises(ValueError, match=r"\['cuda_graph'\].*not released"):
            await engine.resume_memory_occupation(["cuda_graph"])
        await engine.resume_memory_occupation(["weights"])
        resumed = param_bytes(engine)
        with pytest.raises(EngineReleasedError, match="kv_cache memory is released"):
            await engine.generate(PROMPT, SAMPLING)
        version = await engine.update_weights_from_tensors(state, weight_version=5)
        await engine.resume_memory_occupation(["kv_cache"])
        after = await engine.generate(PROMPT, SAMPLING)
        await engine.close()
        return held, freed, resumed, before, after, version

    held, freed, resumed, before, after, version = asyncio.run(scenario())
    assert held > 0 and freed == 0 and resumed == held
    assert after.output_ids == before.output_ids and after.logprobs == before.logprobs
    assert version == 5 and after.weight_version == 5


def test_resumed_weights_without_an_update_refuse_to_generate():
    """Like SGLang without --enable-weights-cpu-backup, resumed weights hold no values."""

    async def scenario():
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
        await engine.release_memory_occupation()  # no tags = all
        assert await engine.released_memory() == ["cuda_graph", "kv_cache", "weights"]
        await engine.resume_memory_occupation()
        with pytest.raises(EngineReleasedError, match="hold no values yet"):
            await engine.generate(PROMPT, SAMPLING)
        await engine.update_weights_from_tensors(checkpoint_state(LocalEngine(CONFIG, seed=0).model))
        result = await engine.generate(PROMPT, SAMPLING)
        await engine.close()
        return result

    assert len(asyncio.run(scenario()).output_ids) == SAMPLING.max_new_tokens


def test_engine_refuses_to_release_with_requests_in_flight():
    async def scenario():
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
        await engine.pause()
        task = asyncio.create_task(engine.generate(PROMPT, SAMPLING, rid="r1"))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="needs an idle engine, 1 request"):
            await engine.release_memory_occupation(["weights"])
        await engine.resume()
        await task
        await engine.release_memory_occupation(["weights"])  # idle now
        await engine.close()

    asyncio.run(scenario())


def test_http_server_and_sglang_client_speak_the_release_resume_routes():
    from megatron_stepwise.rollout.engines.embedded.server import start_server
    from megatron_stepwise.rollout.engines.sglang import EngineRequestError, SGLangClient

    async def scenario():
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
        runner, port = await start_server(engine)
        client = SGLangClient(f"http://127.0.0.1:{port}")
        state = checkpoint_state(engine.model)
        try:
            await client.release_memory_occupation(["weights", "kv_cache"])
            assert await engine.released_memory() == ["kv_cache", "weights"] and param_bytes(engine) == 0
            with pytest.raises(EngineRequestError, match="HTTP 400.*cannot generate while"):
                await client.generate(PROMPT, SAMPLING)
            with pytest.raises(EngineRequestError, match="HTTP 400.*weights' memory is released"):
                await client.update_weights_from_tensors(state)
            with pytest.raises(ValueError, match="unknown memory tag"):
                await client.resume_memory_occupation(["weight"])  # refused before sending
            await client.resume_memory_occupation(["weights"])
            await client.update_weights_from_tensors(state, weight_version=2)
            await client.resume_memory_occupation(["kv_cache"])
            result = await client.generate(PROMPT, SAMPLING)
        finally:
            await client.close()
            await runner.cleanup()
            await engine.close()
        return result

    result = asyncio.run(scenario())
    assert result.weight_version == 2 and len(result.output_ids) == SAMPLING.max_new_tokens


@pytest.fixture(scope="module")
def colocated_runs(tmp_path_factory):
    """The worker's two 3-iteration runs of the tiny CPU experiment (one rank, one embedded
    engine in-process): without and with rollout.colocate, same seed."""
    root = tmp_path_factory.mktemp("colocate")
    out = root / "out.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port()))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    proc = run_launch(
        [sys.executable, str(TESTS / "workers" / "colocate_worker.py"), str(out), str(root)],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_colocated_trainer_releases_trains_resumes_updates_in_order(colocated_runs):
    log = colocated_runs["colocated"]["log"]
    # The initial push (nothing released yet), then per iteration: rollout, release, the two
    # optimizer steps, weights back, the push, KV cache back; the next rollout follows.
    iteration = [
        "generate",
        "release(kv_cache,weights)",
        "train",
        "train",
        "resume(weights)",
        "update",
        "resume(kv_cache)",
    ]
    assert log == ["update"] + iteration * 3
    assert colocated_runs["separate"]["log"] == ["update"] + ["generate", "train", "train", "update"] * 3
    for m in colocated_runs["colocated"]["metrics"]:
        assert m["time/engine_release"] > 0 and m["time/engine_resume"] > 0
    assert all("time/engine_release" not in m for m in colocated_runs["separate"]["metrics"])


def test_colocation_changes_no_result(colocated_runs):
    """Same seed: identical rewards, losses and final engine weights. The engine's log-probs
    equal the trainer's after every zero-filled resume + push, so every weight was reloaded."""
    separate, colocated = colocated_runs["separate"], colocated_runs["colocated"]
    for a, b in zip(separate["metrics"], colocated["metrics"], strict=True):
        for key in ("reward/mean", "train/loss", "train/grad_norm", "weight_version"):
            assert a[key] == b[key], key
        assert b["train/logprob_gap_max"] < 1e-4
    assert separate["weights"] == colocated["weights"]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_fleet_fans_out_and_refuses_generation_while_released():
    from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm
    from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
    from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

    target = checkpoint_state(build_causal_lm(CONFIG, seed=4))
    greedy = SamplingParams(temperature=0, max_new_tokens=4)

    async def scenario():
        fleet = RolloutFleet(
            [EngineSpec(model_config=CONFIG, seed=i, num_cpus=0.5) for i in range(2)],
            max_retries=2,
            request_timeout_s=60,
        )
        await fleet.wait_ready()
        try:
            await fleet.release_memory_occupation(["weights", "kv_cache"])
            released = [await fleet.engine(i).call.remote("released_memory") for i in range(2)]
            with pytest.raises(EngineReleasedError, match="released their kv_cache and weights"):
                await fleet.generate(PROMPT, greedy)
            with pytest.raises(EngineReleasedError, match="resume_memory_occupation"):
                await fleet.update_weights_from_tensors(target)
            fleet.kill_engine(1)  # dies while released: the next fan-out finds it, the fleet restarts it
            await fleet.resume_memory_occupation(["weights"])
            await fleet.update_weights_from_tensors(target, weight_version=3)
            await fleet.resume_memory_occupation(["kv_cache"])
            await fleet.wait_restarts()
            outs = [await fleet.engine(i).generate.remote(PROMPT, greedy) for i in range(2)]
            after = [await fleet.engine(i).call.remote("released_memory") for i in range(2)]
            return released, outs, after, fleet.released_memory(), fleet.metrics()
        finally:
            await fleet.shutdown()

    released, outs, after, left, metrics = asyncio.run(scenario())
    assert released == [["kv_cache", "weights"]] * 2 and after == [[], []] and left == []
    # Both engines (different random inits; engine 1 a restarted one) now run the pushed weights.
    assert outs[0].output_ids == outs[1].output_ids and outs[0].weight_version == outs[1].weight_version == 3
    assert metrics["restarts"] == 1 and metrics["alive_engines"] == 2
    assert metrics["requests"] == 0 and metrics["retries"] == 0  # refused at once, never retried
