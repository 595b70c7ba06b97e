"""A `RolloutFleet` over embedded engines in this process: no Ray, no actors (unit tests)."""

from __future__ import annotations

from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
from megatron_stepwise.rollout.fleet.fleet import RolloutFleet


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class InProcessHandle:
    """What the fleet needs of an engine actor's handle (`generate.remote`, `call.remote`),
    around an engine of this process."""

    def __init__(self, engine):
        self.generate = _Remote(engine.generate)
        self.call = _Remote(lambda method, *args, **kwargs: getattr(engine, method)(*args, **kwargs))


def in_process_fleet(engine, model_config, **kwargs) -> RolloutFleet:
    """A one-engine fleet around `engine`. Update its weights from disk (tensor updates go
    through Ray's object store)."""
    spec = EngineSpec(kind="local", model_config=model_config)
    return RolloutFleet([spec], spawn=lambda spec, index, incarnation: InProcessHandle(engine), **kwargs)
