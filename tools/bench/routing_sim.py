"""Replays a trace (tools/bench/routing_traces.py) through `EngineRouter` over simulated engines.

The router is the real one (rollout/fleet/engine_router.py, with a policy of rollout/fleet/session_routing.py):
the simulation calls its `pick`, `remember` and `forget` exactly where `EngineRouter.generate`
does, and keeps each engine's `outstanding` and `outstanding_tokens` as `generate` does.

An engine (`SimEngine`) has an LRU prefix cache of `cache_tokens` tokens in whole blocks
(`BlockCache`: a lookup matches the prompt's leading blocks; a finished request stores all its
blocks, deepest first, so an eviction takes the least recently used tails before their
prefixes), and serves its requests by processor sharing (continuous batching, roughly): a
request's work is `prefill_s` per uncached prompt token + `decode_s` per generated token, and the
requests in flight share the engine equally.

Engine kill (`kill_engine`, `kill_at_s`): the engine stops; each request it was serving fails
`detect_s` later (the caller's RPC error), and so does a request the router sends it before it
has seen a failure. A failure marks the engine dead (`on_dead`: not alive, its sessions
orphaned) and the request is retried on another engine, as `generate` does. Each session pinned
to the killed engine at the kill is an orphan; for each, the report gives the attempts its first
request after the kill took and the seconds until that request was served (from the kill, and
from the request's own start).

Reported: prefix-hit rate (prompt tokens served from a cache / prompt tokens), engine load as
the work routed to each engine (max / mean over the engines, over the whole trace and per
`window_s` window, weighted by the window's work), re-pins, request latency and the time the
last request finished.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from routing_traces import Session, Turn

from megatron_stepwise.rollout.fleet.engine_router import EngineRouter, EngineSlot
from megatron_stepwise.rollout.fleet.session_routing import RoutingPolicy


class BlockCache:
    """LRU set of block keys, at most `max_blocks` of them."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, turn: Turn) -> int:
        """Leading prompt blocks of `turn` in the cache."""
        n = 0
        for k in range(turn.prompt_blocks):
            if turn.blocks[k] not in self.blocks:
                break
            n += 1
        return n

    def store(self, turn: Turn) -> None:
        for k in range(len(turn.blocks) - 1, -1, -1):  # deepest first: prefixes end most recent
            key = turn.blocks[k]
            if key in self.blocks:
                self.blocks.move_to_end(key)
            else:
                self.blocks[key] = None
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()


@dataclass
class Request:
    session: Session
    turn_index: int
    issued_s: float
    attempts: int = 0
    tried: set[int] = field(default_factory=set)
    work_s: float = 0.0  # left to serve on its engine (at full engine speed)
    engine: int = -1

    @property
    def turn(self) -> Turn:
        return self.session.turns[self.turn_index]

    @property
    def cost(self) -> int:
        return self.turn.prompt_tokens + self.turn.max_new_tokens


@dataclass
class SimEngine:
    index: int
    cache: BlockCache
    dead: bool = False
    jobs: list[Request] = field(default_factory=list)
    clock_s: float = 0.0
    version: int = 0  # grows with every change of its jobs: older completion events are stale

    def advance(self, now: float) -> None:
        if self.jobs:
            share = (now - self.clock_s) / len(self.jobs)
            for r in self.jobs:
                r.work_s -= share
        self.clock_s = now

    def next_done_s(self) -> Optional[float]:
        if not self.jobs:
            return None
        return self.clock_s + max(0.0, min(r.work_s for r in self.jobs)) * len(self.jobs)


