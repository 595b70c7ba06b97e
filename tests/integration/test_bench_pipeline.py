"""tools/bench/bench_pipeline.py keeps running (tiny workload); its figures are checked for consistency,
never for speed."""

import json
import os
import sys
from pathlib import Path

from helpers import run_launch

ROOT = Path(__file__).resolve().parents[2]


def test_bench_pipeline_tiny_run(tmp_path):
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "bench" / "bench_pipeline.py"),
        "--prompts",
        "4",
        "--samples",
        "2",
        "--prompts-per-minibatch",
        "2",
        "--dp",
        "2",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    proc = run_launch(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert set(res["time_s"]["cold"]) == {"validate", "minibatch", "prepare", "plan", "total"}
    merge = res["merge"]
    assert merge["rows_before"] == res["workload"]["steps"] and merge["tokens_before"] == res["workload"]["tokens"]
    layouts = res["layouts"]
    # Each layout's real tokens are what its rows hold; the merged layout holds tokens_after.
    assert layouts["ours_merged"]["real_tokens"] == merge["tokens_after"]
    assert layouts["stepwise_unmerged"]["real_tokens"] == merge["tokens_before"]
    assert layouts["obs_in_response"]["real_tokens"] >= merge["tokens_before"]
    for r in layouts.values():
        assert r["packed_tokens"] >= r["real_tokens"] and 0 < r["packed_efficiency"] <= 1
    assert "ours" in res["dp_balance"]["ours_merged dp=2"]
