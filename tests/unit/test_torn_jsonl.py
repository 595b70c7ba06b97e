"""A crash mid-write (disk full, SIGKILL) tears the last line of a file the run appends to: the
readers skip it with one warning naming the file and line, and a resume starts on a fresh line."""

import json
import logging

import pytest

from megatron_stepwise.cli.main import main as cli_main
from megatron_stepwise.metrics.core import MetricsLogger
from megatron_stepwise.rundir.jsonl import read_metrics
from megatron_stepwise.rundir.paths import LOG
from megatron_stepwise.rundir.record import log_to_run_dir

TORN_TAILS = {
    "cut_mid_record": b'{"iteration": 3, "reward/me',
    "cut_mid_utf8": '{"iteration": 3, "note": "\u00e9'.encode()[:-1],
    "zero_filled": b"\x00\x00\x00\x00",
}


def _write_torn(run_dir, tail: bytes) -> str:
    path = run_dir / "metrics.jsonl"
    lines = [json.dumps({"iteration": i, "reward/mean": i / 4}) for i in range(3)]
    path.write_bytes(("\n".join(lines) + "\n").encode() + tail)
    return str(path)


@pytest.mark.parametrize("tail", TORN_TAILS.values(), ids=TORN_TAILS.keys())
def test_readers_drop_a_torn_last_line_with_one_warning(tmp_path, caplog, tail):
    path = _write_torn(tmp_path, tail)
    with caplog.at_level(logging.WARNING):
        records = read_metrics(str(tmp_path))
    assert [r["iteration"] for r in records] == [0, 1, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and path in warnings[0] and "line 4" in warnings[0]


@pytest.mark.parametrize("tail", TORN_TAILS.values(), ids=TORN_TAILS.keys())
def test_plot_works_after_a_torn_line(tmp_path, tail, capsys):
    _write_torn(tmp_path, tail)
    assert cli_main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("resume_at", [3, 2])
def test_resume_after_a_torn_line_writes_the_next_record_on_its_own_line(tmp_path, resume_at):
    _write_torn(tmp_path, TORN_TAILS["cut_mid_record"])
    log = MetricsLogger(str(tmp_path), resume_iteration=resume_at)
    log.log(resume_at, {"reward/mean": 0.9})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [*range(resume_at), resume_at]


def test_a_resumed_train_log_starts_on_a_fresh_line(tmp_path):
    (tmp_path / LOG).write_bytes(b"2025-01-01 INFO megatron_stepwise: iteration 3/10: rew")
    handler = log_to_run_dir(str(tmp_path), logger_name="stepwise_test_torn")
    try:
        logging.getLogger("stepwise_test_torn").warning("resumed")
    finally:
        logging.getLogger("stepwise_test_torn").removeHandler(handler)
        logging.getLogger("py.warnings").removeHandler(handler)
        logging.captureWarnings(False)
        handler.close()
    lines = (tmp_path / LOG).read_text().splitlines()
    assert lines[0].endswith("rew") and len(lines) == 2 and lines[1].endswith("resumed")
