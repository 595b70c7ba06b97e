"""The sampled sync check rides in the update request (docs/weights.md, 'Every sync verified').

An engine asked to `sample_weights` answers the update itself with the values at the sampled
positions of every tensor it loaded, taken once the update is applied; the trainer compares them
with its record. A one-element corruption between the trainer's sample and the engine's load is
named with the tensor, its flat index and the engine, whether the update came as tensors, from
disk or by broadcast, in process, over Ray's call surface or over HTTP; no second request is made
(spies count them); an SGLang server is counted unverified without one; only `full` mode asks
the engines again.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import tiny_lm
from in_process_fleet import InProcessHandle

from megatron_stepwise import weight_checks as C
from megatron_stepwise import weight_transport
from megatron_stepwise.mcore.weights import sync as S
from megatron_stepwise.mcore.weights.sync_verify import (
    PushRecord,
    WeightMismatch,
    judge_samples,
    merge_answers,
    mismatch_message,
)
from megatron_stepwise.rollout.engines.embedded import engine as engine_module
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.hf_model import checkpoint_state
from megatron_stepwise.rollout.engines.embedded.server import start_server
from megatron_stepwise.rollout.engines.sglang import SGLangClient
from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
from megatron_stepwise.rollout.fleet.fleet import RolloutFleet, _sampled_answers

TOK, CONFIG = tiny_lm("tiny_word")
NAME = "model.embed_tokens.weight"  # large: SAMPLE_SIZE of its elements are sampled
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]


def pushed(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """What a trainer would send: another model's weights under HF names, in `dtype`."""
    state = checkpoint_state(LocalEngine(CONFIG, seed=seed).model)
    if CONFIG.get("tie_word_embeddings"):
        state.pop("lm_head.weight")  # a sync never sends the tied copy
    return {k: v.to(dtype) for k, v in state.items()}


def record_of(tensors: dict, version: int) -> PushRecord:
    """The trainer's sample of what it sends."""
    record = PushRecord(version, "sampled")
    record.add(list(tensors.items()))
    record.finish()
    return record


def corrupted(tensors: dict, version: int) -> tuple[dict, int]:
    """A copy of `tensors` with one element of NAME changed at a sampled position, and that position."""
    where = int(C.sample_positions(NAME, version, tensors[NAME].numel())[17])  # (positions are distinct)
    out = dict(tensors)
    out[NAME] = tensors[NAME].clone()
    out[NAME].view(-1)[where] += 1.0
    return out, where


def judged_message(answer: dict, record: PushRecord, index: int = 0):
    return mismatch_message(judge_samples([{"index": index, **answer}], record), record.version)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _update_by_broadcast(engine: LocalEngine, tensors: dict, version: int):
    """The trainer's side of a distributed update (a one-engine gloo group in this process)
    beside the engine's `update_weights_from_distributed(sample_weights=True)`."""
    port = _free_port()
    loop = asyncio.get_running_loop()
    opened = loop.run_in_executor(None, weight_transport.open_group, "127.0.0.1", port, 2, 60)
    await engine.init_weights_update_group("127.0.0.1", port, 1, 2)
    group = await opened
    names = list(tensors)
    dtypes = [weight_transport.dtype_name(t.dtype) for t in tensors.values()]
    shapes = [list(t.shape) for t in tensors.values()]
    answer, _ = await asyncio.gather(
        engine.update_weights_from_distributed(names, dtypes, shapes, weight_version=version, sample_weights=True),
        loop.run_in_executor(None, weight_transport.broadcast, group, list(tensors.values())),
    )
    return answer


async def _update(engine: LocalEngine, mode: str, tensors: dict, version: int, tmp_path):
    if mode == "tensor":
        return await engine.update_weights_from_tensors(tensors, version, sample_weights=True)
    if mode == "disk":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
        return await engine.update_weights_from_disk(str(tmp_path), version, sample_weights=True)
    return await _update_by_broadcast(engine, tensors, version)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sampled_update_answers_with_the_samples_of_what_it_loaded(dtype):
    engine = LocalEngine(CONFIG, seed=0, name="engine0.2")
    tensors = pushed(seed=5, dtype=dtype)
    record = record_of(tensors, 7)

    async def go():
        answer = await engine.update_weights_from_tensors(tensors, 7, sample_weights=True)
        plain = await engine.update_weights_from_tensors(tensors, 8)
        return answer, plain

    answer, plain = asyncio.run(go())
    assert plain == 8  # without the flag an update answers its version, as before
    assert answer["engine"] == "engine0.2" and answer["weight_version"] == 7 and answer["sample_s"] >= 0
    assert set(answer["samples"]) == set(tensors)
    assert answer["samples"][NAME].dtype == "float32"  # taken from what the engine holds, in its dtype
    [judged] = judge_samples([{"index": 0, **answer}], record)
    assert judged["problems"] == {} and judged["weight_version"] == 7 and "samples" not in judged
    assert mismatch_message([judged], 7) is None


