"""Test fault injection: a deterministic pause where a fault must land. Never set in production.

`STEPWISE_FAULT_PAUSE_FETCH=<dir>`: before a data-parallel replica's leader fetches a round's rows
from the agent workers (`workers/worker_rows.py`, `RowFetcher.fetch`), it creates
`<dir>/fetching.<rank>.<key>` and waits until `<dir>/go.<key>` exists (`key`: the round, the
iteration in synchronous training), at most `PAUSE_DEADLINE_S`. A test that wants a fault inside
the fetch (a window of milliseconds otherwise) waits for the `fetching` file, injects the fault,
then creates `go.<key>`; it releases the rounds it lets through by creating their `go` files first.

`STEPWISE_FAULT_PAUSE_ROLLOUT=<dir>`: the same before rank 0 rolls out a round (the iteration, in
synchronous training; `loop/sources.py`), its marker `<dir>/rollout.0.<key>`: a fault then lands
at the start of that rollout, not wherever the test's reaction time happens to put it.

The variables are read once, at import; unset, each hook is one comparison with None.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Mapping, Optional

FETCH_VARIABLE = "STEPWISE_FAULT_PAUSE_FETCH"
ROLLOUT_VARIABLE = "STEPWISE_FAULT_PAUSE_ROLLOUT"
PAUSE_DEADLINE_S = 900.0  # a forgotten `go` file fails the run rather than hanging it
POLL_S = 0.05


class FaultPauseTimeout(RuntimeError):
    """The test that set the variable never released the pause."""


class FilePause:
    """Waits at a named point until a test's file says go (see the module docstring)."""

    def __init__(self, directory: Path, variable: str, deadline_s: float = PAUSE_DEADLINE_S, point: str = "fetching"):
        self.directory, self.variable, self.deadline_s = Path(directory), variable, deadline_s
        self.point = point  # the marker's name: what is paused

    @classmethod
    def from_env(
        cls, variable: str, environ: Mapping[str, str] = os.environ, point: str = "fetching"
    ) -> Optional["FilePause"]:
        value = environ.get(variable, "")
        return cls(Path(value), variable, point=point) if value else None

    def wait(self, key: int, rank: Optional[str] = None) -> None:
        rank = rank if rank is not None else os.environ.get("RANK", "0")
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"{self.point}.{rank}.{key}").touch()
        go = self.directory / f"go.{key}"
        deadline = time.monotonic() + self.deadline_s
        while not go.exists():
            if time.monotonic() > deadline:
                raise FaultPauseTimeout(
                    f"{self.variable}={self.directory}: {go.name} did not appear there within {self.deadline_s:g} s "
                    f"(test fault injection; unset {self.variable} to train without pausing)"
                )
            time.sleep(POLL_S)


FETCH_PAUSE = FilePause.from_env(FETCH_VARIABLE)
ROLLOUT_PAUSE = FilePause.from_env(ROLLOUT_VARIABLE, point="rollout")


def before_fetch(key: int) -> None:
    """The hook in the row fetch: pauses only under STEPWISE_FAULT_PAUSE_FETCH."""
    if FETCH_PAUSE is not None:
        FETCH_PAUSE.wait(key)


def before_rollout(key: int) -> None:
    """The hook at the start of rank 0's rollout: pauses only under STEPWISE_FAULT_PAUSE_ROLLOUT."""
    if ROLLOUT_PAUSE is not None:
        ROLLOUT_PAUSE.wait(key)
