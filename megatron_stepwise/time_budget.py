"""Where an iteration's wall time goes: a budget whose parts add up to the iteration.

`ActivityClock` attributes the rollout's wall time while many trajectories run at once: each
instant goes to the highest-priority activity in flight (generation, then environment), so
overlapping calls are counted once and the parts never exceed the wall time. `TimeBudget`
splits rank 0's iteration into generation, environment, host work (agent loop, tokenisation,
validation, prepare and plan, dumps), hand-off, training, weight push and idle (the rest:
metrics, waits), all read from one clock, which tests replace with a controllable one.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

GENERATION, ENVIRONMENT = "generation", "environment"
PRIORITY = (GENERATION, ENVIRONMENT)
PARTS = ("generation", "environment", "host", "handoff", "train", "weight_push", "idle")


class ActivityClock:
    """Seconds during which some generation was in flight, and environment calls (but no generation)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = defaultdict(int)
        self._totals: dict[str, float] = defaultdict(float)
        self._since = clock()

    def _settle(self) -> None:
        now = self.clock()
        top = next((k for k in PRIORITY if self._in_flight[k] > 0), None)
        if top is not None:
            self._totals[top] += now - self._since
        self._since = now

    @contextmanager
    def active(self, kind: str) -> Iterator[None]:
        with self._lock:
            self._settle()
            self._in_flight[kind] += 1
        try:
            yield
        finally:
            with self._lock:
                self._settle()
                self._in_flight[kind] -= 1

    def snapshot(self) -> dict[str, float]:
        """Cumulative seconds per activity up to now."""
        with self._lock:
            self._settle()
            return {k: self._totals[k] for k in PRIORITY}


class _NoActivity:
    """What an agent loop reports to when nobody measures it."""

    @contextmanager
    def active(self, kind: str) -> Iterator[None]:
        yield

    def snapshot(self) -> dict[str, float]:
        return {k: 0.0 for k in PRIORITY}


NO_ACTIVITY = _NoActivity()


class TimeBudget:
    """One iteration's budget: `rollout` around taking a round, `part` around the other phases."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, activity=NO_ACTIVITY):
        self.clock, self.activity = clock, activity
        self.parts: dict[str, float] = defaultdict(float)
        self.start = clock()

    @contextmanager
    def rollout(self, produced: Callable[[], float]) -> Iterator[None]:
        """Taking a round: rank 0's produce time (`produced()`, cumulative seconds) holds the
        rollout (generation and environment by `activity`, the rest host work); what the take
        spends outside it is the hand-off (or, on other ranks, waiting for rank 0)."""
        t, p, a = self.clock(), produced(), self.activity.snapshot()
        try:
            yield
        finally:
            took, prod = self.clock() - t, produced() - p
            after = self.activity.snapshot()
            gen, env = after[GENERATION] - a[GENERATION], after[ENVIRONMENT] - a[ENVIRONMENT]
            self.parts["generation"] += gen
            self.parts["environment"] += env
            self.parts["host"] += max(prod - gen - env, 0.0)
            self.parts["handoff"] += max(took - max(prod, gen + env), 0.0)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t = self.clock()
        try:
            yield
        finally:
            self.parts[name] += self.clock() - t

    def finish(self, tokens: int = 0, devices: Optional[int] = None) -> dict[str, float]:
        """`budget/<part>` seconds (idle: the wall time no part holds), `budget/wall`, and tokens/s
        per device when given."""
        wall = self.clock() - self.start
        out = {f"budget/{k}": self.parts.get(k, 0.0) for k in PARTS if k != "idle"}
        out["budget/idle"] = max(wall - sum(out.values()), 0.0)
        out["budget/wall"] = wall
        if devices:
            out["perf/tokens_per_s_per_gpu"] = tokens / max(wall, 1e-9) / devices
        return out


def budget_line(records: list[dict]) -> Optional[str]:
    """`time budget per iteration (mean): generation 0.41 s (44%), ...` over metrics records."""
    rows = [r for r in records if "budget/wall" in r]
    if not rows:
        return None
    wall = sum(r["budget/wall"] for r in rows) / len(rows)
    parts = []
    for k in PARTS:
        v = sum(r.get(f"budget/{k}", 0.0) for r in rows) / len(rows)
        parts.append(f"{k} {v:.3g} s ({100 * v / max(wall, 1e-9):.0f}%)")
    return f"time budget per iteration (mean of {len(rows)}, wall {wall:.3g} s): " + ", ".join(parts)
