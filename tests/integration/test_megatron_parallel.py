"""Parallel invariance of the step-wise Megatron path, on CPU under torchrun (gloo).

torchrun launches of tests/workers/megatron_worker.py (one per process count) run (the real megatron-core
schedules, TP layers, DDP and optimizer) on a fixed tiny model with layout-independent weights
and a fixed step-wise mini-batch. Every layout (TP, PP, DP, CP and their products) must
reproduce the TP1xPP1xDP1 baseline: the loss and every metric, the gradients (gathered to full
shapes), the parameters after one optimizer step, and the merged batch's metrics and
gradients, within 1e-5 relative; and the plugin's log-probs must equal a plain full-logits
reference (the Hugging Face model with the same weights) within 1e-5. Bad inputs raise clear errors on every rank without a hang.

The bf16 layouts run the mixed-precision path a GPU runs (bf16 weights and matmuls, fp32 main
params, fp32 gradient reduction, megatron's Float16 optimizer) on the CPU: each must match the
fp32 TP1 baseline within what bf16 allows (`BF16_TOL`), for TP2+SP, PP2, DP2 with the
distributed optimizer and TP2xPP2. The workers always run on the CPU (gloo), also on a machine
with GPUs, so that every layout runs everywhere; the GPU's own bf16 kernels are exercised by
`tools/bench/bench_gpu.py`.

The gateway's steps (a context-managing agent's calls, recorded here through the real `openai`
SDK, prefix breaks included) are trained merged and unmerged at TP2+SP and PP2 in the same
launch: each row is fed exactly the tokens its calls sent and sampled, and the loss and every
gradient are the same within 1e-6 relative.

Every layout runs the local spec's per-row packed attention (the CPU default); the `*_one_call`
layouts run the one-call path (a GPU's default), and must give the same log-probs, loss and
gradients within 1e-6 (TP1 with GQA, TP2, CP2).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_cases as cases  # noqa: E402
from gateway_fixtures import assert_exact_in_any_order, record_window_agent  # noqa: E402
from helpers import check_ok, run_torchrun, tiny_lm  # noqa: E402

from megatron_stepwise.mcore.train.model import tiny_config  # noqa: E402

# Longer than the suite's 600 s: a comparison runs up to three torchrun layouts, each allowed 900 s on a busy machine.
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

RTOL = 1e-5

# name: (processes, worker run options, baseline layout)
LAYOUTS = {
    "tp1": (1, "", None),
    "tp1_tied": (1, "tied=1", None),
    "tp2_sequence_parallel": (2, "tp=2", "tp1"),
    "pp2": (2, "pp=2", "tp1"),
    "dp2": (2, "", "tp1"),
    # a different micro-batch budget, the distributed optimizer, megatron's per-token loss mode
    "dp2_budget40_distopt_per_token_loss_tied": (2, "budget=40,distopt=1,per_token_loss=1,tied=1", "tp1_tied"),
    "tp2_pp2_tied": (4, "tp=2,pp=2,sp=0,tied=1", "tp1_tied"),
    # context parallelism: every row split over the CP ranks (all-gather attention on the local path)
    "cp2": (2, "cp=2", "tp1"),
    # virtual pipeline (interleaved 1F1B): 4 layers as 2 stages x 2 chunks of one layer each
    "pp2_vpp2": (2, "pp=2,vpp=2", "tp1"),
    "pp2_vpp2_per_token_loss_tied": (2, "pp=2,vpp=2,per_token_loss=1,tied=1", "tp1_tied"),
    "tp2_cp2_sequence_parallel": (4, "tp=2,cp=2", "tp1"),
    "cp2_pp2_tied": (4, "cp=2,pp=2,tied=1", "tp1_tied"),
    "dp2_cp2_budget40_distopt_per_token_loss": (4, "cp=2,budget=40,distopt=1,per_token_loss=1", "tp1"),
    # a vocabulary TP does not divide: TP2 pads it to 256 rows, the padding row (randomly
    # initialised, so it would show) is left out of every softmax
    "tp1_vocab255": (1, "vocab=255", None),
    "tp2_vocab255_padded": (2, "tp=2,vocab=255", "tp1_vocab255"),
    # mixture of experts (Qwen3-MoE: 4 experts, top-2): experts split over EP ranks of the DP group
    "tp1_moe": (1, "moe=1", None),
    "ep2_moe": (2, "moe=1,ep=2", "tp1_moe"),
    "ep2_tp2_moe": (4, "moe=1,ep=2,tp=2", "tp1_moe"),
    "ep2_pp2_moe": (4, "moe=1,ep=2,pp=2", "tp1_moe"),
    # experts over the CP ranks: every row split in two, its per-expert counts summed over CP
    "ep2_cp2_moe": (2, "moe=1,ep=2,cp=2", "tp1_moe"),
    # another packing of the same steps, and megatron's per-token loss mode (another gradient scale)
    "ep2_budget40_per_token_loss_moe": (2, "moe=1,ep=2,budget=40,per_token_loss=1", "tp1_moe"),
    # bf16 mixed precision, compared with the fp32 baselines under BF16_TOL
    "tp1_bf16": (1, "bf16=1", "tp1"),
    "tp2_sequence_parallel_bf16": (2, "tp=2,bf16=1", "tp1"),
    "pp2_bf16": (2, "pp=2,bf16=1", "tp1"),
    "dp2_budget40_distopt_bf16": (2, "budget=40,distopt=1,bf16=1", "tp1"),
    "tp2_pp2_tied_bf16": (4, "tp=2,pp=2,sp=0,tied=1,bf16=1", "tp1_tied"),
    # the local spec's one-call packed attention (a GPU's default), against the per-row path every
    # other layout runs on CPU (model.packed_attention=auto): GQA (4 heads, 2 KV groups), TP2 (a
    # head group per rank), CP2 (all-gather attention)
    "tp1_one_call": (1, "one_call=1", "tp1"),
    "tp2_sequence_parallel_one_call": (2, "tp=2,one_call=1", "tp2_sequence_parallel"),
    "cp2_one_call": (2, "cp=2,one_call=1", "cp2"),
}
FP32_LAYOUTS = [n for n, (_, opts, _) in LAYOUTS.items() if "bf16=1" not in opts]
ONE_CALL_LAYOUTS = [n for n, (_, opts, _) in LAYOUTS.items() if "one_call=1" in opts]
# One-call vs per-row attention: the same sums in another order of evaluation (measured: 1e-7).
ATTENTION_RTOL = 1e-6
BF16_LAYOUTS = [n for n in LAYOUTS if n not in FP32_LAYOUTS]

# What bf16 (8-bit mantissa, unit roundoff 2^-9 = 2e-3) allows against the fp32 baseline. Measured
# on this model: log-probs within 3e-3, metrics within 0.6%, gradients within 1.3% (relative L2
# per tensor), parameters after the Adam step within 1%. A real fault (a loss scaled twice, a
# missing TP or DP reduction, a lost micro-batch) moves these by tens of percent or more.
BF16_TOL = {"logprobs_abs": 1e-2, "metrics_rel": 2e-2, "grads_rel": 5e-2, "params_rel": 3e-2}
# Turn-level advantages are centred per turn, so the policy loss is a near-cancelling sum (~1e-3):
# its bf16 error is measured against the terms' scale, 1e-2 (abs 2e-4; seen: 2e-5; a loss counted
# twice moves it by ~1e-3, and the gradient check catches that by tens of percent anyway).
BF16_METRIC_FLOOR = 1e-2

# Layouts that also train the gateway's recorded steps (worker option gateway=1, fp32), and how
# close merged and unmerged must be there. The same tokens, packed into rows and micro-batches of
# other lengths, go through matmuls of other shapes that round differently: measured, every
# gradient within 4.4e-7 of its norm (8.5e-7 of its largest entry), the loss within 1.2e-6 of
# itself.
GATEWAY_LAYOUTS = ("tp2_sequence_parallel", "pp2")
GATEWAY_RTOL = 1e-6
# GRPO's advantages are centred, so the policy loss is a near-cancelling sum (~1e-3) of terms
# about 0.7 in size (|advantage| x importance weight): a loss or metric is compared within
# GATEWAY_RTOL of that scale when it is smaller (as BF16_METRIC_FLOOR does). Measured: 6e-8.
GATEWAY_LOSS_SCALE = 1.0


def _merge_stages(out_dir: str) -> dict:
    parts = [torch.load(f, weights_only=False) for f in sorted(glob.glob(os.path.join(out_dir, "stage*.pt")))]
    merged = dict(parts[-1])  # the last stage holds the loss-side results
    for key in ("init_params", "grads", "params_after_step", "merged_grads", "empty_mb_grads"):
        if key in parts[-1]:
            merged[key] = {k: v for p in parts for k, v in p[key].items()}
    if "gateway" in merged:  # each run's gradients, of every stage
        merged["gateway"] = {
            run: dict(value, grads={k: v for p in parts for k, v in p["gateway"][run]["grads"].items()})
            for run, value in merged["gateway"].items()
        }
    with open(os.path.join(out_dir, "bad_inputs.json")) as f:
        merged["bad_inputs"] = json.load(f)
    return merged


@functools.lru_cache(maxsize=None)
def gateway_recording(tmp_root: str) -> dict:
    """The window agent's two trajectories through a gateway (CPU, seconds), saved for the
    workers: the steps, the engine's calls, the gateway's counts and the tokenizer's size."""
    steps, calls, counts = record_window_agent(rewards=(1.0, 0.0), turns=6)
    recording = {"steps": steps, "calls": calls, "counts": counts, "vocab": len(tiny_lm("tiny_bpe")[0])}
    recording["path"] = os.path.join(tmp_root, "gateway_steps.pt")
    torch.save(recording, recording["path"])
    return recording


