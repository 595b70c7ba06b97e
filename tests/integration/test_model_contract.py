"""The plugin's model contract: a bring-your-own megatron-core model is checked before its first
forward, and the error names the fix (mcore/train/model_contract.py, docs/megatron.md)."""

import json
import os
import sys

from helpers import run_launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_local_spec_model_gets_the_contract_error_before_its_first_forward():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = run_launch(
        [sys.executable, os.path.join(ROOT, "tests", "workers", "contract_worker.py")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["forwards_before_error"] == 0
    assert "decoder layer 0: core attention is megatron-core's local DotProductAttention" in result["error"]
    assert "megatron_stepwise.layer_spec(config, use_te=False)" in result["error"]
    # the fix it names works: the same model built with layer_spec scores the batch
    assert result["fixed_forwards"] >= 1 and result["fixed_logprobs"] == result["tokens"] == 10
