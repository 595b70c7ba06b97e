"""Bad config inputs of issue 42 (hardening, round three): each is one problem naming its key,
file or value (exit 2 from the CLI), never a traceback or a silent acceptance."""

import json
import os
import subprocess

import pytest
from config_fakes import FakeProbes

from megatron_stepwise.cli.main import main as cli_main
from megatron_stepwise.config import load_config
from megatron_stepwise.config.errors import ConfigError
from megatron_stepwise.hf.presets import tiny_config

HUGE = "9" * 5000


def _problems(path, overrides=()):
    with pytest.raises(ConfigError) as e:
        load_config(str(path), list(overrides), probes=FakeProbes(modules=()))
    return [str(p) for p in e.value.problems]


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


# (case id, file text, overrides, words the single problem must contain)
CASES = [
    ("huge_int_in_file", f"trainer:\n  seed: {HUGE}\n", [], ["line 2", "5000 digits"]),
    ("huge_int_override", "name: x\n", [f"trainer.seed={HUGE}"], ["trainer.seed", "5000 digits"]),
    ("int_beyond_64_bits", f"trainer:\n  iterations: {2**70}\n", [], ["trainer.iterations", "out of range"]),
    ("duplicate_section", "optim:\n  lr: 1.0e-3\noptim:\n  min_lr: 0.0\n", [], ["duplicate key 'optim'", "line 1"]),
    ("duplicate_key", "optim:\n  lr: 1.0e-3\n  lr: 1.0e-4\n", [], ["duplicate key 'lr'", "line 2"]),
    ("learning_rate", "optim:\n  learning_rate: 1.0e-3\n", [], ["optim.learning_rate", "did you mean 'optim.lr'"]),
    ("learning_rate_override", "name: x\n", ["optim.learning_rate=1e-3"], ["did you mean 'optim.lr'"]),
    ("proc_checkpoint_dir", "checkpoint:\n  dir: /proc/no_such_dir/ckpt\n", [], ["checkpoint.dir", "/proc"]),
]


@pytest.mark.parametrize("text,overrides,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_problem_naming_it(tmp_path, text, overrides, words):
    (problem,) = _problems(_write(tmp_path, "bad.yaml", text), overrides)
    for word in words:
        assert word in problem
    assert len(problem) < 400  # one readable line, not the 5,000 digits echoed back


def test_run_dir_pointing_at_a_file(tmp_path):
    afile = _write(tmp_path, "not_a_dir", "x")
    (problem,) = _problems(_write(tmp_path, "c.yaml", f"logging:\n  run_dir: {afile}\n"))
    assert problem.startswith("logging.run_dir:") and "is a file" in problem


def test_checkpoint_dir_under_a_file(tmp_path):
    afile = _write(tmp_path, "not_a_dir", "x")
    (problem,) = _problems(_write(tmp_path, "c.yaml", f"checkpoint:\n  dir: {afile}/ckpt\n"))
    assert problem.startswith("checkpoint.dir:") and f"{afile} is a file" in problem


@pytest.mark.launches  # root mounts a read-only tmpfs (`mount`)
def test_unwritable_checkpoint_dir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    mounted = False
    if os.geteuid() == 0:  # root writes through permission bits: a read-only mount stops it too
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(locked)]).returncode:
            pytest.skip("root that cannot mount: runs as a non-root user, or as root where mount works (CI)")
        mounted = True
    try:
        (problem,) = _problems(_write(tmp_path, "c.yaml", f"checkpoint:\n  dir: {locked}/ckpt\n"))
        assert problem.startswith("checkpoint.dir:") and "not writable" in problem
    finally:
        if mounted:
            subprocess.run(["umount", str(locked)], check=True)


def test_merge_keys_may_still_be_overridden_beside_them(tmp_path):
    text = "base: &b {lr: 1.0e-3, min_lr: 0.0}\noptim:\n  <<: *b\n  lr: 2.0e-3\n"
    problems = _problems(_write(tmp_path, "c.yaml", text))
    assert problems == ["base: unknown key [%s]" % (tmp_path / "c.yaml")]  # only the anchor's holder


