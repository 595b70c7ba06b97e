"""Launch scripts: SLURM node lists, and the commands the dry runs print (nodes, ranks, ports, GPUs)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from config_fakes import FakeProbes
from helpers import TESTS, check_ok, load_script, run_launch

from megatron_stepwise.config import load_config
from megatron_stepwise.rundir import torchrun as bound_torchrun

REPO = Path(__file__).resolve().parents[2]
# The launch scripts are not a package: load them by path (nodelist first: plan imports it).
expand_nodelist = load_script(REPO / "launch" / "nodelist.py").expand_nodelist
plan = load_script(REPO / "launch" / "plan.py")

RECIPE_1X8 = "configs/recipes/qwen2.5-1.5b_math_tool_1x8.yaml"
RECIPE_4X8 = "configs/recipes/qwen2.5-3b_retrieval_4x8.yaml"
TORCHRUN = "megatron_stepwise.rundir.torchrun"  # torchrun with the rendezvous store bound to one address


# ---- node lists -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04]", ["node01", "node02", "node03", "node04"]),
        ("a[01-04,07],b3", ["a01", "a02", "a03", "a04", "a07", "b3"]),
        ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
        ("x[098-101]", ["x098", "x099", "x100", "x101"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("c1, c2 ,d[5]", ["c1", "c2", "d5"]),
    ],
)
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-04", "node01]", "node[a-b]", "node[4-1]", "", "n[1-]"])
def test_expand_nodelist_rejects_malformed_lists(text):
    with pytest.raises(ValueError):
        expand_nodelist(text)


# ---- plans through the API (recipes need sglang, which this machine lacks: fake probes) ---------


def job(config: str, *overrides: str) -> plan.Job:
    cfg = load_config(REPO / config, overrides, probes=FakeProbes())
    return plan.Job(cfg, config, list(overrides))


def slurm_env(nodelist: str, nnodes: int, job_id: str = "4321", gpus: str | None = "8") -> dict[str, str]:
    env = {"SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": str(nnodes), "SLURM_JOB_ID": job_id}
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = gpus
    return env


def commands(lines: list[str], program: str) -> list[list[str]]:
    """The command lines that run `program`, split into words (trailing `&` dropped)."""
    out = []
    for line in lines:
        if line.startswith("#"):
            continue
        words = shlex.split(line.removesuffix(" &"))
        if program in words:
            out.append(words)
    return out


def opt(words: list[str], name: str) -> str:
    (value,) = [w.split("=", 1)[1] for w in words if w.startswith(name + "=")]
    return value


def test_slurm_plan_for_four_nodes():
    lines = plan.plan_slurm(job(RECIPE_4X8), slurm_env("node[01-04]", 4, job_id="4321"))
    port = 20000 + 4321 % 20000
    rays = commands(lines, "ray")
    # one Ray node per allocated node: head on node01, workers on the rest, all joining the head
    assert [w[w.index("-w") + 1] for w in rays] == ["node01", "node02", "node03", "node04"]
    assert "--head" in rays[0] and opt(rays[0], "--port") == "6379"
    assert all(opt(w, "--address") == "$HEAD_IP:6379" for w in rays[1:])
    # training nodes 1-2 use all 8 GPUs for training; rollout nodes 3-4 give all 8 to Ray
    assert [opt(w, "--num-gpus") for w in rays] == ["0", "0", "8", "8"]
    assert opt(rays[2], "CUDA_VISIBLE_DEVICES") == "0,1,2,3,4,5,6,7"
    trains = commands(lines, TORCHRUN)
    assert [w[w.index("-w") + 1] for w in trains] == ["node01", "node02"]
    assert [opt(w, "--rdzv-conf") for w in trains] == ["rank=0", "rank=1"]
    # the store listens on the head's cluster address (Ray's), never on every interface
    assert "HEAD_IP=$(srun --overlap --nodes=1 --ntasks=1 -w node01 hostname --ip-address | awk '{print $1}')" in lines
    for w in trains:
        assert opt(w, "--nnodes") == "2" and opt(w, "--nproc-per-node") == "8"
        assert opt(w, "--rdzv-endpoint") == f"$HEAD_IP:{port}" and opt(w, "--rdzv-backend") == "bound-static"
        assert opt(w, "CUDA_VISIBLE_DEVICES") == "0,1,2,3,4,5,6,7"
        tail = w[w.index("megatron_stepwise.cli") - 1 :]
        assert tail[:4] == ["-m", "megatron_stepwise.cli", "train", RECIPE_4X8]
        assert tail[-1] == "rollout.ray_address=$HEAD_IP:6379"
    # Ray must be up on all 4 nodes before training starts
    text = "\n".join(lines)
    assert text.index('wait-ray "$HEAD_IP:6379" 4') < text.index("torchrun")
    # every `ray start` runs its workers at niceness 0, not Ray's 15 (busy ranks would starve them)
    assert text.index('export RAY_worker_niceness="${RAY_worker_niceness:-0}"') < text.index("ray start --head")


def test_slurm_plan_shares_one_node_between_training_and_rollout():
    lines = plan.plan_slurm(job(RECIPE_1X8, "launch.master_port=23456"), slurm_env("gpu7", 1))
    (ray,) = commands(lines, "ray")
    assert opt(ray, "CUDA_VISIBLE_DEVICES") == "4,5,6,7" and opt(ray, "--num-gpus") == "4"
    (train,) = commands(lines, TORCHRUN)
    assert opt(train, "CUDA_VISIBLE_DEVICES") == "0,1,2,3" and opt(train, "--nproc-per-node") == "4"
    assert opt(train, "--rdzv-endpoint") == "$HEAD_IP:23456" and opt(train, "--rdzv-conf") == "rank=0"
    assert "launch.master_port=23456" in train  # user overrides reach the training ranks


def test_slurm_plan_rejects_allocations_that_do_not_fit():
    with pytest.raises(plan.PlanError, match=r"launch.nnodes: .* = 4 nodes, the allocation has 2"):
        plan.plan_slurm(job(RECIPE_4X8), slurm_env("node[01-02]", 2))
    with pytest.raises(plan.PlanError, match="launch.gpus_per_node: is 8 but SLURM_GPUS_ON_NODE is 4"):
        plan.plan_slurm(job(RECIPE_4X8), slurm_env("node[01-04]", 4, gpus="4"))
    with pytest.raises(plan.PlanError, match="SLURM_NNODES: is 3"):
        plan.plan_slurm(job(RECIPE_4X8), slurm_env("node[01-04]", 3))
    with pytest.raises(plan.PlanError, match="SLURM_JOB_NODELIST: not set"):
        plan.plan_slurm(job(RECIPE_4X8), {})


def test_slurm_plan_joins_an_existing_ray_cluster_and_notes_unused_nodes():
    lines = plan.plan_slurm(
        job("configs/tiny_cpu.yaml", "rollout.ray_address=10.0.0.5:6379"),
        slurm_env("cpu[1-3]", 3, job_id="77", gpus=None),
    )
    assert commands(lines, "ray") == [] and "# note: nodes not used by this layout: cpu2,cpu3" in lines
    (train,) = commands(lines, TORCHRUN)
    assert opt(train, "--rdzv-endpoint") == "$HEAD_IP:20077" and opt(train, "OMP_NUM_THREADS") == "1"
    assert any(line.startswith("HEAD_IP=$(") for line in lines)  # computed without a Ray cluster to start too
    assert not any(w.startswith("rollout.ray_address=$") for w in train)


def test_local_plan_on_gpus_starts_a_ray_head_on_the_rollout_gpus():
    lines = plan.plan_local(job(RECIPE_1X8))
    (ray,) = commands(lines, "ray")
    assert opt(ray, "CUDA_VISIBLE_DEVICES") == "4,5,6,7" and opt(ray, "--num-gpus") == "4"
    (train,) = commands(lines, TORCHRUN)
    assert opt(train, "--rdzv-endpoint") == "127.0.0.1:0" and opt(train, "CUDA_VISIBLE_DEVICES") == "0,1,2,3"
    assert train[-1] == "rollout.ray_address=127.0.0.1:6379"
    with pytest.raises(plan.PlanError, match="use launch/train_slurm.sbatch"):
        plan.plan_local(job(RECIPE_4X8))


def test_colocated_plans_give_ray_the_training_gpus_too():
    """rollout.colocate: engines share the training GPUs (they release their memory while it trains)."""
    colocated = ("rollout.colocate=true", "rollout.num_engines=8", "weight_sync.mode=tensor")
    (ray,) = commands(plan.plan_local(job(RECIPE_1X8, *colocated)), "ray")
    assert opt(ray, "CUDA_VISIBLE_DEVICES") == "0,1,2,3,4,5,6,7" and opt(ray, "--num-gpus") == "8"
    (ray,) = commands(plan.plan_slurm(job(RECIPE_1X8, *colocated), slurm_env("gpu7", 1)), "ray")
    assert opt(ray, "CUDA_VISIBLE_DEVICES") == "0,1,2,3,4,5,6,7" and opt(ray, "--num-gpus") == "8"


# ---- where the rendezvous store listens ------------------------------------------------------


def test_a_one_node_launch_listens_on_loopback_only():
    """The self-launcher's and train_local.sh's rendezvous, a real 2-rank CPU launch: the store
    (torchrun's agent) and gloo listen on 127.0.0.1 only (torchrun's own store: every interface)."""
    pythonpath = os.pathsep.join([str(REPO), str(TESTS)])
    cmd = [sys.executable, "-m", TORCHRUN, *bound_torchrun.single_node_args(), "--nproc-per-node=2"]
    proc = run_launch(
        [*cmd, str(TESTS / "workers" / "listen_worker.py")],
        env=dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1"),
        timeout=300,
        cwd=REPO,
    )
    check_ok(proc)
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("LISTENING ")]
    report = json.loads(line.removeprefix("LISTENING "))
    assert report["agent"] and report["master_addr"] == "127.0.0.1", report
    sockets = report["agent"] + [a for rank in report["ranks"] for a in rank]
    assert all(a.rsplit(":", 1)[0] == "127.0.0.1" for a in sockets), report


def test_a_multi_node_bound_rendezvous_needs_a_rank_and_a_fixed_port():
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    for endpoint, conf in (("10.0.0.1:29500", {}), ("10.0.0.1:0", {"rank": "1"})):
        params = RendezvousParameters(bound_torchrun.BACKEND, endpoint, "run", 2, 2, **conf)
        with pytest.raises(ValueError, match=r"--rdzv-endpoint=10.0.0.1:\d+: 2 nodes need --rdzv-conf=rank=N"):
            bound_torchrun.create_handler(params)


# ---- the scripts' dry runs, as a user runs them ----------------------------------------------


def run_script(script: str, *args: str, extra_env: dict[str, str] | None = None, cwd: Path = REPO):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update({"PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(extra_env or {})})
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        ["bash", str(REPO / "launch" / script), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


def test_train_local_dry_run_for_the_tiny_experiment(tmp_path):
    result = run_script("train_local.sh", "--dry-run", "configs/tiny_cpu.yaml", "trainer.iterations=3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    (train,) = commands(lines, TORCHRUN)
    assert train[:2] == ["env", "OMP_NUM_THREADS=1"]
    assert train[2:] == [
        "python",
        "-m",
        TORCHRUN,
        "--rdzv-backend=bound-static",
        "--rdzv-endpoint=127.0.0.1:0",  # loopback only, a free port
        "--nnodes=1",
        "--nproc-per-node=2",
        "-m",
        "megatron_stepwise.cli",
        "train",
        "configs/tiny_cpu.yaml",
        "trainer.iterations=3",
    ]
    assert commands(lines, "ray") == []  # on CPU rank 0 starts its own Ray instance
    assert f"cd {REPO}" in lines  # the directory it was started from, as `megatron-stepwise train`
    assert (
        'export MEGATRON_STEPWISE_COMMAND=\'["launch/train_local.sh", "configs/tiny_cpu.yaml", '
        '"trainer.iterations=3"]\''
    ) in lines  # what run.json records
    # run from another directory: the plan runs there (relative paths resolve there), the config by its path
    elsewhere = run_script("train_local.sh", "--dry-run", str(REPO / "configs/tiny_cpu.yaml"), cwd=tmp_path)
    assert f"cd {tmp_path}" in elsewhere.stdout.splitlines()
    assert f"# working directory: {tmp_path} (relative paths" in elsewhere.stdout
    assert f"train {REPO / 'configs/tiny_cpu.yaml'}" in elsewhere.stdout
    assert f"MEGATRON_STEPWISE_RUN_DIR={tmp_path / 'runs/tiny_cpu'}" in elsewhere.stdout


def test_train_slurm_dry_run_under_a_simulated_allocation():
    servers = "rollout.sglang.servers=[" + ",".join(f"h{i}:30000" for i in range(16)) + "]"  # no sglang here
    # The recipe's hub ids are not in this machine's cache: the nodes will download them.
    result = run_script(
        "train_slurm.sbatch",
        "--dry-run",
        RECIPE_4X8,
        servers,
        "model.allow_download=true",
        extra_env={
            "SLURM_JOB_NODELIST": "node[01-04]",
            "SLURM_NNODES": "4",
            "SLURM_JOB_ID": "9",
            "SLURM_GPUS_ON_NODE": "8",
            "SLURM_SUBMIT_DIR": str(REPO),
        },
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    trains = commands(lines, TORCHRUN)
    assert [(w[w.index("-w") + 1], opt(w, "--rdzv-conf")) for w in trains] == [
        ("node01", "rank=0"),
        ("node02", "rank=1"),
    ]
    assert {opt(w, "--rdzv-endpoint") for w in trains} == {"$HEAD_IP:20009"}
    assert [w[w.index("-w") + 1] for w in commands(lines, "ray")] == ["node01", "node02", "node03", "node04"]
    # the plan is valid bash
    assert subprocess.run(["bash", "-n"], input=result.stdout, text=True).returncode == 0


def test_dry_runs_report_bad_configs_and_allocations_with_exit_2():
    bad = run_script("train_local.sh", "--dry-run", "configs/tiny_cpu.yaml", "parallel.tensor=3")
    assert bad.returncode == 2 and "- parallel: world size 2" in bad.stderr and "Traceback" not in bad.stderr
    small = run_script(
        "train_slurm.sbatch",
        "--dry-run",
        "configs/tiny_cpu.yaml",
        "launch.nnodes=2",
        extra_env={"SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1"},
    )
    assert small.returncode == 2 and "launch.nnodes" in small.stderr and small.stdout == ""
    outside = run_script("train_slurm.sbatch", "--dry-run", "configs/tiny_cpu.yaml")
    assert outside.returncode == 2 and "SLURM_JOB_NODELIST: not set" in outside.stderr
    usage = run_script("train_local.sh")
    assert usage.returncode == 2 and "--dry-run" in usage.stderr


def test_the_reported_rank_is_the_one_that_failed_by_itself():
    """When one rank exits with an error, torchrun stops the others (SIGTERM, exit code -15):
    the launcher must report the rank that failed, not the lowest one it killed."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from megatron_stepwise.rundir.lifecycle import first_failure

    def failure(rank, code, t):
        f = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="<N/A>")
        f.timestamp = t
        return f

    assert first_failure({0: failure(0, -15, 5), 1: failure(1, 2, 4)})[0] == 1
    assert first_failure({0: failure(0, 1, 7), 1: failure(1, 2, 4)})[0] == 1  # earliest error
    assert first_failure({0: failure(0, -9, 4), 1: failure(1, -9, 4)})[0] == 0  # all killed: lowest


