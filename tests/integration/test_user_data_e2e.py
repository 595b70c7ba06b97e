"""End to end: docs/custom_envs.md as written, from a package outside the repository.

The doc's files (each code block starting `# file: <path>`) are written to a temporary
directory put on PYTHONPATH; its `make_data.py` writes a Parquet file and a `datasets`
directory with its own column names; each `megatron-stepwise train` command of its `train.sh`
trains the tiny CPU experiment for a few iterations. The first run also writes TensorBoard and
offline W&B logs, which must equal metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_launch
from test_loggers import assert_loggers_match_jsonl

# Longer than the suite's 600 s: the module's data set-up and a training launch, each allowed up to 900 s on a busy machine.
pytestmark = pytest.mark.timeout(1200)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "custom_envs.md"
FILE_BLOCK = re.compile(r"```(?:python|bash)\n# file: (\S+)\n(.*?)```", re.S)
SHORT = ["trainer.iterations=3", "checkpoint.every=0", "logging.progress=false"]

for module in ("pyarrow", "datasets", "tensorboard", "wandb"):
    pytest.importorskip(module, reason=f"{module} (test extra) is not installed")


def doc_files() -> dict[str, str]:
    return {path: body for path, body in FILE_BLOCK.findall(DOC.read_text())}


def train_commands(script: str) -> list[list[str]]:
    """The `megatron-stepwise train ...` commands of train.sh, continuation lines joined."""
    joined = script.replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.startswith("megatron-stepwise train")]


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("outside_the_repo")
    files = doc_files()
    assert {"my_envs/digit_env.py", "my_envs/rewards.py", "make_data.py", "train.sh"} <= set(files)
    for rel, body in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body)
    subprocess.run([sys.executable, "make_data.py"], cwd=root, check=True, timeout=300)
    return root


def _run(user_dir: Path, argv: list[str], run_dir: Path, *extra: str):
    assert argv[:2] == ["megatron-stepwise", "train"]
    config = str(REPO / argv[2])  # the doc's path is relative to the repository
    overrides = [a for a in argv[3:] if not a.startswith("logging.run_dir=")]
    # The user's package is found through PYTHONPATH only (the repo is importable as installed).
    env = dict(
        os.environ,
        PYTHONPATH=f"{user_dir}{os.pathsep}{REPO}",
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
    )
    cmd = [
        sys.executable,
        "-m",
        "megatron_stepwise.cli",
        "train",
        config,
        *overrides,
        f"logging.run_dir={run_dir}",
        *SHORT,
        *extra,
    ]
    return run_launch(cmd, cwd=user_dir, env=env, capture_output=True, text=True, timeout=900)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_user_environment_by_dotted_path_trains_on_a_datasets_directory(user_dir, tmp_path):
    (digit_env, _) = train_commands(doc_files()["train.sh"])
    assert "env.name=my_envs.digit_env:SayDigit" in digit_env and "env.dataset=digits_hf" in digit_env
    run_dir = tmp_path / "digit_env"
    out = _run(user_dir, digit_env, run_dir, "logging.tensorboard=true", "logging.wandb.project=stepwise-e2e")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m = _metrics(run_dir)
    assert [r["iteration"] for r in m] == [0, 1, 2]
    assert all(r["rollout/trajectories"] == 64 and r["train/optimizer_steps"] == 2 for r in m)
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in m)
    assert (run_dir / "checkpoints" / "latest").is_file()
    compared = assert_loggers_match_jsonl(str(run_dir))
    assert compared >= 3 * 20, compared  # every numeric key of every iteration, in both loggers


@pytest.mark.slow
def test_reward_function_only_trains_on_a_parquet_file(user_dir, tmp_path):
    (_, reward_fn) = train_commands(doc_files()["train.sh"])
    assert "env.reward_fn=my_envs.rewards:until_right" in reward_fn and "env.dataset=digits.parquet" in reward_fn
    run_dir = tmp_path / "reward_fn"
    out = _run(user_dir, reward_fn, run_dir, "trainer.eval_every=0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m = _metrics(run_dir)
    assert [r["iteration"] for r in m] == [0, 1, 2]
    assert all(r["rollout/trajectories"] == 64 for r in m)
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in m)


def test_a_user_module_that_does_not_import_fails_validate_naming_it(user_dir):
    env = dict(os.environ, PYTHONPATH=f"{user_dir}{os.pathsep}{REPO}")
    cmd = [
        sys.executable,
        "-m",
        "megatron_stepwise.cli",
        "validate",
        str(REPO / "configs/tiny_cpu.yaml"),
        "env.name=my_envs.digit_env:SayDigits",
        "env.dataset=digits_hf",
    ]
    out = run_launch(cmd, cwd=user_dir, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "env.name" in out.stderr and "has no 'SayDigits'" in out.stderr
    # the same with the right name, but a column the environment needs left unmapped
    cmd[-2] = "env.name=my_envs.digit_env:SayDigit"
    out = run_launch(
        [*cmd, "env.fields.prompt=question"], cwd=user_dir, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2 and "has no field 'target'" in out.stderr and "digits_hf" in out.stderr
