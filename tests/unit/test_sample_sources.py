"""Datasets in the formats people keep (JSONL, Parquet, a `datasets` directory), with a field
mapping, read lazily; a missing field is one error naming it and the file, at validation."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from megatron_stepwise.config import config_from_dict
from megatron_stepwise.config.errors import ConfigError
from megatron_stepwise.data.files import DatasetError, dataset_facts, open_samples
from megatron_stepwise.data.prompts import PromptDataset

pa = pytest.importorskip("pyarrow", reason="pyarrow (test extra) is not installed")
pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow (test extra) is not installed")
datasets = pytest.importorskip("datasets", reason="the datasets package (test extra) is not installed")

ROWS = [{"qid": f"q{i}", "question": f"say {i % 10}", "target": str(i % 10), "level": i % 3} for i in range(12)]
FIELDS = {"prompt_id": "qid", "prompt": "question", "answer": "target"}


def write_all(tmp_path, rows=ROWS):
    """The same rows as JSONL, Parquet and a save_to_disk directory (train/test splits)."""
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    hf_dir = tmp_path / "rows_hf"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:3])}
    ).save_to_disk(str(hf_dir))
    return {"jsonl": str(jsonl), "parquet": str(parquet), "hf_dir": str(hf_dir)}


def test_every_format_gives_the_same_mapped_samples(tmp_path):
    paths = write_all(tmp_path)
    by_format = {kind: open_samples(path, fields=FIELDS)[:] for kind, path in paths.items()}
    expected = [{**r, "prompt_id": r["qid"], "prompt": r["question"], "answer": r["target"]} for r in ROWS]
    for kind, samples in by_format.items():
        assert samples == expected, kind
    assert len(open_samples(paths["hf_dir"], split="test")) == 3
    facts = dataset_facts(paths["parquet"])
    assert (facts.num_rows, facts.columns) == (12, ("qid", "question", "target", "level"))


def test_a_missing_column_names_the_key_the_column_and_the_file(tmp_path):
    paths = write_all(tmp_path)
    for path in paths.values():
        with pytest.raises(DatasetError) as e:
            open_samples(path, fields={"prompt": "problem"})
        assert "env.fields.prompt: column 'problem' is not in" in str(e.value) and path in str(e.value)
    with pytest.raises(DatasetError, match="no split 'validation'"):
        open_samples(paths["hf_dir"], split="validation")


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf_dir"])
def test_validation_names_a_missing_field_and_the_file(tmp_path, kind, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = write_all(tmp_path)[kind]
    # the echo environment reads 'digits', which these rows lack
    with pytest.raises(ConfigError) as e:
        config_from_dict({"env": {"name": "echo", "dataset": path}})
    assert e.value.keys == ["env.dataset"], str(e.value)
    assert "has no field 'digits'" in str(e.value) and path in str(e.value) and "env.fields.digits" in str(e.value)
    # a mapped column that is not there
    with pytest.raises(ConfigError) as e:
        config_from_dict({"env": {"name": "echo", "dataset": path, "fields": {"digits": "numbers"}}})
    assert e.value.keys == ["env.fields.digits"] and "column 'numbers' is not in" in str(e.value)
    # 12 rows cannot fill an iteration of 16 prompts
    with pytest.raises(ConfigError) as e:
        config_from_dict(
            {
                "env": {"name": "echo", "dataset": path, "fields": {"digits": "level"}},
                "data": {"prompts_per_iteration": 16},
            }
        )
    assert e.value.keys == ["data.prompts_per_iteration"] and "has 12" in str(e.value)


def test_prompt_dataset_draws_from_a_lazy_source_and_resumes(tmp_path):
    source = open_samples(write_all(tmp_path)["parquet"], fields=FIELDS)
    ds = PromptDataset(source, seed=3)
    first = [s["prompt_id"] for s in ds.next(8)]
    state = ds.state_dict()
    rest = [s["prompt_id"] for s in ds.next(8)]
    assert len(set(first)) == 8 and len(set(rest)) == 8  # no repeats inside a draw, across the epoch edge
    (tmp_path / "reopened").mkdir()  # a fresh reader of the same rows, as after a restart
    again = PromptDataset(open_samples(write_all(tmp_path / "reopened")["parquet"], fields=FIELDS), seed=3)
    again.load_state_dict(state)
    assert [s["prompt_id"] for s in again.next(8)] == rest


def test_large_files_are_not_read_into_python_objects(tmp_path):
    """200k samples of ~100 bytes: opening keeps byte offsets (JSONL), Arrow columns
    (Parquet) or a memory map (`datasets` directory), so the Python heap grows by far less than the data."""
    rows = ({"prompt": "x" * 80 + str(i), "answer": str(i)} for i in range(200_000))
    jsonl = tmp_path / "big.jsonl"
    with open(jsonl, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    parquet = tmp_path / "big.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "x" * 80 + str(i), "answer": str(i)} for i in range(200_000)]), parquet
    )
    hf_dir = tmp_path / "big_hf"
    datasets.Dataset(pq.read_table(parquet)).save_to_disk(str(hf_dir))
    size = jsonl.stat().st_size  # ~20 MB
    for path in (jsonl, parquet, hf_dir):
        tracemalloc.start()
        source = open_samples(str(path))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert len(source) == 200_000 and source[123_456]["answer"] == "123456"
        assert source[123_456]["prompt_id"] == "row123456"
        assert peak < size / 5, (path.name, peak, size)


def test_a_hub_dataset_missing_from_the_local_caches_fails_validation(tmp_path, monkeypatch):
    """Validation never downloads: a hub id must be in the HF hub cache or the datasets cache."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    with pytest.raises(ConfigError) as e:
        config_from_dict({"env": {"dataset": "acme/not-cached", "fields": {"digits": "level"}}})
    assert e.value.keys == ["env.dataset"] and "hf download --repo-type dataset acme/not-cached" in str(e.value)
    (tmp_path / "datasets" / "acme___cached" / "default").mkdir(parents=True)  # prepared by load_dataset
    config_from_dict({"env": {"dataset": "acme/cached", "fields": {"digits": "level"}}})  # size known at start-up


def test_a_hub_dataset_in_the_hub_cache_trains_offline(tmp_path, monkeypatch):
    """A hub id whose files are in the HF hub cache (as `hf download --repo-type dataset` leaves
    them) loads with no network: from the snapshot's files, with the field mapping."""
    snapshot = tmp_path / "hub" / "datasets--acme--sums" / "snapshots" / "abc123"
    (snapshot / "data").mkdir(parents=True)
    (snapshot / "data" / "train.jsonl").write_text(
        "".join(json.dumps({"q": f"{i}+{i}", "a": str(2 * i)}) + "\n" for i in range(5))
    )
    (tmp_path / "hub" / "datasets--acme--sums" / "refs").mkdir()
    (tmp_path / "hub" / "datasets--acme--sums" / "refs" / "main").write_text("abc123")
    for name, value in (
        ("HF_HUB_CACHE", tmp_path / "hub"),
        ("HF_HOME", tmp_path / "home"),
        ("HF_DATASETS_CACHE", tmp_path / "datasets"),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_DATASETS_OFFLINE", "1"),
    ):
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    source = open_samples("acme/sums", fields={"question": "q", "answer": "a"})
    assert len(source) == 5 and (source[3]["question"], source[3]["answer"]) == ("3+3", "6")
    config_from_dict(
        {"env": {"name": "math_tool", "dataset": "acme/sums", "fields": {"question": "q", "answer": "a"}}}
    )  # validation accepts it
