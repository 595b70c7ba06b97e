#!/usr/bin/env python
"""Compute the shell commands that launch an experiment; train_local.sh and train_slurm.sbatch run them.

    python launch/plan.py local CONFIG [KEY=VALUE ...]   # one node: Ray head (GPU only) + torchrun
    python launch/plan.py slurm CONFIG [KEY=VALUE ...]   # inside an allocation: Ray cluster + srun/torchrun
    python launch/plan.py wait-ray ADDRESS NODES         # block until NODES Ray nodes are alive

The plan is a bash script printed on stdout: `--dry-run` shows it, a real launch runs exactly
it. Placement (from the config's `launch` section): training nodes come first in the
allocation and use GPUs [0, nproc_per_node); the remaining GPUs of training nodes and all
GPUs of the `rollout_nodes` that follow are given to Ray for the rollout fleet. Rank 0 (the
fleet's driver) runs on the first node, which is also the Ray head.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nodelist import expand_nodelist  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXIT_BAD_CONFIG = 2
LOCAL_MASTER_PORT = 29500
# torchrun with the `bound-static` rendezvous (megatron_stepwise/rundir/torchrun.py): its store
# listens on the endpoint's address only (loopback on one node, the head's cluster address on
# SLURM), where torchrun's own store listens on every interface, unauthenticated.
TORCHRUN = ["python", "-m", "megatron_stepwise.rundir.torchrun", "--rdzv-backend=bound-static"]
# Recent Ray turns token authentication on for `ray start` (a token in ~/.ray/auth_token), but its
# clients (wait-ray, the trainer's ray.init) send the token only when asked to: without this,
# every client of a cluster the plan starts is refused (InvalidAuthToken). Older Ray ignores it.
# `ray start` runs its workers at niceness 15, where any busy process on the node (a training
# rank spinning on the GPU, a data loader) starves the engines and agent workers: run them at 0.
RAY_ENV = ['export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"', 'export RAY_worker_niceness="${RAY_worker_niceness:-0}"']


class PlanError(Exception):
    """The allocation or config cannot be launched; `problems` are `key: message` lines."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


class Raw(str):
    """A shell word emitted as-is inside double quotes, so `$VARS` in it expand."""


def sh(*words: object) -> str:
    """One command line: literal words are quoted, `Raw` words double-quoted for expansion."""
    return " ".join(f'"{w}"' if isinstance(w, Raw) else shlex.quote(str(w)) for w in words)


def gpu_list(start: int, stop: int) -> str:
    return ",".join(str(i) for i in range(start, stop))


@dataclass
class Job:
    """What the plan needs from the config and the command line."""

    cfg: object  # ExperimentConfig
    config_path: str
    overrides: list[str]

    def train_command(self, torchrun_args: list[object], ray_address: object | None) -> list[object]:
        extra = [Raw(f"rollout.ray_address={ray_address}")] if ray_address else []
        return [
            *TORCHRUN,
            *torchrun_args,
            "-m",
            "megatron_stepwise.cli",
            "train",
            self.config_path,
            *self.overrides,
            *extra,
        ]


def load_job(config_path: str, overrides: list[str], skip_local_checks: bool = False) -> Job:
    sys.path.insert(0, str(REPO))
    from megatron_stepwise.config import load_config
    from megatron_stepwise.config.errors import ConfigError
    from megatron_stepwise.config.probes import ClusterProbes

    try:
        cfg = load_config(config_path, overrides, probes=ClusterProbes() if skip_local_checks else None)
    except ConfigError as e:
        raise PlanError([str(p) for p in e.problems]) from None
    return Job(cfg, _as_typed(config_path), list(overrides))


def _as_typed(path: str) -> str:
    """The config path as the plan's commands see it: they run in the working directory (below)."""
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(resolved)