def gateway_available() -> bool:
    return importlib.util.find_spec("openai") is not None


@functools.lru_cache(maxsize=None)
def launch(nproc: int, tmp_root: str) -> None:
    """One torchrun launch runs every layout of this process count, one after another (megatron's
    parallel state is re-created per layout): startup dominates on a 2-core machine."""
    names = [n for n, (p, _, _) in LAYOUTS.items() if p == nproc]
    gateway = gateway_available() and any(n in GATEWAY_LAYOUTS for n in names)
    args = ["--out", tmp_root] + (["--gateway-steps", gateway_recording(tmp_root)["path"]] if gateway else [])
    for name in names:
        options = ",".join(filter(None, [LAYOUTS[name][1], "gateway=1" if gateway and name in GATEWAY_LAYOUTS else ""]))
        args += ["--layout", f"{name}:{options}"]
    # CPU workers also on a GPU machine: every layout runs everywhere (see the module docstring).
    proc = run_torchrun("megatron_worker.py", nproc, args, timeout=900, env={"CUDA_VISIBLE_DEVICES": ""})
    check_ok(proc, f"torchrun with {nproc} processes ({', '.join(names)})")


@functools.lru_cache(maxsize=None)
def run_layout(name: str, tmp_root: str) -> dict:
    launch(LAYOUTS[name][0], tmp_root)
    merged = _merge_stages(os.path.join(tmp_root, name))
    if "gateway" in merged:
        merged["gateway_recording"] = gateway_recording(tmp_root)
    return merged


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron_layouts"))
    return lambda name: run_layout(name, root)


