"""A JSONL dataset rewritten while a run reads it (issue 42): samples are read back by byte
offset, so a rewrite is a named error instead of a JSONDecodeError or a wrong sample."""

import json
import os
import pickle

import pytest

from megatron_stepwise.data.files import DatasetError, open_samples


def _write(path, n, word):
    path.write_text("".join(json.dumps({"prompt": f"{word} {i}" * (1 + i % 3)}) + "\n" for i in range(n)))


def test_a_file_rewritten_in_place_is_a_named_error(tmp_path):
    path = tmp_path / "d.jsonl"
    _write(path, 6, "first")
    samples = open_samples(str(path))
    assert samples[0]["prompt"] == "first 0"
    with open(path, "w") as f:  # in place: same inode, other bytes
        f.write(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DatasetError) as e:
        samples[4]
    assert str(e.value).startswith("env.dataset: ") and str(path) in str(e.value) and "changed" in str(e.value)


def test_a_file_replaced_by_a_rename_keeps_serving_the_scanned_samples(tmp_path):
    path = tmp_path / "d.jsonl"
    _write(path, 6, "first")
    samples = open_samples(str(path))
    _write(tmp_path / "new.jsonl", 2, "second")
    os.replace(tmp_path / "new.jsonl", path)
    assert [s["prompt"] for s in samples[3:5]] == ["first 3", "first 4first 4"]


def test_a_copy_reopened_after_a_replace_refuses_the_new_file(tmp_path):
    path = tmp_path / "d.jsonl"
    _write(path, 6, "first")
    copy = pickle.loads(pickle.dumps(open_samples(str(path))))  # e.g. sent to a Ray actor
    _write(tmp_path / "new.jsonl", 6, "other")
    os.replace(tmp_path / "new.jsonl", path)
    with pytest.raises(DatasetError, match="changed while the run was reading it"):
        copy[1]