# One working-directory rule for every launcher, the same as `megatron-stepwise train`: the
# directory it was started from (under sbatch, the submission directory, where SLURM starts the
# batch script). Relative paths on the command line and in the config (logging.run_dir,
# env.dataset, ...) resolve there; the plan says so and cds there explicitly.
def _prelude(lines: list[str], job: Job, script: str) -> list[str]:
    bindir = Path(sys.executable).parent
    workdir = str(Path.cwd().resolve())
    command = json.dumps([script, job.config_path, *job.overrides])  # recorded in <run_dir>/run.json
    return [
        "set -euo pipefail",
        f"# working directory: {workdir} (relative paths in the config and arguments resolve here)",
        f"cd {shlex.quote(workdir)}",
        f"export MEGATRON_STEPWISE_COMMAND={shlex.quote(command)}",
        f'export PATH={shlex.quote(str(bindir))}:"$PATH"',
        f"export PYTHONPATH={shlex.quote(str(REPO))}${{PYTHONPATH:+:$PYTHONPATH}}",
        *lines,
    ]


def _wait_ray(address: object, nodes: int) -> str:
    return sh("python", str(REPO / "launch" / "plan.py"), "wait-ray", address, nodes)


def plan_local(job: Job) -> list[str]:
    """One node: torchrun for the training ranks, plus a Ray head holding the rollout GPUs."""
    launch, ro = job.cfg.launch, job.cfg.rollout
    if launch.nnodes > 1 or launch.rollout_nodes > 0:
        raise PlanError(
            [
                f"launch.nnodes: {launch.nnodes} training nodes and launch.rollout_nodes "
                f"{launch.rollout_nodes}: a multi-node layout, use launch/train_slurm.sbatch"
            ]
        )
    nproc = launch.nproc_per_node
    # port 0: a free port on loopback, so concurrent runs do not collide
    torchrun = [f"--rdzv-endpoint=127.0.0.1:{launch.master_port or 0}", "--nnodes=1", f"--nproc-per-node={nproc}"]
    lines = [
        f"# megatron-stepwise local launch of {job.cfg.name}: {nproc} training rank(s) on "
        f"{'GPUs ' + gpu_list(0, nproc) if launch.gpus_per_node else 'CPU'}"
    ]
    # The ranks die with this script (megatron_stepwise/rundir/lifecycle.py): `$$` is the bash that runs the plan.
    lines += [
        "export MEGATRON_STEPWISE_LAUNCHER_PID=$$",
        f"export MEGATRON_STEPWISE_RUN_DIR={shlex.quote(str(Path.cwd().resolve() / job.cfg.run_dir))}",
    ]
    ray_address = None
    if launch.gpus_per_node:
        env: list[object] = ["env", f"CUDA_VISIBLE_DEVICES={gpu_list(0, nproc)}"]
        if ro.ray_address is None:
            # Engines need GPUs disjoint from training: a Ray head that only sees the rest (all
            # of them when colocated: engines then release their memory while training runs).
            ray_address = f"127.0.0.1:{launch.ray_port}"
            first = 0 if ro.colocate else nproc
            rollout = gpu_list(first, launch.gpus_per_node)
            lines += [
                *RAY_ENV,
                f"# rollout: Ray head on GPUs {rollout or '(none)'} for {ro.num_engines} {ro.engine} engine(s)"
                + (" colocated with training" if ro.colocate else ""),
                sh(
                    "env",
                    f"CUDA_VISIBLE_DEVICES={rollout}",
                    "ray",
                    "start",
                    "--head",
                    "--node-ip-address=127.0.0.1",
                    f"--port={launch.ray_port}",
                    f"--num-gpus={launch.gpus_per_node - first}",
                    "--block",
                )
                + " &",
                "RAY_PID=$!",
                "trap 'kill $RAY_PID 2>/dev/null || true' EXIT",
                _wait_ray(ray_address, 1),
            ]
    else:
        env = ["env", "OMP_NUM_THREADS=1"]  # CPU: ranks and engines share the cores
        lines.append(
            f"# rollout: {ro.num_engines} {ro.engine} engine(s) on "
            f"{'Ray at ' + ro.ray_address if ro.ray_address else 'a local Ray instance rank 0 starts'}"
        )
    lines.append(sh(*env, *job.train_command(torchrun, ray_address)))
    return _prelude(lines, job, "launch/train_local.sh")


