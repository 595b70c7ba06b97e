"""What a call on a Ray actor raises when the actor is gone, so every caller treats it alike.

A dead actor raises `RayActorError` (`ActorDiedError`), an unreachable one `ActorUnavailableError`.
An actor that Ray's memory monitor kills (the node past `RAY_memory_usage_threshold`, 95% by
default) raises `OutOfMemoryError` to its pending calls instead: a `RayError` but no
`RayActorError`, so a caller that catches only the first two lets one engine killed for memory
end the whole run instead of restarting that engine.
"""

from __future__ import annotations


def actor_gone_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "this actor is gone" (Ray imported only when asked)."""
    import ray.exceptions

    return (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.OutOfMemoryError)
