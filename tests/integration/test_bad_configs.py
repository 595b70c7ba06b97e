"""The bad-config corpus: every case is rejected with exactly one problem, naming the right key.

Most cases go through the API (fast); a few go through `megatron-stepwise validate` in a
subprocess to check the exit code 2 and that users see the problems, not a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from config_fakes import FakeProbes
from helpers import run_launch

from megatron_stepwise.config import config_from_dict
from megatron_stepwise.config.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
GPU_NODE = {"launch": {"gpus_per_node": 8, "nproc_per_node": 4}}  # 4 GPUs left to rollout
SGLANG = {**GPU_NODE, "rollout": {"engine": "sglang", "num_engines": 4}}
QWEN_1_5B = "Qwen/Qwen2.5-1.5B-Instruct"


def merged(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for section, values in part.items():
            if isinstance(values, dict) and isinstance(out.get(section), dict):
                out[section] = {**out[section], **values}
            else:
                out[section] = values
    return out


# (id, config, overrides, probe settings, the key named, a fragment of the message)
CASES = [
    # unknown keys, with the closest valid name suggested
    ("unknown-section", {"modle": {"dtype": "bf16"}}, [], {}, "modle", "did you mean 'model'"),
    ("unknown-key-typo", {"optim": {"lrr": 1e-5}}, [], {}, "optim.lrr", "did you mean 'optim.lr'"),
    (
        "unknown-key-wrong-section",
        {"rollout": {"temperature": 0.7}},
        [],
        {},
        "rollout.temperature",
        "did you mean 'rollout.sampling.temperature'",
    ),
    ("unknown-override", {}, ["trainer.iteration=3"], {}, "trainer.iteration", "did you mean 'trainer.iterations'"),
    # wrong types
    ("int-expected", {"data": {"epochs": "two"}}, [], {}, "data.epochs", "expected an integer"),
    ("float-expected", {"optim": {"lr": "fast"}}, [], {}, "optim.lr", "expected a number"),
    ("bool-expected", {"data": {"shuffle": "yes please"}}, [], {}, "data.shuffle", "expected true or false"),
    ("str-expected", {"env": {"name": 3}}, [], {}, "env.name", "expected a string"),
    (
        "list-expected",
        {"rollout": {"sampling": {"stop": "</answer>"}}},
        [],
        {},
        "rollout.sampling.stop",
        "expected a list",
    ),
    ("list-item-type", {"trainer": {"imports": [1]}}, [], {}, "trainer.imports", "item 0"),
    ("enum-typo", {"model": {"dtype": "bf61"}}, [], {}, "model.dtype", "did you mean 'bf16'"),
    ("enum-async-policy", {"async": {"stale_policy": "retry"}}, [], {}, "async.stale_policy", "drop, requeue"),
    (
        "optional-int",
        {"algo": {"loss": {"max_response_len": "long"}}},
        [],
        {},
        "algo.loss.max_response_len",
        "expected an integer",
    ),
    ("section-not-mapping", {"rollout": 5}, [], {}, "rollout", "mapping"),
    ("override-into-value", {}, ["model.dtype.kind=bf16"], {}, "model.dtype.kind", "model.dtype is a value"),
    # impossible parallel layouts
    (
        "world-not-divisible",
        {"parallel": {"tensor": 2}, "launch": {"nproc_per_node": 3}},
        [],
        {},
        "parallel",
        "world size 3",
    ),
    (
        "tp-vs-kv-heads",
        {"model": {"hf_config": QWEN_1_5B}, "parallel": {"tensor": 4}, "launch": {"nproc_per_node": 4}},
        [],
        {"shapes": {QWEN_1_5B: (12, 2, 28)}},
        "parallel.tensor",
        "num_key_value_heads=2",
    ),
    (
        "pp-vs-layers",
        {"model": {"hf_config": QWEN_1_5B}, "parallel": {"pipeline": 3}, "launch": {"nproc_per_node": 3}},
        [],
        {"shapes": {QWEN_1_5B: (12, 2, 28)}},
        "parallel.pipeline",
        "num_hidden_layers=28",
    ),
    (
        "sequence-parallel-without-tp",
        {"parallel": {"sequence_parallel": True}},
        [],
        {},
        "parallel.sequence_parallel",
        "parallel.tensor > 1",
    ),
    (
        "context-parallel-world",
        {"parallel": {"context": 4}, "launch": {"nproc_per_node": 2}},
        [],
        {},
        "parallel",
        "parallel.context 4",
    ),
    (
        "ranks-exceed-gpus",
        {"launch": {"gpus_per_node": 4, "nproc_per_node": 8}},
        [],
        {},
        "launch.nproc_per_node",
        "gpus_per_node is 4",
    ),
    (
        "te-not-installed",
        {"model": {"transformer_impl": "te"}},
        [],
        {"modules": ()},
        "model.transformer_impl",
        "transformer-engine",
    ),
    # estimators and losses
    (
        "temporal-estimator-multi-turn",
        {"algo": {"estimator": "gae"}, "rollout": {"max_turns": 4}},
        [],
        {},
        "algo.estimator",
        "temporal estimator",
    ),
    ("reinforce-pp-multi-turn", {"algo": {"estimator": "reinforce++"}}, [], {}, "algo.estimator", "multi-step"),
    ("unknown-estimator", {"algo": {"estimator": "grop"}}, [], {}, "algo.estimator", "did you mean 'grpo'"),
    (
        "turn-estimator-single-turn",
        {"algo": {"estimator": "turn_rloo"}, "rollout": {"max_turns": 1}},
        [],
        {},
        "algo.estimator",
        "no per-turn rewards",
    ),
    (
        "turn-estimator-gamma",
        {"algo": {"estimator": "turn_rloo", "estimator_options": {"gamma": 1.5}}},
        [],
        {},
        "algo.estimator_options.gamma",
        "(0, 1]",
    ),
    (
        "turn-estimator-unknown-option",
        {"algo": {"estimator": "turn_rloo", "estimator_options": {"gama": 0.9}}},
        [],
        {},
        "algo.estimator_options.gama",
        "not an option of turn_rloo",
    ),
    (
        "turn-discount-base",
        {"algo": {"estimator": "turn_discount", "estimator_options": {"base": "gae"}}},
        [],
        {},
        "algo.estimator_options.base",
        "must be one of",
    ),
    (
        "turn-estimator-group-of-one",
        {"algo": {"estimator": "turn_rloo"}, "data": {"samples_per_prompt": 1}},
        [],
        {},
        "data.samples_per_prompt",
        "every advantage",
    ),
    (
        "unknown-policy-loss",
        {"algo": {"loss": {"policy_loss": "cipso"}}},
        [],
        {},
        "algo.loss.policy_loss",
        "did you mean 'cispo'",
    ),
    ("group-of-one", {"data": {"samples_per_prompt": 1}}, [], {}, "data.samples_per_prompt", "every advantage"),
    (
        "filter-group-of-one",
        {
            "data": {"samples_per_prompt": 1},
            "rollout": {"max_turns": 1},
            "algo": {"estimator": "reinforce++", "filters": {"zero_variance": True}},
        },
        [],
        {},
        "algo.filters.zero_variance",
        "no reward variance",
    ),
    (
        "merge-step-mean",
        {"data": {"merge_steps": True}, "algo": {"loss": {"reduction": "step_mean"}}},
        [],
        {},
        "algo.loss.reduction",
        "data.merge_steps=true",
    ),
    (
        "merge-dr-grpo-norm",
        {
            "data": {"merge_steps": True},
            "algo": {"loss": {"reduction": "seq_mean_token_sum_norm", "max_response_len": 256}},
        },
        [],
        {},
        "algo.loss.reduction",
        "data.merge_steps=true",
    ),
    (
        "merge-gspo",
        {"data": {"merge_steps": True}, "algo": {"loss": {"policy_loss": "gspo"}}},
        [],
        {},
        "algo.loss.policy_loss",
        "per sequence",
    ),
    (
        "merge-sequence-tis",
        {"data": {"merge_steps": True}, "algo": {"loss": {"tis": "sequence"}}},
        [],
        {},
        "algo.loss.tis",
        "data.merge_steps=true",
    ),
    (
        "merge-sequence-icepop",
        {"data": {"merge_steps": True}, "algo": {"loss": {"icepop_low": 0.5, "icepop_level": "sequence"}}},
        [],
        {},
        "algo.loss.icepop_level",
        "data.merge_steps=true",
    ),
    (
        "dr-grpo-norm-without-length",
        {"algo": {"loss": {"reduction": "seq_mean_token_sum_norm"}}},
        [],
        {},
        "algo.loss.max_response_len",
        "must be set for reduction 'seq_mean_token_sum_norm'",
    ),
    ("clip-low-negative", {"algo": {"loss": {"clip_low": -0.1}}}, [], {}, "algo.loss.clip_low", ">= 0"),
    ("clip-low-one", {"algo": {"loss": {"clip_low": 1.0}}}, [], {}, "algo.loss.clip_low", "< 1"),
    ("clip-high-negative", {}, ["algo.loss.clip_high=-0.1"], {}, "algo.loss.clip_high", ">= 0"),
    (
        "reduction-typo",
        {"algo": {"loss": {"reduction": "tokn_mean"}}},
        [],
        {},
        "algo.loss.reduction",
        "did you mean 'token_mean'",
    ),
    ("icepop-low-above-one", {"algo": {"loss": {"icepop_low": 1.2}}}, [], {}, "algo.loss.icepop_low", "< 1"),
    ("dual-clip-below-one", {"algo": {"loss": {"clip_c": 0.5}}}, [], {}, "algo.loss.clip_c", "> 1"),
    ("icepop-high-below-one", {"algo": {"loss": {"icepop_high": 0.9}}}, [], {}, "algo.loss.icepop_high", "> 1"),
    # batching
    (
        "minibatch-not-dividing",
        {"data": {"prompts_per_iteration": 10, "prompts_per_minibatch": 4}},
        [],
        {},
        "data.prompts_per_minibatch",
        "does not divide",
    ),
    (
        "microbatch-smaller-than-a-step",
        {"data": {"max_tokens_per_microbatch": 1000}},
        [],
        {},
        "data.max_tokens_per_microbatch",
        "2304 tokens",
    ),
    # rollout
    (
        "temperature-zero",
        {"rollout": {"sampling": {"temperature": 0}}},
        [],
        {},
        "rollout.sampling.temperature",
        ">= 0.0001",
    ),
    # 1e-300 passed `> 0` once and then made every engine's logits / T overflow to NaN
    (
        "temperature-underflow",
        {"rollout": {"sampling": {"temperature": 1e-300}}},
        [],
        {},
        "rollout.sampling.temperature",
        ">= 0.0001",
    ),
    ("top-k-float", {"rollout": {"sampling": {"top_k": 2.0}}}, [], {}, "rollout.sampling.top_k", "expected an integer"),
    (
        "eval-temperature-underflow",
        {"eval": {"temperature": 1e-300}},
        [],
        {},
        "eval.temperature",
        "0 (greedy) or a finite number >= 0.0001",
    ),
    # non-finite floats: NaN passes no bound, so every float key checks finiteness itself
    ("nan-lr", {"optim": {"lr": float("nan")}}, [], {}, "optim.lr", "must be a finite number"),
    ("absurd-lr", {"optim": {"lr": 1e30}}, [], {}, "optim.lr", "must be <= 1.0"),
    (
        "inf-reward",
        {"rollout": {"env_error_reward": float("-inf")}},
        [],
        {},
        "rollout.env_error_reward",
        "must be a finite number",
    ),
    ("nan-override", {}, ["algo.loss.entropy_coef=nan"], {}, "algo.loss.entropy_coef", "must be a finite number"),
    ("top-k-zero", {"rollout": {"sampling": {"top_k": 0}}}, [], {}, "rollout.sampling.top_k", "-1 (off)"),
    ("sglang-without-extra", SGLANG, [], {"modules": ()}, "rollout.engine", "pip install 'megatron-stepwise[sglang]'"),
    (
        "sglang-not-enough-gpus",
        merged(SGLANG, {"rollout": {"engine": "sglang", "num_engines": 8}}),
        [],
        {},
        "rollout.num_engines",
        "need 8 GPUs",
    ),
    ("sglang-on-cpu", {"rollout": {"engine": "sglang"}}, [], {}, "rollout.num_engines", "leaves 0 to rollout"),
    (
        "sglang-servers-count",
        {"rollout": {"engine": "sglang", "num_engines": 2, "sglang": {"servers": ["h1:30000"]}}},
        [],
        {"modules": ()},
        "rollout.num_engines",
        "lists 1 servers",
    ),
    (
        "sglang-router-without-servers",
        {"rollout": {"engine": "sglang", "sglang": {"router_url": "http://r:8000"}}},
        [],
        {"modules": ()},
        "rollout.sglang.servers",
        "router_url is set",
    ),
    (
        "sglang-router-with-routing-replay",
        {
            "rollout": {"engine": "sglang", "sglang": {"router_url": "http://r:8000", "servers": ["h1:30000"]}},
            "algo": {"routing_replay": True},
        },
        [],
        {"modules": ()},
        "rollout.sglang.router_url",
        "sglang-router drops",
    ),
    (
        "sglang-bad-server",
        {"rollout": {"engine": "sglang", "sglang": {"servers": ["h1"]}}},
        [],
        {"modules": ()},
        "rollout.sglang.servers",
        "host:port",
    ),
    (
        "servers-with-embedded",
        {"rollout": {"sglang": {"servers": ["h1:30000"]}}},
        [],
        {},
        "rollout.sglang.servers",
        "rollout.engine is embedded",
    ),
    ("embedded-engine-tp", {"rollout": {"engine_tp": 2}}, [], {}, "rollout.engine_tp", "one CPU process"),
    ("context-mode-typo", {"rollout": {"context": "token"}}, [], {}, "rollout.context", "did you mean 'tokens'"),
    # async
    (
        "async-zero-staleness",
        {"async": {"enabled": True, "max_staleness": 0}, "algo": {"loss": {"tis": "token"}}},
        [],
        {},
        "async.max_staleness",
        "async.enabled=false",
    ),
    ("async-without-correction", {"async": {"enabled": True}}, [], {}, "algo.loss.tis", "policy lag"),
    (
        "async-several-epochs",
        {"async": {"enabled": True}, "algo": {"loss": {"tis": "token"}}, "data": {"epochs": 2}},
        [],
        {},
        "data.epochs",
        "set data.epochs=1",
    ),
    (
        "async-in-place-pause-on-sglang",
        merged(SGLANG, {"async": {"enabled": True, "pause_mode": "in_place"}, "algo": {"loss": {"tis": "token"}}}),
        [],
        {},
        "async.pause_mode",
        "only the embedded engine",
    ),
    # colocated mode
    (
        "colocate-with-async",
        {"rollout": {"colocate": True}, "async": {"enabled": True}, "algo": {"loss": {"tis": "token"}}},
        [],
        {},
        "rollout.colocate",
        "set one of them to false",
    ),
    (
        "colocate-sglang-distributed",
        merged(
            SGLANG,
            {
                "rollout": {"engine": "sglang", "num_engines": 4, "colocate": True},
                "weight_sync": {"mode": "distributed"},
            },
        ),
        [],
        {},
        "rollout.colocate",
        "one NCCL group cannot hold two ranks on the same GPU",
    ),
    (
        "colocate-tensor-handles-across-nodes",
        {
            "launch": {"gpus_per_node": 8, "nproc_per_node": 4, "rollout_nodes": 1},
            "rollout": {"engine": "sglang", "num_engines": 4, "colocate": True},
        },
        [],
        {},
        "rollout.colocate",
        "set weight_sync.mode=disk",
    ),
    # optimizer, outputs, paths
    ("min-lr-above-lr", {"optim": {"lr": 1e-6, "min_lr": 1e-5}}, [], {}, "optim.min_lr", "above optim.lr"),
    ("warmup-longer-than-run", {"optim": {"warmup_steps": 100}}, [], {}, "optim.warmup_steps", "20 optimizer steps"),
    ("resume-missing-path", {"checkpoint": {"resume": "/no/such/ckpt"}}, [], {}, "checkpoint.resume", "/no/such/ckpt"),
    (
        "tensorboard-missing",
        {"logging": {"tensorboard": True}},
        [],
        {"modules": ()},
        "logging.tensorboard",
        "pip install tensorboard",
    ),
    ("wandb-missing", {"logging": {"wandb": {"project": "p"}}}, [], {"modules": ()}, "logging.wandb.project", "wandb"),
    (
        "checkpoint-dir-missing",
        {"model": {"hf_checkpoint": "./no/such/model"}},
        [],
        {},
        "model.hf_checkpoint",
        "no such file",
    ),
    ("dataset-missing", {"env": {"dataset": "/no/such/data.jsonl"}}, [], {}, "env.dataset", "no such file"),
    # hub ids neither local nor in the HF cache (model.allow_download=true would accept them)
    (
        "hub-config-not-cached",
        {"model": {"hf_config": "Qwen/Qwen2.5-1.5B-Instrcut"}},
        [],
        {"hub_missing": ["Qwen/Qwen2.5-1.5B-Instrcut"]},
        "model.hf_config",
        "model.allow_download=true",
    ),
    (
        "hub-checkpoint-not-cached",
        {"model": {"hf_checkpoint": QWEN_1_5B}},
        [],
        {"hub_missing": [QWEN_1_5B]},
        "model.hf_checkpoint",
        "looked for *.safetensors",
    ),
    (
        "hub-tokenizer-not-cached",
        {"model": {"tokenizer": "Org/no-such-tokenizer"}},
        [],
        {"hub_missing": ["Org/no-such-tokenizer"]},
        "model.tokenizer",
        "nor in the Hugging Face cache",
    ),
    (
        "unknown-env",
        {"env": {"name": "retreival"}},
        [],
        {"registries": {"env": ["retrieval", "math_tool"]}},
        "env.name",
        "did you mean 'retrieval'",
    ),
    (
        "dataset-smaller-than-an-iteration",
        {"env": {"dataset_options": {"num_prompts": 6}}},
        [],
        {},
        "data.prompts_per_iteration",
        "the shipped echo dataset has 6",
    ),
    (
        "shipped-dataset-bad-option",
        {"env": {"dataset_options": {"num_digits": 11}}},
        [],
        {},
        "env.dataset_options",
        "num_digits must be in 1..10",
    ),
    (
        "ray-port-in-worker-range",
        {"launch": {"ray_port": 16379}},
        [],
        {},
        "launch.ray_port",
        "worker port range 10002-19999",
    ),
    (
        "fields-without-a-dataset-file",
        {"env": {"fields": {"prompt": "question"}}},
        [],
        {},
        "env.fields",
        "neither is set",
    ),
    (
        "env-dotted-path-not-importable",
        {"env": {"name": "no_such_pkg.envs:MyEnv"}},
        [],
        {},
        "env.name",
        "cannot import 'no_such_pkg.envs'",
    ),
    (
        "env-dotted-path-no-attribute",
        {"env": {"name": "megatron_stepwise.envs.echo:NoSuchEnv"}},
        [],
        {},
        "env.name",
        "has no 'NoSuchEnv'",
    ),
    (
        "reward-fn-and-env-name",
        {"env": {"name": "math_tool", "reward_fn": "json:dumps"}},
        [],
        {},
        "env.reward_fn",
        "set only one",
    ),
    (
        "reward-fn-without-dataset",
        {"env": {"reward_fn": "json:dumps"}, "model": {"tokenizer": "tiny_char"}},
        [],
        {},
        "env.dataset",
        "ships no dataset: set env.dataset",
    ),
    (
        "reward-fn-without-tokenizer",
        {
            "env": {
                "reward_fn": "json:dumps",
                "dataset": "megatron_stepwise/envs/data/math_problems.jsonl",
                "fields": {"prompt": "question"},
            }
        },
        [],
        {},
        "model.tokenizer",
        "ships no tokenizer",
    ),
    ("port-out-of-range", {"launch": {"master_port": 70000}}, [], {}, "launch.master_port", "<= 65535"),
    ("name-is-a-path", {}, ["name=../.."], {}, "name", "must be a plain name"),
    (
        "env-option-typo",
        {"env": {"name": "math_tool", "options": {"timeout": 5}}},
        [],
        {},
        "env.options",
        "environment 'math_tool' takes no option 'timeout' (it accepts: timeout_s, memory_mb, max_output_chars)",
    ),
    (
        "router-loss-on-a-dense-model",
        {"algo": {"loss": {"router_aux_coef": 0.01}}},
        [],
        {"shapes": {"tiny": (4, 4, 2)}},
        "algo.loss.router_aux_coef",
        "needs a mixture-of-experts model",
    ),
    (
        "echo-dataset-options-on-another-env",
        {"env": {"name": "math_tool", "dataset_options": {"num_digits": 4}}},
        [],
        {},
        "env.dataset_options",
        "takes no option 'num_digits' (it accepts: num_prompts, offset); options written "
        "for another environment? override with env.dataset_options={}",
    ),
    ("router-loss-negative", {"algo": {"loss": {"router_z_coef": -0.1}}}, [], {}, "algo.loss.router_z_coef", ">= 0"),
]


def test_corpus_is_large_and_covers_every_section():
    assert len(CASES) >= 25
    assert len({c[0] for c in CASES}) == len(CASES)
    sections = {c[4].split(".")[0] for c in CASES}
    assert {
        "model",
        "parallel",
        "rollout",
        "env",
        "data",
        "algo",
        "optim",
        "async",
        "checkpoint",
        "logging",
        "launch",
        "trainer",
    } <= sections


@pytest.mark.parametrize("case_id,data,overrides,probe_args,key,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_config_is_rejected_naming_the_key(case_id, data, overrides, probe_args, key, fragment, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as e:
        config_from_dict(data, overrides, probes=FakeProbes(**probe_args))
    assert e.value.keys == [key], str(e.value)  # exactly one problem: the root cause, no cascade
    assert fragment in str(e.value)


def test_the_same_configs_pass_once_fixed(monkeypatch):
    """Guards the corpus: the fixed version of a few cases validates (the error is the one named)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    fixed = [
        ({"parallel": {"tensor": 2}, "launch": {"nproc_per_node": 4}}, {}),
        ({"data": {"merge_steps": True}, "algo": {"loss": {"reduction": "trajectory_mean", "tis": "token"}}}, {}),
        (merged(SGLANG, {"rollout": {"engine": "sglang", "num_engines": 4}}), {}),
        # colocated: 8 engines share the node's 8 GPUs, 4 of them with the training ranks
        (merged(SGLANG, {"rollout": {"engine": "sglang", "num_engines": 8, "colocate": True}}), {}),
        ({"rollout": {"colocate": True}}, {}),
        ({"async": {"enabled": True}, "algo": {"loss": {"tis": "token"}}}, {}),
        ({"algo": {"estimator": "reinforce++"}, "rollout": {"max_turns": 1}}, {}),
        ({"algo": {"estimator": "turn_discount", "estimator_options": {"gamma": 0.9, "base": "grpo"}}}, {}),
        (
            {"rollout": {"engine": "sglang", "num_engines": 1, "sglang": {"servers": ["http://h1:30000"]}}},
            {"modules": ()},
        ),
        ({"model": {"hf_config": "Org/absent", "allow_download": True}}, {"hub_missing": ["Org/absent"]}),
    ]
    for data, probe_args in fixed:
        config_from_dict(data, probes=FakeProbes(**probe_args))


