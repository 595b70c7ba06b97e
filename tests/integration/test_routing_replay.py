"""Rollout routing replay (R3) for MoE models (mcore/train/routing_replay.py, rollout/engines/routed_experts.py).

End to end (tests/workers/routing_replay_worker.py under torchrun): the tiny Qwen3-MoE in megatron, its
weights in an embedded engine whose routers are slightly perturbed. With replay on, the experts
the trainer's routers use equal the engine's at every reported position and the engine-vs-trainer
log-prob gap falls to that of an unperturbed engine; without replay the routers pick other
experts and the gap is >= 10x larger. Unit tests: the per-token field stays aligned through
Step, StepBatch, merge, packing, the CP split and the SP slice; the replay itself; the engine's
recording; the SGLang wire form; the config.
"""

from __future__ import annotations

import ast
import asyncio
import json
import zipfile

import pytest
import torch
from helpers import check_ok, run_torchrun

from megatron_stepwise.algo.merge import merge_steps
from megatron_stepwise.algo.validate import validate_steps
from megatron_stepwise.mcore.train.packing import pack_rows, split_for_context_parallel
from megatron_stepwise.rollout.engines import routed_experts as routing
from megatron_stepwise.rollout.engines.protocol import GenerateResult, SamplingParams
from megatron_stepwise.steps import Step, StepBatch, StepwiseBatchError, TrajectoryID, make_padding_step

L, K = 3, 2  # layers, top-k of the synthetic routed experts


def experts_of(tokens: torch.Tensor) -> torch.Tensor:
    """Synthetic routed experts that encode their token: alignment shows as equality."""
    t = torch.as_tensor(tokens).long()
    out = torch.stack([t * 10 + layer for layer in range(L)], 1)
    return torch.stack([out, out + 1], 2) % 30000


def step(tid, prompt, response, *, last=False, unknown_tail=1, carry=True) -> Step:
    tokens = torch.tensor(prompt + response)
    routed = experts_of(tokens)
    if unknown_tail:
        routed[-unknown_tail:] = -1  # the engine never ran the last sampled token
    return Step(
        trajectory_id=TrajectoryID(tid, 0),
        prompt_ids=prompt,
        response_ids=response,
        loss_mask=[1] * len(response),
        rollout_logprobs=[-0.5] * len(response),
        is_last_step=last,
        routed_experts=routed if carry else None,
    )


def check_aligned(tokens: torch.Tensor, routed: torch.Tensor) -> int:
    """Every known position's experts encode its token; returns how many are known."""
    known = (routed >= 0).all(-1).all(-1)
    assert torch.equal(routed[known].long(), experts_of(tokens[known]))
    return int(known.sum())


# ---- the per-token field ----------------------------------------------------------------------


def test_step_field_is_compact_and_checked():
    s = step("a", [1, 2, 3], [4, 5])
    assert s.routed_experts.dtype == torch.int16 and s.routed_experts.shape == (5, L, K)
    with pytest.raises(StepwiseBatchError, match="routed_experts"):
        Step(
            trajectory_id=TrajectoryID("a", 0),
            prompt_ids=[1],
            response_ids=[2],
            loss_mask=[1],
            routed_experts=torch.zeros(2, L),
        )
    bad = step("a", [1, 2, 3], [4, 5])
    bad.routed_experts = bad.routed_experts[:4]
    with pytest.raises(StepwiseBatchError, match=r"step 0 .*'routed_experts' has 4 positions but the step has 5"):
        validate_steps([bad])


