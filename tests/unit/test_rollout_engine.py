"""The embedded CPU engine: exact log-probs, sampling rules, stops, weight updates, pause/abort."""

import asyncio
import socket
import threading

import pytest
import torch
from helpers import tiny_lm
from oracles import teacher_forced_logprobs

from megatron_stepwise import weight_transport
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm, save_safetensors_dir
from megatron_stepwise.rollout.engines.embedded.sampling import _truncate
from megatron_stepwise.rollout.engines.protocol import GenerateResult, SamplingParams

TOK, CONFIG = tiny_lm("tiny_char")


def run(coro):
    return asyncio.run(coro)


async def generate_many(engine, prompts, params):
    return await asyncio.gather(*(engine.generate(p, params) for p in prompts))


PROMPTS = [[1, 30, 31, 32], [1, 40, 41], [1, 50, 51, 52, 53, 54, 55], [1, 60]]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=24),
        SamplingParams(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=24),
        SamplingParams(temperature=0.0, max_new_tokens=12),
    ],
    ids=["T1", "T0.6-topp-topk", "greedy"],
)
def test_logprobs_equal_teacher_forced_forward(params):
    """Batched (left-padded, KV-cached) generation reports the log-prob a single unpadded forward
    of the same model assigns, under log_softmax(logits / T) over the full vocabulary."""
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=3)
    results = run(generate_many(engine, PROMPTS, params))
    for prompt, r in zip(PROMPTS, results):
        assert len(r.output_ids) == params.max_new_tokens and r.finish_reason == "length"
        expected = teacher_forced_logprobs(engine.model, prompt, r.output_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-4, rtol=0)


def test_greedy_picks_argmax_and_top_k_1_matches_greedy():
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
    greedy = run(engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=10)))
    top1 = run(engine.generate(PROMPTS[0], SamplingParams(temperature=1.3, top_k=1, max_new_tokens=10)))
    assert greedy.output_ids == top1.output_ids
    ids = torch.tensor([PROMPTS[0] + greedy.output_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(PROMPTS[0]) - 1 : -1]
    assert greedy.output_ids == logits.argmax(-1).tolist()


def test_truncate_keeps_top_k_and_nucleus():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    assert _truncate(probs, 2, 1.0).nonzero().flatten().tolist() == [1, 3]
    # nucleus 0.75: 0.4 + 0.3 = 0.7 < 0.75, so the 0.15 token that crosses it is kept too
    assert sorted(_truncate(probs, -1, 0.75).nonzero().flatten().tolist()) == [1, 3, 4]
    # top-k first (0.4, 0.3, 0.15 -> mass 0.85), then top-p 0.5 of that = 0.425: 0.4 < 0.425 keeps 0.3
    assert sorted(_truncate(probs, 3, 0.5).nonzero().flatten().tolist()) == [1, 3]


def test_sampling_frequencies_follow_the_temperature_scaled_distribution():
    """Many one-token samples: the empirical distribution matches softmax(logits / T)."""
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=1, max_batch_size=64)
    params = SamplingParams(temperature=0.5, max_new_tokens=1)
    results = run(generate_many(engine, [PROMPTS[1]] * 2000, params))
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([PROMPTS[1]])).logits[0, -1]
    probs = torch.softmax(logits / 0.5, -1)
    counts = torch.bincount(torch.tensor([r.output_ids[0] for r in results]), minlength=probs.numel()).float()
    top = probs.argsort(descending=True)[:3]
    assert torch.allclose(counts[top] / 2000, probs[top], atol=0.04)


def test_stop_token_and_stop_string_and_length():
    engine = LocalEngine(CONFIG, tokenizer=TOK, eos_token_ids=[], seed=0)
    free = run(engine.generate(PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=16)))
    assert free.finish_reason == "length" and len(free.output_ids) == 16
    # A stop token id: generation ends at its first occurrence and keeps it (as SGLang does).
    stop_id = free.output_ids[5]
    first = free.output_ids.index(stop_id)
    r = run(engine.generate(PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[stop_id])))
    assert r.finish_reason == "stop" and r.matched == stop_id and r.output_ids == free.output_ids[: first + 1]
    # A stop string made of two generated characters: ends right after it, text trimmed unless no_stop_trim.
    text = TOK.decode(free.output_ids, skip_special_tokens=True)
    stop = text[6:8]
    end = text.index(stop) + 2
    r = run(engine.generate(PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=16, stop=[stop])))
    assert r.finish_reason == "stop" and r.matched == stop
    assert TOK.decode(r.output_ids, skip_special_tokens=True) == text[:end] and r.text == text[: end - 2]
    r = run(
        engine.generate(PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=16, stop=[stop], no_stop_trim=True))
    )
    assert r.text == text[:end]
    r = run(engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=0)))
    assert r.output_ids == [] and r.finish_reason == "length"