@dataclass
class Allocation:
    nodes: list[str]
    job_id: str | None
    gpus_on_node: int | None


def read_allocation(environ: dict[str, str]) -> Allocation:
    """The SLURM allocation from SLURM_* variables (no scontrol needed)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise PlanError(["SLURM_JOB_NODELIST: not set; run inside an allocation (sbatch/salloc)"])
    try:
        nodes = expand_nodelist(nodelist)
    except ValueError as e:
        raise PlanError([f"SLURM_JOB_NODELIST: {e}"]) from None
    nnodes = environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES")
    if nnodes and nnodes.isdigit() and int(nnodes) != len(nodes):
        raise PlanError([f"SLURM_NNODES: is {nnodes} but SLURM_JOB_NODELIST={nodelist} names {len(nodes)} nodes"])
    gpus = environ.get("SLURM_GPUS_ON_NODE")
    return Allocation(nodes, environ.get("SLURM_JOB_ID"), int(gpus) if gpus and gpus.isdigit() else None)


def master_port(job: Job, alloc: Allocation) -> int:
    """The configured port, else one derived from the job id so jobs sharing a node differ."""
    if job.cfg.launch.master_port is not None:
        return job.cfg.launch.master_port
    if alloc.job_id and alloc.job_id.isdigit():
        return 20000 + int(alloc.job_id) % 20000
    return LOCAL_MASTER_PORT


def plan_slurm(job: Job, environ: dict[str, str]) -> list[str]:
    """A Ray cluster across the allocation, the fleet's GPUs given to Ray, srun + torchrun per training node."""
    launch, ro = job.cfg.launch, job.cfg.rollout
    alloc = read_allocation(environ)
    need = launch.nnodes + launch.rollout_nodes
    if len(alloc.nodes) < need:
        raise PlanError(
            [
                f"launch.nnodes: the config needs launch.nnodes {launch.nnodes} + launch.rollout_nodes "
                f"{launch.rollout_nodes} = {need} nodes, the allocation has {len(alloc.nodes)} "
                f"({','.join(alloc.nodes)}); sbatch --nodes={need}"
            ]
        )
    if alloc.gpus_on_node is not None and alloc.gpus_on_node != launch.gpus_per_node:
        raise PlanError(
            [f"launch.gpus_per_node: is {launch.gpus_per_node} but SLURM_GPUS_ON_NODE is {alloc.gpus_on_node}"]
        )
    train_nodes = alloc.nodes[: launch.nnodes]
    rollout_nodes = alloc.nodes[launch.nnodes : need]
    head, port, gpus, nproc = train_nodes[0], master_port(job, alloc), launch.gpus_per_node, launch.nproc_per_node
    ray_address = Raw(f"$HEAD_IP:{launch.ray_port}")
    step = ["srun", "--overlap", "--nodes=1", "--ntasks=1"]
    lines = [
        f"# megatron-stepwise SLURM launch of {job.cfg.name} (job {alloc.job_id or '?'})",
        f"# training: {','.join(train_nodes)} ({nproc} ranks each, world size {launch.world_size()}); "
        f"rollout-only nodes: {','.join(rollout_nodes) or 'none'}; master {head}:{port}",
    ]
    unused = alloc.nodes[need:]
    if unused:
        lines.append(f"# note: nodes not used by this layout: {','.join(unused)}")
    # The head's cluster address (Ray's too): the rendezvous store listens there only.
    lines.append(f"HEAD_IP=$({sh(*step, '-w', head, 'hostname', '--ip-address')} | awk '{{print $1}}')")
    if ro.ray_address:
        ray_address = None  # an existing Ray cluster: the fleet joins it, nothing to start
        lines.append(f"# rollout: {ro.num_engines} {ro.engine} engine(s) on the Ray cluster at {ro.ray_address}")
    else:
        lines += _ray_cluster(launch, train_nodes, rollout_nodes, step, ray_address, ro.colocate)
        lines.append(f"# rollout: {ro.num_engines} {ro.engine} engine(s) placed by the fleet on this Ray cluster")
    lines.append("TRAIN_PIDS=()")
    for rank, node in enumerate(train_nodes):
        env = ["env", f"CUDA_VISIBLE_DEVICES={gpu_list(0, nproc)}"] if gpus else ["env", "OMP_NUM_THREADS=1"]
        torchrun = [
            f"--nnodes={launch.nnodes}",
            f"--nproc-per-node={nproc}",
            f"--rdzv-conf=rank={rank}",
            Raw(f"--rdzv-endpoint=$HEAD_IP:{port}"),
        ]
        lines += [sh(*step, "-w", node, *env, *job.train_command(torchrun, ray_address)) + " &", 'TRAIN_PIDS+=("$!")']
    lines += ["status=0", 'for pid in "${TRAIN_PIDS[@]}"; do wait "$pid" || status=$?; done', 'exit "$status"']
    return _prelude(lines, job, "launch/train_slurm.sbatch")


