"""Ctrl-C: one line naming the checkpoint the run resumes from (or that there is none), exit 130,
no traceback wall (issue 42)."""

import logging
import signal

import pytest
from config_fakes import FakeProbes

from megatron_stepwise.cli import train
from megatron_stepwise.config import load_config
from megatron_stepwise.rundir import lifecycle
from megatron_stepwise.rundir.paths import LOG


def _cfg(run_dir, *overrides):
    return load_config(
        "configs/tiny_cpu.yaml", [f"logging.run_dir={run_dir}", *overrides], probes=FakeProbes(modules=())
    )


def _fake_checkpoint(ckpt_dir, iteration):
    path = ckpt_dir / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    for name in ("metadata.json", "trainer_state.json"):
        (path / name).write_text("{}")
    return path


class _InterruptedTrainer:
    def __init__(self, cfg):
        raise KeyboardInterrupt


@pytest.fixture
def interrupted(monkeypatch):
    import megatron_stepwise.loop.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "Trainer", _InterruptedTrainer)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    previous = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, previous)
    for name in ("megatron_stepwise", "py.warnings"):  # the run's train.log handler
        for h in [h for h in logging.getLogger(name).handlers if getattr(h, "baseFilename", "").endswith(LOG)]:
            logging.getLogger(name).removeHandler(h)
            h.close()
    logging.captureWarnings(False)


@pytest.mark.parametrize("saved", [None, 4], ids=["no_checkpoint", "checkpoint"])
def test_a_rank_interrupted_says_where_it_resumes_and_exits_130(tmp_path, capsys, interrupted, saved):
    cfg = _cfg(tmp_path / "run")
    expected = _fake_checkpoint(tmp_path / "run" / "checkpoints", saved) if saved is not None else None
    assert train._train(cfg) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("interrupted:") and "Traceback" not in err[0]
    if expected is None:
        assert "no checkpoint" in err[0] and "iteration 0" in err[0]
    else:
        assert str(expected) in err[0]


def test_the_self_launcher_returns_130_without_a_traceback(monkeypatch, capsys):
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def run(args):
        raise SignalException("Process got signal: 2", signal.SIGINT)

    monkeypatch.setattr(torch_run, "run", run)
    assert lifecycle.run_torchrun(["--standalone", "--nproc-per-node=1", "-m", "x"]) == 130
    assert capsys.readouterr().err == ""


def test_any_command_interrupted_exits_130(monkeypatch, capsys):
    from megatron_stepwise.cli.main import main as cli_main

    def interrupted_validate(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("megatron_stepwise.cli.config._validate", interrupted_validate)
    assert cli_main(["validate", "configs/tiny_cpu.yaml"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted:") and err.count("\n") == 1