# ---- through the command line ----------------------------------------------------------------


def validate_cli(tmp_path: Path, text: str | None, *overrides: str) -> subprocess.CompletedProcess:
    path = tmp_path / "exp.yaml"
    if text is not None:
        path.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return run_launch(
        [sys.executable, "-m", "megatron_stepwise.cli", "validate", str(path), *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    "case_id",
    [
        "unknown-key-wrong-section",
        "merge-gspo",
        "world-not-divisible",
        "minibatch-not-dividing",
        "temperature-underflow",
        "top-k-float",
        "nan-lr",
    ],
)
def test_cli_exits_2_with_the_key_and_no_traceback(tmp_path, case_id):
    _, data, overrides, _, key, fragment = next(c for c in CASES if c[0] == case_id)
    result = validate_cli(tmp_path, yaml.safe_dump(data), *overrides)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert f"- {key}: " in result.stderr and fragment in result.stderr


def test_cli_lists_all_problems_and_handles_unreadable_files(tmp_path):
    result = validate_cli(tmp_path, "optim: {lr: x}\ndata: {epochs: 0}\n", "trainer.iterations=-1")
    assert result.returncode == 2 and "3 config problems" in result.stderr
    for key in ("optim.lr", "data.epochs", "trainer.iterations"):
        assert f"- {key}: " in result.stderr
    syntax = validate_cli(tmp_path, "optim: {lr: [\n")
    assert syntax.returncode == 2 and "YAML syntax error" in syntax.stderr and "Traceback" not in syntax.stderr
    (tmp_path / "exp.yaml").unlink()
    missing = validate_cli(tmp_path, None)
    assert missing.returncode == 2 and "no such config file" in missing.stderr


LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")
)


