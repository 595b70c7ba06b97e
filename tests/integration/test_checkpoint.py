"""Checkpoint / resume: pointer and pruning rules (fast), and real dist_checkpointing at TP2.

The distributed part runs tests/workers/ckpt_worker.py twice under torchrun (2 processes) per layout
(TP2; DP2 with the distributed optimizer): a run that saves three checkpoints and is SIGKILLed
while writing a fourth, then fresh processes that resume from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import check_ok, run_torchrun

from megatron_stepwise.mcore.weights import dist_checkpoint as C
from megatron_stepwise.mcore.weights.checkpoint_choice import UNVERIFIED, choose_checkpoint, resume_decision
from megatron_stepwise.mcore.weights.checkpoint_dir import (
    LATEST,
    MANIFEST,
    TRAINER_STATE,
    checkpoint_name,
    find_latest,
    prune,
    verify_checkpoint,
    write_manifest,
)
from megatron_stepwise.mcore.weights.checkpoint_errors import CheckpointError


def fake_checkpoint(root: Path, iteration: int, *, complete: bool = True, suffix: str = "") -> Path:
    path = root / (checkpoint_name(iteration) + suffix)
    path.mkdir(parents=True)
    (path / "common.pt").write_bytes(b"x")
    if complete:
        (path / "metadata.json").write_text("{}")
        (path / TRAINER_STATE).write_text(json.dumps({"iteration": iteration}))
    return path


def test_find_latest_follows_the_pointer(tmp_path):
    assert find_latest(tmp_path) is None
    assert find_latest(tmp_path / "missing") is None
    fake_checkpoint(tmp_path, 5)
    ten = fake_checkpoint(tmp_path, 10)
    (tmp_path / LATEST).write_text("iter_0000005\n")
    assert find_latest(tmp_path).name == "iter_0000005"  # the pointer wins over the newest dir
    (tmp_path / LATEST).write_text("iter_0000010\n")
    assert find_latest(tmp_path) == ten


def test_find_latest_ignores_unfinished_saves_and_a_stale_pointer(tmp_path):
    fake_checkpoint(tmp_path, 3)
    fake_checkpoint(tmp_path, 4, suffix=".tmp")  # a save that died after writing everything
    fake_checkpoint(tmp_path, 5, complete=False)  # a directory without the completion markers
    (tmp_path / LATEST).write_text("iter_0000009\n")  # points at nothing
    assert find_latest(tmp_path).name == "iter_0000003"
    (tmp_path / LATEST).unlink()
    assert find_latest(tmp_path).name == "iter_0000003"


def test_prune_keeps_the_last_k_and_what_latest_names(tmp_path):
    for it in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, it)
    fake_checkpoint(tmp_path, 5, suffix=".tmp")
    (tmp_path / LATEST).write_text("iter_0000001\n")
    removed = prune(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["iter_0000002", "iter_0000005.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "iter_0000003", "iter_0000004", "latest"]
    with pytest.raises(CheckpointError, match="keep_last must be >= 1"):
        prune(tmp_path, keep_last=0)


def test_the_manifest_names_a_truncated_flipped_or_missing_file(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 4)
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    write_manifest(ckpt)
    assert verify_checkpoint(ckpt) == (None, True)
    shard = ckpt / "sub" / "__0_0.distcp"
    shard.write_bytes(bytes(range(256)) * 2)  # truncated
    assert verify_checkpoint(ckpt) == ("file sub/__0_0.distcp: expected 1024 bytes, got 512", True)
    data = bytearray(range(256)) * 4
    data[700] ^= 0x01  # one flipped bit, same size
    shard.write_bytes(bytes(data))
    problem, _ = verify_checkpoint(ckpt)
    assert problem.startswith("file sub/__0_0.distcp: expected sha256 ") and ", got " in problem
    shard.unlink()
    assert verify_checkpoint(ckpt) == ("file sub/__0_0.distcp: missing (expected 1024 bytes)", True)
    (ckpt / MANIFEST).write_text("{not json")
    assert verify_checkpoint(ckpt)[0].startswith("manifest.json unreadable (JSONDecodeError")
    (ckpt / MANIFEST).unlink()
    assert verify_checkpoint(ckpt) == (None, False)  # saved before manifests: usable, unverified


def test_a_corrupt_latest_falls_back_and_none_good_is_one_clear_error(tmp_path):
    assert choose_checkpoint(tmp_path) == (None, False, [])  # nothing to resume: a fresh start
    for it in (2, 4, 6):
        write_manifest(fake_checkpoint(tmp_path, it))
    (tmp_path / LATEST).write_text("iter_0000006\n")
    assert choose_checkpoint(tmp_path) == (tmp_path / "iter_0000006", True, [])
    (tmp_path / "iter_0000006" / "common.pt").write_bytes(b"")
    (tmp_path / "iter_0000004" / TRAINER_STATE).unlink()  # incomplete
    path, verified, warnings = choose_checkpoint(tmp_path)
    assert (path, verified) == (tmp_path / "iter_0000002", True)
    assert warnings == [
        "checkpoint iter_0000006 (file common.pt: expected 1 bytes, got 0) is corrupt or incomplete, skipped",
        "checkpoint iter_0000004 (incomplete: trainer_state.json missing) is corrupt or incomplete, skipped",
    ]
    (tmp_path / "iter_0000002" / MANIFEST).unlink()  # an older checkpoint without a manifest
    assert choose_checkpoint(tmp_path, accept_unverified=True) == (tmp_path / "iter_0000002", False, warnings)
    with pytest.raises(
        CheckpointError,
        match=r"iter_0000002 \(no manifest.json, so unverified "
        r"\(checkpoint.accept_unverified=true loads it\)\)",
    ):
        choose_checkpoint(tmp_path)  # refused by default
    write_manifest(tmp_path / "iter_0000002")
    (tmp_path / "iter_0000002" / "metadata.json").write_text("{}  ")
    with pytest.raises(CheckpointError) as e:
        choose_checkpoint(tmp_path)
    assert str(e.value).startswith(f"no good checkpoint in {tmp_path} to resume from: iter_0000006 (file common.pt")
    assert "iter_0000002 (file metadata.json: expected 2 bytes, got 4)" in str(e.value)


def test_an_unverified_latest_falls_back_to_the_previous_verified_one(tmp_path):
    write_manifest(fake_checkpoint(tmp_path, 2))
    fake_checkpoint(tmp_path, 4)  # no manifest: lost, or written by an older version
    path, verified, warnings = choose_checkpoint(tmp_path)
    assert (path.name, verified) == ("iter_0000002", True)
    assert warnings == [f"checkpoint iter_0000004 ({UNVERIFIED}) is corrupt or incomplete, skipped"]
    assert choose_checkpoint(tmp_path, accept_unverified=True)[:2] == (tmp_path / "iter_0000004", False)
    # one that failed to load on some rank is skipped the same way
    write_manifest(tmp_path / "iter_0000004")
    path, _, warnings = choose_checkpoint(tmp_path, failed={"iter_0000004": "failed to load (KeyError: 'x')"})
    assert path.name == "iter_0000002" and "iter_0000004 (failed to load (KeyError: 'x'))" in warnings[0]


def test_a_checkpoint_written_by_another_run_is_refused_naming_both(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 3)
    (ckpt / TRAINER_STATE).write_text(json.dumps({"iteration": 3, "run_id": "aaaa", "run_dir": "/runs/first"}))
    write_manifest(ckpt)
    kind, message = resume_decision(tmp_path, None, run_id="bbbb")
    assert kind == "error" and "\n" not in message
    assert f"checkpoint {ckpt} was written by another run (run_id aaaa in /runs/first), this is run bbbb" in message
    assert "checkpoint.dir" in message and "checkpoint.resume=" in message
    assert resume_decision(tmp_path, None, run_id="aaaa") == ("path", str(ckpt))  # its own run resumes
    assert resume_decision(None, ckpt, run_id="bbbb") == ("path", str(ckpt))  # named deliberately: allowed


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_checkpoint_that_fails_to_load_falls_back_to_the_previous_one(tmp_path, one_rank, monkeypatch):
    ckpts = tmp_path / "ckpts"
    for it in (2, 4, 6):
        write_manifest(fake_checkpoint(ckpts, it))
    tried = []

    def load(target, *args, **kwargs):  # iter 6 is damaged in a way its manifest cannot show
        tried.append(target.name)
        if target.name == "iter_0000006":
            raise RuntimeError("torch_dist metadata says shard 3\nmore text")
        return {"iteration": int(target.name[5:])}

    monkeypatch.setattr(C, "_load", load)
    assert C.load_checkpoint([], ckpt_dir=ckpts) == {"iteration": 4}
    assert tried == ["iter_0000006", "iter_0000004"]
    # every one fails: one error naming each
    monkeypatch.setattr(C, "_load", lambda target, *a, **k: (_ for _ in ()).throw(OSError("bad")))
    with pytest.raises(
        CheckpointError,
        match=r"no good checkpoint in .*iter_0000006 \(failed to load "
        r"\(OSError: bad\)\); iter_0000004 .*; iter_0000002 ",
    ):
        C.load_checkpoint([], ckpt_dir=ckpts)


def test_a_second_trainer_on_the_same_checkpoint_dir_is_refused(tmp_path):
    from megatron_stepwise.rundir.lifecycle import HeldLocks, RunDirLocked, run_locks

    shared = tmp_path / "shared_ckpts"
    first = HeldLocks(run_locks(str(tmp_path / "run_a"), str(shared))).acquire()
    try:
        second = HeldLocks(run_locks(str(tmp_path / "run_b"), str(shared)))
        with pytest.raises(
            RunDirLocked,
            match=rf"checkpoint directory {shared} is in use by another trainer: "
            r"pid \d+ .*set checkpoint.dir to another directory",
        ):
            second.acquire()
        assert not second.locks[0].held  # its own run directory's lock is not kept either
    finally:
        first.release()
    HeldLocks(run_locks(str(tmp_path / "run_b"), str(shared))).acquire().release()
    assert len(run_locks(str(tmp_path / "r"), str(tmp_path / "r"))) == 1  # checkpoint.dir = run_dir: one lock


# ----------------------------------------------------------------------------- torchrun


LAYOUTS = {
    "tp2": ["--tp", "2", "--distopt", "0"],
    # DP2 with megatron's distributed optimizer: each rank owns half of the Adam state.
    "dp2-distopt": ["--tp", "1", "--distopt", "1"],
}


@pytest.fixture(
    scope="module",
    params=[pytest.param("tp2"), pytest.param("dp2-distopt", marks=pytest.mark.slow)],
)
def runs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    ckpt, out = root / "ckpt", root / "out"
    out.mkdir()
    common = ["--ckpt", str(ckpt), "--out", str(out), *LAYOUTS[request.param]]
    saving = run_torchrun("ckpt_worker.py", 2, ["--mode", "save", *common])
    assert saving.returncode != 0 and (out / "saved-rank0.pt").is_file(), saving.stderr[-4000:]
    check_ok(run_torchrun("ckpt_worker.py", 2, ["--mode", "load", *common]))
    load = lambda name: torch.load(out / name, weights_only=False)  # noqa: E731
    pairs = []
    for r in (0, 1):
        saved = load(f"saved-rank{r}.pt")
        saved["params_step4"] = load(f"saved-rank{r}-step4.pt")
        pairs.append((saved, load(f"loaded-rank{r}.pt")))
    return pairs


def assert_same(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.distributed
def test_keep_last_and_the_killed_save(runs):
    saved, loaded = runs[0]
    assert saved["saved"] == ["iter_0000001", "iter_0000002", "iter_0000003"]
    assert saved["listing"] == ["iter_0000002", "iter_0000003", "latest"]  # keep_last=2
    # The SIGKILL during the 4th save left only its .tmp behind; `latest` still names iteration 3.
    assert loaded["listing_before"] == ["iter_0000002", "iter_0000003", "iter_0000004.tmp", "latest"]
    # The next save cleans up and moves the pointer.
    assert loaded["listing_after"] == ["iter_0000003", "iter_0000004", "latest"]
    assert loaded["latest_after"] == "iter_0000004"
    assert loaded["verified"] == (None, True)  # every save writes its manifest; checked on load


@pytest.mark.distributed
@pytest.mark.parametrize("rank", [0, 1])
def test_resume_restores_params_optimizer_scheduler_and_rng(runs, rank):
    saved, loaded = runs[rank]
    assert loaded["trainer_state"] == {"iteration": 3, "data_position": 24, "weight_version": 3, "config_hash": "cfg-1"}
    assert_same(saved["params"], loaded["params"], "params")  # fresh processes started from other weights
    assert saved["optimizer"] and all("exp_avg_sq" in s for s in saved["optimizer"]), "Adam moments to compare"
    assert_same(saved["optimizer"], loaded["optimizer"], "optimizer")
    assert_same(saved["scheduler"], loaded["scheduler"], "scheduler")
    for rng in ("python", "numpy", "torch", "tracker"):
        assert_same(saved[rng], loaded[rng], rng)
    assert "config_hash='cfg-1'" in loaded["hash_error"] and "'cfg-2'" in loaded["hash_error"]


@pytest.mark.distributed
def test_the_step_after_a_resume_equals_the_uninterrupted_step(runs):
    saved, loaded = runs[0]
    # Adam's update depends on its moments and step count (bias correction): all must be right.
    assert_same(saved["params_step4"], loaded["params_step4"], "params after step 4")
    assert not torch.equal(saved["params"]["output_layer.weight"], loaded["params_step4"]["output_layer.weight"])


@pytest.mark.distributed
def test_a_checkpoint_loads_resharded_into_the_other_layout(runs):
    saved, loaded = runs[0]
    resharded = loaded["resharded"]
    assert resharded["trainer_state"]["iteration"] == 3
    assert_same(saved["params"], resharded["params"], "params")
    # A different layout gets a fresh RNG stream rather than another rank's state.
    assert not torch.equal(saved["torch"], resharded["torch"])
