"""Bad input ends a command with one line naming what was wrong and exit 2, never a traceback:
every "fix your input" error derives from `UserError` (errors.py), which cli/main.py turns into
that line in one place. Other errors keep their traceback."""

import argparse
import importlib

import pytest

from megatron_stepwise.config.errors import ConfigError, ConfigProblem
from megatron_stepwise.data.files import DatasetError
from megatron_stepwise.errors import UserError
from megatron_stepwise.rundir import lifecycle
from megatron_stepwise.rundir.dump_table import DumpError
from megatron_stepwise.rundir.run_files import UnsafePathError
from megatron_stepwise.steps import StepwiseBatchError

cli = importlib.import_module("megatron_stepwise.cli.main")  # the module (the package's `main` is its function)


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_user_errors_keep_their_old_bases():
    # `except ValueError` / `except OSError` around them still works
    assert issubclass(ConfigError, ValueError) and issubclass(DatasetError, ValueError)
    assert issubclass(StepwiseBatchError, ValueError) and issubclass(DumpError, ValueError)
    assert issubclass(UnsafePathError, OSError)
    for cls in (ConfigError, DatasetError, StepwiseBatchError, DumpError, UnsafePathError):
        assert issubclass(cls, UserError), cls


def test_view_of_a_run_without_dumps_is_one_line(tmp_path, capsys):
    code = cli.main(["view", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    (line,) = _error_lines(err)
    assert line.startswith("error: ") and str(tmp_path) in line and "dump" in line


def test_replay_of_a_missing_dump_is_one_line(tmp_path, capsys):
    code = cli.main(["replay", str(tmp_path), "--iteration", "7"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    (line,) = _error_lines(err)
    assert line.startswith("error: ") and "iteration 7" in line and str(tmp_path) in line


def test_train_on_a_locked_run_directory_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lifecycle, "LOCK_WAIT_S", 0.0)
    monkeypatch.delenv("RANK", raising=False)
    run_dir = tmp_path / "run"
    held = lifecycle.HeldLocks(lifecycle.run_locks(str(run_dir), str(run_dir / "checkpoints"))).acquire()
    try:
        code = cli.main(["train", "configs/tiny_cpu.yaml", f"logging.run_dir={run_dir}"])
    finally:
        held.release()
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert _error_lines(err)[-1].startswith("error: ") and str(run_dir) in _error_lines(err)[-1]


def _command_raising(monkeypatch, error: BaseException) -> None:
    """`megatron-stepwise validate` replaced by a command that raises `error`."""

    def register(sub: argparse._SubParsersAction) -> None:
        def raise_it(args):
            raise error

        sub.add_parser("validate").set_defaults(func=raise_it)

    monkeypatch.setattr(cli, "_load", lambda target: register)


@pytest.mark.parametrize("rank,prefix", [(None, "error: "), ("0", "error: "), ("3", "error (rank 3): ")])
def test_any_user_error_is_one_line_with_the_rank(monkeypatch, capsys, rank, prefix):
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    problem = ConfigProblem("optim.lr", "must be > 0 (got -1)")
    _command_raising(monkeypatch, ConfigError([problem]))
    assert cli.main(["validate"]) == cli.EXIT_USER_ERROR == 2
    err = capsys.readouterr().err
    assert err.startswith(prefix) and "optim.lr: must be > 0 (got -1)" in err and "Traceback" not in err


def test_a_program_failure_keeps_its_traceback(monkeypatch):
    _command_raising(monkeypatch, RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["validate"])


def test_an_unreadable_dump_names_the_file(tmp_path, capsys):
    rollouts = tmp_path / "rollouts"
    rollouts.mkdir()
    (rollouts / "iter_0000001.parquet").write_text("not parquet")
    code = cli.main(["view", str(tmp_path), "--iteration", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    (line,) = _error_lines(err)
    assert line.startswith("error: ") and "iter_0000001.parquet is not a readable Parquet file" in line


def test_a_training_rank_names_the_error_before_its_cleanup(tmp_path, capsys, monkeypatch):
    """A rank's cleanup may wait on the other ranks: the line comes first."""
    from megatron_stepwise.loop import trainer
    from megatron_stepwise.rundir import record

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(record, "write_run_record", lambda *args: None)  # no `git rev-parse` here
    seen_at_close = []

    class FailingTrainer:
        def __init__(self, cfg):
            pass

        def run(self):
            raise DatasetError("env.dataset: row 3 has no 'prompt' field")

        def close(self):
            seen_at_close.append(capsys.readouterr().err)

    monkeypatch.setattr(trainer, "Trainer", FailingTrainer)
    run_dir = tmp_path / "run"
    code = cli.main(["train", "configs/tiny_cpu.yaml", f"logging.run_dir={run_dir}", "launch.nproc_per_node=1"])
    assert code == 2
    (before_close,) = seen_at_close
    assert _error_lines(before_close)[-1] == "error: env.dataset: row 3 has no 'prompt' field"
    assert "Traceback" not in before_close + capsys.readouterr().err
