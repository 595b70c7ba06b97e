"""The rollout bank's files (`async.rollout_bank`): one finished prompt group each, in
`<run_dir>/rollout_bank/` (`RunDir.rollout_bank`).

A file is named `draw_<d>.<sha256>.parquet`: `d` is the sample's dataset draw, the checksum that of
the whole file, so a torn or damaged file is recognised. It holds the group's steps, trajectory by
trajectory, in the columnar format of the rollout dumps (`dumps.rows_table`), and the group's
identity (sample, start version, attempt, the run id and config hash of the run that wrote it, ...)
as JSON in the file metadata. What the bank does with its files (which to keep, reuse or prune)
is `workers/rollout_bank.py`'s.

The checksum catches damage, not tampering (anyone can recompute it), so a file is also read as
data with bounds: only a regular file (no FIFO, device or link) of at most MAX_FILE_BYTES, whose
columns decode to at most MAX_DECODED_BYTES, and whose trajectory lengths add up to its rows.

    >>> name = file_name(3, b"...")
    >>> parse_name(name)[0]
    3
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_stepwise.rundir.dumps import RESPONSE_FIELDS, Captured, batch_from_rows, rows_table
from megatron_stepwise.rundir.file_reads import read_regular
from megatron_stepwise.rundir.paths import RunDir
from megatron_stepwise.rundir.run_files import write_path
from megatron_stepwise.steps import Step, StepBatch

META_KEY = b"megatron_stepwise.rollout_bank"
FORMAT_VERSION = 2  # 2: the writing run's run_id and config_hash in the metadata
# One group's rows, zstd-compressed: a few MiB for 16 trajectories of 10 turns of 8k tokens.
MAX_FILE_BYTES = 1 << 30
MAX_DECODED_BYTES = 4 << 30  # the same rows decoded (a file of zeros compresses a thousandfold)


@dataclass(frozen=True)
class BankFile:
    """A written bank file as rank 0 records it: its name (draw and checksum) and the newest weight
    version among its tokens (what decides whether a resume may reuse it)."""

    name: str
    newest_version: int

    @property
    def draw(self) -> int:
        return parse_name(self.name)[0]


def encode_steps(trajectories: Sequence[Sequence[Step]], meta: dict[str, Any]) -> bytes:
    """A group's trajectories as Parquet bytes: the dump's row columns, `meta` in the file metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    batch = StepBatch.from_groups([trajectories], keep_metadata=True)
    table, experts_shape = rows_table([Captured(batch, batch.metadata or [])])
    meta = {
        "version": FORMAT_VERSION,
        **meta,
        "lengths": [len(t) for t in trajectories],
        "routed_experts_shape": experts_shape,
    }
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta, default=str).encode()})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def decode_steps(data: bytes) -> tuple[list[list[Step]], dict[str, Any]]:
    """`encode_steps`'s bytes back: the trajectories, their steps exactly as written, and the meta.
    ValueError names what is wrong with bytes no bank file holds."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(pa.BufferReader(data))
    decoded = sum(parquet.metadata.row_group(i).total_byte_size for i in range(parquet.metadata.num_row_groups))
    if decoded > MAX_DECODED_BYTES:
        raise ValueError(f"its rows decode to {decoded} bytes, more than the {MAX_DECODED_BYTES} a group may hold")
    table = parquet.read()
    meta = json.loads((table.schema.metadata or {})[META_KEY])
    if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION:
        version = meta.get("version") if isinstance(meta, dict) else meta
        raise ValueError(f"format version {version!r}, this version reads {FORMAT_VERSION}")
    lengths = meta["lengths"]
    if not (isinstance(lengths, list) and all(type(n) is int and n > 0 for n in lengths)):
        raise ValueError(f"trajectory lengths {lengths!r} are not positive integers")
    if sum(lengths) != table.num_rows:
        raise ValueError(f"trajectory lengths add up to {sum(lengths)} steps, the file holds {table.num_rows}")
    cols = table.to_pydict()
    check_row_lengths(cols, meta["routed_experts_shape"])
    batch, _ = batch_from_rows(cols, list(range(table.num_rows)), meta["routed_experts_shape"])
    batch.metadata = [json.loads(info) for info in cols["info"]]
    kinds = {type(info).__name__ for info in batch.metadata} - {"dict"}
    if kinds:
        raise ValueError(f"a step's info is a {kinds.pop()}, not a dict")
    steps = batch.to_steps(copy=False)
    trajectories, start = [], 0
    for n in lengths:
        trajectories.append(steps[start : start + n])
        start += n
    return trajectories, meta


def check_row_lengths(cols: dict[str, list], experts_shape: Optional[list[int]]) -> None:
    """ValueError naming the first row with a token field of another length than its tokens (a
    one-entry field would otherwise be broadcast over the response)."""
    per_token = math.prod(experts_shape) if experts_shape else None
    for r, (prompt, response) in enumerate(zip(cols["prompt_ids"], cols["response_ids"])):
        tokens = len(prompt) + len(response)
        expected = {name: len(response) for name in (*RESPONSE_FIELDS, "trainer_logprobs", "logprob_forwards")}
        expected["route_forwards"] = tokens
        if per_token is not None:
            expected["routed_experts"] = tokens * per_token
        for name, n in expected.items():
            value = cols.get(name, [None] * (r + 1))[r]
            if value is not None and len(value) != n:
                raise ValueError(f"row {r}: field {name!r} has {len(value)} entries for {n} (ragged)")


def write_file(run_dir: str | Path, draw: int, data: bytes) -> str:
    """Write one group's file (atomic: a temporary file, then a rename); returns its name."""
    name = file_name(draw, data)
    Path(run_dir).mkdir(parents=True, exist_ok=True)  # a worker may write before rank 0 made it
    write_path(RunDir(run_dir).rollout_bank / name, data, base=run_dir)
    return name


def read_file(path: str | Path) -> tuple[int, bytes]:
    """(the draw its name carries, its bytes) of a bank file, checked against the checksum in its
    name; ValueError (or OSError) names what is wrong with a damaged or missing file."""
    path = Path(path)
    parsed = parse_name(path.name)
    if parsed is None:
        raise ValueError(f"{path.name} is not a rollout bank file name")
    draw, checksum = parsed
    data = read_regular(path, MAX_FILE_BYTES, follow=False)  # UnsafeFileError (an OSError) names it
    actual = hashlib.sha256(data).hexdigest()
    if actual != checksum:
        raise ValueError(f"sha256 {actual[:12]}..., the name says {checksum[:12]}...")
    return draw, data


def file_name(draw: int, data: bytes) -> str:
    return f"draw_{draw}.{hashlib.sha256(data).hexdigest()}.parquet"


def parse_name(name: str) -> Optional[tuple[int, str]]:
    """(draw, checksum) of a bank file name, or None for any other name."""
    parts = name.split(".")
    if len(parts) != 3 or parts[2] != "parquet" or not parts[0].startswith("draw_") or len(parts[1]) != 64:
        return None
    try:
        return int(parts[0][len("draw_") :]), parts[1]
    except ValueError:
        return None


def listing(directory: Path, remove_partial: bool) -> list[Path]:
    """The bank files in `directory`. `remove_partial`: half-written temporary files of a killed
    write are removed (only while no writer runs: at the start of a run)."""
    try:
        names = sorted(directory.iterdir())
    except FileNotFoundError:
        return []
    for path in names:
        if remove_partial and path.name.startswith(".draw_") and path.name.endswith(".tmp"):
            unlink(path)
    return [p for p in names if parse_name(p.name) is not None]


def unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