_HF_CACHE: dict = {}  # (tied, merged, vocab) -> reference log-probs (weights are the same in every layout)
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def vocab_of(options: str) -> int:
    return int(options.split("vocab=")[1].split(",")[0]) if "vocab=" in options else 256


def without_vocab_padding(state: dict, vocab: int) -> dict:
    return {k: v[:vocab] if k in VOCAB_ROWS else v for k, v in state.items()}


def reference_logprobs(result: dict, tied: bool, merged: bool, vocab: int = 256, moe: bool = False) -> torch.Tensor:
    key = (tied, merged, vocab, moe)
    if key not in _HF_CACHE:
        cfg = tiny_config(tie_word_embeddings=tied, vocab_size=vocab, **({"model_type": "qwen3_moe"} if moe else {}))
        steps, extras = cases.make_steps(vocab=vocab)
        if merged:
            steps, extras = cases.merge_for_test(steps, extras)
        weights = without_vocab_padding(result["init_params"], vocab)
        _HF_CACHE[key] = cases.hf_reference_logprobs(cfg, weights, cases.to_batch(steps, extras))
    return _HF_CACHE[key]


def assert_tensors_close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: parameter names differ: {set(got) ^ set(want)}"
    for name, ref in want.items():
        err = float((got[name] - ref).abs().max())
        scale = float(ref.abs().max())
        assert err <= RTOL * scale + 1e-12, f"{what} {name}: max |diff| {err:.3e} > {RTOL} x max |ref| {scale:.3e}"


