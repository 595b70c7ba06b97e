"""tools/bench/bench_bf16_gap.py --quick (tiny model): the decomposition runs end to end, the fp32
control is at the floor, the plain-torch reference computes what HF and the trainer compute, and
switching parts to bf16 moves the log-probs."""

import json
import os
import sys
from pathlib import Path

from helpers import run_launch

ROOT = Path(__file__).resolve().parents[2]


def test_bf16_gap_decomposition_on_the_tiny_model(tmp_path):
    out = tmp_path / "gap.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "STEPWISE_NO_LAUNCH": "1"}
    cmd = [sys.executable, str(ROOT / "tools" / "bench" / "bench_bf16_gap.py"), "--quick", "--out", str(out)]
    proc = run_launch(cmd, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {r["compared"]: r for r in result["table"]}
    assert result["trained_tokens"] > 100
    # The fp32 controls: trainer vs engine, and the reference vs the engine, agree to fp32 rounding.
    assert rows["trainer fp32 vs engine fp32 (bf16-valued weights)"]["max"] < 1e-5
    assert rows["our fp32 reference vs engine fp32"]["max"] < 1e-5
    # bf16 is measurably off the exact function, and the reference with every part in bf16 is the
    # HF model's bf16 forward (the decomposition explains the engine, not some other model).
    assert rows["engine bf16 vs exact (fp32 reference)"]["mean"] > 1e-5
    bf16_model = rows["all of it in bf16 except the log-softmax (a bf16 model)"]
    assert abs(bf16_model["mean"] - rows["engine bf16 vs exact (fp32 reference)"]["mean"]) < 0.2 * bf16_model["mean"]
    # Each factor moves the log-probs by itself; a bf16 log-softmax (its output's ulp is 1/32 at
    # |log p| in [4, 8)) moves them most.
    factors = [r for r in result["table"] if r["section"] == "factor alone vs exact"]
    assert len(factors) == 9 and all(r["max"] > 0 for r in factors)
    assert max(factors, key=lambda r: r["mean"])["compared"] == "log-softmax in bf16 (logits fp32)"
    assert "trainer bf16 vs engine bf16" in proc.stdout
