"""Where the rollout's Ray actors run, as one log line: the first thing to check on more than one
node (engines on the nodes meant for them, agent workers spread, the driver where expected)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from megatron_stepwise.rollout.fleet.ray_nodes import actor_nodes, node_address

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)


def placement_line(roles: dict[str, list[ActorHandle]], timeout_s: float = 60.0) -> str:
    """'placement: driver 10.0.0.1; engines 10.0.0.2 x2; agent workers 10.0.0.2 x2'."""
    parts = [f"driver {node_address()}"]
    for role, handles in roles.items():
        if handles:
            counts = Counter(actor_nodes(handles, timeout_s))
            parts.append(f"{role} " + ", ".join(f"{node} x{n}" for node, n in sorted(counts.items())))
    return "placement: " + "; ".join(parts)


def log_placement(roles: dict[str, list[ActorHandle]]) -> None:
    """Log the placement; a node that does not answer is reported, never fatal."""
    try:
        log.info(placement_line(roles))
    except Exception as e:  # noqa: BLE001 - a log line must not stop a run
        log.warning("placement: could not ask the actors where they run (%s)", type(e).__name__)
