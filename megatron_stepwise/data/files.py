"""Prompt samples from the files people keep: JSONL, Parquet, a Hugging Face `datasets` directory
(`save_to_disk`) or hub id, with a field mapping, read lazily.

A source is a `Sequence` of sample dicts: `len(source)` and `source[i]`. Nothing reads a whole
file into Python lists: a `datasets` directory stays a memory-mapped Arrow table on disk; a
Parquet file is decoded once into Arrow columns (C++ buffers, no Python objects; for files
larger than memory, save them as a `datasets` directory); a row becomes a dict only when drawn.
A JSONL file is scanned once (each line parsed, checked and dropped, only its byte offset kept)
and its lines are re-read on demand.

`fields` maps the names an environment reads to the dataset's own column names, e.g.
`{"prompt": "question", "answer": "solution"}`: the sample keeps all its columns and gains the
mapped names. A mapped column that is missing is one error naming the key, the column and the
file. Every sample gets a unique `prompt_id` (mapped, present, or `row<N>` from its position),
and so does every sample of an environment's `dataset` callable (`with_prompt_ids`).
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_stepwise.errors import UserError
from megatron_stepwise.hf import hub


class DatasetError(UserError, ValueError):
    """A dataset that cannot be read as configured; the message names the key, file and field."""


# ------------------------------------------------------------------------------ what a source is
def dataset_kind(path: str) -> str:
    """jsonl, parquet, hf_dir (a `save_to_disk` directory) or hub (a Hugging Face hub id)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return "hf_dir"
    suffix = p.suffix.lower()
    if suffix in (".parquet", ".pq", ".jsonl", ".json", ".ndjson"):
        if not p.is_file():
            raise DatasetError(f"no such file: {path}")
        return "parquet" if suffix in (".parquet", ".pq") else "jsonl"
    if p.exists():
        raise DatasetError(f"{path}: unknown dataset format (expected .jsonl, .parquet or a `datasets` directory)")
    if "/" in path and not path.startswith((".", "/", "~")) and path.count("/") == 1:
        return "hub"
    raise DatasetError(f"no such file or directory: {path}")


@dataclass(frozen=True)
class DatasetFacts:
    """What validation can know without loading the samples: size, columns, where they are."""

    num_rows: int
    columns: tuple[str, ...]
    description: str


def dataset_facts(path: str, *, split: str = "train") -> Optional[DatasetFacts]:
    """Row count and column names (cheap: Parquet metadata, Arrow schema, one pass over JSONL);
    None for a cached hub dataset (known once loaded)."""
    kind = dataset_kind(path)
    if kind == "parquet":
        pq = _parquet(path)

        meta = pq.ParquetFile(str(Path(path).expanduser()))
        return DatasetFacts(meta.metadata.num_rows, tuple(meta.schema_arrow.names), path)
    if kind == "hub":
        # Validation never downloads: a hub id must be in the local cache; its size is read at start-up.
        if not _in_hub_cache(path):
            raise DatasetError(
                f"{path!r} is neither a local file or directory nor a dataset in the Hugging Face "
                f"cache ({hub.hub_cache_dir()}); download it first "
                f"(hf download --repo-type dataset {path})"
            )
        return None
    if kind == "hf_dir":
        table = _open_hf(path, split)
        return DatasetFacts(len(table), tuple(table.column_names), f"{path} (split {split})")
    columns: dict[str, None] = {}
    rows = 0
    for _, sample in _scan_jsonl(path):
        rows += 1
        columns.update(dict.fromkeys(sample))
    return DatasetFacts(rows, tuple(columns), path)


def open_samples(
    path: str, *, fields: Optional[Mapping[str, str]] = None, split: str = "train", key: str = "env.dataset"
) -> "Sequence[dict[str, Any]]":
    """The samples at `path` (any supported format), with `fields` mapped; `key` words errors."""
    fields = dict(fields or {})
    kind = dataset_kind(path)
    if kind == "jsonl":
        return JsonlSamples(path, fields=fields, key=key)
    if kind == "parquet":
        pq = _parquet(path)

        table = pq.read_table(str(Path(path).expanduser()), memory_map=True)  # Arrow columns, not Python rows
        return ArrowSamples(table, fields=fields, key=key, description=path)
    table = _open_hf(path, split).data.table  # the Arrow table datasets memory-maps
    return ArrowSamples(table, fields=fields, key=key, description=f"{path} (split {split})")


def _parquet(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install 'megatron-stepwise[data]')") from e
    return pq


def _in_hub_cache(repo_id: str) -> bool:
    """Dataset `repo_id` in the local caches: its hub files (the HF hub cache), or the Arrow files
    `load_dataset` prepared from them (the datasets cache, which offline loading reads)."""
    snapshots = hub.hub_cache_dir() / f"datasets--{repo_id.replace('/', '--')}" / "snapshots"
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    prepared = Path(os.environ.get("HF_DATASETS_CACHE") or os.path.join(home, "datasets")).expanduser()
    return any(d.is_dir() and any(d.iterdir()) for d in (snapshots, prepared / repo_id.replace("/", "___")))


