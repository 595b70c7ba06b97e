"""tools/bench/bench_startup.py and its process sampler (tools/bench/process_cpu.py): roles, the
metrics comparison, and CPU counted for a whole process tree."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_script(REPO / "tools" / "bench" / "bench_startup.py")


@pytest.fixture(scope="module")
def process_cpu():
    return load_script(REPO / "tools" / "bench" / "process_cpu.py")


def test_each_process_of_a_launch_gets_its_role(process_cpu):
    role = process_cpu.role
    assert role("python -u -m megatron_stepwise.cli train c.yaml", {"RANK": "1"}) == "rank 1"
    assert role("python -m megatron_stepwise.cli train c.yaml", {}) == "other"  # the launcher is named by pid
    assert role("ray::EngineActor.generate") == "engine"
    assert role("ray::AgentWorker") == "agent worker"
    assert role(".../ray/core/src/ray/gcs/gcs_server --log_dir=x") == "Ray GCS"
    assert role(".../ray/core/src/ray/raylet/raylet --x") == "raylet"
    assert role("python .../ray/dashboard/dashboard.py --host=127.0.0.1") == "Ray dashboard (head)"
    assert role("ray::DashboardAgent") == "Ray dashboard agent"
    assert role("python -u .../ray/_private/log_monitor.py") == "Ray log monitor"
    assert role("python .../ray/_private/workers/default_worker.py --x") == "Ray worker (idle)"
    assert role("ray::Something") == "Ray actor Something"


def test_the_metrics_comparison_skips_timings_and_names_every_other_difference(bench):
    a = [{"iteration": 0, "reward/mean": 0.5, "time/train": 1.0, "budget/wall": 2.0, "fleet/cached_tokens": 10}]
    b = [{"iteration": 0, "reward/mean": 0.5, "time/train": 9.0, "budget/wall": 7.0, "fleet/cached_tokens": 12}]
    assert bench.metric_differences(a, b) == []
    b[0]["reward/mean"], b[0]["train/loss"] = 0.25, 1.0
    assert bench.metric_differences(a, b) == ["line 0: reward/mean: 0.5 vs 0.25", "line 0: train/loss: None vs 1.0"]
    assert bench.metric_differences(a, a + a) == ["1 vs 2 metrics lines"]
    gap_a, gap_b = [{"train/logprob_gap": 1e-7}], [{"train/logprob_gap": 3e-7}]
    assert bench.metric_differences(gap_a, gap_b) == []  # engine batching moves the last bits
    assert bench.metric_differences(gap_a, [{"train/logprob_gap": 1e-3}]) != []


@pytest.mark.timeout(120)
@pytest.mark.launches  # samples a real process tree
def test_the_sampler_counts_the_cpu_of_every_process_of_the_tree(process_cpu, tmp_path):
    # Each process burns 0.3 CPU-s, then waits for its go file, which the test writes once the
    # sampler has seen that CPU: no process can exit before it was sampled, however busy the machine.
    burn = "import os, sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    wait = "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
    (tmp_path / "child.py").write_text(burn + wait)
    run_child = f"import subprocess\nsubprocess.run([sys.executable, {str(tmp_path / 'child.py')!r}, sys.argv[2]])\n"
    (tmp_path / "parent.py").write_text(burn + wait + run_child)
    parent_go, child_go = tmp_path / "parent.go", tmp_path / "child.go"
    proc = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(parent_go), str(child_go)])
    sampler = process_cpu.ProcessTreeSampler(proc.pid, root_role="parent")
    deadline = time.monotonic() + 60
    for role, go in (("parent", parent_go), ("other", child_go)):
        while sampler.by_role().get(role, {}).get("cpu", 0.0) < 0.3 and time.monotonic() < deadline:
            sampler.poll()
            time.sleep(0.05)
        go.touch()
    assert proc.wait(timeout=60) == 0
    roles = sampler.by_role()
    assert roles["parent"]["cpu"] >= 0.3 and roles["parent"]["count"] == 1
    assert roles["other"]["cpu"] >= 0.3 and roles["other"]["count"] == 1  # the child, seen before it exited
    assert sampler.total() == pytest.approx(roles["parent"]["cpu"] + roles["other"]["cpu"])
