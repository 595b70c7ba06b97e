"""Weight sync to the fleet and train/inference consistency (tests/workers/sync_worker.py under torchrun).

After each push (tensor, disk, distributed) at TP2, PP2 and TP1, the embedded engine's greedy
log-probs for a sequence equal the plugin's `compute_logprobs` on the same tokens within 1e-4;
so do log-probs of tokens sampled at T = 0.6 with top-p 0.9 and top-k 20, scored by a plugin
told the temperature. Every push is verified on the engine (`weight_sync.verify`) inside the update
request, with no separate verify request; in every mode and layout one element of a tensor (PP2's
second stage's) changed after the trainer sampled it and before the engine loaded it stops the
push on both ranks, named with the tensor, its flat index and the engine; a tensor of PP2's second
stage corrupted on the engine is caught by name on both ranks; verify off checks nothing.

Every model (qwen2 untied and tied, qwen3, qwen3-MoE, Mixtral) runs in one torchrun launch, one
after another: the imports and Ray's start are paid once (87 -> 49 CPU-s for this file).
"""

from __future__ import annotations

import pytest
import torch
from helpers import check_ok, run_torchrun
from weights_helpers import load_json

from megatron_stepwise import weight_checks
from megatron_stepwise.algo.losses import LossConfig, LossInputs, policy_loss
from megatron_stepwise.mcore.weights import sync as S

LAYOUTS = ["tp2", "pp2", "tp1"]
MODES = ["tensor", "disk", "distributed"]


def test_bad_modes_are_rejected_by_name():
    with pytest.raises(S.WeightSyncError, match=r"weight_sync.mode must be one of .*got 'nccl'"):
        S.WeightSync(None, "nccl", {})
    with pytest.raises(S.WeightSyncError, match=r"mode='disk' needs a shared directory \(weight_sync.dir\)"):
        S.WeightSync(None, "disk", {})


