"""Faults across nodes, on two hosts of this machine (tools/two_nodes.sh): the Ray head and rank 0 on
host a (no CPUs for actors), a Ray worker with every engine and agent worker and rank 1 on host b.

Three faults, one after the other, in one run on one cluster: host b's network cut at the start of
iteration 2's rollout, where the test fault injection (STEPWISE_FAULT_PAUSE_ROLLOUT) holds rank 0;
every process on host b killed at the start of iteration 3's rollout; the cut inside iteration 4's
fetch of the workers' rows, where STEPWISE_FAULT_PAUSE_FETCH holds the replica leaders. Nothing can
take over b's actors (a offers Ray no CPU), so the outcome asserted is the failure path: every rank
still running ends within a bound, with an error that names what was lost; after the link is back
(or b's Ray worker restarted) the same command resumes from the last checkpoint and repeats the
uninterrupted run's metrics exactly, up to where the next fault holds it (each resume is the next
fault's run: one cluster and four launches for the three faults, not three clusters and six).
Each test is one fault and runs the faults before it if they have not run (`-k` picks one).
Needs root (as CI has); skips elsewhere, saying so.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import pytest
import two_hosts
from two_hosts import REFERENCE_RUN, ray_cluster, start_ray_worker, start_training, wait_for

from megatron_stepwise.fault_injection import FETCH_VARIABLE, ROLLOUT_VARIABLE

# The reference, one cluster, then per fault: the run held where it lands, the fault, the ranks'
# ends (up to the collectives' 1 minute), a restart of b's Ray worker, the resume.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ITERATIONS = 5  # REFERENCE_RUN's
# fault -> (what, when, the iteration it lands in): each after the last one's resume, the first after
# two checkpointed iterations, the last with an iteration left to resume into.
FAULTS = {
    "link-rollout": ("link", "rollout", 2),
    "kill-rollout": ("kill", "rollout", 3),
    "link-fetch": ("link", "fetch", 4),
}
# The pause that holds the run where a fault lands, and its markers (rank 0 on a, rank 1 on b).
PAUSES = {"rollout": (ROLLOUT_VARIABLE, ["rollout.0"]), "fetch": (FETCH_VARIABLE, ["fetching.0", "fetching.1"])}
# The reference's command, checkpointed every iteration, the same before and after each fault;
# collectives give up on a lost rank after 1 minute.
RUN = (*REFERENCE_RUN, "checkpoint.every=1", "parallel.timeout_minutes=1")
# Ray's failure detection, tightened from its defaults (a lost node declared dead after 5 health
# checks of up to 10 s; a lost GCS connection noticed by a 2-minute keepalive, then 60 s of
# reconnection) so that a fault costs the suite seconds, not minutes. The paths taken are the same.
FAST_FAILURE_DETECTION = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "3000",
    "RAY_health_check_failure_threshold": "5",
    "RAY_grpc_client_keepalive_time_ms": "5000",
    "RAY_grpc_client_keepalive_timeout_ms": "10000",
    "RAY_gcs_rpc_server_reconnect_timeout_s": "20",
}
# How long every rank may take to end after a fault: Ray's node-death detection, the collectives'
# 1-minute timeout and Ray's GCS reconnection limit, with room for a busy 2-core machine. (A shorter
# collectives' timeout would end rank 0 sooner after a cut, but it is also every healthy wait's bound.)
FAULT_BOUND_S = 420
COMPARED = ("reward/", "rollout/", "train/loss", "advantages/", "weight_version")


def _checkpointed(run_dir: Path) -> int:
    try:
        return int((run_dir / "checkpoints" / "latest").read_text().strip().rsplit("_", 1)[-1])
    except (OSError, ValueError):
        return 0


def _metrics(run_dir: Path) -> list[dict]:
    """The lines written so far (polled while the run writes: a line not yet ended is left out)."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted run, on one node (the two-node run repeats it exactly: test_two_nodes.py)."""
    return two_hosts.one_node_reference(tmp_path_factory)


def _log(run_dir: Path, host: str) -> str:
    path = run_dir.parent / f"torchrun_{host}.log"
    return path.read_text(errors="replace") if path.exists() else ""