@pytest.mark.parametrize(
    "what,text,fragment",
    [
        ("alias bomb (9^9 values)", LAUGHS, "YAML aliases expand to more than 100000 values"),
        ("a list that contains itself", "x: &x [*x]\n", "YAML aliases expand to more than 100000 values"),
        ("a binary file", None, "is not a UTF-8 text file"),
        ("a huge file", "# " + "x" * (1 << 20) + "\n", "is over 1 MiB"),
        (
            "lists nested deeper than the parser recurses",
            "model: " + "[" * 5000 + "]" * 5000 + "\n",
            "nested more than 64 levels deep",
        ),
        (
            "mappings nested deeper than the parser recurses",
            "model: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n",
            "nested more than 64 levels deep",
        ),
        ("nested 65 levels", "model: " + "[" * 65 + "]" * 65 + "\n", "nested more than 64 levels deep"),
    ],
)
def test_hostile_yaml_is_refused_without_a_traceback(tmp_path, what, text, fragment):
    if text is None:
        (tmp_path / "exp.yaml").write_bytes(bytes(range(256)) * 8)
    result = validate_cli(tmp_path, text)
    assert result.returncode == 2 and fragment in result.stderr, (what, result.stderr[-2000:])
    assert "Traceback" not in result.stderr


def test_an_override_nested_too_deep_is_one_error_naming_its_key():
    from megatron_stepwise.config.loader import parse_override

    with pytest.raises(ValueError, match=r"^override model.x=\.\.\.: nested more than 64 levels deep$"):
        parse_override("model.x=" + "[" * 3000 + "]" * 3000)