def test_batch_select_and_round_trip_keep_alignment():
    steps = [
        step("a", [1, 2, 3], [4, 5]),
        step("b", [7, 8], [9, 10, 11], last=True),
        step("c", [12], [13], carry=False, last=True),
        make_padding_step(0, [14, 15]),
    ]
    batch = StepBatch.from_steps(steps)
    routed = batch.token_fields["routed_experts"]
    assert routed.shape == (batch.tokens.numel(), L, K)
    assert check_aligned(batch.tokens, routed) == 4 + 4
    # a step without them (an engine that did not report, a padding step): unknown, never invented
    assert bool((routed[batch.row_slice(2)] == -1).all()) and bool((routed[batch.row_slice(3)] == -1).all())
    sub = batch.select([3, 1])
    assert check_aligned(sub.tokens, sub.token_fields["routed_experts"]) == 4
    back = batch.to_steps()
    assert torch.equal(back[0].routed_experts, steps[0].routed_experts)
    assert torch.equal(back[1].routed_experts, steps[1].routed_experts)


def test_merge_keeps_each_position_of_the_earliest_step_that_reported_it():
    s0 = step("a", [1, 2, 3], [4, 5])
    s1 = step("a", [1, 2, 3, 4, 5, 6, 7], [8, 9], last=True)
    # the second turn's prefill reported the first turn's last token, with other experts
    s1.routed_experts[:5] = experts_of(torch.tensor([1, 2, 3, 4, 5])) + 7
    merged, stats = merge_steps([s0, s1])
    assert stats.rows_after == 1
    row = merged[0].routed_experts
    assert row.shape == (9, L, K)
    assert torch.equal(row[:4], s0.routed_experts[:4])  # s0's own forward, including its prompt
    assert torch.equal(row[4], s1.routed_experts[4])  # s0 never ran its last token: s1's prefill did
    assert torch.equal(row[5:8], s1.routed_experts[5:8]) and bool((row[8] == -1).all())
    # merging with a step that carries none leaves its positions unknown
    merged, _ = merge_steps([s0, step("a", [1, 2, 3, 4, 5, 6], [8], last=True, carry=False)])
    assert torch.equal(merged[0].routed_experts[:4], s0.routed_experts[:4])
    assert bool((merged[0].routed_experts[4:] == -1).all())


@pytest.mark.parametrize("cp", [1, 2])
def test_packing_and_context_parallel_split_carry_the_experts(cp):
    steps = [
        step("a", [1, 2, 3], [4, 5], unknown_tail=0),
        step("b", [7, 8, 9, 10], [11, 12, 13], unknown_tail=0),
        make_padding_step(0, [14, 15, 16]),
    ]
    batch = StepBatch.from_steps(steps)
    mb = pack_rows(batch, [1, 0, 2], align=4 if cp == 2 else 3, cp=cp)
    assert mb.routed_experts.shape == (mb.seq_len, L, K)
    known = check_aligned(mb.tokens[0], mb.routed_experts)
    assert known == 12  # every real token of the data rows; pads and the padding step are -1
    if cp == 1:
        return
    seen = 0
    for rank in range(cp):
        part = split_for_context_parallel(mb, cp, rank)
        assert part.routed_experts.size(0) == part.tokens.size(1)
        seen += check_aligned(part.tokens[0], part.routed_experts)
    assert seen == known


def test_sequence_parallel_slice_follows_the_tokens(monkeypatch):
    from megatron.core import parallel_state as ps

    from megatron_stepwise.mcore.train.routers import local_tokens

    class Cfg:
        tensor_model_parallel_size, sequence_parallel = 2, True

    routed = experts_of(torch.arange(8))
    for rank in range(2):
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: rank)
        assert torch.equal(local_tokens(routed, Cfg), routed[4 * rank : 4 * rank + 4])
    Cfg.sequence_parallel = False
    assert local_tokens(routed, Cfg) is routed


# ---- the replay --------------------------------------------------------------------------------


