"""tools/gpu_check.sh's Python steps run (DRY=1: on the CPU at tiny shapes), so a GPU session
spends its minutes measuring, not finding a broken command line. Speed is never checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = (
    "versions",
    "attention",
    "bench_gpu-0.5b",
    "bench_gpu-1.5b",
    "packed-vs-padded",
    "engine-agreement",
    "logprobs-head",
    "weight-push",
    "bf16-gap",
)


@pytest.mark.slow
@pytest.mark.timeout(3300)  # seven CPU runs of the benchmarks, torch.compile included, on a busy 2-core machine
def test_gpu_check_dry_run_runs_every_python_step(tmp_path):
    env = {
        **os.environ,
        "DRY": "1",
        "OUT": str(tmp_path),
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PYTHON": sys.executable,
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=3200
    )
    log = (tmp_path / "log").read_text()
    assert proc.returncode == 0, log[-3000:]
    codes = dict(re.findall(r"^=== (\S+): rc=(\d+) in", log, flags=re.M))
    assert codes == {name: "0" for name in STEPS}, log[-4000:]

    attention = json.loads((tmp_path / "attention.json").read_text())
    assert set(attention["mixed"]) == {"one_call", "per_row", "sdpa_mask"}
    assert [r["rows"] for r in attention["scaling"]] and attention["mixed"]["one_call"]["max_abs_diff_out"] < 1e-5
    gpu = json.loads((tmp_path / "bench_gpu_0.5b.json").read_text())
    assert list(gpu["variants"]) == ["per_row", "one_call", "fused"]
    assert gpu["variants"]["fused"]["build"] == {"packed_attention": "one_call", "fused_elementwise": True}
    assert all(v["tokens_per_s"] > 0 for v in gpu["variants"].values())
    step = json.loads((tmp_path / "trainer_step.json").read_text())
    assert {"packed", "padded", "packed_one_call", "packed_per_row", "packed_fused"} == set(step["layouts"])
    assert step["one_call_over_per_row_tokens_per_s"] > 0 and step["fused_over_unfused_tokens_per_s"] > 0
    for name in ("bench_gpu_1.5b", "engine_agreement", "logprobs", "weight_sync", "bf16_gap"):
        assert (tmp_path / f"{name}.json").exists(), name