def test_an_explicit_empty_mapping_clears_the_inherited_one(tmp_path):
    _write(tmp_path, "parent.yaml", "env:\n  dataset_options: {num_prompts: 5}\n  options: {}\n")
    child = _write(tmp_path, "child.yaml", "defaults: parent.yaml\nenv:\n  dataset_options: {}\n")
    cfg = load_config(str(child), probes=FakeProbes(modules=()))
    assert cfg.env.dataset_options == {}
    nested = _write(tmp_path, "nested.yaml", "defaults: parent.yaml\nenv:\n  dataset_options: {num_turns: 2}\n")
    cfg = load_config(
        str(nested), ["data.prompts_per_iteration=4", "data.prompts_per_minibatch=4"], probes=FakeProbes(modules=())
    )
    assert cfg.env.dataset_options == {"num_prompts": 5, "num_turns": 2}  # a non-empty mapping still merges


def test_lengths_beyond_a_real_models_context_window(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_config(max_position_embeddings=512)))
    text = f"model:\n  hf_config: {model}\nrollout:\n  max_input_length: 500\n  max_new_tokens: 100\n"
    (problem,) = _problems(_write(tmp_path, "c.yaml", text))
    assert problem.startswith("rollout.max_input_length:") and "600 tokens" in problem and "512" in problem


def test_validate_cli_exits_2_with_one_line_per_problem(tmp_path, capsys):
    path = _write(tmp_path, "c.yaml", f"optim:\n  lr: 1.0e-3\noptim:\n  lr: {HUGE}\n")
    assert cli_main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "duplicate key 'optim'" in err and len(err.splitlines()) == 2


IMPOSSIBLE_SIZES = {
    "sglang_ports_past_65535": (
        ["rollout.engine=sglang", "rollout.sglang.base_port=65530", "rollout.num_engines=8", "launch.gpus_per_node=16"],
        "rollout.sglang.base_port",
        "past 65535",
    ),
    "weight_bucket_past_memory": (["weight_sync.bucket_mb=1099511627776"], "weight_sync.bucket_mb", "in memory"),
    "sequence_past_int32": (
        ["rollout.max_input_length=4294967296", f"data.max_tokens_per_microbatch={2**33}"],
        "rollout.max_input_length",
        "positions",
    ),
    "ranks_past_any_node": (["launch.nproc_per_node=100000"], "launch.nproc_per_node", "must be <= 256"),
    "engines_past_any_fleet": (["rollout.num_engines=100000"], "rollout.num_engines", "must be <= 4096"),
    "nodes_past_any_cluster": (["launch.nnodes=1000000"], "launch.nnodes", "must be <= 65536"),
    "option_grpo_does_not_take": (
        ["algo.estimator_options.gamma=0.9"],
        "algo.estimator_options.gamma",
        "is not an option of grpo (it takes none)",
    ),
    "option_reinforce_pp_does_not_take": (
        ["algo.estimator=reinforce++", "rollout.max_turns=1", "algo.estimator_options.lam=0.9"],
        "algo.estimator_options.lam",
        "is not an option of reinforce++ (it takes gamma)",
    ),
    "microbatch_past_int32": ([f"data.max_tokens_per_microbatch={2**40}"], "data.max_tokens_per_microbatch", "index"),
    "trajectories_past_int32": (
        ["data.prompts_per_iteration=4194304", "data.prompts_per_minibatch=4194304", "data.samples_per_prompt=1048576"],
        "data.prompts_per_iteration",
        "trajectories per iteration",
    ),
}


@pytest.mark.parametrize("overrides,key,words", IMPOSSIBLE_SIZES.values(), ids=IMPOSSIBLE_SIZES.keys())
def test_impossible_sizes_are_named(tmp_path, overrides, key, words):
    problems = _problems(_write(tmp_path, "c.yaml", f"logging:\n  run_dir: {tmp_path / 'run'}\n"), overrides)
    assert any(p.startswith(f"{key}:") and words in p for p in problems), problems
