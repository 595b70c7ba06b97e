"""Checkpoints are data through the real commands: a tiny CPU run's checkpoints, their `.metadata`
replaced by a pickle whose `__reduce__` writes a marker file and their manifests rewritten to
match (the attack the manifest cannot see), then `train` (resume), `eval --checkpoint` and
`replay`: each stops with one line naming the file and the class (exit 2), and the marker never
appears. Slow: one 3-iteration training run, then three short commands.
"""

from __future__ import annotations

import builtins
import os
import pickle
import sys

import pytest
from helpers import run_launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs/tiny_cpu.yaml")


def _cli(*args, timeout=600):
    return run_launch(
        [sys.executable, "-m", "megatron_stepwise.cli", *args],
        env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Poison:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def poisoned_run(tmp_path_factory):
    """(run_dir, overrides, marker): iterations 2 and 3 of a 3-iteration run carry the poison."""
    from megatron_stepwise.mcore.weights.dist_checkpoint import checkpoint_name, write_manifest

    base = tmp_path_factory.mktemp("poisoned_run")
    run_dir, marker = str(base / "run"), str(base / "MARKER")
    overrides = [
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        "trainer.iterations=3",
        "trainer.eval_every=0",
        "checkpoint.every=1",
        "checkpoint.keep_last=4",
        "trainer.dump_rollouts=2",
    ]
    out = _cli("train", CONFIG, *overrides, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for it in (2, 3):
        ckpt = os.path.join(run_dir, "checkpoints", checkpoint_name(it))
        with open(os.path.join(ckpt, ".metadata"), "wb") as f:
            pickle.dump(Poison(marker), f)
        write_manifest(ckpt)
    return run_dir, overrides, marker


def _assert_refused(out, run_dir: str, marker: str, it: int) -> None:
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    bad = os.path.join(run_dir, "checkpoints", f"iter_{it:07d}", ".metadata")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error")]
    assert errors and bad in errors[0] and "builtins.exec" in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not os.path.exists(marker)


def test_train_resume_refuses_a_poisoned_checkpoint(poisoned_run):
    run_dir, overrides, marker = poisoned_run
    out = _cli("train", CONFIG, *overrides, "trainer.iterations=4")
    _assert_refused(out, run_dir, marker, 3)


def test_eval_refuses_a_poisoned_checkpoint(poisoned_run):
    run_dir, overrides, marker = poisoned_run
    out = _cli("eval", CONFIG, *overrides, "--checkpoint", os.path.join(run_dir, "checkpoints", "iter_0000003"))
    _assert_refused(out, run_dir, marker, 3)


def test_replay_refuses_a_poisoned_checkpoint(poisoned_run):
    run_dir, _, marker = poisoned_run
    out = _cli("replay", run_dir, "launch.nproc_per_node=1", "--iteration", "2")
    _assert_refused(out, run_dir, marker, 2)