@dataclass
class SimConfig:
    engines: int = 8
    cache_tokens: int = 262144
    prefill_s: float = 5e-5  # per uncached prompt token
    decode_s: float = 4e-4  # per generated token
    window_s: float = 60.0
    kill_engine: Optional[int] = None
    kill_at_s: float = 0.0
    detect_s: float = 0.5
    max_retries: int = 2


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def replay(trace: list[Session], policy: RoutingPolicy, cfg: SimConfig) -> dict[str, Any]:
    """Every turn of `trace` through an `EngineRouter` with `policy` (see the module docstring)."""
    slots = [EngineSlot(i, None) for i in range(cfg.engines)]
    block_tokens = next((t.block_tokens for s in trace for t in s.turns), 1)
    engines = [SimEngine(i, BlockCache(cfg.cache_tokens // block_tokens)) for i in range(cfg.engines)]

    def on_dead(slot: EngineSlot, incarnation: int) -> None:  # as an agent worker's EngineView
        if slot.alive:
            slot.alive = False
            router.forget(slot.index)

    router = EngineRouter(slots, max_retries=cfg.max_retries, request_timeout_s=3600, on_dead=on_dead, policy=policy)
    events: list[tuple] = []
    seq = itertools.count()

    def at(t: float, kind: str, payload: Any) -> None:
        heapq.heappush(events, (t, next(seq), kind, payload))

    for s in trace:
        at(s.start_s, "request", Request(s, 0, s.start_s))
    for epoch_start in sorted({s.start_s for s in trace if s.epoch > 0}):
        at(epoch_start - 1e-9, "flush", None)
    if cfg.kill_engine is not None:
        at(cfg.kill_at_s, "kill", cfg.kill_engine)

    prompt = cached = failed = in_flight_at_kill = 0
    work = [0.0] * cfg.engines
    windows: dict[int, list[float]] = {}
    latencies: list[float] = []
    orphans: dict[str, dict[str, float]] = {}  # session -> its re-pin, filled when served again
    kill_s = 0.0
    done_sessions: set[str] = set()
    last_done = 0.0

    def schedule(e: SimEngine) -> None:
        e.version += 1
        t = e.next_done_s()
        if t is not None:
            at(t, "done", (e.index, e.version))

    def send(r: Request, now: float) -> None:
        slot = router.pick(r.session.name, r.tried, r.cost)
        r.tried.add(slot.index)
        r.attempts += 1
        r.engine = slot.index
        slot.outstanding += 1
        slot.outstanding_tokens += r.cost
        e = engines[slot.index]
        if e.dead:
            at(now + cfg.detect_s, "fail", r)
            return
        nonlocal prompt, cached
        hit = min(e.cache.match(r.turn) * r.turn.block_tokens, max(0, r.turn.prompt_tokens - 1))
        prompt += r.turn.prompt_tokens
        cached += hit
        r.work_s = cfg.prefill_s * (r.turn.prompt_tokens - hit) + cfg.decode_s * r.turn.new_tokens
        work[e.index] += r.work_s
        windows.setdefault(int(now // cfg.window_s), [0.0] * cfg.engines)[e.index] += r.work_s
        e.advance(now)
        e.jobs.append(r)
        schedule(e)

    def release(r: Request) -> None:
        slot = slots[r.engine]
        slot.outstanding -= 1
        slot.outstanding_tokens -= r.cost

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "request":
            send(payload, now)
        elif kind == "flush":
            for e in engines:
                e.cache.clear()
        elif kind == "kill":
            e = engines[payload]
            e.advance(now)
            e.dead, kill_s = True, now
            in_flight_at_kill = len(e.jobs)
            for r in e.jobs:
                at(now + cfg.detect_s, "fail", r)
            e.jobs = []
            e.version += 1
            for session, index in router.sticky.items():
                if index == payload and session not in done_sessions:
                    orphans[session] = {}
        elif kind == "fail":
            r = payload
            release(r)
            failed += 1
            router.on_dead(slots[r.engine], 0)
            if r.attempts > cfg.max_retries:
                raise RuntimeError(f"request of {r.session.name} failed {r.attempts} times")
            router.counters.retries += 1
            send(r, now)
        elif kind == "done":
            index, version = payload
            e = engines[index]
            if version != e.version or e.dead:
                continue
            e.advance(now)
            finished = [r for r in e.jobs if r.work_s <= 1e-12]
            e.jobs = [r for r in e.jobs if r.work_s > 1e-12]
            for r in finished:
                release(r)
                e.cache.store(r.turn)
                router.remember(r.session.name, index)
                latencies.append(now - r.issued_s)
                last_done = max(last_done, now)
                name = r.session.name
                if name in orphans and not orphans[name]:  # its first turn served since the kill
                    orphans[name] = {
                        "attempts": r.attempts,
                        "since_kill_s": now - kill_s,
                        "latency_s": now - r.issued_s,
                    }
                if r.turn_index + 1 < len(r.session.turns):
                    at(now + r.turn.think_s, "request", Request(r.session, r.turn_index + 1, now + r.turn.think_s))
                else:
                    done_sessions.add(name)
            schedule(e)

    return _report(
        policy, cfg, prompt, cached, work, windows, latencies, last_done, router, orphans, failed, in_flight_at_kill
    )


def _report(policy, cfg, prompt, cached, work, windows, latencies, last_done, router, orphans, failed, in_flight):
    live = [i for i in range(cfg.engines) if i != cfg.kill_engine]
    mean = statistics.fmean(work[i] for i in live) if live else 0.0
    weighted = total = 0.0
    for per_engine in windows.values():  # the engines alive throughout; a window's weight is its work
        w = [per_engine[i] for i in live]
        if sum(w) > 0:
            weighted += max(w) / statistics.fmean(w) * sum(w)
            total += sum(w)
    out: dict[str, Any] = {
        "policy": policy.name,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "work_s_per_engine": [round(w, 3) for w in work],
        "imbalance": max(work[i] for i in live) / mean if mean else 1.0,
        "imbalance_windowed": weighted / total if total else 1.0,
        "repins": router.counters.repins,
        "requests": len(latencies),
        "latency_p50_s": _percentile(latencies, 0.5),
        "latency_p99_s": _percentile(latencies, 0.99),
        "makespan_s": last_done,
    }
    if cfg.kill_engine is not None:
        served = [o for o in orphans.values() if o]
        out["kill"] = {
            "engine": cfg.kill_engine,
            "at_s": cfg.kill_at_s,
            "orphaned_sessions": len(orphans),
            "orphans_served_again": len(served),
            "in_flight_at_kill": in_flight,
            "failed_attempts": failed,  # requests that reached the dead engine: in flight, or sent before a failure showed
            "attempts_max": max((o["attempts"] for o in served), default=0),
            "attempts_mean": statistics.fmean(o["attempts"] for o in served) if served else 0.0,
            "since_kill_s_p50": _percentile([o["since_kill_s"] for o in served], 0.5),
            "since_kill_s_max": max((o["since_kill_s"] for o in served), default=0.0),
            "latency_s_p50": _percentile([o["latency_s"] for o in served], 0.5),
            "latency_s_max": max((o["latency_s"] for o in served), default=0.0),
        }
    return out


def cache_ceiling(trace: list[Session]) -> float:
    """The hit rate of one engine with an unlimited cache serving the trace turn by turn: what no
    routing can beat (flushes between epochs included)."""
    cache = BlockCache(1 << 62)
    prompt = cached = 0
    epoch = None
    events = sorted(((s.start_s, i, k) for i, s in enumerate(trace) for k in range(len(s.turns))))
    for _, i, k in events:  # arrival order is enough: each session's turns in order
        s = trace[i]
        if s.epoch != epoch:
            cache.clear()
            epoch = s.epoch
        t = s.turns[k]
        prompt += t.prompt_tokens
        cached += min(cache.match(t) * t.block_tokens, max(0, t.prompt_tokens - 1))
        cache.store(t)
    return cached / prompt if prompt else 0.0
