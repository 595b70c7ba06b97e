"""The benchmark suite keeps running and reports what it promises (keys, invariants of the
accounting, missing benchmarks); it never checks speed."""

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import load_script, run_launch

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "bench"


def _load(name: str):
    return load_script(TOOLS / f"{name}.py")


@pytest.fixture()
def suite(tools_on_path):
    return _load("suite")


@pytest.fixture()
def tools_on_path(monkeypatch):
    """The benchmarks import their siblings (flops, harness, ...); sys.path, including what a
    loaded tool adds to it, is restored after the test."""
    monkeypatch.syspath_prepend(str(TOOLS))


def test_quick_suite_subset_writes_json_and_markdown(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(TOOLS / "suite.py"), "--quick", "--only", "merge", "--out", str(out)]
    proc = run_launch(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["suite"] == "cpu" and report["quick"] is True
    assert {"label", "cpu_count", "torch", "megatron_core"} <= set(report["machine"])
    assert set(report["benchmarks"]) == {"merge"}
    assert all(b["status"] == "ok" for b in report["benchmarks"].values())

    merge = report["benchmarks"]["merge"]["result"]
    rows = merge["by_turns"]
    assert [r["turns"] for r in rows] == list(range(1, 17))
    # One turn has nothing to merge; with more, merging never adds tokens and never goes below
    # the trajectory's own stream; the trained tokens are the same in both layouts.
    assert rows[0]["unmerged_tokens_per_traj"] == rows[0]["merged_tokens_per_traj"]
    for r in rows:
        assert r["unique_tokens_per_traj"] <= r["merged_tokens_per_traj"] <= r["unmerged_tokens_per_traj"]
        assert r["trained_tokens_equal"] and r["broken_prefixes"] == 0
    assert set(merge["growth_exponent"]) == {"unmerged", "merged", "unique"}

    # Every figure of the benchmark that ran is in the summary, with a value and its target.
    figures = report["figures"]
    assert {f["benchmark"] for f in figures} == {"merge"}
    targeted = [f for f in figures if f["target"] != "-"]
    assert targeted and all(f["value"] is not None and f["met"] in (True, False) for f in targeted)
    md = out.with_suffix(".md").read_text()
    assert "| Benchmark | Figure | Measured | Target | Met |" in md
    assert md.count("\n| merge |") == sum(f["benchmark"] == "merge" for f in figures)


def test_host_pipeline_reports_every_phase_and_the_reference(tools_on_path, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        host = _load("bench_host").run(quick=True, prompts=8, prompts_per_minibatch=4, repeats=1)
    finally:
        torch.set_num_threads(threads)  # the benchmark pins one thread
    phases = {"validate", "minibatch", "prepare", "plan", "total"}
    assert set(host["time_s"]["warm_wall"]) == phases
    assert host["workload"]["merged_rows"] == 8 * 8  # prefix-consistent: one row per trajectory
    ref = host["reference_gpu"]
    assert ref["tokens"] == host["workload"]["tokens_after_merge"] < host["workload"]["tokens"]
    assert ref["seconds"] > 0 and host["fraction_of_gpu_time"] == pytest.approx(host["seconds"] / ref["seconds"])
    assert "assumption:" in capsys.readouterr().out


def test_context_benchmark_compares_the_modes_with_the_bpe_at_small_size(tools_on_path, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        result = _load("bench_context").run(quick=True, prompts=1, samples=2, new_tokens=4)
    finally:
        torch.set_num_threads(threads)  # the benchmark pins one thread
    rows = {(r["mode"], r["turns"]): r for r in result["rows"]}
    assert set(rows) == {(m, t) for m in ("tokens", "retokenize") for t in (4, 8, 16)}
    for (mode, turns), r in rows.items():
        assert r["trajectories"] == 2 and r["steps_per_traj"] == turns  # echo runs exactly T turns
        assert r["unique_tokens_per_traj"] <= r["merged_tokens_per_traj"] <= r["unmerged_tokens_per_traj"]
        if mode == "tokens":  # one row per trajectory, nothing re-read, whatever the drift
            assert r["merged_over_unique"] == 1.0 and r["rows_per_traj_merged"] == 1 and r["broken_prefixes"] == 0
        else:  # every broken prefix is a drifted turn boundary, and it costs tokens
            assert r["broken_prefixes"] == round(r["drift_rate"] * 2 * (turns - 1))
            assert (r["merged_over_unique"] > 1.0) == (r["broken_prefixes"] > 0)
    report = _load("bench_report")
    figures = report.evaluate({"context": {"status": "ok", "result": result}})
    context = [f for f in figures if f["benchmark"] == "context"]
    assert len(context) == 10 and all(f["value"] is not None for f in context)
    assert "tokens mode: merged / unique tokens" in report.summary_table(context)
    assert "retokenize" in capsys.readouterr().out


def test_update_reruns_the_selected_benchmarks_and_keeps_the_others(suite, tmp_path, monkeypatch):
    import argparse

    out = tmp_path / "bench.json"
    first = {
        "suite": "cpu",
        "quick": False,
        "started_utc": "2026-01-02T03:04:05+00:00",
        "total_seconds": 100.0,
        "machine": {"label": "VM", "megatron_core": "0.16.1", "python": "3.11"},
        "benchmarks": {
            "merge": {"status": "ok", "result": {"merged_over_unique_max": 1.0}},
            "context": {"status": "ok", "result": {"figures": {"retokenize_drift_rate": 0.5}}},
        },
    }
    out.write_text(json.dumps(first))
    fresh = {"status": "ok", "result": {"figures": {"retokenize_drift_rate": 0.25}}}
    monkeypatch.setattr(suite, "run_benchmark", lambda bench, **kw: fresh)
    args = argparse.Namespace(
        suite="cpu", only="context", quick=True, timeout=None, machine="other", out=str(out), update=True
    )
    report = suite.run_suite(args)
    assert report["benchmarks"] == {"merge": first["benchmarks"]["merge"], "context": fresh}
    assert report["started_utc"] == first["started_utc"] and report["quick"] is False
    assert [u["benchmarks"] for u in report["updates"]] == [["context"]] and report["updates"][0]["quick"] is True
    drift = next(f for f in report["figures"] if "drift rate" in f["figure"])
    assert drift["value"] == 0.25
    md = out.with_suffix(".md").read_text()
    assert "(cpu suite, full)" in md and "Re-run later with `--only context --quick --update` on other" in md
    assert md.count("\n| merge |") >= 1
    with pytest.raises(SystemExit, match="--update: no report"):
        suite.run_suite(argparse.Namespace(**{**vars(args), "out": str(tmp_path / "none.json")}))


def test_quick_mode_leaves_out_ray_benchmarks_unless_named(suite):
    import argparse

    rollout = suite.BENCHMARKS["rollout"]
    assert suite.quick_skip(rollout, argparse.Namespace(quick=True, only=None))
    assert suite.quick_skip(rollout, argparse.Namespace(quick=True, only="merge,rollout")) is None
    assert suite.quick_skip(rollout, argparse.Namespace(quick=False, only=None)) is None
    assert suite.quick_skip(suite.BENCHMARKS["merge"], argparse.Namespace(quick=True, only=None)) is None


def test_missing_script_and_skipped_benchmarks_are_reported(suite, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(suite, "TOOLS", tmp_path)
    missing = suite.run_benchmark(suite.Benchmark("x", "bench_not_here", "3", "t"), quick=True, timeout_s=30)
    assert missing["status"] == "missing" and "bench_not_here.py" in missing["message"]
    assert "MISSING" in capsys.readouterr().out

    # A script without run(): its printed output is the result.
    (tmp_path / "bench_script.py").write_text("import sys\nprint('table', sys.argv[1:])\n")
    entry = suite.run_benchmark(suite.Benchmark("s", "bench_script", "7", "t"), quick=True, timeout_s=30)
    assert entry["status"] == "ok" and entry["result"]["stdout"].strip() == "table ['--quick']"

    # A module whose run() reports a skip, and one that fails.
    (tmp_path / "bench_skip.py").write_text("def run(quick=False):\n    return {'skipped': 'no widget'}\n")
    entry = suite.run_benchmark(suite.Benchmark("k", "bench_skip", "9", "t"), quick=False, timeout_s=30)
    assert entry["status"] == "skipped" and entry["message"] == "no widget"
    (tmp_path / "bench_fail.py").write_text("def run(quick=False):\n    raise RuntimeError('boom')\n")
    entry = suite.run_benchmark(suite.Benchmark("f", "bench_fail", "9", "t"), quick=False, timeout_s=30)
    assert entry["status"] == "failed" and "boom" in entry["message"]


def test_unknown_benchmark_name_is_rejected(suite):
    with pytest.raises(SystemExit, match="unknown benchmark.*nope.*choose from"):
        suite.select("cpu", "merge,nope")


def test_unmeasured_figures_have_no_verdict(tools_on_path):
    report = _load("bench_report")
    rows = report.evaluate(
        {"logprobs": {"status": "missing"}, "merge": {"status": "ok", "result": {"merged_over_unique_max": 1.2}}}
    )
    by_label = {r["figure"]: r for r in rows}
    lp = next(r for r in rows if r["benchmark"] == "logprobs")
    assert lp["value"] is None and lp["met"] is None and lp["display"] == "not measured"
    worst = by_label["merged tokens / unique tokens, prefix-consistent (worst over T=1..16)"]
    assert worst["value"] == 1.2 and worst["met"] is False  # target <= 1.05


def test_flops_model_by_hand(tools_on_path):
    flops = _load("flops")
    shape = flops.ModelShape(hidden=8, ffn=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=10, tied=False)
    # per layer: QKV 8*(8+2*4)=128, out 8*8=64, MLP 3*8*16=384 -> 576; 2 layers
    assert shape.layer_matmul_params == 1152
    f = flops.training_flops(shape, [3, 5], trained_tokens=4)
    assert f["dense"] == 6 * 1152 * 8
    assert f["output"] == 6 * 10 * 8 * 4
    assert f["attention"] == 6 * 2 * 8 * (9 + 25)  # causal, per row: 6 * layers * heads*head_dim * L^2
    # Published parameter counts of the Qwen2.5 shapes (0.49B, 1.54B, 7.61B) within 1%.
    for name, published in [("qwen2.5-0.5b", 0.49e9), ("qwen2.5-1.5b", 1.54e9), ("qwen2.5-7b", 7.61e9)]:
        total = flops.ModelShape.from_hf(flops.QWEN2_CONFIGS[name]).total_params
        assert abs(total / published - 1) < 0.01, (name, total)


def test_cli_bench_subcommand_takes_the_suite_options(capsys):
    from megatron_stepwise.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(opt in out for opt in ("--suite", "--quick", "--only", "--out", "--machine"))


def test_gpu_benchmark_skips_without_cuda_and_runs_its_code_on_cpu(tmp_path):
    """bench_gpu.py says why it skips on a machine without CUDA; `--device cpu --model tiny` runs
    the same code path (bf16 model, packed micro-batches, timing, FLOPs accounting) on the CPU."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = str(TOOLS / "bench_gpu.py")
    proc = run_launch([sys.executable, script, "--quick"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "skipped: no CUDA GPU" in proc.stdout, proc.stdout + proc.stderr[-2000:]

    out = tmp_path / "gpu.json"
    cmd = [
        sys.executable,
        script,
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--quick",
        "--prompts",
        "2",
        "--samples",
        "4",
        "--micro-tokens",
        "4096",
        "--out",
        str(out),
    ]
    proc = run_launch(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["device"].startswith("CPU") and r["transformer_engine"] is False
    assert 0 < r["trained_tokens"] < r["tokens"]
    assert r["num_microbatches"] >= -(-r["tokens"] // 4096)  # packed into <= 4096-token micro-batches
    flops = r["flops"]
    assert flops["total"] == pytest.approx(flops["dense"] + flops["attention"] + flops["output"])
    assert len(r["all_step_s"]) == 2 and r["step_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_s"])
    assert r["mfu"] == pytest.approx(flops["total"] / r["step_s"] / 1e12 / r["peak_tflops"])
    assert r["peak_tflops"] == max(r["matmul_peak_tflops"].values()) > 0
    assert r["loss"] == r["loss"]  # finite loss from the bf16 step (NaN != NaN)


@pytest.mark.usefixtures("ray_session")
def test_scale_benchmark_runs_the_real_host_path_at_small_size(tools_on_path, capsys):
    """tools/bench/bench_scale.py with 16 prompts x 4 samples x 2 turns: every phase reports, the agent
    workers roll out every turn, and the shards a rank receives shrink as 1/DP."""
    bench = _load("bench_scale")
    r = bench.run(quick=True, prompts=16, samples=4, turns=2, prompts_per_minibatch=4, concurrency=32)
    assert r["turns"] == 16 * 4 * 2  # echo ends after its 2 turns; every trajectory is there
    for key in ("in_process", "workers1", "workers2"):
        assert r[key]["turns_per_s"] > 0 and r[key]["wall_s"] > 0
    after = r["handoff_after"]
    whole = sum(after["dp1"]["bytes_per_rank"])
    for dp, most in ((2, 0.65), (4, 0.4)):  # ~1/DP, plus each shard's fixed framing at this tiny size
        assert len(after[f"dp{dp}"]["bytes_per_rank"]) == dp
        assert max(after[f"dp{dp}"]["bytes_per_rank"]) < most * whole
    assert r["handoff_before"]["bytes_per_rank"] > 0 and r["host_seconds_after"] > 0
    # rows left in the workers: rank 0 sends manifests, each rank fetches ~1/DP of the rows
    held = r["held"]
    fetched = sum(held["dp1"]["bytes_fetched_per_rank"])
    assert fetched > 0 and r["host_seconds_held"] > 0
    for dp, most in ((2, 0.65), (4, 0.4)):
        assert len(held[f"dp{dp}"]["bytes_fetched_per_rank"]) == dp
        assert max(held[f"dp{dp}"]["bytes_fetched_per_rank"]) < most * fetched
    assert max(held["dp1"]["manifest_bytes"]) < 0.2 * fetched  # no token data through rank 0
    # async training: rank 0 receives summaries instead of rows and sends manifests instead of shards
    a = r["async_bytes"]
    assert a["steps"] == 4 and 0 < a["workers_in"] < 0.5 * a["driver_in"]
    assert a["dp1"] == {"driver_out": 0, "workers_out": 0}  # DP1: rank 0 trains it all, sends nothing
    for dp in (2, 4):
        assert 0 < a[f"dp{dp}"]["workers_out"] < 0.5 * a[f"dp{dp}"]["driver_out"]
    out = capsys.readouterr().out
    assert "2 workers vs 1" in out and "async training, bytes through rank 0 per iteration" in out


def test_prefix_cache_benchmark_on_the_tiny_preset(tools_on_path, capsys):
    """tools/bench/bench_prefix_cache.py --model tiny --quick: every configuration generates the same
    tokens; the cache serves the earlier turns, and sessions keep each trajectory on one engine."""
    import torch

    threads = torch.get_num_threads()
    try:
        r = _load("bench_prefix_cache").run(quick=True, model="tiny")
    finally:
        torch.set_num_threads(threads)  # the benchmark pins one thread
    rows = r["results"]
    assert len(rows) == 5 and all(row["same_tokens_as_cache_off"] == 1.0 for row in rows.values())
    assert len({row["generated_tokens"] for row in rows.values()}) == 1
    assert rows["1 engine, cache off"]["hit_rate"] == 0 < rows["1 engine, cache on"]["hit_rate"]
    assert rows["2 engines, sessions (affinity)"]["moved_turns"] == 0
    assert r["hit_rate_sessions"] == rows["1 engine, cache on"]["hit_rate"] >= r["hit_rate_round_robin"]
    assert "cache on / off" in capsys.readouterr().out


def test_continuous_batching_benchmark_on_the_tiny_preset(tools_on_path, capsys):
    """tools/bench/bench_continuous_batching.py --quick: both configurations generate the same tokens,
    and only continuous batching lets arrivals join a running batch."""
    import torch

    threads = torch.get_num_threads()
    try:
        r = _load("bench_continuous_batching").run(quick=True, gap_s=0.0)  # later turns join the slow one
    finally:
        torch.set_num_threads(threads)  # the benchmark pins one thread
    rows = r["results"]
    assert all(row["same_tokens_as_static"] == 1.0 for row in rows.values())
    assert rows["static batches"]["generated_tokens"] == rows["continuous batching"]["generated_tokens"]
    assert rows["static batches"]["joined_running_batch"] == 0 < rows["continuous batching"]["joined_running_batch"]
    assert r["latency_mean_ratio"] > 0 and "continuous / static" in capsys.readouterr().out


def test_teacher_scoring_benchmark_on_the_tiny_preset(tools_on_path, capsys):
    """tools/bench/bench_teacher_scoring.py --model tiny --quick: batched scoring runs fewer forwards
    than requests and gives the log-probs of one request at a time."""
    import torch

    threads = torch.get_num_threads()
    try:
        r = _load("bench_teacher_scoring").run(model="tiny", quick=True)
    finally:
        torch.set_num_threads(threads)
    assert r["results"]["sequential"]["forwards"] == r["rows"] > r["results"]["batched"]["forwards"]
    assert r["max_logprob_gap"] < 1e-5
    assert "batched / sequential" in capsys.readouterr().out
