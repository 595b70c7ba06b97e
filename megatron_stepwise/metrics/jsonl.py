"""Reading back the JSON-lines files a run appends to (metrics.jsonl).

A crash mid-write (disk full, SIGKILL) leaves a torn line: a record cut short, or bytes that are
not UTF-8. Readers skip it with one warning naming the file and line instead of failing on every
later read, so `plot`, `view` and a resume still work; the writer on resume rewrites the file
without it (metrics/core.py `_truncate_after`).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterator

log = logging.getLogger(__name__)


def read_jsonl_records(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line without its newline, parsed object) of each good line of `path`; each unreadable
    line (torn JSON, not an object, invalid UTF-8) is skipped with a warning naming file and line."""
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
            yield line, record
