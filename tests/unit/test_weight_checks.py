"""Every weight sync verified (weight_checks.py, the embedded engine's /verify_weights, sync_verify.py).

The engine compares the trainer's record of a push with the weights it holds: a corrupted tensor
(one element, or a whole layer misapplied) is named with the engine and version; a bf16 push into
an fp32 engine verifies exactly; the same record passes over HTTP; the manifest hashes every weight.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import tiny_lm

from megatron_stepwise import weight_checks as C
from megatron_stepwise.mcore.weights.sync_verify import PushRecord, mismatch_message
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.hf_model import checkpoint_state
from megatron_stepwise.rollout.engines.embedded.server import start_server
from megatron_stepwise.rollout.engines.sglang import SGLangClient

TOK, CONFIG = tiny_lm("tiny_word")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def pushed(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """What a trainer would send: another model's weights under HF names, in `dtype`."""
    state = checkpoint_state(LocalEngine(CONFIG, seed=seed).model)
    if CONFIG.get("tie_word_embeddings"):
        state.pop("lm_head.weight")  # a sync never sends the tied copy
    return {k: v.to(dtype) for k, v in state.items()}


def record_of(tensors: dict, version: int, mode: str = "sampled") -> PushRecord:
    record = PushRecord(version, mode)
    record.add(list(tensors.items()))
    return record


def load_and_verify(engine: LocalEngine, tensors: dict, record: PushRecord, corrupt=None) -> dict:
    async def go():
        await engine.update_weights_from_tensors(tensors, record.version)
        if corrupt is not None:
            corrupt(engine.model)
        return await engine.verify_weights(record.checks, record.version)

    return asyncio.run(go())


def test_positions_are_seeded_by_name_and_version_and_cover_small_tensors_whole():
    a = C.sample_positions("model.layers.0.mlp.up_proj.weight", 3, 10_000)
    assert torch.equal(a, C.sample_positions("model.layers.0.mlp.up_proj.weight", 3, 10_000))
    assert not torch.equal(a, C.sample_positions("model.layers.0.mlp.up_proj.weight", 4, 10_000))
    assert not torch.equal(a, C.sample_positions("model.layers.1.mlp.up_proj.weight", 3, 10_000))
    assert len(a) == C.SAMPLE_SIZE and int(a.max()) < 10_000
    assert torch.equal(C.sample_positions("model.norm.weight", 3, 64), torch.arange(64))


def test_sampling_a_strided_view_reads_the_right_elements():
    full = torch.arange(48.0).reshape(6, 8)
    view = full[:, 2:5]  # non-contiguous, as a q/k/v slice of a fused tensor
    positions = torch.tensor([0, 4, 17])
    assert C.take(view, positions).tolist() == view.reshape(-1)[positions].tolist()


def test_a_faithful_push_verifies_in_every_mode_and_dtype():
    engine = LocalEngine(CONFIG, seed=0)
    for mode in ("sampled", "full"):
        for dtype in (torch.float32, torch.bfloat16):
            tensors = pushed(seed=5, dtype=dtype)
            answer = load_and_verify(engine, tensors, record_of(tensors, 7, mode))
            assert answer["problems"] == {}, (mode, dtype)
            assert answer["weight_version"] == 7


def test_one_flipped_element_is_caught_by_name():
    engine = LocalEngine(CONFIG, seed=0)
    tensors = pushed(seed=5)
    name = "model.layers.1.post_attention_layernorm.weight"  # small: sampled whole

    def flip(model):
        with torch.no_grad():
            model.get_parameter(name)[3] += 1.0

    answer = load_and_verify(engine, tensors, record_of(tensors, 2), corrupt=flip)
    assert list(answer["problems"]) == [name]
    assert "1 of 64 sampled values differ (first at flat index 3" in answer["problems"][name]