def test_replay_overrides_known_positions_only():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_stepwise.mcore.train.routing_replay import KnownPositionsReplay, RoutingReplayError

    before = len(RouterReplay.global_router_replay_instances)
    replay = KnownPositionsReplay()
    assert len(RouterReplay.global_router_replay_instances) == before  # nothing kept alive globally
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0], [0.0, 5.0, 1.0, 2.0]])

    def topk(s, k, num_groups=None, group_topk=None):
        return torch.topk(s, k, dim=1)

    replay.record = True
    replay.set_targets(torch.tensor([[2, 3], [-1, -1], [0, 2]]))
    probs, idx = replay.get_replay_topk(scores, 2, None, None, topk)
    assert idx.tolist() == [[2, 3], [3, 2], [0, 2]]
    assert torch.equal(probs, scores.gather(1, idx)) and torch.equal(replay.recorded_topk_idx, idx)
    replay.set_targets(None)  # cleared after every forward: nothing accumulates
    assert replay.get_replay_topk(scores, 2, None, None, topk)[1].tolist() == [[0, 1], [3, 2], [1, 3]]
    replay.set_targets(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(RoutingReplayError, match=r"routes \(3, 2\).*\(2, 2\)"):
        replay.get_replay_topk(scores, 2, None, None, topk)


def test_layouts_replay_cannot_serve_are_refused():
    from megatron_stepwise.mcore.train.routing_replay import RoutingReplayError, check_config

    class Cfg:
        moe_router_fusion = False
        recompute_granularity, recompute_modules = "full", None

    with pytest.raises(RoutingReplayError, match="activation recomputation"):
        check_config(Cfg)
    Cfg.recompute_granularity, Cfg.moe_router_fusion = None, True
    with pytest.raises(RoutingReplayError, match="moe_router_fusion"):
        check_config(Cfg)


# ---- the engines -------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_embedded_engine_reports_the_experts_of_every_position_it_ran(model_type):
    from megatron_stepwise.hf.presets import tiny_config
    from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
    from megatron_stepwise.rollout.engines.routed_experts import pad_to_tokens

    cfg = tiny_config(model_type=model_type)

    async def run():
        engine = LocalEngine(cfg, seed=1, eos_token_ids=[])
        prompts = [[1, 2], [3, 4, 5, 6], [7]]
        batched = await asyncio.gather(
            *(engine.generate(p, SamplingParams(max_new_tokens=4 + i, sampling_seed=i)) for i, p in enumerate(prompts))
        )
        alone = await engine.generate(prompts[0], SamplingParams(max_new_tokens=4, sampling_seed=0))
        await engine.close()
        return prompts, batched, alone

    prompts, batched, alone = asyncio.run(run())
    for p, r in zip(prompts, batched):
        n = len(p) + len(r.output_ids)
        # every position but possibly the last sampled token (fed back only if the batch went on)
        assert r.routed_experts.shape[1:] == (2, 2) and n - 1 <= r.routed_experts.size(0) <= n
        assert int(r.routed_experts.min()) >= 0 and int(r.routed_experts.max()) < 4
    # left padding in a batch does not shift a row's positions
    assert alone.output_ids == batched[0].output_ids
    m = alone.routed_experts.size(0)
    assert torch.equal(alone.routed_experts, batched[0].routed_experts[:m])
    padded = pad_to_tokens(alone.routed_experts, len(prompts[0]) + len(alone.output_ids))
    assert padded.size(0) == 6 and bool((padded[m:] == -1).all())


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_router_hook_reproduces_the_models_own_routing(model_type):
    """The recorder finds every router (Qwen3MoeTopKRouter, MixtralTopKRouter) and, with a
    vanishing router noise, its recomputed gating (renormalised as the family does) leaves the
    model's logits as they were."""
    from megatron_stepwise.hf.presets import tiny_config
    from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm
    from megatron_stepwise.rollout.engines.routed_experts import RouterRecorder, moe_gates

    model = build_causal_lm(tiny_config(model_type=model_type), seed=4)
    assert sorted(moe_gates(model)) == [0, 1]
    ids = torch.tensor([[5, 9, 17, 3, 200, 41]])
    with torch.no_grad():
        plain = model(ids).logits
        recorder = RouterRecorder(model, router_noise=1e-12)
        hooked = model(ids).logits
    experts = recorder.take(6)
    recorder.close()
    assert experts.shape == (6, 2, 2) and int(experts.min()) >= 0 and int(experts.max()) < 4
    assert torch.allclose(hooked, plain, atol=1e-6, rtol=0)


def test_agent_loop_steps_carry_the_engines_experts_and_merge_aligned():
    """Echo env, token-in/token-out context (so the turns merge), a MoE engine: each step's
    experts are its request's, padded with -1, and the merged row keeps every position's."""
    from helpers import tiny_lm

    from megatron_stepwise.envs.echo import echo_dataset
    from megatron_stepwise.hf.presets import tiny_config
    from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
    from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine

    tok, _ = tiny_lm("tiny_word")
    engine = LocalEngine(
        tiny_config(model_type="qwen3_moe", vocab_size=len(tok)), tokenizer=tok, seed=2, record_routed_experts=True
    )
    served = []

    class Recording:
        async def generate(self, input_ids, sampling, rid=None, session=None):
            result = await engine.generate(input_ids, sampling, rid=rid, session=session)
            served.append((list(input_ids), result))
            return result

    config = AgentLoopConfig(
        max_turns=3,
        max_input_length=300,
        n_samples_per_prompt=2,
        context="tokens",
        sampling=SamplingParams(max_new_tokens=3),
    )
    loop = AgentLoop(Recording(), tok, "echo", config)
    try:
        steps = asyncio.run(loop.rollout(echo_dataset(2, num_turns=3, seed=1)))
    finally:
        loop.close()
        asyncio.run(engine.close())
    for s in steps:
        result = next(
            r
            for p, r in served
            if p == s.prompt_ids.tolist() and r.output_ids == s.response_ids.tolist()[: len(r.output_ids)]
        )
        n = result.routed_experts.size(0)
        assert s.routed_experts.size(0) == s.num_tokens and torch.equal(s.routed_experts[:n], result.routed_experts)
        assert bool((s.routed_experts[n:] == -1).all())
    merged, stats = merge_steps(steps)
    assert stats.rows_after < stats.rows_before
    batch, merged_batch = StepBatch.from_steps(steps), StepBatch.from_steps(merged)
    # each position of a merged row has the experts of the earliest of its steps that knew them
    i = 0
    for r, row in enumerate(merged):
        own = steps[i : i + row.metadata["merged_steps"]]
        i += len(own)
        want = torch.full((row.num_tokens, 2, 2), -1, dtype=torch.int16)
        for st in own:
            fill = (want[: st.num_tokens] < 0).all(-1).all(-1) & (st.routed_experts >= 0).all(-1).all(-1)
            want[: st.num_tokens][fill] = st.routed_experts[fill]
        assert torch.equal(merged_batch.token_fields["routed_experts"][merged_batch.row_slice(r)], want)
        for st in own:  # every response token its own turn ran keeps that turn's experts
            resp = slice(st.prompt_ids.numel(), st.num_tokens)
            known = (st.routed_experts[resp] >= 0).all(-1).all(-1)
            assert torch.equal(want[resp][known], st.routed_experts[resp][known])
    assert batch.token_fields["routed_experts"].shape[1:] == (2, 2)


def test_sglang_wire_form_round_trips_through_the_embedded_server_response():
    from megatron_stepwise.rollout.engines.embedded.generate_response import generate_response
    from megatron_stepwise.rollout.engines.sglang import parse_generate_response

    routed = torch.randint(0, 4, (7, 2, 2), dtype=torch.int16)  # prompt 3 + output 4 (all run)
    result = GenerateResult([5, 6, 7, 8], [-0.1] * 4, "length", routed_experts=routed)
    resp = json.loads(json.dumps(generate_response("r", 3, result, True, return_routed_experts=True)))
    back = parse_generate_response(resp, (2, 2)).routed_experts
    assert torch.equal(back, routed[:6])  # SGLang's contract: all but the last position
    assert parse_generate_response(resp).routed_experts is None
    from megatron_stepwise.rollout.engines.protocol import EngineError

    del resp["meta_info"]["routed_experts"]
    with pytest.raises(EngineError, match="--enable-return-routed-experts"):
        parse_generate_response(resp, (2, 2))


def test_sglang_declares_what_the_client_uses():
    """The request fields, the server flag and the meta_info key, read from the pinned wheel."""
    from test_sglang_contract import _download_wheel, class_fields

    from megatron_stepwise.rollout.engines.sglang import SGLangClient

    with zipfile.ZipFile(_download_wheel()) as z:
        io_struct = ast.parse(z.read("sglang/srt/managers/io_struct.py").decode())
        exec_args = ast.parse(z.read("sglang/srt/arg_groups/fields/exec_.py").decode())
        tokenizer_manager = z.read("sglang/srt/managers/tokenizer_manager.py").decode()
        capturer = z.read("sglang/srt/state_capturer/routed_experts.py").decode()
    assert {"return_routed_experts", "routed_experts_start_len"} <= set(class_fields(io_struct, "GenerateReqInput"))
    assert "enable_return_routed_experts" in class_fields(exec_args, "ExecFeatures")
    assert 'meta_info["routed_experts"]' in tokenizer_manager and "dtype=np.int32" in capturer
    captured = {}

    class Client(SGLangClient):
        async def _request(self, method, path, json=None, params=None, base_url=None):
            captured.update(json)
            return {
                "meta_info": {
                    "output_token_logprobs": [],
                    "finish_reason": {"type": "length"},
                    "routed_experts": routing.encode(torch.zeros(2, 2, 2)),
                }
            }

    result = asyncio.run(Client("http://x", routed_experts=(2, 2)).generate([1, 2, 3], SamplingParams()))
    assert captured["return_routed_experts"] is True and result.routed_experts.shape == (2, 2, 2)


def test_config_refuses_replay_for_a_dense_model(monkeypatch):
    from config_fakes import FakeProbes

    from megatron_stepwise.config import config_from_dict
    from megatron_stepwise.config.errors import ConfigError

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as e:
        config_from_dict({"algo": {"routing_replay": True}}, [], probes=FakeProbes(shapes={"tiny": (4, 4, 2)}))
    assert e.value.keys == ["algo.routing_replay"] and "needs a mixture-of-experts model" in str(e.value)
    moe = config_from_dict(
        {"algo": {"routing_replay": True}, "model": {"hf_config": "tiny_qwen3_moe"}}, [], probes=FakeProbes()
    )
    assert moe.algo.routing_replay


def test_mixtral_configs_count_their_experts_for_validation(tmp_path, monkeypatch):
    """A Mixtral config (hub keys: num_local_experts) is a MoE model to config validation: the
    preset and a config.json report their experts; replay is allowed, a non-dividing EP refused."""
    import json

    from config_fakes import FakeProbes

    from megatron_stepwise.config import config_from_dict
    from megatron_stepwise.config.errors import ConfigError
    from megatron_stepwise.config.probes import Probes
    from megatron_stepwise.hf.presets import tiny_config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from megatron_stepwise.hf.arch import arch_from_hf

    assert arch_from_hf(Probes().model_config("tiny_mixtral")[0]).num_experts == 4
    (tmp_path / "config.json").write_text(
        json.dumps({**tiny_config(model_type="mixtral", max_position_embeddings=4096), "num_local_experts": 8})
    )
    assert arch_from_hf(Probes().model_config(str(tmp_path))[0]).num_experts == 8
    cfg = config_from_dict(
        {"algo": {"routing_replay": True}, "model": {"hf_config": str(tmp_path)}}, [], probes=FakeProbes()
    )
    assert cfg.algo.routing_replay
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"hf_config": str(tmp_path)}, "parallel": {"expert": 3}}, [], probes=FakeProbes())
    assert "parallel.expert: expert_parallel=3 does not divide num_experts=8" in str(e.value)