def assert_tensors_close_l2(got: dict, want: dict, rtol: float, what: str) -> None:
    """Per tensor ||got - want|| <= rtol ||want||: the norm-wise form suits bf16 rounding, which
    is relative to each element and would fail an elementwise max test on near-zero entries."""
    assert set(got) == set(want), f"{what}: parameter names differ: {set(got) ^ set(want)}"
    for name, ref in want.items():
        err = float((got[name] - ref).norm() / ref.norm().clamp_min(1e-30))
        assert err <= rtol, f"{what} {name}: relative L2 error {err:.3e} > {rtol}"


def assert_metrics_close(got: dict, want: dict, what: str, rtol: float = RTOL, floor: float = 1e-3) -> None:
    """|got - want| <= rtol * max(|want|, floor): `floor` is the scale below which a metric counts
    as zero (a policy loss of centred advantages sums terms of either sign to near 0)."""
    skip = {"num_microbatches"}  # legitimately depends on the layout
    assert set(got) - skip == set(want) - skip, f"{what}: metric names differ"
    for key in sorted(set(want) - skip):
        a, b = got[key], want[key]
        assert abs(a - b) <= rtol * max(abs(b), floor), f"{what} {key}: {a!r} vs baseline {b!r}"


def assert_logprobs_match_reference(
    result: dict, tied: bool, atol: float = 1e-5, vocab: int = 256, moe: bool = False
) -> None:
    for merged, key in ((False, "logprobs"), (True, "merged_logprobs")):
        ref = reference_logprobs(result, tied, merged, vocab, moe)
        err = float((result[key] - ref).abs().max())
        assert err <= atol, f"{key}: plugin vs full-logits reference max |diff| {err:.3e}"
    if "megatron_reference_logprobs" in result:
        err = float((result["logprobs"] - result["megatron_reference_logprobs"]).abs().max())
        assert err <= atol, f"plugin vs megatron's own full-logits forward: {err:.3e}"


def clip_coefficient(metrics: dict) -> float:
    # megatron's clip_grad_by_total_norm_fp32 with clip_grad=1.0 (the worker's setting)
    return min(1.0, 1.0 / (metrics["grad_norm"] + 1e-6))