def test_a_misapplied_layer_is_caught_and_the_error_names_tensor_engine_and_version():
    # prime-rl #3175's failure: one layer's weights landed in another layer.
    engine = LocalEngine(CONFIG, seed=0, name="engine0.1")
    tensors = pushed(seed=5)
    a, b = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"

    def swap(model):
        with torch.no_grad():
            model.get_parameter(b).copy_(model.get_parameter(a))

    answer = load_and_verify(engine, tensors, record_of(tensors, 9), corrupt=swap)
    assert list(answer["problems"]) == [b]
    message = mismatch_message([{"index": 0, **answer}], 9)
    assert message.startswith("weight sync of version 9 verified wrong: engine 0 (engine0.1) holds 1 tensor(s)")
    assert b in message and a not in message


def test_full_mode_catches_what_sampling_can_miss():
    engine = LocalEngine(CONFIG, seed=0)
    tensors = pushed(seed=5)
    name = "model.embed_tokens.weight"
    sampled = set(C.sample_positions(name, 4, tensors[name].numel()).tolist())
    unsampled = next(i for i in range(tensors[name].numel()) if i not in sampled)

    def flip(model):
        with torch.no_grad():
            model.get_parameter(name).view(-1)[unsampled] += 1.0

    assert load_and_verify(engine, tensors, record_of(tensors, 4), corrupt=flip)["problems"] == {}
    problems = load_and_verify(engine, tensors, record_of(tensors, 4, "full"), corrupt=flip)["problems"]
    assert list(problems) == [name] and problems[name].startswith("sha256 ")


def test_a_stale_engine_version_and_an_unknown_tensor_are_named():
    held = {"w": torch.zeros(3)}
    sent = {
        "w": C.check_of("w", torch.zeros(3), 1, "sampled"),
        "extra.weight": C.check_of("x", torch.ones(2), 1, "full"),
    }
    assert C.compare_all(held, sent, 1) == {"extra.weight": "not a weight of the engine's model"}
    message = mismatch_message([{"index": 1, "engine": "e1", "weight_version": 4, "problems": {}}], 5)
    assert "engine 1 (e1)" in message and "the engine reports version 4" in message
    assert mismatch_message([{"index": 0, "unverified": True}], 5) is None


def test_the_record_travels_over_http_and_the_manifest_hashes_every_weight():
    engine = LocalEngine(CONFIG, tokenizer=TOK, seed=0)
    tensors = pushed(seed=5, dtype=torch.bfloat16)
    name = "model.layers.0.self_attn.q_proj.weight"

    async def go():
        runner, port = await start_server(engine, "127.0.0.1", 0)
        client = SGLangClient(f"http://127.0.0.1:{port}")
        try:
            await client.update_weights_from_tensors(tensors, 3)
            good = await client.verify_weights(record_of(tensors, 3).checks, 3)
            with torch.no_grad():
                engine.model.get_parameter(name).mul_(2.0)
            bad = await client.verify_weights(record_of(tensors, 3).checks, 3)
            return good, bad, await client.weights_manifest()
        finally:
            await client.close()
            await runner.cleanup()
            await engine.close()

    good, bad, manifest = asyncio.run(go())
    assert good["problems"] == {} and good["weight_version"] == 3
    assert list(bad["problems"]) == [name]
    assert manifest["weight_version"] == 3 and set(manifest["tensors"]) == set(tensors)
    same = C.tensor_digest(tensors["model.norm.weight"].to(torch.float32))
    assert manifest["tensors"]["model.norm.weight"]["sha256"] == same


def test_a_record_pickles_exactly_in_every_dtype():
    # Ray sends the record to every engine as one blob of values (mixed dtypes stay aligned).
    import pickle

    checks = C.Checks()
    for i, dtype in enumerate((torch.bfloat16, torch.float32, torch.float16, torch.float64)):
        checks[f"w{i}"] = C.check_of(f"w{i}", torch.randn(3 + i, 5).to(dtype), 2, "sampled")
    checks["h"] = C.check_of("h", torch.ones(4), 2, "full")
    back = pickle.loads(pickle.dumps(checks))
    assert isinstance(back, C.Checks) and list(back) == list(checks)
    for name, check in checks.items():
        assert back[name].shape == check.shape and back[name].digest == check.digest
        if check.values is not None:
            assert back[name].values.dtype == check.values.dtype and torch.equal(back[name].values, check.values)
    assert back["h"].values is None


