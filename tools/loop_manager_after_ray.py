"""Issue 41's hang, repeated: the Manager tests run after a Ray-starting module in one pytest process, N times.

The suite once hung in tests/integration/test_driver_handoff.py::test_each_rank_receives_only_its_data_parallel_shard:
its `mp.Manager()` server had been forked from the pytest process that already ran Ray's threads and
waited on a futex forever (fork after threads). The Managers are now spawned (tests/unit/test_no_fork_after_threads.py
refuses the default context). Each round here is one pytest process that first starts Ray and runs an actor
(so Ray's threads run in that process, as the `ray_session` fixture leaves them), then runs the two Manager
tests that hung or could. A round that outlives --round-timeout counts as a hang (its process tree is killed).

    PYTHONPATH=. python tools/loop_manager_after_ray.py --rounds 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MANAGER_TESTS = [
    "tests/integration/test_driver_handoff.py::test_each_rank_receives_only_its_data_parallel_shard",
    "tests/integration/test_worker_rows.py::test_a_replica_leader_resolves_for_its_replica_and_a_failure_reaches_every_rank",
]
RAY_FIRST = """
import ray

from megatron_stepwise.rollout.fleet.ray_start import ensure_ray


@ray.remote
class Echo:
    def ping(self, x):
        return x


def test_ray_runs_in_this_process():
    ensure_ray(num_cpus=2)  # as the fleets start it; it stays up for the rest of the session, as ray_session leaves it
    assert ray.get(Echo.remote().ping.remote(7)) == 7
"""


def run_round(ray_module: Path, timeout: float) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        "--rootdir",
        str(REPO),
        "-c",
        str(REPO / "pyproject.toml"),
        str(ray_module),
        *MANAGER_TESTS,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        hung = True
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    return {
        "seconds": round(time.monotonic() - start, 1),
        "hung": hung,
        "exit": proc.returncode,
        "summary": tail,
        "output": out if (hung or proc.returncode) else "",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--round-timeout", type=float, default=600, help="seconds before a round counts as hung")
    ap.add_argument("--json", type=Path, help="write the rounds here")
    args = ap.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        ray_module = Path(tmp) / "test_ray_first.py"
        ray_module.write_text(RAY_FIRST)
        for i in range(args.rounds):
            r = run_round(ray_module, args.round_timeout)
            rounds.append(r)
            print(
                f"round {i + 1}/{args.rounds}: {r['seconds']} s, exit {r['exit']}, hung {r['hung']}: {r['summary']}",
                flush=True,
            )
            if r["output"]:
                print(r["output"][-6000:], flush=True)
    ok = sum(1 for r in rounds if r["exit"] == 0 and not r["hung"])
    hung = sum(r["hung"] for r in rounds)
    print(
        f"{ok}/{len(rounds)} rounds passed, {hung} hung; "
        f"seconds per round min {min(r['seconds'] for r in rounds)} max {max(r['seconds'] for r in rounds)}"
    )
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "passed": ok, "hung": hung}, indent=1))
    return 0 if ok == len(rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