def test_the_trainer_turns_replay_on_in_the_model_and_the_engines():
    from config_fakes import FakeProbes

    from megatron_stepwise.compose import components as C
    from megatron_stepwise.config import config_from_dict

    cfg = config_from_dict(
        {"algo": {"routing_replay": True}, "model": {"hf_config": "tiny_qwen3_moe"}}, [], probes=FakeProbes()
    )
    assert C._model_overrides(cfg)["moe_enable_routing_replay"] is True


# ---- end to end --------------------------------------------------------------------------------


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("ep1", 1, []), id="ep1"),
        pytest.param(("ep2", 2, ["--ep", "2"]), id="ep2", marks=pytest.mark.slow),
        pytest.param(("tp2_sp", 2, ["--tp", "2"]), id="tp2_sp", marks=pytest.mark.slow),
        pytest.param(("cp2", 2, ["--cp", "2"]), id="cp2", marks=pytest.mark.slow),
        pytest.param(("pp2", 2, ["--pp", "2"]), id="pp2", marks=pytest.mark.slow),
    ],
)
def replay_run(request, tmp_path_factory):
    name, nproc, extra = request.param
    out = tmp_path_factory.mktemp(f"routing_replay_{name}")
    check_ok(
        run_torchrun(
            "routing_replay_worker.py",
            nproc,
            ["--out", str(out), *extra],
            timeout=600,
            env={"CUDA_VISIBLE_DEVICES": ""},
        )
    )
    return json.loads((out / "routing_replay.json").read_text())


