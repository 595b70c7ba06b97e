"""Synthetic multi-turn agent batches shaped like Search-R1 rollouts.

Each trajectory is a token stream `prompt0 | resp0 | obs1 | resp1 | obs2 | ... | resp(T-1)`;
step i's prompt is the stream up to (not including) response i, so prompts are
prefix-consistent (`prompt[i] = prompt[i-1] + response[i-1] + obs[i]`) unless re-tokenisation
drift is injected. Every step owns its own tensors (as a real rollout would deliver them),
built with tensor ops only: the full 512 x 8 workload is ~70M prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megatron_stepwise.steps import Step, TrajectoryID


@dataclass(frozen=True)
class AgentWorkload:
    """Shape of a synthetic agent batch. Ranges are inclusive (low, high)."""

    num_prompts: int = 512
    samples_per_prompt: int = 8
    turns: tuple[int, int] = (1, 8)
    prompt_len: tuple[int, int] = (100, 600)
    obs_len: tuple[int, int] = (50, 2000)
    response_len: tuple[int, int] = (20, 500)
    vocab_size: int = 32000
    # Probability that a step's re-tokenised prompt differs from the previous step's tokens
    # at the turn boundary (breaks the prefix merge there).
    drift_prob: float = 0.0
    # Probability that a response ends with an EOS appended after the fact (loss_mask 0).
    appended_eos_prob: float = 0.1
    success_prob: float = 0.3
    with_logprobs: bool = True
    weight_version: Optional[int] = None  # if set, every response token gets this version
    seed: int = 0


def make_agent_steps(workload: AgentWorkload = AgentWorkload()) -> list[Step]:
    """Steps for `num_prompts x samples_per_prompt` trajectories, grouped by prompt, seeded."""
    w = workload
    rng = np.random.default_rng(w.seed)
    gen = torch.Generator().manual_seed(w.seed)
    steps: list[Step] = []
    for p in range(w.num_prompts):
        prompt_id = f"p{p}"
        for k in range(w.samples_per_prompt):
            steps.extend(_trajectory(TrajectoryID(prompt_id, k), w, rng, gen))
    return steps


def _uniform(rng: np.random.Generator, lo_hi: tuple[int, int], size: Optional[int] = None):
    return rng.integers(lo_hi[0], lo_hi[1] + 1, size=size)


def _trajectory(tid: TrajectoryID, w: AgentWorkload, rng: np.random.Generator, gen: torch.Generator) -> list[Step]:
    turns = int(_uniform(rng, w.turns))
    resp = _uniform(rng, w.response_len, turns)
    obs = _uniform(rng, w.obs_len, turns)  # obs[i] precedes response i; obs[0] is unused
    obs[0] = 0
    prompt0 = int(_uniform(rng, w.prompt_len))
    # Segment boundaries in the stream: prompt_end[i] = where response i starts.
    seg = np.empty(2 * turns, dtype=np.int64)
    seg[0::2] = obs
    seg[0] += prompt0
    seg[1::2] = resp
    ends = np.cumsum(seg)
    prompt_end = ends[0::2]
    stream = torch.randint(0, w.vocab_size, (int(ends[-1]),), generator=gen)

    drift = rng.random(turns) < w.drift_prob
    eos = rng.random(turns) < w.appended_eos_prob
    success = bool(rng.random() < w.success_prob)
    steps = []
    for i in range(turns):
        a, b = int(prompt_end[i]), int(prompt_end[i] + resp[i])
        if i > 0 and drift[i]:
            # The history as re-tokenised for this turn differs in the last token of the
            # previous response; later prompts are built on this drifted history.
            stream[a - int(obs[i]) - 1] = (stream[a - int(obs[i]) - 1] + 1) % w.vocab_size
        n = b - a
        mask = torch.ones(n, dtype=torch.long)
        if eos[i]:
            mask[-1] = 0
        last = i == turns - 1
        steps.append(
            Step(
                trajectory_id=tid,
                prompt_ids=stream[:a].clone(),
                response_ids=stream[a:b].clone(),
                loss_mask=mask,
                rollout_logprobs=-2.0 * torch.rand(n, generator=gen) * mask if w.with_logprobs else None,
                reward=float(success) if last else 0.0,
                is_last_step=last,
                stop_reason="stop" if last else "tool_call",
                weight_versions=None if w.weight_version is None else torch.full((n,), w.weight_version),
                metadata={"turn": i},
            )
        )
    return steps
