"""Your agent as the source of trajectories, run once per trajectory, its calls the steps.

`AgentRollout` has the agent loop's interface (`rollout_groups`, `rollout`, `env_stats`, `track`,
`close`), so the trainer, agent workers and `rollout -n` take it where they take an `AgentLoop`.
Per trajectory it opens a gateway URL and runs the agent under `env.agent_timeout_s`, one of two
strategies: `FunctionAgent` (`env.agent`: `solve(sample, base_url, api_key)`, a coroutine or a
function on a thread of its own pool) or `CommandAgent` (`env.agent_command`, in the sandbox:
`command_agent.py`). It hands the recorder's steps back with the outcome: a number, or
`{"reward", "turn_rewards", "info"}`. An agent that raises, crashes, hangs or yields something
else ends only its own trajectory: invalid (never trained, outside group statistics), counted in
`gateway/agent_errors`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Protocol, Sequence, Union

from megatron_stepwise.algo.groups import RolloutGroup, flat_steps
from megatron_stepwise.envs.custom import load_object
from megatron_stepwise.gateway.command_agent import CommandAgent
from megatron_stepwise.gateway.outcome import AgentError, AgentFailure, outcome_of
from megatron_stepwise.gateway.server import Gateway, GatewaySettings
from megatron_stepwise.rollout.agent.hooks import AfterTrajectory
from megatron_stepwise.rollout.agent.loop import checked_prompt_ids
from megatron_stepwise.steps import Step, TrajectoryID
from megatron_stepwise.time_budget import GENERATION, NO_ACTIVITY

log = logging.getLogger(__name__)


class Agent(Protocol):
    """How one trajectory's agent runs: `run` returns its raw outcome, raises `AgentFailure`
    (invalid, with a reason), `asyncio.TimeoutError` or anything else (the agent's error)."""

    async def start(self, gateway: Gateway) -> None: ...

    async def run(self, gateway: Gateway, sample: dict, url: str, timeout_s: float) -> Any: ...

    def close(self) -> None: ...


class FunctionAgent:
    """`env.agent`: `solve(sample, base_url, api_key)` with the gateway's key."""

    def __init__(self, agent: Union[str, Callable], max_concurrency: int = 64):
        self.solve = load_object(agent, key="env.agent") if isinstance(agent, str) else agent
        if not callable(self.solve):
            raise AgentError(f"env.agent={agent!r} is not a function")
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="env-agent")

    async def start(self, gateway: Gateway) -> None:
        pass

    async def run(self, gateway: Gateway, sample: dict, url: str, timeout_s: float) -> Any:
        key = gateway.api_key
        if inspect.iscoroutinefunction(self.solve):
            call = self.solve(sample, url, key)
        else:
            call = asyncio.get_running_loop().run_in_executor(self._pool, self.solve, sample, url, key)
        return await asyncio.wait_for(call, timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class AgentRollout:
    """Runs `agent` per trajectory through its own `Gateway` (started on first use): a function
    (or `module:function`), an `Agent` such as a `CommandAgent`, or None for `settings.agent`'s."""

    def __init__(
        self,
        generator: Any,
        tokenizer: Any,
        agent: Union[str, Callable, Agent, None],
        settings: GatewaySettings,
        eos_token_ids: Sequence[int],
        n_samples_per_prompt: int = 4,
        max_concurrency: int = 64,
    ):
        if agent is None and settings.agent.agent_command is not None:
            agent = CommandAgent(settings.agent.argv(), max_concurrency=max_concurrency)
        elif agent is None:
            agent = settings.agent.agent
        self.agent: Agent = agent if hasattr(agent, "run") else FunctionAgent(agent, max_concurrency)
        self.gateway = Gateway(generator, tokenizer, eos_token_ids, settings)
        self.settings = settings
        self.n_samples_per_prompt, self.max_concurrency = n_samples_per_prompt, max_concurrency
        self.activity = NO_ACTIVITY
        self.agent_errors = 0
        self._reported: dict[str, float] = {}
        self.after_trajectory = AfterTrajectory()  # a judge's verdict, a teacher's scores (rollout/agent/hooks.py)

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
            await self.agent.start(self.gateway)
        prompt_ids = checked_prompt_ids(samples)
        limit = asyncio.Semaphore(self.max_concurrency)

        async def one(sample: dict, traj_id: TrajectoryID) -> list[Step]:
            async with limit:
                with self.activity.active(GENERATION):
                    steps = await self.run_trajectory(sample, traj_id, seed)
            await self.after_trajectory(steps, sample)
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
            out = await self.agent.run(self.gateway, dict(sample), url, timeout)
            reward, turns, info = outcome_of(out)
        except asyncio.TimeoutError:
            invalid = f"agent_timeout (env.agent_timeout_s={timeout})"
        except AgentFailure as e:
            invalid, info = e.reason[:500], e.info
            log.warning("the agent failed on trajectory %s: %s", traj_id, invalid)
        except Exception as e:  # noqa: BLE001 - the user's agent: any failure ends only its trajectory
            invalid = f"agent_error: {type(e).__name__}: {e}"[:500]
            log.warning("env.agent failed on trajectory %s: %s\n%s", traj_id, invalid, traceback.format_exc(limit=-4))
        self.agent_errors += invalid is not None
        steps = self.gateway.finish(url, reward, turns, invalid)
        if info:
            steps[-1].metadata["agent_info"] = info
        return steps

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
        return {**out, **self.after_trajectory.metrics()}

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
        self.agent.close()
        self.gateway.close_from_sync()
