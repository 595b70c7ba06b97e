"""The trainer's side of "every weight sync verified": record what a push sent, judge the answers.

`PushRecord` takes each bucket as it is sent (on whichever rank holds it) and keeps a
`weight_checks.TensorCheck` per tensor; `mismatch_message` turns the engines' answers into the
one error that stops the run, naming the tensor, the engine and the weight version.
The protocol and its cost: docs/weights.md, 'Every sync verified'.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Optional

import torch

from megatron_stepwise import weight_checks

MAX_NAMED = 3  # tensors named per engine in the error; the rest are counted


class WeightMismatch(RuntimeError):
    """An engine holds other weights than the trainer sent (named in the message)."""


class PushRecord:
    """The checks of one push's tensors (those this rank sent) and the seconds spent taking them."""

    def __init__(self, version: int, mode: str):
        if mode not in weight_checks.VERIFY_MODES or mode == "off":
            raise ValueError(f"weight_sync.verify must be 'sampled' or 'full' to record a push, got {mode!r}")
        self.version, self.mode = int(version), mode
        self.checks = weight_checks.Checks()
        self.seconds = 0.0

    def add(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        start = time.perf_counter()
        for name, tensor in bucket:
            self.checks[name] = weight_checks.check_of(name, tensor, self.version, self.mode)
        self.seconds += time.perf_counter() - start

    def merge(self, others: Iterable[Optional[tuple[dict, float]]]) -> None:
        """Fold in other ranks' (checks, seconds) (disk mode: each stage records its own files)."""
        for other in others:
            if other is not None:
                checks, seconds = other
                self.checks.update(checks)
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
