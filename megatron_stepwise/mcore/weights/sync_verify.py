"""The trainer's side of "every weight sync verified": record what a push sent, judge the answers.

`PushRecord` takes each bucket as it is sent (on whichever rank holds it), sampling it on a
helper thread beside the transfer, and keeps a `weight_checks.TensorCheck` per tensor; `mismatch_message` turns the engines' answers into the
one error that stops the run, naming the tensor, the engine and the weight version.
The protocol and its cost: docs/weights.md, 'Every sync verified'.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from typing import Any, Iterable, Optional

import torch

from megatron_stepwise import weight_checks

MAX_NAMED = 3  # tensors named per engine in the error; the rest are counted


class WeightMismatch(RuntimeError):
    """An engine holds other weights than the trainer sent (named in the message)."""


class PushRecord:
    """The checks of one push's tensors (those this rank sent) and the seconds the push spent on
    them.

    With a `sampler` (a one-thread executor) the sampling of CPU buckets runs beside the push:
    `add` hands a bucket over and returns, and the push waits only for a bucket still being
    sampled when the next one comes (at most one in flight, so no bucket is held longer than the
    push's own loop holds it) and, in `finish`, for the last one. `seconds` counts those waits."""

    def __init__(self, version: int, mode: str, sampler: Optional[Executor] = None):
        if mode not in weight_checks.VERIFY_MODES or mode == "off":
            raise ValueError(f"weight_sync.verify must be 'sampled' or 'full' to record a push, got {mode!r}")
        self.version, self.mode = int(version), mode
        self.checks = weight_checks.Checks()
        self.seconds = 0.0
        self._sampler = sampler if mode == "sampled" else None  # full hashes whole buckets: kept in line
        self._pending: Optional[Future] = None
        self._packing: Optional[Future] = None

    def add(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        start = time.perf_counter()
        bucket = list(bucket)
        self._collect()
        if self._sampler is not None and all(t.device.type == "cpu" for _, t in bucket):
            # (GPU buckets are sampled in line: cheap there, and no stream to order against)
            self._pending = self._sampler.submit(weight_checks.checks_of, bucket, self.version, self.mode)
        else:
            self.checks.update(weight_checks.checks_of(bucket, self.version, self.mode))
        self.seconds += time.perf_counter() - start

    def finish(self) -> None:
        """Wait for the bucket still being sampled (before the checks are sent)."""
        start = time.perf_counter()
        self._collect()
        self.seconds += time.perf_counter() - start

    def pack_ahead(self) -> None:
        """The record is complete: pickle it on the sampler thread while the engines load."""
        self.finish()
        if self._sampler is not None and self.checks:
            self._packing = self._sampler.submit(weight_checks.PackedChecks, self.checks)

    def to_send(self) -> Any:
        """What goes to the engines: the packed record when `pack_ahead` made one, else the checks."""
        return self._packing.result() if self._packing is not None else self.checks

    def _collect(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.checks.update(pending.result())

    def merge(self, others: Iterable[Optional[tuple[dict, float]]]) -> None:
        """Fold in other ranks' (checks, seconds) (disk mode: each stage records its own files)."""
        for other in others:
            if other is not None:
                checks, seconds = other
                self.checks.update(checks)
                self._packing = None  # no longer the whole record
                self.seconds = max(self.seconds, seconds)  # stages record in parallel


def mismatch_message(answers: list[dict[str, Any]], version: int) -> Optional[str]:
    """The error for engines whose weights differ from what was sent at `version` (None if none)."""
    lines = []
    for a in answers:
        if a.get("unverified"):
            continue
        who = f"engine {a['index']} ({a.get('engine', '?')})"
        problems = dict(a.get("problems") or {})
        if int(a.get("weight_version", version)) != int(version):
            problems = {"(weight version)": f"the engine reports version {a['weight_version']}", **problems}
        if not problems:
            continue
        named = "; ".join(f"{name}: {why}" for name, why in list(problems.items())[:MAX_NAMED])
        more = f"; and {len(problems) - MAX_NAMED} more tensors" if len(problems) > MAX_NAMED else ""
        lines.append(f"{who} holds {len(problems)} tensor(s) other than sent: {named}{more}")
    if not lines:
        return None
    return f"weight sync of version {version} verified wrong: " + " | ".join(lines)
