"""One owner for the run directory (rundir/paths.py): every file the run's writers leave is a
`RunDir` path, and no other module spells a run-directory name or the `iter_` name itself."""

import ast
import json
import logging
from pathlib import Path

import pytest
from helpers import make_step, stride_decide
from source_ast import parse_python

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.cli.plot import plot_run
from megatron_stepwise.cli.replay import write_report
from megatron_stepwise.config import load_config
from megatron_stepwise.loop.checkpointer import run_id
from megatron_stepwise.loop.rounds import RowsOnRank0, decide_round
from megatron_stepwise.mcore.weights.checkpoint_dir import checkpoint_name, list_checkpoints
from megatron_stepwise.metrics.core import MetricsLogger, write_eval
from megatron_stepwise.rundir import paths
from megatron_stepwise.rundir.dump_recorder import DumpRecorder
from megatron_stepwise.rundir.dumps import write_dump
from megatron_stepwise.rundir.lifecycle import RunLock
from megatron_stepwise.rundir.paths import RunDir, iteration_name, parse_iteration
from megatron_stepwise.rundir.record import log_to_run_dir, write_run_record
from megatron_stepwise.viewer.page import write_pages
from megatron_stepwise.workers.rollout_bank import BankedGroup, write_group

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_stepwise"
EOS, SAY, ZERO = 2, 8, 11


def _steps(pid: str) -> list:
    return [
        make_step(pid, k, prompt=[1, 5, SAY, ZERO, EOS, 1, 6], resp=[ZERO, EOS], reward=float(k), lp=[-0.5, -0.5])
        for k in range(2)
    ]


def _write_a_run(root: Path) -> None:
    """What a run and the commands reading it write, each through its own writer."""
    config = load_config(str(PACKAGE.parent / "configs/tiny_cpu.yaml"))
    write_run_record(str(root), config.to_yaml(), ["train"])
    handler = log_to_run_dir(str(root), "test_run_dir_paths")
    logging.getLogger("test_run_dir_paths").warning("a line")
    for name in ("test_run_dir_paths", "py.warnings"):
        logging.getLogger(name).removeHandler(handler)
    handler.close()
    RunLock(str(root)).acquire().release(keep_record=True)
    run_id(str(root))
    metrics = MetricsLogger(str(root), tensorboard=True)
    for i in range(2):
        metrics.log(i, {"reward/mean": 0.5 * i})
    metrics.close()
    write_eval(str(root), "final", 2, {"eval/reward/mean": 0.5})
    recorder = DumpRecorder(every=1)
    recorder.begin(1)
    decide_round([groups_of(_steps("p0"))], RowsOnRank0(recorder=recorder), decide=stride_decide(), dp_size=1)
    write_dump(
        RunDir(root).dump(1),
        recorder.minibatches,
        iteration=1,
        weight_version=1,
        config=config.to_dict(),
        train_metrics=[],
        tokenizer="tiny_word",
    )
    (group,) = groups_of(_steps("p1"))
    banked = BankedGroup(
        draw=3, sample={"prompt_id": "p1"}, group_id="p1", start_version=0, attempt=0, end_version=0, rollout=group
    )
    write_group(root, banked)
    write_pages(root)  # view/iter_0000001.html
    write_pages(root, 1, page_tokens=8)  # an index and numbered pages beside it
    write_report(str(root), None, {"iteration": 1})
    plot_run(str(root))


@pytest.mark.launches  # the run record asks git for the commit
def test_every_file_a_run_writes_is_a_run_dir_path(tmp_path):
    root = tmp_path / "run"
    _write_a_run(root)
    run = RunDir(root)
    files = {
        run.config,
        run.run_record,
        run.log,
        run.lock,
        run.run_id,
        run.metrics,
        run.eval_result("final"),
        run.dump(1),
        run.view(1),
        run.replay_report(1),
        run.curves,
    }
    folders = {run.tensorboard, run.rollout_bank, RunDir.view_pages(run.view(1))}
    written = sorted(p for p in root.rglob("*") if p.is_file())
    strays = [p for p in written if p not in files and not any(d in p.parents for d in folders)]
    assert strays == []
    assert all(p.is_file() for p in files) and all(any(d.iterdir()) for d in folders)


def test_the_config_puts_checkpoints_and_weights_in_the_run_dir_unless_told_otherwise(tmp_path):
    config = load_config(str(PACKAGE.parent / "configs/tiny_cpu.yaml"), [f"logging.run_dir={tmp_path / 'r'}"])
    assert config.rundir == RunDir(tmp_path / "r")
    assert Path(config.checkpoint_dir) == tmp_path / "r" / paths.CHECKPOINTS
    assert Path(config.weight_sync_dir) == tmp_path / "r" / paths.WEIGHTS
    moved = load_config(
        str(PACKAGE.parent / "configs/tiny_cpu.yaml"),
        [f"logging.run_dir={tmp_path / 'r'}", f"checkpoint.dir={tmp_path / 'c'}", f"weight_sync.dir={tmp_path / 'w'}"],
    )
    assert moved.rundir.checkpoint(7) == tmp_path / "c" / "iter_0000007"
    assert Path(moved.weight_sync_dir) == tmp_path / "w" and moved.rundir.metrics == tmp_path / "r" / "metrics.jsonl"


def test_iteration_names_are_one_name(tmp_path):
    assert iteration_name(42) == checkpoint_name(42) == "iter_0000042"
    assert RunDir(tmp_path).dump(42).name == "iter_0000042.parquet"
    assert [parse_iteration(n) for n in ("iter_0000042", "iter_12345678", "iter_42", "iter_0000042.tmp")] == [
        42,
        12345678,
        None,
        None,
    ]
    complete = RunDir(tmp_path).checkpoint(3)  # what list_checkpoints counts as a checkpoint
    complete.mkdir(parents=True)
    for marker in ("metadata.json", "trainer_state.json"):
        (complete / marker).write_text(json.dumps({}))
    assert list_checkpoints(RunDir(tmp_path).checkpoints) == [complete]


def _spellings(tree: ast.AST) -> list[str]:
    """Run-directory file names written as string constants (a constant equal to the name: not a
    docstring or message), paths built as f"{run_dir}/name", and f-strings building an `iter_` name."""
    files = {paths.CONFIG, paths.RUN_RECORD, paths.LOG, paths.LOCK, paths.METRICS, paths.CURVES, paths.BANK}
    folders = {paths.CHECKPOINTS, paths.WEIGHTS, paths.DUMPS, paths.VIEWS, paths.REPLAYS, paths.EVAL, paths.TENSORBOARD}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in files:
            found.append(f"line {node.lineno}: {node.value!r}")
        if isinstance(node, ast.JoinedStr):
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and str(head.value).endswith("iter_"):
                found.append(f"line {node.lineno}: f'iter_{{...}}'")
            for part in node.values[1:]:
                if isinstance(part, ast.Constant) and str(part.value).split("/")[1:2] in ([n] for n in files | folders):
                    found.append(f"line {node.lineno}: {part.value!r}")
    return found


def test_no_module_but_rundir_paths_spells_a_run_dir_name():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module == "rundir/paths.py":
            continue
        found = _spellings(parse_python(path.read_text()))
        if found:
            offenders[module] = found
    assert offenders == {}
