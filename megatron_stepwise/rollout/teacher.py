"""Teacher scoring: the log-prob a teacher model gives each token the policy sampled.

Each finished trajectory is scored before it is handed over, while other trajectories still roll
out. Steps whose prompt extends the previous step's prompt + response (token-in-token-out
context) form one chain, and a chain is ONE prefill request: `input_ids` = its last step's
prompt + response, scored from its first step's prompt on; every step of the chain takes its
response's slice. A step whose prompt breaks the prefix (re-tokenised context, a gateway agent
that edited its history) starts a chain of its own, so each step is always scored on exactly
the context the policy saw. Invalid trajectories and steps with nothing trained are skipped.
A request the teacher refuses or fails (a row past its context, an engine error after the
retries) makes the trajectory invalid, named and counted (`teacher/failures`): never trained,
and the rest of the rollout goes on. Losing every teacher engine (`NoLiveEngine`, `FleetLost`)
ends the run, as losing the policy's does.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from megatron_stepwise.rollout.engines.protocol import EngineError, FleetLost, NoLiveEngine
from megatron_stepwise.steps import INVALID, Step


class Scorer(Protocol):
    """Anything with the engines' `score` (an engine, a fleet, an agent worker's engine view)."""

    async def score(self, input_ids: list[int], start: int, temperature: float = 1.0) -> list[float]: ...


def prefix_chains(steps: list[Step]) -> list[list[Step]]:
    """Consecutive steps each of whose prompt starts with the previous step's prompt + response."""
    chains: list[list[Step]] = []
    for s in steps:
        if chains and _extends(chains[-1][-1], s):
            chains[-1].append(s)
        else:
            chains.append([s])
    return chains


def _extends(prev: Step, step: Step) -> bool:
    row = torch.cat([prev.prompt_ids, prev.response_ids])
    return step.prompt_ids.numel() >= row.numel() and torch.equal(step.prompt_ids[: row.numel()], row)


class TeacherScorer:
    """Sets `Step.teacher_logprobs` on each trajectory it is called with (an agent loop's
    after-trajectory hook), at `temperature` (the rollout's)."""

    def __init__(self, teacher: Scorer, temperature: float):
        self.teacher = teacher
        self.temperature = float(temperature)
        self.counts = {
            "teacher/requests": 0.0,
            "teacher/scored_tokens": 0.0,
            "teacher/score_s": 0.0,
            "teacher/failures": 0.0,
        }

    async def __call__(self, steps: list[Step], sample: dict[str, Any]) -> None:
        if steps[-1].invalid_reason is not None:  # never trained: no need of a verdict
            return
        try:
            for chain in prefix_chains([s for s in steps if s.num_trainable]):
                await self._score_chain(chain)
        except (NoLiveEngine, FleetLost):  # no teacher left: the run cannot distil
            raise
        except (EngineError, ValueError) as e:
            self.counts["teacher/failures"] += 1
            steps[-1].metadata[INVALID] = f"teacher: {type(e).__name__}: {str(e)[:300]}"

    async def _score_chain(self, chain: list[Step]) -> None:
        last, start = chain[-1], chain[0].prompt_ids.numel()
        ids = torch.cat([last.prompt_ids, last.response_ids]).tolist()
        began = time.perf_counter()
        logprobs = torch.tensor(await self.teacher.score(ids, start, self.temperature), dtype=torch.float32)
        self.counts["teacher/score_s"] += time.perf_counter() - began
        self.counts["teacher/requests"] += 1
        self.counts["teacher/scored_tokens"] += len(ids) - start
        for s in chain:
            at = s.prompt_ids.numel() - start
            s.teacher_logprobs = logprobs[at : at + s.response_ids.numel()].clone()

    def metrics(self) -> dict[str, float]:
        """Counts since the last call (they add up over agent workers)."""
        out, self.counts = self.counts, dict.fromkeys(self.counts, 0.0)
        return out