@pytest.mark.parametrize("script", ["train_local.sh", "train_slurm.sbatch"])
def test_help_prints_usage_and_runs_nothing(script, tmp_path):
    # No python on PATH either: --help must not need it (it used to exit 127 looking for one).
    bare = {"PATH": "/usr/bin:/bin", "PYTHON": str(tmp_path / "must-not-run")}
    for flag in ("--help", "-h"):
        out = subprocess.run(
            ["bash", str(REPO / "launch" / script), flag, "configs/tiny_cpu.yaml"],
            env=bare,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and out.stderr == "", out.stderr
        assert "CONFIG [KEY=VALUE ...]" in out.stdout and "--dry-run" in out.stdout
        assert "#SBATCH" not in out.stdout and "set -euo" not in out.stdout


def test_a_launch_without_python_on_path_says_how_to_activate_the_environment():
    # As with no activated environment: the interpreter the script would use is not on PATH.
    env = {"PATH": os.environ["PATH"], "PYTHON": "no-such-python-for-this-test"}
    out = subprocess.run(
        ["bash", str(REPO / "launch" / "train_local.sh"), "configs/tiny_cpu.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "source .venv/bin/activate" in out.stderr


def test_gpu_recipe_dry_run_from_a_cpu_login_node_with_skip_local_checks():
    """No sglang here and no servers listed: refused as this machine, planned for the nodes."""
    env = {
        "SLURM_JOB_NODELIST": "node[01-04]",
        "SLURM_NNODES": "4",
        "SLURM_JOB_ID": "9",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_SUBMIT_DIR": str(REPO),
    }
    if importlib.util.find_spec("sglang") is None:  # this machine cannot launch SGLang servers itself
        here = run_script("train_slurm.sbatch", "--dry-run", RECIPE_4X8, "model.allow_download=true", extra_env=env)
        assert here.returncode == 2 and "sglang" in here.stderr
    nodes = run_script("train_slurm.sbatch", "--dry-run", "--skip-local-checks", RECIPE_4X8, extra_env=env)
    assert nodes.returncode == 0, nodes.stderr
    assert len(commands(nodes.stdout.splitlines(), TORCHRUN)) == 2
