"""Admission for `serve`: a budget of tokens in flight, shared fairly between clients.

Without it every /generate joined the engine's queue, and a small request waited behind every
long one queued before it (4 of 4 timed out at 60 s behind a flood). Now a request costs its
prompt plus `max_new_tokens`, for each prompt it carries, and is admitted while

- it fits the client's fair share (the budget divided among the clients holding tokens or
  refused in the last `WAITING_S`): always, even when others filled the budget, so a client
  with little in flight gets in at once (the engine batches it with the running requests); or
- it fits what the budget has left and no other client is being turned away.

Anything else is answered 503 with `Retry-After` (the seconds the engine needs, at the rate it
has been finishing tokens, to free the room), so the flooding client backs off and the others
keep their share. Admitted tokens never pass twice the budget. A request larger than the whole
budget runs only when nothing else is in flight. Clients are told apart by an `X-Client-Id`
header, else by their address (cooperative fairness, not a security boundary: the API key is).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Callable, Optional

WAITING_S = 10.0  # a client refused this recently still counts towards the fair share
MAX_RETRY_AFTER_S = 30


class Overloaded(Exception):
    """Not admitted now: retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Admission:
    def __init__(self, budget_tokens: int, clock: Callable[[], float] = time.monotonic):
        if budget_tokens < 1:
            raise ValueError(f"max_tokens_in_flight must be >= 1, got {budget_tokens}")
        self.budget = budget_tokens
        self.clock = clock
        self.held: dict[str, int] = defaultdict(int)  # client -> tokens admitted and not finished
        self.refused_at: dict[str, float] = {}  # client -> when it was last turned away
        self.refused = 0  # requests answered 503
        self._rate = 0.0  # tokens finished per second (moving average)
        self._last_release: Optional[float] = None

    @property
    def in_flight(self) -> int:
        return sum(self.held.values())

    def _waiting(self, now: float) -> set[str]:
        for client, at in list(self.refused_at.items()):
            if now - at > WAITING_S:
                del self.refused_at[client]
        return set(self.refused_at)

    def admit(self, client: str, cost: int) -> None:
        """Count `cost` tokens for `client`, or raise Overloaded."""
        now = self.clock()
        others_waiting = self._waiting(now) - {client}
        active = {c for c, n in self.held.items() if n > 0} | others_waiting | {client}
        share = self.budget / len(active)
        total, mine = self.in_flight, self.held[client]
        if cost > self.budget:
            fits = total == 0  # larger than the whole budget: alone, or never
        else:
            within_share = mine + cost <= share and total + cost <= 2 * self.budget
            fits = within_share or (total + cost <= self.budget and not others_waiting)
        if not fits:
            self.refused += 1
            self.refused_at[client] = now
            raise Overloaded(self._why(client, cost, total, mine, share), self._retry_after(total + cost))
        self.refused_at.pop(client, None)
        self.held[client] += cost

    def release(self, client: str, cost: int) -> None:
        """The admitted request finished (or failed, or its client went away)."""
        self.held[client] -= cost
        if self.held[client] <= 0:
            del self.held[client]
        now = self.clock()
        if self._last_release is not None and now > self._last_release:
            instant = cost / (now - self._last_release)
            self._rate = instant if self._rate == 0 else 0.8 * self._rate + 0.2 * instant
        self._last_release = now

    def _retry_after(self, wanted: int) -> int:
        excess = max(1, wanted - self.budget)
        if self._rate <= 0:
            return 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(excess / self._rate)))

    def _why(self, client: str, cost: int, total: int, mine: int, share: float) -> str:
        if cost > self.budget:
            return (
                f"the request needs {cost} tokens (prompts + max_new_tokens), more than the server's whole "
                f"budget of {self.budget} (--max-tokens-in-flight): it runs only when nothing else is in flight"
            )
        return (
            f"overloaded: {total} of {self.budget} tokens in flight (--max-tokens-in-flight); client "
            f"{client!r} holds {mine}, its fair share is {int(share)}, this request needs {cost}"
        )

    def stats(self) -> dict:
        return {
            "tokens_in_flight": self.in_flight,
            "max_tokens_in_flight": self.budget,
            "clients_in_flight": len(self.held),
            "refused_requests": self.refused,
        }
