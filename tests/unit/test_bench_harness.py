"""The benchmarks' shared harness (tools/bench/harness.py): warm-up left out of the timings, A and B
interleaved round by round, median and spread, the timed CLI training run, the GPU skip."""

import subprocess
from pathlib import Path

import pytest
from helpers import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def harness():
    return load_script(REPO / "tools" / "bench" / "harness.py")


def test_side_by_side_interleaves_the_calls_and_leaves_the_warm_up_out(harness):
    order = []

    def call(name):
        def fn():
            order.append(name)
            return f"{name}{len(order)}"

        return fn

    timings = harness.side_by_side({"a": call("a"), "b": call("b")}, repeats=3, warmup=2)
    assert order == ["a", "b"] * 5  # one round runs each call once, in turn, so noise hits both
    assert [len(t.seconds) for t in timings.values()] == [3, 3]
    assert timings["a"].result == "a9" and timings["b"].result == "b10"  # the last call's return value


def test_sync_brackets_every_call_and_time_repeats_is_one_call_side_by_side(harness):
    events = []
    timing = harness.time_repeats(
        lambda: events.append("call"), repeats=2, warmup=1, sync=lambda: events.append("sync")
    )
    assert events == ["sync", "call", "sync"] * 3
    assert len(timing.seconds) == 2 and all(s >= 0 for s in timing.seconds)
    assert harness.median_time(lambda: None, 3, warmup=False) >= 0


def test_timing_reports_median_and_spread(harness, capsys):
    t = harness.Timing(seconds=[1.0, 3.0, 2.0])
    assert t.median == 2.0 and t.spread == pytest.approx(1.0)
    assert t.as_dict() == {"median_s": 2.0, "spread": 1.0, "seconds": [1.0, 3.0, 2.0]}
    harness.print_timings({"new": harness.Timing([1.0, 1.0]), "old": harness.Timing([4.0, 4.0])}, baseline="old")
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["new", "1.00"] and "median of 2, spread 0%" in out[0]
    assert out[2].startswith("ratio old / new") and out[2].endswith("4.0x")


def test_train_run_reads_the_metrics_and_names_a_failed_run(harness, tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, env, cwd, capture_output, text):
        seen.update(cmd=cmd, env=env)
        run_dir = Path(next(a for a in cmd if a.startswith("logging.run_dir=")).split("=", 1)[1])
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text('{"reward/mean": 0.5}\n\n{"reward/mean": 0.7}\n')
        return subprocess.CompletedProcess(cmd, 0, "", "")

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "old").write_text("a previous run")  # a fresh directory every time
    monkeypatch.setattr(harness.subprocess, "run", fake_run)
    rows, wall = harness.train_run("configs/tiny_cpu.yaml", run_dir, ["trainer.iterations=2"], "x", env={"A": "1"})
    assert rows == [{"reward/mean": 0.5}, {"reward/mean": 0.7}] and wall >= 0
    assert not (run_dir / "old").exists()
    assert seen["cmd"][4] == str(REPO / "configs/tiny_cpu.yaml") and "checkpoint.resume=never" in seen["cmd"]
    assert seen["env"]["A"] == "1" and seen["env"]["PYTHONPATH"] == str(REPO)

    monkeypatch.setattr(harness.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 2, "out", "err"))
    with pytest.raises(SystemExit, match="sync run failed with exit code 2"):
        harness.train_run("configs/tiny_cpu.yaml", run_dir, [], "sync run")


def test_cuda_skip_says_why_only_when_cuda_is_asked_for_and_absent(harness, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert harness.cuda_skip("bench_x", "cpu") is None
    skipped = harness.cuda_skip("bench_x", "cuda")
    assert skipped == {"skipped": "no CUDA GPU on this machine (torch.cuda.is_available() is False)"}
    assert capsys.readouterr().out == f"bench_x: skipped: {skipped['skipped']}\n"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert harness.cuda_skip("bench_x", "cuda") is None
