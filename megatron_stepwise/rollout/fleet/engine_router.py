"""One request to one of several engine actors: sticky sessions, least outstanding, retries.

The fleet on the driver and every agent worker route the same way through `EngineRouter`: its
policy (rollout/fleet/session_routing.py, `rollout.routing`) picks the engine of each turn from the live
ones; by default a session's turns go back to the engine that served its previous turn
(prefix-cache reuse) while it is alive and has at most `sticky_slack` more outstanding requests
than the least busy engine; a new session, or one whose engine is dead or that much busier, goes
to the engine with the fewest outstanding requests. A session served elsewhere than its previous
turn counts as a re-pin (`repins`). A request whose engine dies,
errors or times out is retried from scratch on another engine (at most `max_retries` times),
its late result dropped and the request aborted on its engine. What a death means is the
owner's `on_dead(slot, incarnation)`: the fleet restarts the engine, an agent worker stops
using it and reports it to the fleet.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_stepwise.rollout.engines.protocol import (
    EngineError,
    EngineReleasedError,
    GenerateResult,
    NoLiveEngine,
    SamplingParams,
)
from megatron_stepwise.rollout.engines.sglang import EngineRequestError
from megatron_stepwise.rollout.fleet.actor_loss import actor_gone_errors
from megatron_stepwise.rollout.fleet.session_routing import RoutingPolicy, Sticky

log = logging.getLogger(__name__)
ORPHAN = -1  # the engine a session remembers after its own died: none


@dataclass
class RequestCounters:
    requests: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engines' prefix caches served
    retries: int = 0
    timeouts: int = 0
    repins: int = 0  # turns of a session served on another engine than its previous turn
    aborted_by_update: int = 0  # requests a pause for a weight update ended (0 unless pause_mode "abort")
    dropped_stale: int = 0  # requests ended because their start version fell past the staleness bound
    scored_tokens: int = 0  # tokens teachers scored (`score` requests, counted in `requests` too)


@dataclass
class EngineSlot:
    """One engine as a router sees it; `incarnation` grows with every restart."""

    index: int
    handle: Any
    incarnation: int = 0
    alive: bool = True
    outstanding: int = 0
    outstanding_tokens: int = 0  # prompt + max_new_tokens of the requests in flight


class EngineRouter:
    """`handle.generate.remote(...)` and `handle.call.remote(...)` are awaited (Ray actor handles).
    `policy` picks each turn's engine (default: `Sticky(sticky_slack)`, where `sticky_slack` is how
    many more outstanding requests than the least busy engine a session's engine may have and
    still get its next turn); `max_sessions`: sessions remembered (the least recently served are
    forgotten first)."""

    def __init__(
        self,
        slots: list[EngineSlot],
        *,
        max_retries: int,
        request_timeout_s: float,
        on_dead: Callable[[EngineSlot, int], None],
        counters: Optional[RequestCounters] = None,
        sticky_slack: int = 16,
        max_sessions: int = 1 << 16,
        policy: Optional[RoutingPolicy] = None,
    ):
        self.slots = slots
        self.max_retries = max_retries
        self.request_timeout_s = request_timeout_s
        self.on_dead = on_dead
        self.counters = counters or RequestCounters()
        self.max_sessions = max_sessions
        self.policy = policy or Sticky(sticky_slack)
        self.sticky: OrderedDict[str, int] = OrderedDict()

    def forget(self, index: int) -> None:
        """Sessions of a dead engine start afresh elsewhere: they stay remembered as orphans
        (`ORPHAN`), so that serving their next turn counts as a re-pin."""
        for session in [k for k, v in self.sticky.items() if v == index]:
            self.sticky[session] = ORPHAN

    def pick(self, session: Optional[str], exclude: set[int], cost: int = 0) -> EngineSlot:
        """The engine for a request of `cost` tokens: never a dead one, nor one in `exclude`
        (tried already for this request) while another is alive."""
        candidates = [s for s in self.slots if s.alive and s.index not in exclude]
        if not candidates:
            candidates = [s for s in self.slots if s.alive]
        if not candidates:
            raise NoLiveEngine("no live engine in the fleet")
        index = self.sticky.get(session) if session is not None else None
        pinned = next((s for s in candidates if s.index == index), None) if index is not None else None
        return self.policy.choose(pinned, candidates, cost)

    def remember(self, session: str, index: int) -> None:
        """`session`'s turn was served by engine `index`: its next turn starts there."""
        if self.sticky.get(session, index) != index:
            self.counters.repins += 1
        self.sticky[session] = index
        self.sticky.move_to_end(session)
        while len(self.sticky) > self.max_sessions:
            self.sticky.popitem(last=False)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: Optional[str] = None, session: Optional[str] = None
    ) -> GenerateResult:
        cost = len(input_ids) + sampling.max_new_tokens
        send = lambda slot: slot.handle.generate.remote(input_ids, sampling, rid, session)  # noqa: E731
        slot, result = await self._attempts(send, cost, rid, session)
        if session is not None:
            self.remember(session, slot.index)
        self.counters.requests += 1
        self.counters.generated_tokens += len(result.output_ids)
        self.counters.prompt_tokens += len(input_ids)
        self.counters.cached_tokens += result.cached_tokens
        self.counters.aborted_by_update += result.abort_reason == "pause"
        self.counters.dropped_stale += result.abort_reason == "stale"
        return result

    async def score(self, input_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """Teacher log-probs (`Engine.score`) on one engine, retried on another like `generate`."""
        send = lambda slot: slot.handle.call.remote("score", input_ids, start, temperature)  # noqa: E731
        _, values = await self._attempts(send, len(input_ids), None, None)
        self.counters.requests += 1
        self.counters.scored_tokens += len(values)
        return values

    async def _attempts(
        self, send: Callable[[EngineSlot], Any], cost: int, rid: Optional[str], session: Optional[str]
    ) -> tuple[EngineSlot, Any]:
        """`send(slot)` awaited on an engine the policy picks (for a request of `cost` tokens), again
        on another one after a failure or a timeout (at most `max_retries` times); the engine that
        answered and its answer. A request the engine refused as bad is raised at once."""
        import ray

        tried: set[int] = set()
        for attempt in range(self.max_retries + 1):
            slot = self.pick(session, tried, cost)
            tried.add(slot.index)
            slot.outstanding += 1
            slot.outstanding_tokens += cost
            incarnation = slot.incarnation
            try:
                result = await asyncio.wait_for(send(slot), self.request_timeout_s)
            except asyncio.TimeoutError:
                self.counters.timeouts += 1
                error: BaseException = EngineError(f"engine {slot.index} timed out after {self.request_timeout_s}s")
                if rid is not None and slot.alive:
                    slot.handle.call.remote("abort", rid)  # fire and forget; its late result is dropped
                await self.check_engine(slot, incarnation)
            except actor_gone_errors() as e:
                error = e
                self.on_dead(slot, incarnation)
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                if isinstance(cause, (EngineRequestError, EngineReleasedError, ValueError, KeyError, TypeError)):
                    raise cause from None  # the request itself is bad: retrying elsewhere won't help
                error = cause
                await self.check_engine(slot, incarnation)
            else:
                return slot, result
            finally:
                slot.outstanding -= 1
                slot.outstanding_tokens -= cost
            if attempt < self.max_retries:
                self.counters.retries += 1
                log.warning("request %s failed on engine %d (%r); retrying", rid, slot.index, error)
        raise EngineError(f"request {rid} failed after {self.max_retries + 1} attempts: {error!r}")

    async def check_engine(self, slot: EngineSlot, incarnation: int) -> None:
        """After an error or timeout: an engine that fails its health check is treated as dead."""
        import ray

        try:
            healthy = await asyncio.wait_for(slot.handle.call.remote("health"), 10)
        except (asyncio.TimeoutError, ray.exceptions.RayError):
            healthy = False
        if not healthy:
            self.on_dead(slot, incarnation)


class EngineView:
    """An agent worker's generator: routes its own requests over the fleet's engines.

    The fleet on the driver owns the engines (restarts, weight updates). The view gets the
    fleet's engine table with every batch of work (`refresh`); an engine it finds dead it stops
    using and reports (`take_report`), and the fleet restarts it, so the next table has it back.
    """

    def __init__(self, *, max_retries: int, request_timeout_s: float, policy: Optional[RoutingPolicy] = None):
        self.router = EngineRouter(
            [], max_retries=max_retries, request_timeout_s=request_timeout_s, on_dead=self._dead, policy=policy
        )
        self._deaths: list[tuple[int, int]] = []

    def refresh(self, table: list[EngineSlot]) -> None:
        current = {s.index: s for s in self.router.slots}
        slots = []
        for t in table:
            mine = current.get(t.index)
            if mine is not None and mine.incarnation == t.incarnation:
                mine.alive = mine.alive and t.alive  # a death seen here stands until a restart
                slots.append(mine)
            else:
                slots.append(EngineSlot(t.index, t.handle, t.incarnation, t.alive))
        self.router.slots[:] = slots  # in place: requests in flight keep their slot objects

    def _dead(self, slot: EngineSlot, incarnation: int) -> None:
        if slot.alive and slot.incarnation == incarnation:
            slot.alive = False
            self.router.forget(slot.index)
            self._deaths.append((slot.index, incarnation))

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: Optional[str] = None, session: Optional[str] = None
    ) -> GenerateResult:
        return await self.router.generate(input_ids, sampling, rid, session)

    async def score(self, input_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        return await self.router.score(input_ids, start, temperature)

    def take_report(self) -> tuple[list[tuple[int, int]], RequestCounters]:
        """(engines found dead, request counters) since the last report."""
        deaths, counters = self._deaths, self.router.counters
        self._deaths, self.router.counters = [], RequestCounters()
        return deaths, counters
