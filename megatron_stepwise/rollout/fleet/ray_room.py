"""Whether the Ray cluster can hold an actor at all, asked before creating one.

Ray queues an actor that no node can hold and waits for a node that may never come: after a node
is lost (its network cut, its processes killed), the engines and agent workers restarted in its
place would each wait out their start timeout (minutes) for nothing. Asked first, the restart
fails at once with an error that names the actor, what it needs and what the live nodes offer.
"""

from __future__ import annotations


class NoRoomForActor(RuntimeError):
    """No live Ray node has the resources an actor needs (in total, free or not)."""


def check_room(what: str, num_cpus: float = 0.0, num_gpus: float = 0.0) -> None:
    """Raise NoRoomForActor naming `what` unless some live node could hold it (now or once its
    current actors are gone). A no-op without a Ray connection."""
    import ray

    if not ray.is_initialized():
        return
    alive = [n for n in ray.nodes() if n.get("Alive")]
    for node in alive:
        resources = node.get("Resources", {})
        if resources.get("CPU", 0.0) >= num_cpus and resources.get("GPU", 0.0) >= num_gpus:
            return
    offers = ", ".join(
        f"{n.get('NodeManagerAddress')}: {n.get('Resources', {}).get('CPU', 0.0):g} CPU "
        f"{n.get('Resources', {}).get('GPU', 0.0):g} GPU"
        for n in alive
    )
    raise NoRoomForActor(
        f"{what} needs {num_cpus:g} CPU and {num_gpus:g} GPU on one node, and no live Ray node has them "
        f"(live nodes: {offers or 'none'}): was the node that held it lost?"
    )