class FaultChain:
    """FAULTS in order on one cluster and one run: `through(fault)` runs each fault not yet run up to
    this one and returns the surviving hosts' logs after it."""

    def __init__(self, tmp: Path, reference: list[dict], stack: ExitStack):
        self.tmp, self.reference, self.stack = tmp, reference, stack
        self.run_dir = tmp / "run"
        self.cluster: Optional[tuple] = None  # (hosts, head address, environment), started by the first fault
        self.procs: dict[str, subprocess.Popen] = {}  # the launch under way, held where the next fault lands
        self.ends: dict[str, dict[str, str]] = {}
        self.failed: Optional[str] = None  # a fault whose checks failed: the run cannot go on past it

    def through(self, fault: str) -> dict[str, str]:
        names = list(FAULTS)
        for name in names[: names.index(fault) + 1]:
            if name in self.ends:
                continue
            if self.failed:
                pytest.fail(f"the shared run stopped at the fault {self.failed} (its test failed), before {fault}")
            try:
                self.ends[name] = self._fault_then_resume(name)
            except BaseException:
                self.failed = name
                raise
        return self.ends[fault]

    def _launch(self, next_fault: Optional[str]) -> None:
        """The command on both hosts; held where `next_fault` lands, the iterations before it let through."""
        hosts, head, env = self.cluster
        if next_fault is not None:
            _, during, iteration = FAULTS[next_fault]
            pause = self.tmp / f"pause.{next_fault}"
            pause.mkdir()
            for before in range(iteration):
                (pause / f"go.{before}").touch()
            env = {**env, PAUSES[during][0]: str(pause)}
        self.procs = dict(zip("ab", start_training(hosts, head, env, self.run_dir, *RUN)))

    def _fault_then_resume(self, name: str) -> dict[str, str]:
        """Inject fault `name` where the run is held for it (the pause is the test fault injection,
        megatron_stepwise/fault_injection.py, released right after the fault, so the fault lands
        there whatever the machine's load). Then check the ends, recover, resume (held at the next
        fault), compare. Returns the last lines of each surviving host's torchrun log after the fault."""
        fault, during, iteration = FAULTS[name]
        run_dir = self.run_dir
        if self.cluster is None:
            self.cluster = self.stack.enter_context(ray_cluster(self.tmp / "hosts", FAST_FAILURE_DETECTION))
            self._launch(name)
        hosts, head, env = self.cluster
        procs, pause = self.procs, self.tmp / f"pause.{name}"
        # The iterations before the fault logged and checkpointed (a line is written before its
        # checkpoint), and the next paused where the fault must land.
        wait_for(
            lambda: len(_metrics(run_dir)) >= iteration and _checkpointed(run_dir) >= iteration,
            f"{iteration} iterations checkpointed before the fault",
            600,
            proc=procs["a"],
        )
        wait_for(
            lambda: all((pause / f"{marker}.{iteration}").exists() for marker in PAUSES[during][1]),
            f"iteration {iteration} paused in its {during}",
            600,
            proc=procs["a"],
        )
        saved = _checkpointed(run_dir)
        if fault == "link":
            hosts.set_link(False)
            survivors = "ab"
        else:
            assert any("ray" in cmd for cmd in hosts.kill_all("b")), "no Ray process on host b to kill"
            survivors = "a"
        faulted_at = time.monotonic()
        (pause / f"go.{iteration}").touch()
        took: dict[str, float] = {}  # host -> seconds from the fault to its training's end

        def every_survivor_ended() -> bool:
            for host in survivors:
                if host not in took and procs[host].poll() is not None:
                    took[host] = time.monotonic() - faulted_at
            return len(took) == len(survivors)

        wait_for(
            every_survivor_ended,
            f"every surviving rank to end after the fault ({fault} during the {during})",
            FAULT_BOUND_S,
        )
        done = len(_metrics(run_dir))
        assert 2 <= done < ITERATIONS, f"{done} iterations logged: the fault came too late"
        assert done == iteration, f"{done} iterations logged: the pause did not hold"
        assert _checkpointed(run_dir) >= saved, "a checkpoint written before the fault was lost"
        ends = {}
        for host in survivors:
            log = _log(run_dir, host)
            assert procs[host].returncode != 0, f"host {host} exited 0 after the fault:\n{log[-3000:]}"
            ends[host] = log
            (run_dir.parent / f"torchrun_{host}.{name}.log").write_text(log)  # the resume writes anew
        ended = ", ".join(f"{host} after {s:.0f} s" for host, s in took.items())
        print(f"fault {fault} during iteration {iteration}'s {during}: the ranks ended ({ended}), {done} logged")

        # Recovery of the cluster, then the same command resumes from the last checkpoint, held
        # where the next fault lands (or to the end).
        if fault == "link":
            hosts.set_link(True)
        for pid, cmd in hosts.processes("b").items():  # what is left of b's old Ray node
            if "ray" in cmd:
                subprocess.run(["kill", "-9", str(pid)], check=False, timeout=30)
        start_ray_worker(hosts, head, env, self.tmp / "hosts" / f"ray_b_after_{name}.log")
        following = list(FAULTS)[list(FAULTS).index(name) + 1 :]
        self._launch(following[0] if following else None)
        procs = self.procs
        if following:  # the iteration the fault interrupted, trained again
            wait_for(lambda: len(_metrics(run_dir)) > iteration, f"iteration {iteration} resumed", 900, proc=procs["a"])
        else:
            for host, proc in procs.items():
                wait_for(lambda p=proc: p.poll() is not None, f"the resumed training on host {host}", 900)
            for host, proc in procs.items():
                assert proc.returncode == 0, f"host {host}:\n{_log(run_dir, host)[-4000:]}"
        resumed_from = re.search(r"resumed from iteration (\d+)", _log(run_dir, "a"))
        assert resumed_from and int(resumed_from.group(1)) >= saved, _log(run_dir, "a")[-3000:]
        print(f"resumed from iteration {resumed_from.group(1)} (checkpoint before the fault: {saved})")

        resumed = _metrics(run_dir)
        logged = len(resumed) if following else ITERATIONS
        assert [r["iteration"] for r in resumed] == list(range(logged))  # no gap, no duplicate line
        for r, ref in zip(resumed, self.reference):
            keys = [k for k in ref if k.startswith(COMPARED)]
            assert keys and {k: r[k] for k in keys} == {k: ref[k] for k in keys}, r["iteration"]
        return ends


