"""A rollout-bank file is data with bounds (issue 58): a tampered file with its checksum recomputed,
another run's file, a FIFO or a huge sparse file is discarded, counted and named on a resume, never
a crash, never trained and never counted as recovered."""

from __future__ import annotations

import json
import logging
import os
import threading
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_rollout_bank import banked

from megatron_stepwise.rundir import bank_files
from megatron_stepwise.rundir.bank_files import META_KEY, file_name
from megatron_stepwise.rundir.paths import BANK
from megatron_stepwise.workers.rollout_bank import RolloutBank

OURS = {"run_id": "run-a", "config_hash": "hash-a"}
PENDING = [({"prompt_id": "p0"}, 0)]


def bank_one(run_dir) -> "os.PathLike":
    """A bank of this run holding draw 0 (prompt p0); its file's path."""
    bank = RolloutBank(run_dir, **OURS)
    group = banked(0, "p0")
    group.run_id, group.config_hash = OURS["run_id"], OURS["config_hash"]
    bank.put(group)
    return next((run_dir / BANK).glob("draw_0.*.parquet"))


def tamper(path, change) -> "os.PathLike":
    """Rewrite bank file `path` with `change(columns, meta)` applied and its checksum recomputed (the
    name carries it): what someone editing a run directory would do."""
    table = pq.read_table(path)
    cols, meta = table.to_pydict(), json.loads(table.schema.metadata[META_KEY])
    cols = change(cols, meta) or cols
    new = pa.table(cols, schema=table.schema.remove_metadata()).replace_schema_metadata(
        {META_KEY: json.dumps(meta).encode()}
    )
    sink = pa.BufferOutputStream()
    pq.write_table(new, sink)
    data = sink.getvalue().to_pybytes()
    os.unlink(path)
    out = path.with_name(file_name(0, data))
    out.write_bytes(data)
    return out


def resume(run_dir, caplog):
    """A resumed bank's recovery of draw 0, run in a thread that must finish (a FIFO must not hang it)."""
    bank = RolloutBank(run_dir, **OURS)
    box = {}
    with caplog.at_level(logging.WARNING, logger="megatron_stepwise.workers.rollout_bank"):
        thread = threading.Thread(target=lambda: box.update(r=bank.recover(PENDING, next_draw=1, version=0)))
        thread.start()
        thread.join(30)
    assert not thread.is_alive(), "the resume hung"
    return bank, box["r"], " | ".join(r.getMessage() for r in caplog.records)


def _set(name, value, row=0):
    def change(cols, meta):
        cols[name][row] = value

    return change


def _meta(key, value):
    def change(cols, meta):
        meta[key] = value

    return change


def _no_trajectories(cols, meta):
    meta["lengths"] = []
    return {k: [] for k in cols}


@pytest.mark.parametrize(
    "change,named",
    [
        (_set("reward", 1e30, row=2), "field 'reward' is 1e+30 (a bank file holds |reward| <= 1e+06)"),
        (_set("reward", float("nan"), row=2), "field 'reward' is nan"),
        (_set("turn_reward", float("inf")), "field 'turn_reward' is inf"),
        (_no_trajectories, "a group with no trajectories"),
        (_set("loss_mask", [1]), "row 0: field 'loss_mask' has 1 entries for 3 (ragged)"),
        (_meta("lengths", [1]), "trajectory lengths add up to 1 steps, the file holds 3"),
        (_meta("sample", "p0"), "its sample is a str, not a dict"),
        (_set("info", "[1]"), "a step's info is a list, not a dict"),
        (_meta("draw", "0"), "its draw is '0', not an integer"),
        (_meta("version", 1), "format version 1, this version reads 2"),
        (_meta("run_id", "run-b"), "written by another run (run_id run-b, config_hash hash-a; this is run run-a"),
        (_meta("config_hash", "hash-b"), "written by another run (run_id run-a, config_hash hash-b"),
    ],
    ids=[
        "huge-reward",
        "nan-reward",
        "inf-turn-reward",
        "no-trajectories",
        "ragged",
        "lengths",
        "sample",
        "info",
        "draw",
        "old-format",
        "other-run",
        "other-config",
    ],
)
def test_a_tampered_file_with_its_checksum_recomputed_is_discarded_and_named(tmp_path, caplog, change, named):
    path = tamper(bank_one(tmp_path), change)
    bank, recovery, log = resume(tmp_path, caplog)
    assert not recovery.pending and not recovery.reissued  # never recovered, so never trained
    assert bank.discarded == 1 and not path.exists()
    assert f"{path} is refused (" in log and named in log, log


def test_the_run_own_file_is_recovered(tmp_path, caplog):
    bank_one(tmp_path)
    bank, recovery, _ = resume(tmp_path, caplog)
    assert list(recovery.pending) == [0] and bank.discarded == 0


def test_a_fifo_named_like_a_bank_file_is_refused_not_hung(tmp_path, caplog):
    path = bank_one(tmp_path)
    os.unlink(path)
    os.mkfifo(path)
    bank, recovery, log = resume(tmp_path, caplog)
    assert not recovery.pending and bank.discarded == 1 and not path.exists()
    assert f"{path} is a FIFO, not a regular file" in log


def test_a_link_named_like_a_bank_file_is_refused(tmp_path, caplog):
    path = bank_one(tmp_path)
    elsewhere = tmp_path / "elsewhere.parquet"
    os.replace(path, elsewhere)
    os.symlink(elsewhere, path)
    bank, recovery, log = resume(tmp_path, caplog)
    assert not recovery.pending and bank.discarded == 1
    assert f"{path} is a symbolic link, not a regular file" in log


def test_a_huge_sparse_bank_file_is_refused_before_it_is_read(tmp_path, caplog):
    path = bank_one(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(6 << 30)  # 6 GiB, no disk: the try
    tracemalloc.start()
    bank, recovery, log = resume(tmp_path, caplog)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert not recovery.pending and bank.discarded == 1 and peak < 64 << 20
    assert f"{path} is 6144.0 MiB, more than the {bank_files.MAX_FILE_BYTES >> 20}.0 MiB" in log