@pytest.mark.parametrize("baseline", ["tp1", "tp1_tied"])
def test_baseline_logprobs_and_merged_batch(results, baseline):
    res = results(baseline)
    assert_logprobs_match_reference(res, tied=baseline.endswith("tied"))
    # Merged rows hold exactly the unmerged batch's trainable tokens: same loss and gradient.
    m, u = res["merged_metrics"], res["metrics"]
    assert {"loss", "pg_loss", "kl", "entropy", "clipfrac_high"} <= set(m)
    assert "logprob_gap_max" in u and "logprob_gap_max" not in m  # max-type: train_minibatch only
    for key in set(m) - {"tokens/total"}:
        assert abs(m[key] - u[key]) <= RTOL * max(abs(u[key]), 1e-3), f"merged vs unmerged {key}: {m[key]} vs {u[key]}"
    assert m["tokens/total"] < u["tokens/total"]  # merging removed the repeated prefixes
    c = clip_coefficient(u)  # train_minibatch's gradients were clipped by the optimizer step
    assert_tensors_close({k: v * c for k, v in res["merged_grads"].items()}, res["grads"], "merged vs unmerged grads")
    assert u["update_successful"] == 1.0 and u["tokens/trained"] == 60.0


def layout_params(names):
    # The 4-process launch is the slowest part on a 2-core machine: also marked slow.
    return [pytest.param(n, marks=pytest.mark.slow) if LAYOUTS[n][0] > 2 else n for n in names]


@pytest.mark.parametrize("layout", layout_params(n for n in FP32_LAYOUTS if LAYOUTS[n][2] is not None))
def test_layout_matches_baseline(results, layout):
    nproc, options, base_name = LAYOUTS[layout]
    res, base = results(layout), results(base_name)
    tied, vocab = "tied=1" in options, vocab_of(options)
    if vocab % 2 and "tp=2" in options:  # padded: the padding row gets no gradient at all
        for key in ("grads", "merged_grads"):
            assert res[key]["output_layer.weight"].shape[0] == vocab + 1
            assert not res[key]["output_layer.weight"][vocab:].any(), key
    trim = functools.partial(without_vocab_padding, vocab=vocab)
    assert_tensors_close(trim(res["init_params"]), base["init_params"], "initial weights")
    assert_logprobs_match_reference(res, tied=tied, vocab=vocab, moe="moe=1" in options)
    assert_metrics_close(res["metrics"], base["metrics"], "metrics")
    assert_metrics_close(res["merged_metrics"], base["merged_metrics"], "merged-batch metrics")
    if "grads" in res:  # the distributed optimizer leaves only shards of the reduced gradients
        assert_tensors_close(trim(res["grads"]), base["grads"], "gradients")
        assert_tensors_close(trim(res["merged_grads"]), base["merged_grads"], "merged-batch gradients")
    assert_tensors_close(trim(res["params_after_step"]), base["params_after_step"], "parameters after one step")
    assert res["bad_inputs"]["alive_ranks"] == nproc
    assert res["shard_logprobs_gap"] == 0.0  # a rank's shard scores exactly as the whole mini-batch


@pytest.mark.parametrize("layout", ONE_CALL_LAYOUTS)
def test_one_call_attention_matches_per_row(results, layout):
    """The one-call packed attention gives the per-row path's (the baseline layout's, CPU
    default) log-probs, loss and gradients, unmerged and merged, within ATTENTION_RTOL."""
    one_call, per_row = results(layout), results(LAYOUTS[layout][2])
    for key in ("logprobs", "merged_logprobs"):
        err = float((one_call[key] - per_row[key]).abs().max())
        assert err <= ATTENTION_RTOL, f"{layout} {key}: one-call vs per-row max |diff| {err:.3e}"
    # the policy loss is a near-cancelling sum (~1e-3) of terms ~0.7: compared on that scale (as
    # the gateway layouts are; measured at CP2: 4.8e-9)
    assert_metrics_close(one_call["metrics"], per_row["metrics"], "metrics", rtol=ATTENTION_RTOL, floor=1.0)
    for key in ("grads", "merged_grads"):
        for name, ref in per_row[key].items():
            err = float((one_call[key][name] - ref).abs().max())
            assert err <= ATTENTION_RTOL * float(ref.abs().max()) + 1e-12, f"{layout} {key} {name}: {err:.3e}"