def _ray_cluster(
    launch, train_nodes: list[str], rollout_nodes: list[str], step: list[str], ray_address: Raw, colocate: bool = False
) -> list[str]:
    """Ray head on the first node, a worker on every other node; each sees only its rollout GPUs
    (every GPU when colocated)."""
    gpus, nproc = launch.gpus_per_node, launch.nproc_per_node
    lines = [*RAY_ENV, "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    ray_nodes = train_nodes + rollout_nodes
    for i, node in enumerate(ray_nodes):
        first_free = nproc if node in train_nodes and not colocate else 0  # training keeps [0, nproc)
        env = ["env", f"CUDA_VISIBLE_DEVICES={gpu_list(first_free, gpus)}"] if gpus else []
        role = (
            ["--head", Raw("--node-ip-address=$HEAD_IP"), f"--port={launch.ray_port}"]
            if i == 0
            else [Raw(f"--address=$HEAD_IP:{launch.ray_port}")]
        )
        lines.append(
            sh(*step, "-w", node, *env, "ray", "start", *role, f"--num-gpus={max(gpus - first_free, 0)}", "--block")
            + " &"
        )
        if i == 0 or i == len(ray_nodes) - 1:  # workers need the head up; training needs every node
            lines.append(_wait_ray(ray_address, i + 1))
    return lines


def wait_ray(address: str, nodes: int, timeout_s: float) -> int:
    """Block until `nodes` Ray nodes are alive at `address` (exit 1 on timeout)."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            alive = sum(1 for n in ray.nodes() if n.get("Alive"))
            ray.shutdown()
            if alive >= nodes:
                return 0
        except (ConnectionError, RuntimeError):
            pass
        time.sleep(2)
    print(f"wait-ray: fewer than {nodes} Ray nodes alive at {address} after {timeout_s:.0f}s", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="launch/plan.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode in ("local", "slurm"):
        p = sub.add_parser(mode)
        p.add_argument("config")
        p.add_argument("overrides", nargs="*")
        p.add_argument(
            "--skip-local-checks",
            action="store_true",
            help="validate for the cluster's nodes, not this machine (a dry run from a login node)",
        )
    w = sub.add_parser("wait-ray")
    w.add_argument("address")
    w.add_argument("nodes", type=int)
    w.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.mode == "wait-ray":
        return wait_ray(args.address, args.nodes, args.timeout)
    try:
        job = load_job(args.config, args.overrides, skip_local_checks=args.skip_local_checks)
        lines = plan_local(job) if args.mode == "local" else plan_slurm(job, dict(os.environ))
    except PlanError as e:
        print(f"{args.config}: cannot launch:", file=sys.stderr)
        for p in e.problems:
            print(f"  - {p}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
