"""`env.agent` as the source of trajectories: your agent, run once per trajectory, its calls the steps.

`AgentRollout` has the agent loop's interface (`rollout_groups`, `rollout`, `env_stats`, `track`,
`close`), so the trainer, agent workers and `rollout -n` take it where they take an `AgentLoop`.
Per trajectory it opens a gateway URL, calls `solve(sample, base_url, api_key)` (a coroutine, or
a function run on a thread of its own pool) under `env.agent_timeout_s`, and hands the
recorder's steps back with the outcome: a number, or `{"reward", "turn_rewards", "info"}`. An
agent that raises, hangs or returns something else ends only its own trajectory: invalid
(never trained, outside group statistics), counted in `gateway/agent_errors`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence, Union

from megatron_stepwise.algo.groups import RolloutGroup, flat_steps
from megatron_stepwise.envs.custom import load_object
from megatron_stepwise.errors import UserError
from megatron_stepwise.gateway.server import Gateway, GatewaySettings
from megatron_stepwise.rollout.agent.loop import checked_prompt_ids
from megatron_stepwise.steps import Step, TrajectoryID
from megatron_stepwise.time_budget import GENERATION, NO_ACTIVITY

log = logging.getLogger(__name__)

Outcome = tuple[float, Optional[list[float]], dict]


class AgentError(UserError, ValueError):
    """A bad `env.agent`: not a function, or what it returned is no outcome (fix the agent)."""


def outcome_of(out: Any) -> Outcome:
    """(reward, per-call rewards or None, info) of what `solve` returned."""
    if isinstance(out, dict):
        if "reward" not in out:
            raise AgentError(f"the agent returned a dict without 'reward': {sorted(out)}")
        turns = out.get("turn_rewards")
        info = out.get("info") or {}
        if not isinstance(info, dict):
            raise AgentError(f"the agent's 'info' must be a dict, got {type(info).__name__}")
        reward = _number(out["reward"], "reward")
        return reward, None if turns is None else [_number(t, "turn_rewards") for t in turns], dict(info)
    return _number(out, "reward"), None, {}


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AgentError(f"the agent's {what} must be a finite number, got {value!r:.100}")
    return float(value)


class AgentRollout:
    """Runs `agent` per trajectory through its own `Gateway` (started on first use)."""

    def __init__(
        self,
        generator: Any,
        tokenizer: Any,
        agent: Union[str, Callable],
        settings: GatewaySettings,
        eos_token_ids: Sequence[int],
        n_samples_per_prompt: int = 4,
        max_concurrency: int = 64,
    ):
        self.solve = load_object(agent, key="env.agent") if isinstance(agent, str) else agent
        if not callable(self.solve):
            raise AgentError(f"env.agent={agent!r} is not a function")
        self.gateway = Gateway(generator, tokenizer, eos_token_ids, settings)
        self.settings = settings
        self.n_samples_per_prompt, self.max_concurrency = n_samples_per_prompt, max_concurrency
        self.activity = NO_ACTIVITY
        self.agent_errors = 0
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="env-agent")
        self._reported: dict[str, float] = {}

    async def rollout(
        self, samples: Sequence[dict], seed: Optional[int] = None, on_trajectory_done=None, request_tag: str = ""
    ) -> list[Step]:
        return flat_steps(await self.rollout_groups(samples, seed, on_trajectory_done, request_tag))

    async def rollout_groups(
        self,
        samples: Sequence[dict[str, Any]],
        seed: Optional[int] = None,
        on_trajectory_done: Optional[Callable[[list[Step]], None]] = None,
        request_tag: str = "",
    ) -> list[RolloutGroup]:
        """One group of `n_samples_per_prompt` trajectories per sample, in sample order. With
        `seed`, call k of a trajectory samples with the agent loop's seed of turn k (a resumed run
        repeats, as far as the agent does); `request_tag` is the agent loop's (unused here)."""
        if self.gateway.url is None:
            await self.gateway.start()
        prompt_ids = checked_prompt_ids(samples)
        limit = asyncio.Semaphore(self.max_concurrency)

        async def one(sample: dict, traj_id: TrajectoryID) -> list[Step]:
            async with limit:
                with self.activity.active(GENERATION):
                    steps = await self.run_trajectory(sample, traj_id, seed)
            if on_trajectory_done is not None:
                on_trajectory_done(steps)
            return steps

        n = self.n_samples_per_prompt
        tasks = [one(s, TrajectoryID(pid, k)) for s, pid in zip(samples, prompt_ids) for k in range(n)]
        done = await asyncio.gather(*tasks)
        return [RolloutGroup(pid, list(done[i * n : (i + 1) * n])) for i, pid in enumerate(prompt_ids)]

    async def run_trajectory(
        self, sample: dict[str, Any], traj_id: TrajectoryID, seed: Optional[int] = None
    ) -> list[Step]:
        url = self.gateway.open(traj_id, seed)
        reward, turns, info, invalid = 0.0, None, {}, None
        timeout = self.settings.agent.agent_timeout_s
        try:
            out = await asyncio.wait_for(self._call(dict(sample), url), timeout)
            reward, turns, info = outcome_of(out)
        except asyncio.TimeoutError:
            invalid = f"agent_timeout (env.agent_timeout_s={timeout})"
        except Exception as e:  # noqa: BLE001 - the user's agent: any failure ends only its trajectory
            invalid = f"agent_error: {type(e).__name__}: {e}"[:500]
            log.warning("env.agent failed on trajectory %s: %s\n%s", traj_id, invalid, traceback.format_exc(limit=-4))
        self.agent_errors += invalid is not None
        steps = self.gateway.finish(url, reward, turns, invalid)
        if info:
            steps[-1].metadata["agent_info"] = info
        return steps

    async def _call(self, sample: dict, url: str) -> Any:
        key = self.gateway.api_key
        if inspect.iscoroutinefunction(self.solve):
            return await self.solve(sample, url, key)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.solve, sample, url, key)

    def metrics(self) -> dict[str, float]:
        """The gateway's counts since the last call: calls, prefix breaks, ignored sampling, ..."""
        now = {
            "gateway/calls": self.gateway.counts["calls"],
            "rollout/prefix_breaks": self.gateway.counts["prefix_breaks"],
            "gateway/ignored_sampling": self.gateway.counts["ignored_sampling"],
            "gateway/retries_answered": self.gateway.counts["retries_answered"],
            "gateway/refused": self.gateway.counts["refused"],
            "gateway/agent_errors": self.agent_errors,
        }
        out = {k: float(v - self._reported.get(k, 0)) for k, v in now.items()}
        self._reported = dict(now)
        return out

    def env_stats(self) -> dict[str, int]:
        return {
            "calls": int(self.gateway.counts["calls"]),
            "errors": self.agent_errors,
            "timeouts": 0,
            "stuck_threads": 0,
        }

    def track(self, activity) -> None:
        self.activity = activity

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