@pytest.mark.parametrize("mode", ["tensor", "disk", "distributed"])
def test_a_corruption_between_the_trainers_sample_and_the_engines_load_is_named(mode, tmp_path):
    engine = LocalEngine(CONFIG, seed=0, name="engine0.1")
    tensors = pushed(seed=5)
    record = record_of(tensors, 4)  # the trainer sampled the good values ...
    bad, where = corrupted(tensors, 4)  # ... then one element changed on its way to the engine

    answer = asyncio.run(_update(engine, mode, bad, 4, tmp_path))
    message = judged_message(answer, record)
    assert message.startswith("weight sync of version 4 verified wrong: engine 0 (engine0.1) holds 1 tensor(s)")
    assert f"{NAME}: 1 of {C.SAMPLE_SIZE} sampled values differ (first at flat index {where}:" in message


def test_a_name_loaded_into_another_names_tensor_is_caught_in_the_update_answer(monkeypatch):
    # prime-rl #3175's failure: a loader that puts one layer's weights into another layer. The
    # engine samples each tensor as soon as it is written, unless two names of the update load
    # into the same memory: then it samples every name after the whole update, and shows it.
    a, b = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"
    targets = engine_module.hf_model.load_targets

    def misapplying(model, items):
        found = targets(model, items)
        names = [name for name, _ in items]
        found[names.index(a)] = found[names.index(b)]  # a lands in b's tensor, before b's own
        return found

    monkeypatch.setattr(engine_module.hf_model, "load_targets", misapplying)
    engine = LocalEngine(CONFIG, seed=0)
    tensors = pushed(seed=5)
    answer = asyncio.run(engine.update_weights_from_tensors(tensors, 9, sample_weights=True))
    [judged] = judge_samples([{"index": 0, **answer}], record_of(tensors, 9))
    assert list(judged["problems"]) == [a]  # a's own tensor still holds the old weights


def test_a_name_of_a_later_request_loaded_over_an_earlier_ones_tensor_is_caught(monkeypatch):
    # A push sent a bucket per request (`atomic: false`): the earlier request's answer sampled b
    # as loaded; the later one that overwrites b answers with b sampled again, after its load.
    a, b = "model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"
    targets = engine_module.hf_model.load_targets

    def misapplying(model, items):
        found = targets(model, items)
        return [targets(model, [(b, t)])[0] if name == a else f for (name, t), f in zip(items, found)]

    monkeypatch.setattr(engine_module.hf_model, "load_targets", misapplying)
    engine = LocalEngine(CONFIG, seed=0)
    tensors = pushed(seed=5)
    first = {b: tensors[b]}
    rest = {name: t for name, t in tensors.items() if name != b}

    async def go():
        return [
            [{"index": 0, **await engine.update_weights_from_tensors(h, 6, sample_weights=True)}] for h in (first, rest)
        ]

    [judged] = judge_samples(merge_answers(asyncio.run(go())), record_of(tensors, 6))
    assert set(judged["problems"]) == {a, b}  # b holds a's values, a still the old weights


def test_tensors_sharing_memory_are_told_apart_from_disjoint_ones():
    fused = torch.zeros(4, 6)
    gate, up = fused.chunk(2, dim=0)  # a fused expert's halves: disjoint rows
    assert not C.overlapping([gate, up, torch.zeros(3)])
    assert C.overlapping([fused, up])  # the whole and a part
    assert C.overlapping([fused[:, :3], fused[:, 3:]])  # interleaved columns: counted as shared (safe side)
    assert not C.overlapping([torch.zeros(0), torch.zeros(0)])
    engine = LocalEngine(CONFIG, seed=0)
    items = list(pushed(seed=5).items())
    assert not C.overlapping(engine_module.hf_model.load_targets(engine.model, items))  # sampled as written


