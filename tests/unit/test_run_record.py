"""The run directory's record (rundir/record.py) and the resume's config check (loop/checkpointer.py)."""

import json

import pytest
import yaml

from megatron_stepwise.config import config_from_dict
from megatron_stepwise.rundir.record import config_diff, git_commit, write_run_record


@pytest.mark.launches  # the record asks git for the commit
def test_write_run_record_keeps_the_config_and_one_entry_per_start(tmp_path):
    run_dir = str(tmp_path / "run")
    write_run_record(run_dir, "name: a\n", ["megatron-stepwise", "train", "a.yaml"])
    write_run_record(run_dir, "name: b\n", ["megatron-stepwise", "train", "a.yaml", "optim.lr=1e-3"])
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()) == {"name": "b"}
    starts = json.loads((tmp_path / "run" / "run.json").read_text())["starts"]
    assert [s["argv"][-1] for s in starts] == ["a.yaml", "optim.lr=1e-3"]
    assert starts[0]["versions"]["torch"] and starts[0]["versions"]["python"]
    assert git_commit(str(tmp_path)) is None  # not a git checkout


def test_config_diff_names_nested_keys_and_compares_option_dicts_whole():
    old = {"optim": {"lr": 1.0, "eps": 2}, "env": {"options": {"a": 1}, "name": "x"}}
    new = {"optim": {"lr": 2.0, "eps": 2}, "env": {"options": {"a": 2}, "name": "x"}}
    assert config_diff(old, new) == [("env.options", {"a": 1}, {"a": 2}), ("optim.lr", 1.0, 2.0)]


def test_a_resume_with_another_algo_names_the_keys_and_the_remedies(monkeypatch):
    from megatron_stepwise.loop.checkpointer import check_same_config, config_hash
    from megatron_stepwise.mcore.weights.checkpoint_errors import CheckpointError

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    saved = config_from_dict({})
    state = {"config_hash": config_hash(saved), "config": saved.to_dict()}
    lr_only = config_from_dict({"optim": {"lr": 1e-3}})
    assert check_same_config(state, lr_only, config_hash(lr_only), "ckpt") == ["optim.lr: 1e-06 -> 0.001"]
    changed = config_from_dict({"algo": {"loss": {"clip_high": 0.3}}, "optim": {"lr": 1e-3}})
    with pytest.raises(CheckpointError) as e:
        check_same_config(state, changed, config_hash(changed), "ckpt")
    text = str(e.value)
    assert "algo.loss.clip_high: 0.2 in the checkpoint, 0.3 now" in text
    assert "optim.lr: 1e-06 -> 0.001" in text  # also named, as a key a resume may change
    assert "algo.loss.clip_high=0.2" in text and "checkpoint.resume=never" in text
    # a checkpoint from before configs were saved: no keys, but still both remedies
    with pytest.raises(CheckpointError, match="does not record its config"):
        check_same_config({"config_hash": "old"}, changed, config_hash(changed), "ckpt")
