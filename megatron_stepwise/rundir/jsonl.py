"""Reading back the JSON-lines files a run appends to (metrics.jsonl).

A crash mid-write (disk full, SIGKILL) leaves a torn line: a record cut short, or bytes that are
not UTF-8. Readers skip it with one warning naming the file and line instead of failing on every
later read, so `plot`, `view` and a resume still work; the writer on resume rewrites the file
without it (metrics/core.py `_truncate_after`). `read_metrics` is here, below the viewer, so
the viewer draws a run's curves from its files alone.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterator

from megatron_stepwise.rundir.paths import RunDir

log = logging.getLogger(__name__)


def read_jsonl_records(path: str, require_iteration: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line without its newline, parsed object) of each good line of `path`; each unreadable
    line (torn JSON, not an object, invalid UTF-8, or with `require_iteration` no integer
    `iteration`, which every metrics record has) is skipped with a warning naming file and line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
                record = json.loads(line)
            except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
                log.warning(
                    "%s line %d is not a complete JSON record (%s): skipped (torn by a crash?)", path, number, e
                )
                continue
            if not isinstance(record, dict):
                log.warning("%s line %d is %s, not a JSON object: skipped", path, number, type(record).__name__)
                continue
            iteration = record.get("iteration")
            if require_iteration and (not isinstance(iteration, int) or isinstance(iteration, bool)):
                log.warning("%s line %d has no integer 'iteration' (%r): skipped", path, number, iteration)
                continue
            yield line, record


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl (`run_dir` may name the file itself); a torn line (a
    crash mid-write) or one without an integer `iteration` is dropped with one warning."""
    path = str(RunDir(run_dir).metrics) if os.path.isdir(run_dir) else run_dir
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir!r}: is it a run directory?")
    return [record for _, record in read_jsonl_records(path, require_iteration=True)]
