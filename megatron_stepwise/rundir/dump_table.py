"""A rollout dump's rows and metadata read from its Parquet file, without torch (the viewer's
reading; rundir/dumps.py writes dumps and rebuilds their batches). The format: rundir/dumps.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_stepwise.errors import UserError
from megatron_stepwise.rundir.paths import RunDir

META_KEY = b"megatron_stepwise.dump"
FORMAT_VERSION = 1


class DumpError(UserError, ValueError):
    """A dump that is missing or does not hold what was asked (named in the message)."""


def dump_path(run_dir: str | Path, iteration: int) -> Path:
    return RunDir(run_dir).dump(iteration)


def dumped_iterations(run_dir: str | Path) -> list[int]:
    return RunDir(run_dir).dumped_iterations()


def read_dump_table(
    run_dir: str | Path,
    iteration: Optional[int] = None,
    columns: Optional[Sequence[str]] = None,
    optional: Sequence[str] = (),
) -> tuple[dict[str, Any], Any]:
    """The metadata and rows (pyarrow Table; only `columns` when given, and those of `optional`
    the file has: columns added since older dumps were written) of `iteration`'s dump (default:
    the last one dumped)."""
    import pyarrow.parquet as pq

    available = dumped_iterations(run_dir)
    if iteration is None:
        if not available:
            raise DumpError(f"no rollout dumps in {RunDir(run_dir).dumps} (train with trainer.dump_rollouts=N)")
        iteration = available[-1]
    path = dump_path(run_dir, iteration)
    if not path.is_file():
        raise DumpError(
            f"no dump of iteration {iteration} in {path.parent}: dumped iterations are "
            f"{available or 'none'} (trainer.dump_rollouts=N dumps every N-th)"
        )
    try:
        if columns is not None and optional:
            present = set(pq.read_schema(path).names)
            columns = list(columns) + [c for c in optional if c in present]
        table = pq.read_table(path, columns=list(columns) if columns is not None else None)
    except (OSError, ValueError) as e:  # pyarrow's errors derive from these
        raise DumpError(f"{path} is not a readable Parquet file: {e}") from e
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise DumpError(f"{path} is not a megatron-stepwise rollout dump (no {META_KEY.decode()} metadata)")
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise DumpError(f"{path}: its {META_KEY.decode()} metadata is not JSON: {e}") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("iteration"), int):
        raise DumpError(f"{path}: its {META_KEY.decode()} metadata has no integer 'iteration'")
    return meta, table
