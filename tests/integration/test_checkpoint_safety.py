"""Checkpoints are data, and a full disk keeps the previous checkpoint (issue 42 items 1 and 4b).

Real megatron-core checkpoints of a tiny model (tests/workers/ckpt_safety_worker.py, 2 ranks, DP2,
distributed optimizer): a `.metadata`, a `.distcp` byte item and a `common.pt` each carrying a
pickle whose `__reduce__` writes a marker file are refused, naming the file and the class, on
every rank, and the marker never appears; a clean checkpoint still loads. The CLI entry points
(train resume, `eval --checkpoint`, `replay`) are in test_replay_e2e.py.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import check_ok, run_torchrun

pytestmark = pytest.mark.distributed


def _records(out, mode: str) -> list[dict]:
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    root = tmp_path_factory.mktemp("poisoned")
    (root / "out").mkdir()
    marker = root / "MARKER"
    args = ["--mode", "poison", "--ckpt", str(root / "ckpt"), "--out", str(root / "out"), "--marker", str(marker)]
    check_ok(run_torchrun("ckpt_safety_worker.py", 2, args))
    return _records(root / "out", "poison"), marker, root / "ckpt"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_clean_checkpoint_loads_through_the_restricted_readers(poisoned, rank):
    records, _, _ = poisoned
    assert records[rank]["clean"]["ok"]["iteration"] == 2
    assert records[rank]["clean_params_equal"]


@pytest.mark.parametrize(
    "case,file",
    [
        ("metadata", "iter_0000002/.metadata"),
        ("rng_bytes", "iter_0000003/__1_0.distcp"),
        ("common", "iter_0000004/common.pt"),
    ],
)
def test_a_poisoned_part_is_refused_on_every_rank_naming_file_and_class(poisoned, case, file):
    records, marker, ckpt = poisoned
    for record in records:
        refused = record[case]
        assert refused.get("error") == "UnsafeCheckpointError", refused
        message = refused["message"]
        assert str(ckpt / file) in message and "builtins.exec" in message and "\n" not in message
    assert records[0]["marker_after_saves"]  # the poison was live (the test's own save ran it)
    assert not records[0]["marker_exists"] and not marker.exists()  # no load ran it


def test_a_resume_from_a_poisoned_latest_stops_instead_of_falling_back(poisoned):
    records, _, ckpt = poisoned
    for record in records:
        assert record["resume"].get("error") == "UnsafeCheckpointError"
        assert str(ckpt / "iter_0000004" / "common.pt") in record["resume"]["message"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 8 MiB tmpfs (a checkpoint of the worker's model is ~1.9 MB), or None where mount is refused."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        mounted = None
    if mounted is None or mounted.returncode != 0:
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60)


def test_a_full_disk_names_the_iteration_and_dir_and_keeps_the_previous_checkpoint(tmp_path, small_tmpfs):
    ckpt = (small_tmpfs or tmp_path) / "ckpt"
    out = tmp_path / "out"
    out.mkdir()
    args = ["--mode", "diskfull", "--ckpt", str(ckpt), "--out", str(out), "--fill", "1" if small_tmpfs else "0"]
    check_ok(run_torchrun("ckpt_safety_worker.py", 2, args))
    records = _records(out, "diskfull")
    expected = f"could not save checkpoint iter_0000002 (iteration 2) in checkpoint.dir {ckpt}: No space left on device"
    cases = ["injected", "full"] if small_tmpfs else ["injected"]
    for record in records:
        for case in cases:
            assert record[case].get("error") == "CheckpointError", (case, record[case])
            assert record[case]["message"].startswith(expected), record[case]["message"]
            assert "the latest checkpoint is still iter_0000001" in record[case]["message"]
            assert record[f"{case}_listing"] == ["iter_0000001", "latest"]  # the half-written save removed
        assert record["latest"] == "iter_0000001"
        assert record["resume"]["ok"]["iteration"] == 1  # a resume loads the previous one
    if not small_tmpfs:
        pytest.skip(
            "only the injected ENOSPC ran: the real full-disk case mounts a tmpfs, so it runs as root (as CI does)"
        )