@pytest.fixture(scope="module")
def faults(tmp_path_factory, reference) -> FaultChain:
    with ExitStack() as stack:  # the cluster, and everything started on it, goes with the module
        yield FaultChain(tmp_path_factory.mktemp("faults"), reference, stack)


# Rank 0's error names what was lost: the actors that cannot come back, for want of a node to hold
# them (rollout/fleet/ray_room.py), or the agent worker that died again when restarted before Ray had
# declared b dead; not the collective that could not reach rank 1, nor "errors in a TaskGroup".
RANK0_ERROR = re.compile(
    r"rollout failed on rank 0 at iteration \d+: .*(NoRoomForActor: (agent worker|engine) \S+ needs .* "
    r"no live Ray node has them|their agent worker died \d+ times)"
)


def test_link_cut_mid_rollout_ends_every_rank_and_the_same_command_resumes(faults):
    ends = faults.through("link-rollout")
    assert RANK0_ERROR.search(ends["a"]), ends["a"][-4000:]
    # Rank 1, cut off from everything: Ray's own limit on a lost GCS, or the collective's timeout.
    assert re.search(r"Failed to connect to GCS within \d+ seconds|Timed out waiting \d+ms", ends["b"]), ends["b"][
        -4000:
    ]


def test_host_b_killed_mid_rollout_ends_rank_0_and_the_same_command_resumes(faults):
    ends = faults.through("kill-rollout")
    assert RANK0_ERROR.search(ends["a"]), ends["a"][-4000:]


FETCH_ITERATION = FAULTS["link-fetch"][2]
# What rank 0's fetch lost, named: the iteration, each agent worker and its node, and what became of
# it; not the collective's timeout that followed when it could not tell rank 1 (loop/handoff.py).
FETCH_ERROR = re.compile(
    rf"RuntimeError: rollout at iteration {FETCH_ITERATION}: fetching the rows failed on DP rank 0 \(global rank 0\): "
    rf"RowsLost: fetching the rows of round {FETCH_ITERATION}: agent worker \S+ on (?P<node>[\d.]+) "
    r"(could not be reached|died)"
)
# Rank 1, on b, cut off in its own fetch: Ray ends a process that lost its GCS, or the hand-off's
# agreement times out and says what was under way.
RANK1_FETCH_END = re.compile(
    rf"Failed to connect to GCS within \d+ seconds|rollout at iteration {FETCH_ITERATION}: "
    r"(agreeing on the fetched rows failed|fetching the rows failed on DP rank 1)"
)


def test_link_cut_mid_fetch_ends_every_rank_naming_the_lost_rows_and_the_same_command_resumes(faults):
    ends = faults.through("link-fetch")
    for host in "ab":
        errors = [
            line for line in ends[host].splitlines() if re.search(r"RuntimeError: |Failed to connect to GCS", line)
        ]
        print(f"host {host}'s errors after the cut:\n  " + "\n  ".join(errors[-3:]))
    named = FETCH_ERROR.search(ends["a"])
    assert named, ends["a"][-4000:]
    assert "(and telling the other ranks failed: " in ends["a"][named.end() :], ends["a"][-4000:]
    workers_at = re.search(r"placement: .*agent workers (\S+) x2", ends["a"])
    assert workers_at and named["node"] == workers_at.group(1), ends["a"][-4000:]  # b: where they ran
    assert RANK1_FETCH_END.search(ends["b"]), ends["b"][-4000:]