def test_the_serve_engine_answers_the_update_with_its_samples_in_one_request():
    engine = LocalEngine(CONFIG, tokenizer=TOK, seed=0, name="served")
    tensors = pushed(seed=5, dtype=torch.bfloat16)
    bad, where = corrupted(tensors, 3)
    requests: list = []

    async def go():
        runner, port = await start_server(engine, "127.0.0.1", 0)
        client = SGLangClient(f"http://127.0.0.1:{port}")
        assert await client._is_embedded()  # (learnt once per client: not part of an update)
        send = client._request

        async def spy(method, path, *args, **kwargs):
            requests.append((method, path))
            return await send(method, path, *args, **kwargs)

        client._request = spy
        try:
            good = await client.update_weights_from_tensors(tensors, 3, sample_weights=True)
            first = list(requests)
            wrong = await client.update_weights_from_tensors(bad, 3, sample_weights=True)
            return good, first, wrong
        finally:
            await client.close()
            await runner.cleanup()
            await engine.close()

    good, first, wrong = asyncio.run(go())
    assert first == [("POST", "/update_weights_from_tensor")]  # no /verify_weights, no version query
    assert len(requests) == 2
    assert good["engine"] == "served" and good["weight_version"] == 3
    assert judged_message(good, record_of(tensors, 3)) is None
    message = judged_message(wrong, record_of(tensors, 3), index=2)
    assert (
        "engine 2 (served)" in message
        and f"{NAME}: 1 of {C.SAMPLE_SIZE} sampled values differ (first at flat index {where}:" in message
    )


def test_an_sglang_server_gets_no_field_of_ours_and_is_counted_unverified_without_a_second_check():
    client = SGLangClient("http://sglang.invalid:30000")
    requests: list = []

    async def fake(method, path, json=None, params=None, base_url=None):
        requests.append((method, path, dict(json or {})))
        if path == "/get_model_info":
            return {"model_path": "m", "weight_version": "6"}  # a real SGLang server: no engine tag
        return {"success": True, "message": "ok"}

    client._request = fake
    answer = asyncio.run(client.update_weights_from_disk("/weights/v6", 6, sample_weights=True))
    assert answer["unverified"] is True and answer["weight_version"] == 6 and "SGLang" in answer["reason"]
    posts = [(path, body) for method, path, body in requests if method == "POST"]
    assert [path for path, _ in posts] == ["/update_weights_from_disk"] and "sample_weights" not in posts[0][1]
    assert not any(path == "/verify_weights" for _, path, _ in requests)
    [judged] = judge_samples([{"index": 1, **answer}], PushRecord(6, "sampled"))
    assert judged["unverified"] and mismatch_message([judged], 6) is None


class SpyHandle(InProcessHandle):
    """An in-process engine handle that records every method the fleet calls on it."""

    def __init__(self, engine, calls: list):
        super().__init__(engine)
        call = self.call.fn
        self.call.fn = lambda method, *args, **kwargs: calls.append(method) or call(method, *args, **kwargs)


def test_the_fleets_update_carries_the_check_and_asks_nothing_else(tmp_path):
    from safetensors.torch import save_file

    engine = LocalEngine(CONFIG, seed=0, name="engine0.0")
    calls: list = []
    fleet = RolloutFleet(
        [EngineSpec(kind="local", model_config=CONFIG)], spawn=lambda spec, i, incarnation: SpyHandle(engine, calls)
    )
    tensors = pushed(seed=5)
    bad, where = corrupted(tensors, 2)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))

    async def go():
        answers = await fleet.update_weights_from_disk(str(tmp_path), 1, sample_weights=True)
        first = list(calls)
        save_file({k: v.contiguous() for k, v in bad.items()}, str(tmp_path / "model.safetensors"))
        return answers, first, await fleet.update_weights_from_disk(str(tmp_path), 2, sample_weights=True)

    answers, first, wrong = asyncio.run(go())
    assert first == ["pause", "update_weights_from_disk", "flush_cache", "resume"]  # one request carries it
    assert "verify_weights" not in calls
    assert [a["index"] for a in answers] == [0] and answers[0]["weight_version"] == 1
    assert mismatch_message(judge_samples(answers, record_of(tensors, 1)), 1) is None
    message = mismatch_message(judge_samples(wrong, record_of(tensors, 2)), 2)
    assert "engine 0 (engine0.0)" in message and f"flat index {where}:" in message


def test_an_engine_that_died_during_the_update_is_unverified_with_its_reason():
    answers = _sampled_answers({0: None, 1: 5, 2: {"engine": "e2", "weight_version": 3, "samples": {}}})
    assert [a.get("unverified", False) for a in answers] == [True, True, False]
    assert answers[0]["reason"] == "died during the update, so it is not verified"


