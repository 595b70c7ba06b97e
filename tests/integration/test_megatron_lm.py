"""The plugin inside Megatron-LM's real training loop (`megatron.training.pretrain`, tag
core_v0.16.1) on torchrun/gloo: examples/megatron_lm_pretrain.py as a user runs it, compared with
`plugin.train_minibatch` on the same mini-batches from the same initial weights.

Needs Megatron-LM's training source on MEGATRON_LM_SRC (not a package on PyPI, never copied into
this project). `.ci/run` sets it from the project's third-party copy where that exists; elsewhere
these tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from helpers import REPO, run_torchrun

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not os.environ.get("MEGATRON_LM_SRC"),
        reason="MEGATRON_LM_SRC is not set: Megatron-LM's training source (tag core_v0.16.1) is needed; "
        ".ci/run sets it where the third-party copy exists",
    ),
]

ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "CUDA_VISIBLE_DEVICES": ""}
LAYOUTS = {
    "dp2": [],
    "dp2_per_token_loss": ["--calculate-per-token-loss"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "pp2_per_token_loss": ["--pipeline-model-parallel-size", "2", "--calculate-per-token-loss"],
    "cp2_per_token_loss": ["--context-parallel-size", "2", "--calculate-per-token-loss"],
    "tp2_sequence_parallel": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2_vpp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
}
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
# Where the worker's console output for one layout starts (tests/workers/megatron_lm_worker.py's
# LAYOUT_MARKER + the layout's name); searched anywhere in a line, as another rank's unfinished
# line can precede it.
LAYOUT_START = re.compile(re.escape("[megatron_lm_worker] layout ") + r"(\S+)")


def printed_metrics(stdout: str) -> dict[int, dict[str, float]]:
    """Megatron-LM's console lines: iteration -> {key: value} of its `key: value |` fields."""
    out = {}
    for line in stdout.splitlines():
        m = ITERATION.search(line)
        if m:
            fields = (f.split(": ", 1) for f in m.group(2).split(" | ") if ": " in f)
            out[int(m.group(1))] = {k.strip(): float(v) for k, v in fields if re.fullmatch(r"[-+0-9.eE]+", v.strip())}
    return out


def console_by_layout(stdout: str) -> dict[str, str]:
    """The worker's stdout cut at its layout markers: layout name -> what was printed for it."""
    parts = LAYOUT_START.split(stdout)  # [before, name1, text1, name2, text2, ...]
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.fixture(scope="module")
def all_layouts_run(tmp_path_factory):
    """Every layout in one torchrun launch (the worker tears Megatron-LM's global state down between
    them): (its output directory, its console per layout). The imports are paid once, not per layout."""
    out_dir = tmp_path_factory.mktemp("megatron_lm")
    proc = run_torchrun(
        str(REPO / "tests" / "workers" / "megatron_lm_worker.py"),
        2,
        [str(out_dir), json.dumps(LAYOUTS)],
        timeout=600,
        env=ENV,
    )
    return proc, out_dir, console_by_layout(proc.stdout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pretrain_matches_train_minibatch(all_layouts_run, layout):
    proc, out_dir, console = all_layouts_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = torch.load(out_dir / layout / "result.pt", weights_only=False)
    logged, reference = r["logged"], r["reference"]
    assert len(logged) == len(reference) == 3

    # Parameters after 3 optimizer steps: bit-identical; grad norms to float32 rounding.
    diff = max(float((r["pretrain_params"][k] - r["reference_params"][k]).abs().max()) for k in r["reference_params"])
    assert diff == 0.0
    for step, (got, want) in enumerate(zip(logged, reference)):
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-6 * want["grad_norm"], f"step {step}"

    # What train_step reduced (and sends to TensorBoard / W&B) is reduce_metrics, key by key.
    for step, (got, want) in enumerate(zip(logged, reference)):
        assert {"loss", "pg_loss", "entropy", "tokens/trained", "logprob_gap/train_vs_rollout"} <= set(got["loss_dict"])
        assert not any(k.endswith("_max") or k.startswith("_") for k in got["loss_dict"])
        for key, value in got["loss_dict"].items():
            assert abs(value - want[key]) <= 1e-6 * max(abs(want[key]), 1e-3), (
                f"step {step} {key}: {value} vs {want[key]}"
            )

    # The console: a value averaged over the iterations since the last print (Megatron-LM does not
    # reset after the first iteration) and printed only when positive.
    printed = printed_metrics(console[layout])
    assert sorted(printed) == [1, 2, 3]
    windows = {1: [0], 2: [0, 1], 3: [2]}
    for it, window in windows.items():
        for key in ("entropy", "loss", "tokens/trained"):
            expected = sum(reference[s][key] for s in window) / len(window)
            if expected > 0:
                assert abs(printed[it][key] - expected) <= 1e-6 * abs(expected), f"iteration {it} {key}"
            else:
                assert key not in printed[it]
    assert r["num_microbatches"] == 8  # --global-batch-size 16 over DP2, or 8 at DP1 x PP/CP/TP 2


def test_a_global_batch_too_small_for_the_mini_batch_is_an_error(tmp_path):
    """Megatron-LM runs global_batch / (micro_batch x DP) micro-batches per step; a mini-batch that
    needs more stops the run with both numbers named instead of straddling optimizer steps."""
    proc = run_torchrun(
        str(REPO / "examples" / "megatron_lm_pretrain.py"), 1, ["--global-batch-size", "4"], timeout=600, env=ENV
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "HostLoopMismatchError: this mini-batch needs 6 micro-batches of <= 256 tokens per DP rank" in out
    assert "the host loop runs num_microbatches=4" in out
    assert "iteration        1/" not in out  # no step was taken