def test_both_sides_sample_the_same_positions_a_bucket_at_a_time():
    # The trainer samples a bucket at once, the engine its own tensors at once: both must read
    # exactly the positions `sample_positions` names for each tensor, whatever the batch holds.
    tensors = pushed(seed=5)
    named = list(tensors.items())
    batch = C.checks_of(named, 11, "sampled")
    for name, t in named:
        expected = t.reshape(-1)[C.sample_positions(name, 11, t.numel())]
        assert torch.equal(batch[name].values, expected), name
        assert torch.equal(C.check_of(name, t, 11, "sampled").values, expected), name
    held = {name: t.clone() for name, t in named}
    assert C.compare_all(held, batch, 11) == {}
    assert C.compare_all(held, batch, 12) != {}  # another version reads other positions


def test_sample_positions_depend_only_on_name_version_and_size():
    a = C.sample_positions("model.embed_tokens.weight", 5, 1_000_003)
    big = C.sample_many([("x", torch.zeros(7)), ("model.embed_tokens.weight", torch.arange(1_000_003.0))], 5)
    assert torch.equal(big[1], a.double())  # the values are the positions themselves
    k, n = C.SAMPLE_SIZE, 1_000_003
    assert len(a) == k
    for j, position in enumerate(a.tolist()):  # one in each of k equal strata
        assert j * n // k <= position < (j + 1) * n // k, (j, position)
    b = C.sample_positions("model.embed_tokens.weight", 6, n)
    c = C.sample_positions("model.norm.weight", 5, n)
    assert not torch.equal(a, b) and not torch.equal(a, c)  # other versions and names, other places


@pytest.mark.parametrize("n", [C.SAMPLE_SIZE + 1, 1000, 884_736, 2**31 + 11])
def test_a_wrong_region_of_two_strata_always_holds_a_sampled_position(n):
    """Wherever a contiguous wrong region of 2n/k elements lies, every version samples in it."""
    k = C.SAMPLE_SIZE
    width = -(-2 * n // k)  # ceil(2n/k)
    for version in range(40):
        positions = C.sample_positions(f"layer.{version}.weight", version, n)
        assert int(positions.min()) >= 0 and int(positions.max()) < n
        gaps = torch.diff(torch.cat([torch.tensor([-1]), positions, torch.tensor([n])]))
        assert int(gaps.max()) <= width, (version, int(gaps.max()), width)  # no window of `width` unsampled


def test_one_element_changed_at_a_sampled_position_of_a_large_tensor_is_caught_and_named():
    engine = LocalEngine(CONFIG, seed=0, name="engine0.3")
    tensors = pushed(seed=5)
    name = "model.embed_tokens.weight"
    where = int(C.sample_positions(name, 8, tensors[name].numel())[17])

    def flip(model):
        with torch.no_grad():
            model.get_parameter(name).view(-1)[where] += 1.0

    answer = load_and_verify(engine, tensors, record_of(tensors, 8), corrupt=flip)
    assert list(answer["problems"]) == [name]
    assert f"(first at flat index {where}:" in answer["problems"][name]
    message = mismatch_message([{"index": 0, **answer}], 8)
    assert "engine 0 (engine0.3)" in message and name in message


def test_a_record_sampled_beside_the_push_equals_one_taken_in_line():
    from concurrent.futures import ThreadPoolExecutor

    tensors = pushed(seed=5)
    named = list(tensors.items())
    buckets = [named[i : i + 7] for i in range(0, len(named), 7)]
    in_line = PushRecord(4, "sampled")
    with ThreadPoolExecutor(max_workers=1) as sampler:
        beside = PushRecord(4, "sampled", sampler)
        for bucket in buckets:
            in_line.add(bucket)
            beside.add(bucket)
        beside.finish()
    assert list(beside.checks) == list(in_line.checks) == list(tensors)
    for name in tensors:
        assert torch.equal(beside.checks[name].values, in_line.checks[name].values)
