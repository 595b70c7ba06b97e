"""Which node a Ray actor runs on, asked of the actor itself (no dashboard or state API needed)."""

from __future__ import annotations

from typing import Any


def node_address() -> str:
    """This process's node address on the Ray cluster."""
    import ray

    return ray.util.get_node_ip_address()


def _actor_node(_actor_instance: Any) -> str:
    return node_address()


def ask_actor_node(handle: Any) -> Any:
    """The actor's node address, asked without waiting: an ObjectRef of it."""
    return handle.__ray_call__.remote(_actor_node)


def actor_nodes(handles: list[Any], timeout_s: float = 60.0) -> list[str]:
    """The node address of each actor."""
    import ray

    return ray.get([ask_actor_node(h) for h in handles], timeout=timeout_s)