def test_prune_versions_keeps_the_newest(tmp_path):
    for v in (3, 10, 7, 12):
        S.version_dir(tmp_path, v).mkdir()
    (tmp_path / "v000001.partial").mkdir()  # an export in progress is not a version
    removed = S.prune_versions(tmp_path, keep=2)
    assert [p.name for p in removed] == ["v000003", "v000007"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001.partial", "v000010", "v000012"]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """One torchrun launch for every model this session runs here (the worker takes them in turn,
    in the same processes and Ray instance): its output directory. A run of a subset (`-m "not
    slow"`, `-k`) launches only the models its tests use."""
    wanted = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.module is request.module and spec and "results" in spec.params:
            wanted += [spec.params["results"]] if spec.params["results"] not in wanted else []
    out = tmp_path_factory.mktemp("sync")
    models = ",".join(f"{model_type}:{tied}" for model_type, tied in wanted)
    # All five models: ~50 s on an idle 2-core machine, within the test's 600 s with room for load.
    check_ok(run_torchrun("sync_worker.py", 2, ["--out", str(out), "--models", models], timeout=600))
    return out


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("qwen2", 0), id="untied"),
        pytest.param(("qwen2", 1), id="tied", marks=pytest.mark.slow),
        pytest.param(("qwen3", 0), id="qwen3", marks=pytest.mark.slow),  # QK norm, explicit head_dim
        pytest.param(("qwen3_moe", 0), id="qwen3moe", marks=pytest.mark.slow),  # 4 experts, top-2 (EP1)
        # 4 experts, top-2 renormalised; pushed under Mixtral's hub names (block_sparse_moe...w1/w2/w3)
        pytest.param(("mixtral", 0), id="mixtral", marks=pytest.mark.slow),
    ],
)
def results(request, launched):
    model_type, tied = request.param
    out = launched / f"{model_type}-{tied}"
    return load_json(out / "results.json"), load_json(out / "weights_listing.json")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_logprobs_equal_megatron_after_a_sync(results, layout, mode):
    r = results[0][f"{layout}/{mode}"]
    assert r["engine_version"] == r["version"]
    assert len(r["engine"]) == len(r["megatron"]) == 8
    gap = max(abs(a - b) for a, b in zip(r["engine"], r["megatron"]))
    assert gap < 1e-4, f"{layout}/{mode}: engine vs megatron log-probs differ by {gap}"
    # Before the push the engine still had the previous weights: the equality is the push's doing.
    stale_gap = max(abs(a - b) for a, b in zip(r["stale_engine"], r["stale_megatron"]))
    assert stale_gap > 1e-2
    assert r["metrics"]["weight_sync/bytes"] > 0 and r["metrics"]["weight_sync/buckets"] > 1
    # Verified on the engine: every tensor of the model (all stages', at PP2), in every mode.
    m = r["metrics"]
    assert m["weight_sync/verified_engines"] == 1 and m["weight_sync/unverified_engines"] == 0
    assert m["weight_sync/verified_tensors"] == results[0]["tp1/tensor"]["metrics"]["weight_sync/verified_tensors"] > 10
    assert 0 < m["weight_sync/verify_s"] < m["weight_sync/seconds"]
    assert m["weight_sync/verify_share"] == pytest.approx(m["weight_sync/verify_s"] / m["weight_sync/seconds"])
    assert m["verify_requests"] == 0  # the check came with the update's answer


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_element_changed_between_the_trainers_sample_and_the_engines_load_stops_the_push(results, layout, mode):
    case = results[0][f"{layout}/{mode}/injected"]
    assert len(case["messages"]) == 2 and case["messages"][0] == case["messages"][1]  # raised on both ranks
    message = case["messages"][0]
    assert message.startswith(
        f"weight sync of version {case['version']} verified wrong: engine 0 (engine0.0) holds 1 tensor(s)"
    )
    where, hits = case["where"], case["hits"]
    assert (
        f"model.layers.1.self_attn.o_proj.weight: {hits} of {weight_checks.SAMPLE_SIZE} sampled values differ (first at flat index {where}:"
        in message
    )


@pytest.mark.distributed
def test_a_corrupted_engine_tensor_stops_every_rank_by_name_and_off_skips(results):
    case = results[0]["pp2/corrupted"]
    assert len(case["messages"]) == 2 and case["messages"][0] == case["messages"][1]  # raised on both ranks
    message = case["messages"][0]
    assert message.startswith(
        f"weight sync of version {case['version']} verified wrong: engine 0 (engine0.0) holds 1 tensor(s)"
    )
    assert "model.layers.1.self_attn.o_proj.weight: " in message and "sampled values differ" in message
    assert "weight_sync/seconds" in case["off_metrics"]
    assert not any(k.startswith("weight_sync/verif") for k in case["off_metrics"])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sampled_logprobs_at_temperature_match_and_tis_weights_are_one(results, layout):
    r = results[0][f"{layout}/sampled"]
    n = len(r["output_ids"])
    assert n >= 4 and len(r["engine"]) == len(r["megatron_t"]) == n
    engine, ours, at_t1 = (torch.tensor(r[k], dtype=torch.float64) for k in ("engine", "megatron_t", "megatron_t1"))
    gap = float((engine - ours).abs().max())
    assert gap <= 1e-4, f"{layout}: engine vs trainer log-probs at T=0.6 differ by {gap}"
    # The control: a trainer scoring at T = 1 sees another distribution.
    assert float((engine - at_t1).abs().max()) > 1e-2

    # On-policy, the TIS weight old/rollout is 1 on every token.
    ones = torch.ones(n, dtype=torch.float64)
    _, metrics = policy_loss(
        LossInputs(
            logprobs=ours,
            old_logprobs=ours,
            advantages=ones,
            weights=ones / n,
            segment_ids=torch.zeros(n, dtype=torch.long),
            rollout_logprobs=engine,
        ),
        LossConfig(tis="token", tis_cap=2.0),
    )
    assert abs(float(metrics["tis_weight_mean"]) - 1.0) <= 1e-4
    assert abs(float(metrics["tis_weight_max"]) - 1.0) <= 1e-4


@pytest.mark.distributed
def test_disk_mode_keeps_the_newest_versions(results):
    # Two disk pushes per layout (one with an element changed in its file); keep_versions=2.
    versions = results[0]["disk_versions"]
    assert len(versions) == 6 and results[1] == [f"v{v:06d}" for v in versions[-2:]]
