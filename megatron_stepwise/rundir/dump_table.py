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
TOKEN_ID_COLUMNS = ("prompt_ids", "response_ids")
# one value per response token: a row whose list is longer or shorter cannot be drawn or replayed
PER_RESPONSE_TOKEN = ("loss_mask", "rollout_logprobs", "rollout_logprobs_known", "advantages", "trainer_logprobs")
INT32_MAX = 2**31 - 1


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
    check_rows(table, path)
    return meta, table


def check_rows(table, path: Path) -> None:
    """A dump is data from a file anyone may have written: its strings must be UTF-8, its token
    ids int32 and not negative, its per-token lists as long as the response (each a DumpError
    naming the column and row, where they were tracebacks from deep inside the viewer)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        table.validate(full=True)  # invalid UTF-8 in a string column, offsets past the data
    except pa.ArrowInvalid as e:
        raise DumpError(f"{path} is corrupt: {e}") from None
    names = set(table.column_names)
    for name in TOKEN_ID_COLUMNS:
        if name not in names:
            continue
        column = table.column(name)
        if not (pa.types.is_list(column.type) and pa.types.is_integer(column.type.value_type)):
            raise DumpError(f"{path}: column {name} holds {column.type}, not lists of token ids")
        flat = pc.list_flatten(column)
        bounds = pc.min_max(flat)
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        if low is not None and (low < 0 or high > INT32_MAX):
            first = pc.index(pc.or_(pc.less(flat, 0), pc.greater(flat, INT32_MAX)), True).as_py()
            row = pc.list_parent_indices(column)[first].as_py()
            raise DumpError(f"{path}: row {row}: {name} holds token id {flat[first].as_py()}, outside [0, {INT32_MAX}]")
    if "response_ids" not in names:
        return
    lengths = pc.list_value_length(table.column("response_ids"))
    for name in PER_RESPONSE_TOKEN:
        if name not in names:
            continue
        column = table.column(name)
        if not pa.types.is_list(column.type):
            raise DumpError(f"{path}: column {name} holds {column.type}, not one list per row")
        mine = pc.list_value_length(column)
        ragged = pc.fill_null(pc.not_equal(mine, lengths), False)
        if pc.any(ragged).as_py():
            row = pc.index(ragged, True).as_py()
            raise DumpError(
                f"{path}: row {row}: {name} has {mine[row].as_py()} values for {lengths[row].as_py()} response tokens"
            )
