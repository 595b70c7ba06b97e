"""Where the rollout's Ray actors run, as one log line: the first thing to check on more than one
node (engines on the nodes meant for them, agent workers spread, the driver where expected)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

log = logging.getLogger(__name__)


def _node_address(_actor_instance: Any) -> str:
    import ray

    return ray.util.get_node_ip_address()


def actor_nodes(handles: list[Any], timeout_s: float = 60.0) -> list[str]:
    """The node address of each actor (run inside the actor: no dashboard or state API needed)."""
    import ray

    return ray.get([h.__ray_call__.remote(_node_address) for h in handles], timeout=timeout_s)


def placement_line(roles: dict[str, list[Any]], timeout_s: float = 60.0) -> str:
    """'placement: driver 10.0.0.1; engines 10.0.0.2 x2; agent workers 10.0.0.2 x2'."""
    import ray

    parts = [f"driver {ray.util.get_node_ip_address()}"]
    for role, handles in roles.items():
        if handles:
            counts = Counter(actor_nodes(handles, timeout_s))
            parts.append(f"{role} " + ", ".join(f"{node} x{n}" for node, n in sorted(counts.items())))
    return "placement: " + "; ".join(parts)


def log_placement(roles: dict[str, list[Any]]) -> None:
    """Log the placement; a node that does not answer is reported, never fatal."""
    try:
        log.info(placement_line(roles))
    except Exception as e:  # noqa: BLE001 - a log line must not stop a run
        log.warning("placement: could not ask the actors where they run (%s)", type(e).__name__)
