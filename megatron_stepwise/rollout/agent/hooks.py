"""What runs on each finished trajectory before the agent loop hands it over.

An LLM judge's verdict (its reward, rollout/judge.py) first, then the teacher's scores of the
sampled tokens (rollout/teacher.py). Each hook is `async hook(steps, sample)`, may have
`metrics()` (counts since the last call), and runs outside the loop's concurrency limit, so
the next trajectory rolls out while this one is judged and scored.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Sequence

from megatron_stepwise.steps import Step

Hook = Callable[[list[Step], dict[str, Any]], Awaitable[None]]


class AfterTrajectory:
    def __init__(self, hooks: Sequence[Hook] = ()):
        self.hooks = list(hooks)

    async def __call__(self, steps: list[Step], sample: dict[str, Any]) -> None:
        for hook in self.hooks:
            await hook(steps, sample)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for hook in self.hooks:
            if hasattr(hook, "metrics"):
                out.update(hook.metrics())
        return out
