"""Dumps and metrics files anyone may have written (issue 58, item 6): `view`, `replay` and
`plot` answer each with one line naming the file, column and row (exit 2), never a traceback."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_dumps import _group, _round

from megatron_stepwise.cli.main import main as cli_main
from megatron_stepwise.rundir.dump_table import dump_path
from megatron_stepwise.rundir.dumps import write_dump
from megatron_stepwise.rundir.jsonl import read_metrics


def _dump(run_dir):
    recorder, _ = _round(_group("a", [1.0, 0.0]) + _group("b", [0.5, 0.0]))
    for cap in recorder.minibatches:
        cap.trainer_logprobs = torch.zeros(cap.batch.tokens.numel())
    return write_dump(
        dump_path(run_dir, 3),
        recorder.minibatches,
        iteration=3,
        weight_version=3,
        config={"name": "x"},
        train_metrics=[{}, {}],
    )


def _replace(path, name, values, type_=None):
    table = pq.read_table(path)
    i = table.column_names.index(name)
    column = pa.array(values, type=type_ or table.schema.field(name).type)
    table = table.set_column(i, pa.field(name, column.type), column).replace_schema_metadata(table.schema.metadata)
    pq.write_table(table, path)


def _column(path, name):
    return pq.read_table(path, columns=[name]).column(name).to_pylist()


def _ragged_mask(rows):
    rows[1] = rows[1][:-1]
    return rows


def _big_id(rows):
    rows[2] = [*rows[2][:-1], 2**40]
    return rows


def _negative_id(rows):
    rows[0] = [-7, *rows[0][1:]]
    return rows


CASES = {
    "ragged_loss_mask": ("loss_mask", _ragged_mask, None, "row 1: loss_mask has"),
    "token_id_past_int32": (
        "response_ids",
        _big_id,
        pa.list_(pa.int64()),
        "row 2: response_ids holds token id 1099511627776",
    ),
    "negative_token_id": ("prompt_ids", _negative_id, None, "row 0: prompt_ids holds token id -7"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,change,type_,words", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("command", ["view", "replay"])
def test_a_hostile_dump_is_one_line_naming_column_and_row(tmp_path, capsys, command, name, change, type_, words):
    path = _dump(tmp_path)
    _replace(path, name, change(_column(path, name)), type_)
    argv = [command, str(tmp_path)] + (["--iteration", "3"] if command == "replay" else [])
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and str(path) in err and "Traceback" not in err


@pytest.mark.timeout(120)
def test_invalid_utf8_in_a_string_column_is_named(tmp_path, capsys):
    path = _dump(tmp_path)
    prompt_ids = _column(path, "prompt_id")
    # bytes that are not UTF-8, written as Arrow's string type (pyarrow checks only when asked)
    raw = pa.array([p.encode() for p in prompt_ids[:-1]] + [b"\xff\xfe"], pa.binary())
    bad = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())
    _replace(path, "prompt_id", bad, pa.string())
    assert cli_main(["view", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is corrupt" in err and "UTF8" in err.upper().replace("-", "") and "Traceback" not in err


@pytest.mark.timeout(60)
def test_metrics_lines_without_an_integer_iteration_are_skipped_and_named(tmp_path, caplog):
    lines = [{"iteration": 0, "reward/mean": 0.1}, {"reward/mean": 0.5}, {"iteration": "1"}, {"iteration": 2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["iteration"] for r in read_metrics(str(tmp_path))] == [0, 2]
    assert "line 2 has no integer 'iteration' (None)" in caplog.text and "line 3" in caplog.text
    assert cli_main(["plot", str(tmp_path), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 0
