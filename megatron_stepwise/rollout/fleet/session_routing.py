"""Which engine serves a session's next turn: the routing policies `EngineRouter` uses.

A policy sees the live engines a request may go to (`candidates`, each with `outstanding`
requests and `outstanding_tokens`: prompt + max_new_tokens of the requests in flight there),
the engine the session's previous turn used when that one is still a candidate (`pinned`,
else None: a new session, or its engine is dead or was already tried for this request) and
the request's own token cost. It returns the engine. The router counts a re-pin whenever a
session's turn is served elsewhere than its previous turn.

- `round_robin`: the next engine in turn, whatever the session (sglang-router's round_robin;
  no prefix-cache affinity, the baseline).
- `sticky` (default): the pinned engine while it has at most `sticky_slack` more outstanding
  requests than the least busy one; else the engine with the fewest outstanding requests.
- `budget_sticky`: the pinned engine while its outstanding tokens, this request included, fit
  `routing_token_budget`; an engine over budget hands the session to the least loaded engine
  (by outstanding tokens) only when that one would stay under half the budget, else keeps it: a
  move costs the session its cached prefix, so it must buy a clearly lighter engine (moving
  whenever the least loaded one merely had room re-pinned 4x as often and lost 3.7 points
  of hit rate in tools/bench/replay_routing.py). New sessions go to the least loaded engine by tokens,
  which weighs long and short sessions where counting requests cannot.

`tools/bench/replay_routing.py` measures the three on recorded and synthetic agent traffic
(docs/scale.md, "Routing measured").
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal, Optional, Protocol

from megatron_stepwise.options import option

POLICIES = ("sticky", "budget_sticky", "round_robin")


@dataclass
class RoutingConfig:
    """The `rollout` keys that choose how turns are spread over the engines (read by the fleet
    and the agent workers' `EngineRouter`)."""

    routing: Literal["sticky", "budget_sticky", "round_robin"] = option(
        "sticky",
        "engine choice per turn: sticky (session affinity, request-count slack), "
        "budget_sticky (affinity within a per-engine token budget), round_robin (no affinity)",
    )
    sticky_slack: int = option(
        16, "routing=sticky: outstanding requests a session's engine may have above the least busy one's", min=0
    )
    routing_token_budget: int = option(
        131072,
        "routing=budget_sticky: outstanding tokens (prompt + max_new_tokens) per engine before a session moves",
        min=1,
    )


class Load(Protocol):
    """What a policy reads of an engine (`EngineSlot`)."""

    index: int
    outstanding: int
    outstanding_tokens: int


class RoutingPolicy(abc.ABC):
    name = ""

    @abc.abstractmethod
    def choose(self, pinned: Optional[Load], candidates: list[Load], cost: int) -> Load:
        """The engine for a turn of `cost` tokens: `pinned` is its session's engine (None: new or dead)."""


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self.turn = -1

    def choose(self, pinned: Optional[Load], candidates: list[Load], cost: int) -> Load:
        self.turn += 1
        return sorted(candidates, key=lambda s: s.index)[self.turn % len(candidates)]


class Sticky(RoutingPolicy):
    name = "sticky"

    def __init__(self, slack: int = 16):
        self.slack = slack

    def choose(self, pinned: Optional[Load], candidates: list[Load], cost: int) -> Load:
        least = min(candidates, key=lambda s: (s.outstanding, s.index))
        if pinned is not None and pinned.outstanding <= least.outstanding + self.slack:
            return pinned
        return least


class BudgetSticky(RoutingPolicy):
    name = "budget_sticky"

    def __init__(self, token_budget: int):
        if token_budget < 1:
            raise ValueError(f"routing_token_budget must be >= 1 token, got {token_budget}")
        self.token_budget = token_budget

    def choose(self, pinned: Optional[Load], candidates: list[Load], cost: int) -> Load:
        least = min(candidates, key=lambda s: (s.outstanding_tokens, s.outstanding, s.index))
        if pinned is None:
            return least
        if pinned.outstanding_tokens + cost <= self.token_budget:
            return pinned
        if least.outstanding_tokens + cost <= self.token_budget // 2:
            return least
        return pinned


def make_policy(routing: str, sticky_slack: int = 16, token_budget: int = 131072) -> RoutingPolicy:
    """The policy a `rollout.routing` value names."""
    if routing == "sticky":
        return Sticky(sticky_slack)
    if routing == "budget_sticky":
        return BudgetSticky(token_budget)
    if routing == "round_robin":
        return RoundRobin()
    raise ValueError(f"rollout.routing must be one of {', '.join(POLICIES)}, got {routing!r}")