@pytest.mark.distributed
def test_replay_makes_the_trainer_route_like_the_engine(replay_run):
    r = replay_run
    assert r["merged_rows"] == 3  # the two turns of each trajectory merged into one row
    for batch in ("unmerged", "merged", "weights_noise"):
        on, off = r[f"{batch}/replay"], r[f"{batch}/no_replay"]
        assert on["experts"]["known"] > 100 and on["experts"]["differ"] == 0, batch  # exactly the engine's
        assert off["experts"]["differ"] > 0, batch  # the perturbation does flip experts
    assert r["unperturbed/no_replay"]["experts"]["differ"] == 0  # the control: same router, same experts
    # engine vs trainer after the weight sync (no perturbation, no replay), at every layout incl. EP2
    assert r["unperturbed/no_replay"]["gap"]["max"] <= 1e-4


@pytest.mark.distributed
def test_replay_shrinks_the_logprob_gap_at_least_tenfold(replay_run):
    r = replay_run
    exact = r["unperturbed/no_replay"]["gap"]["mean"]
    for batch in ("unmerged", "merged"):
        on, off = r[f"{batch}/replay"]["gap"], r[f"{batch}/no_replay"]["gap"]
        assert off["mean"] >= 10 * on["mean"], f"{batch}: gap {off['mean']:.3g} without replay, {on['mean']:.3g} with"
        assert on["mean"] <= 5 * exact + 1e-6 and on["max"] <= 1e-5  # as close as an unperturbed engine
    # the training forward (loss metric logprob_gap/train_vs_rollout) sees the same, and routers still learn
    on, off = r["merged/replay"]["train"], r["merged/no_replay"]["train"]
    assert off["gap"] >= 10 * on["gap"] and on["router_grad_ok"] and off["router_grad_ok"]
    assert abs(on["gap"] - r["merged/replay"]["gap"]["mean"]) <= 1e-6
    # with the gate weight itself perturbed, replay removes the flips; the gating values' part remains
    w_on, w_off = r["weights_noise/replay"]["gap"], r["weights_noise/no_replay"]["gap"]
    assert w_on["mean"] < w_off["mean"] and w_on["max"] < w_off["max"]