def _hub_snapshot(repo_id: str) -> Optional[str]:
    """The directory of dataset `repo_id`'s cached hub snapshot, or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, repo_type="dataset", cache_dir=hub.hub_cache_dir(), local_files_only=True)
    except (LocalEntryNotFoundError, ValueError):
        return None


def _open_hf(path: str, split: str):
    """A `datasets.Dataset` (memory-mapped Arrow) from a save_to_disk directory or the hub cache."""
    try:
        import datasets
    except ImportError as e:
        raise DatasetError(
            f"{path}: reading a Hugging Face dataset needs the datasets package (pip install 'megatron-stepwise[data]')"
        ) from e
    if dataset_kind(path) == "hf_dir":
        loaded = datasets.load_from_disk(str(Path(path).expanduser()))
    else:
        # The local cache first: a hub snapshot loads from its files (offline load_dataset(id) reads only
        # the Arrow files of an earlier load); else load_dataset, which downloads unless HF_*_OFFLINE.
        loaded = datasets.load_dataset(_hub_snapshot(path) or path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"{path}: no split {split!r} (splits: {', '.join(loaded)})")
        loaded = loaded[split]
    return loaded.flatten_indices() if loaded._indices is not None else loaded


# ------------------------------------------------------------------------------ the two readers
def _check_fields(fields: Mapping[str, str], columns: Sequence[str], key: str, description: str) -> None:
    for target, column in fields.items():
        if column not in columns:
            raise DatasetError(
                f"{key}.{target}: column {column!r} is not in {description} (columns: {', '.join(columns)})"
            )


def _mapped(row: dict[str, Any], fields: Mapping[str, str], index: int) -> dict[str, Any]:
    sample = dict(row)
    for target, column in fields.items():
        sample[target] = row[column]
    if sample.get("prompt_id") in (None, ""):
        sample["prompt_id"] = f"row{index}"
    sample["prompt_id"] = str(sample["prompt_id"])
    return sample


def with_prompt_ids(samples: Sequence[dict[str, Any]], *, key: str = "env.dataset") -> list[dict[str, Any]]:
    """An environment's `dataset` callable's samples, each with a unique `prompt_id` (its own, or
    `row<N>` from its position, as files get); a repeated or non-dict sample is an error naming it."""
    out, seen = [], set()
    for i, sample in enumerate(samples):
        if not isinstance(sample, Mapping):
            raise DatasetError(
                f"{key}: sample {i} of the environment's dataset is a {type(sample).__name__}, not a dict"
            )
        sample = _mapped(dict(sample), {}, i)
        if sample["prompt_id"] in seen:
            raise DatasetError(
                f"{key}: prompt_id {sample['prompt_id']!r} (sample {i} of the environment's "
                "dataset) appears twice; prompt ids must be unique"
            )
        seen.add(sample["prompt_id"])
        out.append(sample)
    if not out:
        raise DatasetError(f"{key}: the environment's dataset returned no samples")
    return out


class ArrowSamples(Sequence):
    """Rows of an Arrow table (memory-mapped for `datasets`), turned into dicts one at a time."""

    def __init__(self, table, *, fields: Mapping[str, str], key: str, description: str):
        fields_key = key.rsplit(".", 1)[0] + ".fields"
        _check_fields(fields, table.column_names, fields_key, description)
        self.table, self.fields, self.description = table, dict(fields), description
        if len(table) == 0:
            raise DatasetError(f"{key}: {description} has no rows")
        id_column = fields.get("prompt_id", "prompt_id")
        if id_column in table.column_names:  # uniqueness from the column alone, not from the rows
            import pyarrow.compute as pc

            ids = table.column(id_column)
            if ids.null_count or pc.count_distinct(ids).as_py() != len(table):
                raise DatasetError(
                    f"{key}: column {id_column!r} of {description} must be unique and non-null (it is the prompt_id)"
                )

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return _mapped(self.table.slice(i, 1).to_pylist()[0], self.fields, i)


def _scan_jsonl(path: str):
    """(byte offset, sample) of every non-empty line; a bad line is an error naming it."""
    with open(Path(path).expanduser(), "rb") as f:
        offset, lineno = 0, 0
        for raw in f:
            lineno += 1
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                sample = json.loads(raw)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not valid JSON: {e}") from None
            if not isinstance(sample, dict):
                raise DatasetError(f"{path}:{lineno}: a sample must be a JSON object")
            yield start, sample


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes when a file is rewritten or replaced: device, inode, size, modification time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class JsonlSamples(Sequence):
    """A JSONL file scanned once (parsed and checked line by line) and read back by byte offset."""

    def __init__(self, path: str, *, fields: Mapping[str, str], key: str):
        self.path, self.fields = os.path.expanduser(path), dict(fields)
        self.offsets = array("q")  # 8 bytes a sample, whatever its size
        id_column = self.fields.get("prompt_id", "prompt_id")
        seen: set[str] = set()
        for start, sample in _scan_jsonl(path):
            missing = [c for c in self.fields.values() if c not in sample]
            if missing:
                _check_fields(
                    self.fields, list(sample), key.rsplit(".", 1)[0] + ".fields", f"{path} (line at byte {start})"
                )
            pid = sample.get(id_column)
            if pid not in (None, ""):
                if str(pid) in seen:
                    raise DatasetError(f"{key}: {path}: prompt_id {pid!r} ({id_column!r}) appears twice")
                seen.add(str(pid))
            self.offsets.append(start)
        if not self.offsets:
            raise DatasetError(f"{key}: {path}: no samples")
        self.key = key
        # Held open from here: a file replaced by a rename is still read as scanned. The identity
        # tells a file rewritten in place (or reopened elsewhere after a replace) from the scanned one.
        self._file = open(self.path, "rb")
        self._identity = _identity(os.fstat(self._file.fileno()))

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self._file is None:
            self._file = open(self.path, "rb")
        if _identity(os.fstat(self._file.fileno())) != self._identity:
            raise DatasetError(
                f"{self.key}: {self.path} changed while the run was reading it (samples are read back by "
                "byte offset): leave it unchanged during a run (write a new file and point "
                f"{self.key} at it); the run resumes from its last checkpoint"
            )
        self._file.seek(self.offsets[i])
        return _mapped(json.loads(self._file.readline()), self.fields, i)

    def __getstate__(self):  # picklable (Ray, multiprocessing): the file handle is reopened
        return {**self.__dict__, "_file": None}