@pytest.mark.parametrize("layout", layout_params(BF16_LAYOUTS))
def test_bf16_layout_matches_fp32_baseline(results, layout):
    nproc, options, base_name = LAYOUTS[layout]
    res, base = results(layout), results(base_name)
    # megatron's optimizers for bf16 weights: both keep fp32 main params (the DistributedOptimizer
    # as shards)
    optimizer = "DistributedOptimizer" if "distopt=1" in options else "Float16OptimizerWithFloat16Params"
    assert res["dtypes"] == {"param": "torch.bfloat16", "main_grad": "torch.float32", "optimizers": [optimizer]}
    assert base["dtypes"]["param"] == "torch.float32"
    # Same weights up to bf16 rounding; the full-logits reference runs in fp32 at the bf16 weights.
    assert_tensors_close_l2(res["init_params"], base["init_params"], 2**-8, "initial weights")
    assert_logprobs_match_reference(res, tied="tied=1" in options, atol=BF16_TOL["logprobs_abs"])
    assert_metrics_close(
        res["metrics"], base["metrics"], "metrics", rtol=BF16_TOL["metrics_rel"], floor=BF16_METRIC_FLOOR
    )
    assert_metrics_close(
        res["merged_metrics"],
        base["merged_metrics"],
        "merged-batch metrics",
        rtol=BF16_TOL["metrics_rel"],
        floor=BF16_METRIC_FLOOR,
    )
    if "grads" in res:
        assert_tensors_close_l2(res["grads"], base["grads"], BF16_TOL["grads_rel"], "gradients")
        assert_tensors_close_l2(
            res["merged_grads"], base["merged_grads"], BF16_TOL["grads_rel"], "merged-batch gradients"
        )
    assert_tensors_close_l2(
        res["params_after_step"], base["params_after_step"], BF16_TOL["params_rel"], "parameters after one step"
    )
    assert res["bad_inputs"]["alive_ranks"] == nproc


@pytest.mark.parametrize("layout", layout_params(FP32_LAYOUTS))
def test_megatron_lm_logs_what_reduce_metrics_returns(results, layout):
    """The loss dicts of a host loop, reduced the way Megatron-LM's train_step reduces them before
    printing and logging, give exactly `reduce_metrics` (DP, CP, PP, both loss modes): no key
    averaged over micro-batches, no internal key, no max-type key (those come from train_minibatch)."""
    res = results(layout)
    logged, want = res["merged_megatron_lm_logged"], res["merged_metrics"]
    assert set(logged) == set(want) and {"loss", "pg_loss", "entropy", "tokens/trained"} <= set(logged)
    assert not any(k.endswith("_max") or k.startswith("_") for k in logged)
    for key, value in want.items():
        assert abs(logged[key] - value) <= 1e-9 * max(abs(value), 1.0), f"{key}: {logged[key]} vs {value}"


@pytest.mark.parametrize("layout", layout_params(FP32_LAYOUTS))
def test_empty_microbatches_are_loss_neutral(results, layout):
    """The same mini-batch with one extra, empty micro-batch on every rank (a planner may emit
    them to equalise micro-batch counts across ranks): same loss, metrics and gradients."""
    res = results(layout)
    got, want = res["empty_mb_metrics"], res["metrics"]
    for key in set(got):
        assert abs(got[key] - want[key]) <= RTOL * max(abs(want[key]), 1e-3), f"{key}: {got[key]} vs {want[key]}"
    if "vpp=2" in LAYOUTS[layout][1]:  # plans are padded to whole groups of PP=2 micro-batches anyway
        assert res["empty_mb_count"] % 2 == 0 and res["empty_mb_count"] >= want["num_microbatches"]
    else:
        assert res["empty_mb_count"] == want["num_microbatches"] + 1
    if "grads" in res:
        c = clip_coefficient(want)
        assert_tensors_close({k: v * c for k, v in res["empty_mb_grads"].items()}, res["grads"], "gradients")