def test_bad_requests_fail_clearly():
    engine = LocalEngine(CONFIG, seed=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(engine.generate([1, len(TOK) + 5], SamplingParams()))
    with pytest.raises(ValueError, match="needs an engine with a tokenizer"):
        run(engine.generate([1, 2], SamplingParams(stop=["x"])))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="unsupported field"):
        SamplingParams.from_dict({"temperature": 1.0, "beam_width": 2})


def greedy(engine, prompt=PROMPTS[0], n=8) -> GenerateResult:
    return run(engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=n)))


def test_weight_updates_from_hf_tensors_and_safetensors_dir(tmp_path):
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
    other = build_causal_lm(CONFIG, seed=11)
    reference = LocalEngine(CONFIG, eos_token_ids=[], seed=11)
    assert greedy(engine).weight_version == 0
    # The trainer pushes HF names; a subset (one bucket) then the rest.
    named = dict(other.state_dict())
    names = sorted(named)
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    run(engine.update_weights_from_tensors({k: named[k] for k in names[:5]}))
    v = run(engine.update_weights_from_tensors({k: named[k] for k in names[5:]}))
    assert v == 2 and run(engine.weight_version()) == 2
    after = greedy(engine)
    assert after.weight_version == 2 and after.token_weight_versions == [2] * 8
    assert after.output_ids == greedy(reference).output_ids
    torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(greedy(reference).logprobs))
    # From a safetensors directory, with an explicit version.
    save_safetensors_dir(build_causal_lm(CONFIG, seed=0), tmp_path / "w")
    assert run(engine.update_weights_from_disk(str(tmp_path / "w"), weight_version=7)) == 7
    assert greedy(engine).output_ids == greedy(LocalEngine(CONFIG, eos_token_ids=[], seed=0)).output_ids
    # A bad push names the tensor and leaves the model untouched.
    before = greedy(engine).output_ids
    with pytest.raises(KeyError, match="model.layers.9"):
        run(engine.update_weights_from_tensors({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)}))
    with pytest.raises(ValueError, match="shape"):
        good = {"model.embed_tokens.weight": named["model.embed_tokens.weight"]}
        run(engine.update_weights_from_tensors({**good, "model.norm.weight": torch.zeros(3)}))
    assert greedy(engine).output_ids == before and run(engine.weight_version()) == 7


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_weight_update_from_distributed_group():
    """Trainer (rank 0, a thread here) broadcasts over gloo; the engine (rank 1) receives by name."""
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
    source = build_causal_lm(CONFIG, seed=5)
    tensors = dict(source.state_dict())
    names = sorted(tensors)
    port = _free_port()
    trainer_error = []

    def trainer():
        try:
            group = weight_transport.open_group("127.0.0.1", port, world_size=2, timeout_s=60)
            weight_transport.broadcast(group, [tensors[n] for n in names])
        except Exception as e:  # surfaced by the assertion below
            trainer_error.append(e)

    async def engine_side():
        await engine.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2)
        return await engine.update_weights_from_distributed(
            names, ["float32"] * len(names), [list(tensors[n].shape) for n in names]
        )

    thread = threading.Thread(target=trainer)
    thread.start()
    version = run(engine_side())
    thread.join(60)
    assert not trainer_error and version == 1
    for n in names:
        torch.testing.assert_close(engine.model.state_dict()[n], tensors[n], atol=0, rtol=0)


