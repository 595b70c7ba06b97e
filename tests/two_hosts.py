"""Two hosts on this machine for multi-node tests (tools/two_nodes.sh): network namespaces joined
by a veth pair, each with its own address and hostname, sharing the filesystem as cluster nodes do.

`two_hosts(tmp_dir)` brings them up (skipping, with where it runs, where it cannot: it needs root,
`ip` and `unshare`, as CI has) and tears them down with everything started on them.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence

import pytest
from helpers import _kill_tree, run_launch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "two_nodes.sh"
EXIT_CANNOT = 3


class TwoHosts:
    """Hosts "a" and "b": `popen`/`run` a command on one, read the bytes its link moved, cut it."""

    def __init__(self, state: Path):
        self.state = state
        self.env = dict(line.split("=", 1) for line in (state / "hosts.env").read_text().split())
        self.ip = {"a": self.env["NODE_A_IP"], "b": self.env["NODE_B_IP"]}
        self.name = {"a": self.env["NODE_A_NAME"], "b": self.env["NODE_B_NAME"]}
        self._procs: list[subprocess.Popen] = []

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        return ["bash", str(SCRIPT), "exec", str(self.state), host, *map(str, argv)]

    def popen(self, host: str, argv: Sequence[str], log: Optional[Path] = None, env=None) -> subprocess.Popen:
        """Start `argv` on `host` in a session of its own (killed with the hosts), output to `log`."""
        out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            self.command(host, argv), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], timeout: float, env=None) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(host, argv), env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
        )

    def link_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes each host received and sent on its link to the other so far."""
        out = {}
        for host, ns_key in (("a", "NODE_A_NS"), ("b", "NODE_B_NS")):
            dev = self.env["NODE_LINK"] if host == "a" else self.env["NODE_LINK"].replace("mswa", "mswb", 1)
            stats = {}
            for what in ("rx_bytes", "tx_bytes"):
                got = subprocess.run(
                    ["ip", "netns", "exec", self.env[ns_key], "cat", f"/sys/class/net/{dev}/statistics/{what}"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=True,
                )
                stats[what] = int(got.stdout)
            out[host] = {"received": stats["rx_bytes"], "sent": stats["tx_bytes"]}
        return out

    def processes(self, host: str) -> dict[int, str]:
        """The processes running on `host` (in its network namespace): pid -> command line."""
        ns = self.env["NODE_A_NS" if host == "a" else "NODE_B_NS"]
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
        out = {}
        for pid in pids:
            try:
                out[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass  # it exited meanwhile
        return out

    def kill_all(self, host: str) -> list[str]:
        """SIGKILL every process on `host`, as when the node dies; the command lines killed."""
        killed = []
        for pid, cmdline in self.processes(host).items():
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(cmdline)
            except OSError:
                pass
        return killed

    def set_link(self, up: bool) -> None:
        subprocess.run(["bash", str(SCRIPT), "link", str(self.state), "up" if up else "down"], check=True, timeout=30)

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                _kill_tree(proc)
        subprocess.run(["bash", str(SCRIPT), "down", str(self.state)], capture_output=True, timeout=120)


def two_hosts(state: Path) -> TwoHosts:
    out = subprocess.run(["bash", str(SCRIPT), "up", str(state)], capture_output=True, text=True, timeout=120)
    if out.returncode == EXIT_CANNOT:
        pytest.skip(
            f"two-host tests need root with `ip netns` and `unshare` ({out.stderr.strip()}); they run as root, "
            "as in CI (tools/two_nodes.sh)"
        )
    if out.returncode != 0:  # what it created goes, or the next `up` finds its subnet taken
        subprocess.run(["bash", str(SCRIPT), "down", str(state)], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return TwoHosts(state)


def wait_for(condition, what: str, timeout_s: float = 300.0, proc: Optional[subprocess.Popen] = None):
    """Poll `condition()` until truthy (returned); fail naming `what` after `timeout_s` or if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: the process exited ({proc.returncode}) first")
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {timeout_s:.0f} s")


def python_env() -> dict[str, str]:
    """The environment a host's commands need: this checkout, this venv, one torch thread each."""
    bindir = str(Path(sys.executable).parent)
    return dict(
        os.environ,
        PYTHONPATH=str(REPO),
        PATH=f"{bindir}:{os.environ.get('PATH', '')}",
        OMP_NUM_THREADS="1",
        RAY_AUTH_MODE="token",
        RAY_worker_niceness="0",
    )


RAY_PORT = 6379  # each host has its own ports: nothing else on this machine listens in its namespace
RDZV_PORT = 29400


def start_ray_worker(hosts: TwoHosts, head: str, env: dict, log: Path) -> None:
    """A Ray worker on host b (6 CPUs: every engine and agent worker lands there), waited for."""
    ray = str(Path(sys.executable).parent / "ray")
    hosts.popen(
        "b",
        [ray, "start", f"--address={head}", f"--node-ip-address={hosts.ip['b']}", "--num-cpus=6", "--block"],
        log=log,
        env=env,
    )
    up = hosts.run("a", [sys.executable, "launch/plan.py", "wait-ray", head, "2"], timeout=400, env=env)
    assert up.returncode == 0, up.stderr + log.read_text()[-3000:]


@contextmanager
def ray_cluster(state: Path, ray_env: Optional[dict[str, str]] = None):
    """Two hosts with a Ray cluster across them: head on a (0 CPUs), worker on b (6 CPUs).
    `ray_env`: Ray settings (RAY_*) for every process of the cluster and its clients.
    Yields (hosts, head address, environment); everything started on the hosts dies with it."""
    hosts = two_hosts(state)
    env = {**python_env(), **(ray_env or {})}
    ray = str(Path(sys.executable).parent / "ray")
    head = f"{hosts.ip['a']}:{RAY_PORT}"
    try:
        # A Ray temp dir of their own: Ray records "the cluster on this machine" there, and the
        # suite's other Ray users share /tmp with these hosts.
        temp = f"/tmp/msw-ray-{os.getpid()}-{state.name}"
        hosts.popen(
            "a",
            [
                ray,
                "start",
                "--head",
                f"--node-ip-address={hosts.ip['a']}",
                f"--port={RAY_PORT}",
                "--num-cpus=0",
                f"--temp-dir={temp}",
                "--block",
            ],
            log=state / "ray_a.log",
            env=env,
        )
        up = hosts.run("a", [sys.executable, "launch/plan.py", "wait-ray", head, "1"], timeout=400, env=env)
        assert up.returncode == 0, up.stderr + (state / "ray_a.log").read_text()[-3000:]
        start_ray_worker(hosts, head, env, state / "ray_b.log")
        yield hosts, head, env
    finally:
        hosts.close()


def start_training(hosts: TwoHosts, head: str, env: dict, run_dir: Path, *args: str) -> list[subprocess.Popen]:
    """torchrun on each host (one rank each), rendezvousing at host a, as on two cluster nodes;
    their output in torchrun_a.log / torchrun_b.log beside `run_dir`."""
    procs = []
    for rank, host in enumerate("ab"):
        cmd = [
            sys.executable, "-m", "megatron_stepwise.rundir.torchrun", "--rdzv-backend=bound-static",
            "--nnodes=2", "--nproc-per-node=1", f"--rdzv-conf=rank={rank}",
            f"--rdzv-endpoint={hosts.ip['a']}:{RDZV_PORT}",
            "-m", "megatron_stepwise.cli", "train", "configs/tiny_cpu.yaml", f"logging.run_dir={run_dir}",
            "launch.nnodes=2", "launch.nproc_per_node=1", f"rollout.ray_address={head}", *args,
        ]  # fmt: skip
        procs.append(hosts.popen(host, cmd, log=run_dir.parent / f"torchrun_{host}.log", env=env))
    return procs


# The one-node run both two-node files repeat: test_two_nodes.py in each weight-sync mode, and
# test_two_node_faults.py after each fault's resume (which adds a checkpoint every iteration and a
# short collective timeout; neither changes a metric).
REFERENCE_RUN = ("trainer.iterations=5", "logging.progress=false", "rollout.agent_workers=2")


def one_node_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """REFERENCE_RUN's metrics lines, trained once per test session: the first xdist worker to ask
    trains it, another waits on the lock and reads the same file (a launch fewer for the suite)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this session's, all workers
    run_dir = shared / "one_node_reference"
    with open(shared / "one_node_reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (run_dir / "complete").exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # a failed attempt's remains
            cmd = [sys.executable, "-m", "megatron_stepwise.cli", "train", "configs/tiny_cpu.yaml"]
            out = run_launch(
                [*cmd, f"logging.run_dir={run_dir}", *REFERENCE_RUN], env=python_env(), cwd=REPO, timeout=900
            )
            assert out.returncode == 0, out.stderr[-3000:]
            (run_dir / "complete").touch()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