def test_answers_of_a_push_in_several_requests_are_joined_per_engine():
    tensors = pushed(seed=5)
    names = list(tensors)
    record = record_of(tensors, 3)
    halves = [dict(list(tensors.items())[: len(names) // 2]), dict(list(tensors.items())[len(names) // 2 :])]
    engine = LocalEngine(CONFIG, seed=0)

    async def go():
        return [[{"index": 0, **await engine.update_weights_from_tensors(h, 3, sample_weights=True)}] for h in halves]

    rounds = asyncio.run(go())
    [merged] = merge_answers(rounds)
    assert set(merged["samples"]) == set(names) and merged["weight_version"] == 3
    assert mismatch_message(judge_samples([merged], record), 3) is None
    # only the first request's answer: the other half is named as never loaded
    [partial] = judge_samples(merge_answers(rounds[:1]), record)
    assert set(partial["problems"]) == set(names[len(names) // 2 :])
    assert "did not load it in this update" in partial["problems"][names[-1]]


class CheckFleet:
    """The fleet surface `WeightSync._check` uses, counting the check requests it makes."""

    def __init__(self, engine):
        self.engine, self.verify_requests = engine, 0

    async def verify_weights(self, checks, weight_version):
        self.verify_requests += 1
        return [{"index": 0, **await self.engine.verify_weights(checks, weight_version)}]


@pytest.fixture
def one_rank(monkeypatch):
    """`WeightSync` as global rank 0 of one, without a process group."""
    monkeypatch.setattr(S.dist, "get_rank", lambda: 0)

    def raise_here(error, error_type, src=0):
        if error is not None:
            raise error_type(error)

    monkeypatch.setattr(S, "raise_together", raise_here)


@pytest.mark.usefixtures("one_rank")
def test_weight_sync_judges_a_sampled_push_from_the_update_answers_without_a_verify_request(caplog):
    engine = LocalEngine(CONFIG, seed=0, name="engine0.0")
    fleet = CheckFleet(engine)
    loop = asyncio.new_event_loop()
    syncer = S.WeightSync(fleet, "tensor", CONFIG, loop=loop)
    tensors = pushed(seed=5)
    bad, where = corrupted(tensors, 5)
    died = {"index": 1, "unverified": True, "reason": "died during the update, so it is not verified"}
    try:
        answer = loop.run_until_complete(engine.update_weights_from_tensors(tensors, 5, sample_weights=True))
        with caplog.at_level(logging.WARNING):
            metrics = syncer._check(record_of(tensors, 5), [{"index": 0, **answer}, died])
        assert fleet.verify_requests == 0
        assert metrics["weight_sync/verified_engines"] == 1 and metrics["weight_sync/unverified_engines"] == 1
        assert metrics["weight_sync/verify_s"] >= answer["sample_s"]
        assert "engine 1: died during the update" in caplog.text  # not a silent success

        answer = loop.run_until_complete(engine.update_weights_from_tensors(bad, 5, sample_weights=True))
        with pytest.raises(WeightMismatch, match=rf"engine 0 \(engine0.0\).*{NAME}: .*flat index {where}:"):
            syncer._check(record_of(tensors, 5), [{"index": 0, **answer}])
        assert fleet.verify_requests == 0

        full = PushRecord(5, "full")
        full.add(list(tensors.items()))
        with pytest.raises(WeightMismatch, match=rf"{NAME}: sha256 "):
            syncer._check(full, None)  # full mode keeps its own request
        assert fleet.verify_requests == 1
    finally:
        syncer.close()
        loop.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_samples_travel_as_columns_and_read_as_checks(dtype):
    engine = LocalEngine(CONFIG, seed=0)  # holds float32: bfloat16 pushes are cast on load
    tensors = pushed(seed=5, dtype=dtype)
    record = record_of(tensors, 3)
    answer = asyncio.run(engine.update_weights_from_tensors(tensors, 3, sample_weights=True))
    samples = pickle.loads(pickle.dumps(answer["samples"]))  # as Ray carries it
    assert isinstance(samples, C.Samples) and list(samples) == list(answer["samples"]) == list(tensors)
    for name, sent in record.checks.items():  # read by name, each is the record's values in the engine's dtype
        assert samples[name].shape == sent.shape and samples[name].dtype == "float32"
        assert torch.equal(samples[name].values, sent.values.to(torch.float32)), name
    assert samples.same_as(record.checks) and C.compare_samples(samples, record.checks, 3) == {}

    changed = C.Checks(record.checks)
    values = changed[NAME].values.clone()
    values[5] += 1
    changed[NAME] = C.TensorCheck(changed[NAME].shape, changed[NAME].dtype, values)
    assert not samples.same_as(changed)
    assert list(C.compare_samples(samples, changed, 3)) == [NAME]  # named by the per-tensor path
    fewer = C.Checks({n: c for n, c in record.checks.items() if n != NAME})
    assert not samples.same_as(fewer)  # the engine loaded a name the trainer did not send
    more = C.Checks({**record.checks, "model.extra.weight": record.checks[NAME]})
    assert C.compare_samples(samples, more, 3) == {
        "model.extra.weight": "the engine did not load it in this update (no sample in its answer)"
    }
    reshaped = C.Checks(record.checks)
    reshaped[NAME] = C.TensorCheck(tuple(reversed(record.checks[NAME].shape)), "float32", record.checks[NAME].values)
    assert "shape" in C.compare_samples(samples, reshaped, 3)[NAME]


def test_the_next_versions_positions_are_ready_before_its_update(monkeypatch):
    """After a load the engine computes the next version's sample positions, behind the load on
    its model thread; the next sampled update then computes none on its load path."""
    engine = LocalEngine(CONFIG, seed=0)
    tensors = pushed(seed=5)
    calls = []
    computed = C._position_matrix
    monkeypatch.setattr(C, "_position_matrix", lambda *a: calls.append(a[1]) or computed(*a))

    async def go():
        await engine.update_weights_from_tensors(tensors, 3, sample_weights=True)
        await engine.update_weights_from_tensors(tensors, 4)  # an unsampled load also positions the next
        await engine.scheduler.run(lambda: None)  # what the model thread queued behind the loads is done
        calls.append("update 5")
        answer = await engine.update_weights_from_tensors(tensors, 5, sample_weights=True)
        await engine.scheduler.run(lambda: None)
        return answer

    answer = asyncio.run(go())
    # 3 on the first update's path; 4, 5 and 6 each behind a load; none on the path of update 5
    assert calls == [3, 4, 5, "update 5", 6]
    assert C.compare_samples(answer["samples"], record_of(tensors, 5).checks, 5) == {}


def test_the_trainer_positions_a_push_on_its_sampling_thread_from_the_last_one(monkeypatch):
    tensors = list(pushed(seed=5).items())
    calls = []
    computed = C._position_matrix
    monkeypatch.setattr(
        C, "_position_matrix", lambda *a: calls.append((threading.current_thread().name, len(a[0]))) or computed(*a)
    )
    with ThreadPoolExecutor(1, thread_name_prefix="sampler") as pool:
        first = PushRecord(1, "sampled", pool)
        first.add(tensors)
        first.finish()
        calls.clear()
        second = PushRecord(2, "sampled", pool, expected=first.sent())
        second.add(tensors[:3])
        second.add(tensors[3:])
        second.finish()
    big = sum(1 for _, t in tensors if t.numel() > C.SAMPLE_SIZE)
    assert [(thread.startswith("sampler"), n) for thread, n in calls] == [(True, big)]  # once, for all, ahead
    assert second.checks.keys() == first.checks.keys()
    assert all(torch.equal(second.checks[n].values, C.check_of(n, t, 2, "sampled").values) for n, t in tensors)


def test_cpu_buckets_are_kept_during_the_push_and_sampled_while_the_engines_load(monkeypatch):
    tensors = list(pushed(seed=5).items())
    sampled = []
    real = C.checks_of
    monkeypatch.setattr(C, "checks_of", lambda bucket, *args: sampled.append(len(bucket)) or real(bucket, *args))
    with ThreadPoolExecutor(1) as pool:
        kept = PushRecord(2, "sampled", pool)
        kept.add(tensors[:3])
        kept.add(tensors[3:])
        assert sampled == []  # nothing sampled while the push converts and sends
        kept.sample_held()  # the push starts waiting for the engines
        kept.finish()
        assert sampled == [3, len(tensors) - 3]
        sampled.clear()
        over = PushRecord(2, "sampled", pool, hold_mb=0)  # past the budget: each bucket as it comes
        over.add(tensors[:3])
        over.add(tensors[3:])
        over.finish()
        assert sampled == [3, len(tensors) - 3]
    inline = record_of(dict(tensors), 2)  # no thread: sampled in line
    for record in (kept, over):
        assert list(record.checks) == list(inline.checks)
        assert all(torch.equal(record.checks[n].values, inline.checks[n].values) for n in inline.checks)