async def wait_decoded(engine, rid, n, deadline_s=120.0):
    """Poll the engine's public progress counter until request `rid` has exactly `n` tokens."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while (got := await engine.decoded_tokens(rid)) != n:
        assert got is None or got < n, f"request {rid} went past {n} tokens: {got}"
        assert loop.time() < deadline, f"request {rid} did not reach {n} tokens in {deadline_s} s (at {got})"
        await asyncio.sleep(0.005)


@pytest.mark.timeout(300)  # a hang (a pause never lifted) fails instead of blocking the suite
def test_pause_holds_generation_and_abort_returns_partial():
    async def scenario():
        engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
        await engine.pause()
        task = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=5), rid="a"))
        await asyncio.sleep(0.2)  # time it would have had to (wrongly) make progress
        assert not task.done() and await engine.decoded_tokens("a") == 0
        await engine.resume()
        assert len((await task).output_ids) == 5 and await engine.decoded_tokens("a") is None
        # A long request, held after exactly 3 tokens whatever the machine's speed, then aborted
        # just as decoding resumes: it ends at once, keeping what it had generated.
        await engine.pause_after("b", 3)
        long = asyncio.create_task(engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=100000), rid="b"))
        await wait_decoded(engine, "b", 3)
        assert not long.done()
        await engine.resume()
        await engine.abort("b")
        r = await long
        # abort waits for at most the one decode step that resume may have started
        assert r.finish_reason == "abort" and 3 <= len(r.output_ids) <= 4 and len(r.logprobs) == len(r.output_ids)
        assert await engine.health()
        # the engine serves again, and a pause point the request never reaches does nothing
        await engine.pause_after("c", 50)
        assert len((await engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=5), rid="c")).output_ids) == 5
        assert len((await engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=5))).output_ids) == 5
        with pytest.raises(ValueError, match="num_tokens"):
            await engine.pause_after("d", 0)
        await engine.close()

    run(scenario())


def test_sampling_seed_makes_a_request_reproducible_on_any_engine():
    """Two engines with different sampler seeds but the same weights draw the same tokens for a
    seeded request, alone or batched with others; unseeded requests still differ."""
    model = build_causal_lm(CONFIG, seed=3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    a = LocalEngine(CONFIG, seed=11)
    b = LocalEngine(CONFIG, seed=22)
    for eng in (a, b):
        run(eng.update_weights_from_tensors(list(weights.items())))
    seeded = SamplingParams(temperature=1.0, max_new_tokens=24, sampling_seed=1234)
    alone = run(a.generate(PROMPTS[0], seeded))
    batched = run(generate_many(b, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], seeded))[1]
    assert alone.output_ids == batched.output_ids
    assert alone.logprobs == pytest.approx(batched.logprobs, abs=1e-5)
    other = run(a.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=24, sampling_seed=99)))
    assert other.output_ids != alone.output_ids
    with pytest.raises(ValueError, match="sampling_seed"):
        SamplingParams(sampling_seed="x")  # type: ignore[arg-type]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_moe_weights_are_saved_and_loaded_under_the_hub_names(tmp_path, model_type):
    """transformers fuses a MoE layer's experts in memory; files and pushes name each expert as
    the hub does (Mixtral: block_sparse_moe.experts.e.w1/w3/w2): ours match save_pretrained's, and
    load back into the fused parameters, ours and transformers' alike."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from megatron_stepwise.hf.presets import tiny_config
    from megatron_stepwise.rollout.engines.embedded.hf_model import checkpoint_state

    cfg = tiny_config(model_type=model_type)
    source = build_causal_lm(cfg, seed=3)
    save_safetensors_dir(source, tmp_path / "ours")
    source.save_pretrained(str(tmp_path / "theirs"))
    names = {}
    for which in ("ours", "theirs"):
        with safe_open(str(tmp_path / which / "model.safetensors"), framework="pt") as f:
            names[which] = sorted(f.keys())
    assert names["ours"] == names["theirs"]
    if model_type == "mixtral":
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names["ours"]
    want = source.state_dict()
    for loaded in (
        build_causal_lm(cfg, weights=tmp_path / "ours", seed=9),
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32),
    ):
        got = loaded.state_dict()
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(checkpoint_state(source)) == names["ours"]


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
    before = greedy(engine).output_ids
    bad = dict(build_causal_lm(CONFIG, seed=3).state_dict())
    bad["model.norm.weight"] = bad["model.norm.weight"].clone()
    bad["model.norm.weight"][1] = float("nan")
    with pytest.raises(ValueError, match=r"'model.norm.weight' holds non-finite"):
        run(engine.update_weights_from_tensors(bad))
    bad["model.norm.weight"][1] = float("inf")
    save_safetensors_dir(build_causal_lm(CONFIG, seed=3), tmp_path / "w")
    from safetensors.torch import save_file

    save_file({"model.norm.weight": bad["model.norm.weight"]}, str(tmp_path / "w" / "zz-bad.safetensors"))
    with pytest.raises(ValueError, match=r"'model.norm.weight' holds non-finite"):
        run(engine.update_weights_from_disk(str(tmp_path / "w")))
    # Nothing was written: not even the good file that came first.
    assert greedy(engine).output_ids == before and run(engine.weight_version()) == 0


def test_an_engine_whose_model_thread_failed_recovers_on_the_next_good_weight_load():
    engine = LocalEngine(CONFIG, eos_token_ids=[], seed=0)
    good = {k: v.clone() for k, v in engine.model.state_dict().items()}
    expected = greedy(engine).output_ids

    async def scenario():
        with torch.no_grad():  # weights gone bad behind the loader's back (e.g. overflow in place)
            engine.model.get_input_embeddings().weight.fill_(float("nan"))
        with pytest.raises(Exception):
            await engine.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=4))
        assert not await engine.health()
        with pytest.raises(Exception, match="unhealthy"):
            await engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=4))
        assert await engine.update_weights_from_tensors(good) == 1
        assert await engine.health()
        result = await engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=8))
        return result.output_ids

    assert run(scenario()) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finite_check_sees_every_nan_and_inf_and_no_false_alarm(dtype):
    """The load's check reads min and max: a NaN, +inf or -inf anywhere is found; the largest
    finite values (whose sum would overflow) and an empty tensor pass."""
    from megatron_stepwise.rollout.engines.embedded.hf_model import _all_finite

    t = torch.randn(4097).to(dtype)
    assert _all_finite(t)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 2048, 4096):
            u = t.clone()
            u[where] = bad
            assert not _all_finite(u), (bad, where)
    assert _all_finite(torch.full((64,), torch.finfo(dtype).max, dtype=dtype))
    assert _all_finite(torch.empty(0, dtype=dtype))