def test_bad_inputs_raise_clear_errors_on_every_rank(results):
    bad = results("tp2_sequence_parallel")["bad_inputs"]
    assert bad["over_budget"] == "step 0: 66 tokens do not fit the micro-batch budget max_tokens_per_microbatch=64"
    assert "no trainable token" in bad["no_trainable"]
    assert bad["token_out_of_vocab"] == "step 1: token id 300 is outside the model vocabulary [0, 256)"
    assert bad["no_rollout_logprobs"].startswith("step 1 (bad#0): field 'rollout_logprobs' is missing")
    assert "algo.loss.tis='token'" in bad["no_rollout_logprobs"]
    assert bad["tokenizer_vocab"] == "tokenizer has 300 tokens but the model's vocab_size is 256"
    assert bad["heads_not_divisible"] == "tensor_parallel=2 does not divide num_attention_heads=3"
    assert bad["alive_ranks"] == 2  # both ranks got past every error and met in a collective
    # a fixed micro-batch count (Megatron-LM's pretrain): padded with empty micro-batches, or refused
    assert bad["fixed_count_padded"] == [4, 2]
    assert bad["fixed_count_too_few"].startswith(
        "this mini-batch needs 2 micro-batches of <= 64 tokens per DP rank, but the host loop runs num_microbatches=1"
    )
    assert bad["host_count_mismatch"].startswith(
        "the training loop runs get_num_microbatches()=3 micro-batches per step, but the plugin planned 2"
    )
    assert bad["forward_step_count"] == bad["host_count_mismatch"]
    assert bad["host_count_match"] == 3
    assert "return_schedule_plan=True" in bad["schedule_plan"]


def test_virtual_pipeline_plans_whole_groups_of_pipeline_stages(results):
    """Interleaved 1F1B runs micro-batches in groups of PP: the plan is padded to a multiple of PP,
    and a fixed count that is not one is refused by name."""
    res = results("pp2_vpp2")
    assert res["metrics"]["num_microbatches"] % 2 == 0
    assert res["bad_inputs"]["vpp_count_not_multiple"] == (
        "num_microbatches=3 is not a multiple of the pipeline-parallel size 2, which the interleaved (virtual "
        "pipeline) schedule needs"
    )


def test_pipeline_parallel_needs_variable_sequence_lengths(results):
    bad = results("pp2")["bad_inputs"]
    assert bad["pp_fixed_shapes"].startswith("pipeline parallelism needs config.variable_seq_lengths=True")
    assert bad["host_count_match"] == 3 and bad["fixed_count_padded"][0] == 4


def expected_rows(steps, merged: bool) -> list:
    """Each row's (tokens, trained positions), sorted: a step's prompt + response and the positions
    of its loss-masked-in (sampled) tokens; merged, a trajectory's steps while each prompt extends
    the row so far (a prefix break starts a new row)."""
    rows, last = [], None
    for step in steps:
        prompt, response = step.prompt_ids.tolist(), step.response_ids.tolist()
        trained = [len(prompt) + i for i, m in enumerate(step.loss_mask.tolist()) if m]
        if merged and last == step.trajectory_id and prompt[: len(rows[-1][0])] == rows[-1][0]:
            rows[-1] = (prompt + response, rows[-1][1] + trained)
        else:
            rows.append((prompt + response, trained))
        last = step.trajectory_id
    return sorted((tuple(t), tuple(p)) for t, p in rows)


def gateway_runs(results, layout: str) -> tuple[dict, dict]:
    if not gateway_available():
        pytest.skip("the openai SDK is not installed: no gateway steps were recorded")
    res = results(layout)
    return res["gateway_recording"], res["gateway"]


@pytest.mark.parametrize("layout", GATEWAY_LAYOUTS)
def test_gateway_steps_feed_megatron_exactly_what_they_sent(results, layout):
    """The window agent's steps (from its fourth call on each breaks the prefix), as megatron's
    forward got them: unmerged, one row per call, its prompt and sampled ids (plus a loss-masked
    EOS the gateway appended), trained on the sampled tokens only; merged, one row per
    prefix-holding run, trained on exactly the same tokens."""
    recording, runs = gateway_runs(results, layout)
    steps = recording["steps"]
    assert recording["counts"]["prefix_breaks"] == 6 and len(steps) == 12
    assert_exact_in_any_order(steps, recording["calls"])  # each step is what its call sent and sampled
    # The model's vocabulary is the gateway tokenizer's (the plugin refuses a token outside it).
    assert recording["vocab"] == 384
    assert runs["token_mean/unmerged"]["grads"]["embedding.word_embeddings.weight"].shape[0] == 384
    runs_of_prefix = 2 + sum(s.metadata["prefix_break"] for s in steps)  # a trajectory's start, or a break
    for name, run in runs.items():
        merged = name.endswith("/merged")
        assert run["num_rows"] == (runs_of_prefix if merged else len(steps)), name
        fed = sorted((tuple(r["tokens"]), tuple(r["trained"])) for r in run["rows"].values())
        assert len(fed) == run["num_rows"] and fed == expected_rows(steps, merged), name
    assert runs_of_prefix == 8  # 3 + 1 + 1 + 1 per trajectory


def relative_differences(merged: dict, unmerged: dict) -> dict[str, float]:
    """merged vs unmerged: the loss's |difference| over |loss| and over GATEWAY_LOSS_SCALE, and
    the worst gradient tensor's over its norm and over its largest entry."""
    diff = abs(merged["metrics"]["loss"] - unmerged["metrics"]["loss"])
    grads = [(merged["grads"][n] - ref, ref) for n, ref in unmerged["grads"].items()]
    return {
        "loss": diff / abs(unmerged["metrics"]["loss"]),
        "loss_vs_scale": diff / max(abs(unmerged["metrics"]["loss"]), GATEWAY_LOSS_SCALE),
        "grads_norm": max(float(d.norm() / ref.norm()) for d, ref in grads),
        "grads_max": max(float(d.abs().max() / ref.abs().max()) for d, ref in grads),
    }


@pytest.mark.parametrize("layout", GATEWAY_LAYOUTS)
@pytest.mark.parametrize("reduction", ["token_mean", "trajectory_mean"])
def test_gateway_steps_train_alike_merged_and_unmerged(results, layout, reduction):
    """Through megatron-core's forward and backward, the merged and unmerged batches of the same
    gateway steps give the same loss, metrics and gradients (GATEWAY_RTOL), for merge-invariant
    reductions."""
    recording, runs = gateway_runs(results, layout)
    merged, unmerged = runs[f"{reduction}/merged"], runs[f"{reduction}/unmerged"]
    m, u = merged["metrics"], unmerged["metrics"]
    sampled = sum(int(s.loss_mask.sum()) for s in recording["steps"])
    assert m["tokens/trained"] == u["tokens/trained"] == sampled and m["tokens/total"] < u["tokens/total"]
    assert u["loss"] != 0 and 0 < u["tis_weight_mean"] < 2  # the engine's log-probs weigh the loss
    for key in set(u) - {"tokens/total"}:
        assert abs(m[key] - u[key]) <= GATEWAY_RTOL * max(abs(u[key]), GATEWAY_LOSS_SCALE), (
            f"{key}: {m[key]} vs {u[key]}"
        )
    assert merged["grads"].keys() == unmerged["grads"].keys()
    assert all(bool(g.abs().max() > 0) for g in unmerged["grads"].values())
    diffs = relative_differences(merged, unmerged)
    print(
        f"{layout} {reduction}: merged vs unmerged relative differences "
        + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items())
    )
    assert diffs["loss_vs_scale"] <= GATEWAY_RTOL and diffs["grads_norm"] <= GATEWAY_RTOL, diffs
