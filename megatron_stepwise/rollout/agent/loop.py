"""The step-wise multi-turn agent loop: one `Step` per assistant turn.

Per trajectory: build the turn's prompt (`rollout/agent/context.py`: `retokenize` or `tokens`), check
it fits, generate, append the response, step the environment (through `EnvCaller`,
`rollout/agent/env_calls.py`; its results checked by `rollout/agent/env_outputs.py`) and append its observation to the NEXT prompt, until the environment is
done, the turn budget is spent or the prompt no longer fits. A failing environment ends only its
own trajectory. Output: trajectories and prompt groups contiguous, in sample order.

The invariants it keeps (sampled ids and log-probs 1:1, loss mask, prompt lengths, where rewards
sit, env errors), the drift measurement and the stop reasons: docs/architecture.md,
'The agent loop'.
"""

from __future__ import annotations

import array
import asyncio
import copy
import hashlib
import inspect
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, Union

import torch

from megatron_stepwise.algo.groups import RolloutGroup, flat_steps
from megatron_stepwise.envs.base import Environment, make_env
from megatron_stepwise.envs.tool_calls import check_tools
from megatron_stepwise.options import check_options, option, option_problems
from megatron_stepwise.rollout.agent.context import (
    CONTEXT_MODES,
    extend_context,
    render_prompt,
    retokenize_drifted,
    turn_delta,
)
from megatron_stepwise.rollout.agent.continuation import generate_continued
from megatron_stepwise.rollout.agent.env_calls import EnvCaller, EnvError
from megatron_stepwise.rollout.agent.env_outputs import (
    check_reset_output,
    check_step_output,
    error_traceback,
    read_tools,
)
from megatron_stepwise.rollout.agent.hooks import AfterTrajectory
from megatron_stepwise.rollout.engines.protocol import GenerateResult, SamplingParams, engine_loss
from megatron_stepwise.rollout.engines.routed_experts import pad_to_tokens
from megatron_stepwise.steps import INVALID, Step, TrajectoryID
from megatron_stepwise.time_budget import GENERATION, NO_ACTIVITY

log = logging.getLogger(__name__)

STOP_REASONS = ("stop", "length", "max_turns", "context_limit", "env_error", "abort")


class Generator(Protocol):
    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: Optional[str] = None, session: Optional[str] = None
    ) -> GenerateResult: ...


# The keys AgentLoopConfig shares with the `rollout` config section (same names there):
# declared here once; config/schema.py's RolloutConfig takes their declarations (`option_of`;
# a name added here joins the section by itself) and `from_section` reads them back.
ROLLOUT_KEYS = (
    "max_concurrency",
    "max_turns",
    "context",
    "max_input_length",
    "env_error_reward",
    "score_env_errors",
    "drift_sample_rate",
    "env_concurrency",
)


@dataclass
class AgentLoopConfig:
    """The agent loop's settings; `ROLLOUT_KEYS` are the `rollout.*` keys of an experiment."""

    max_concurrency: int = option(64, "trajectories in flight at once across the fleet", min=1)
    max_turns: int = option(4, "assistant turns per trajectory at most", min=1)
    context: str = option(
        "retokenize",
        "how each turn's prompt is built: retokenize the chat or extend the tokens (docs/chat_conformance.md)",
        choices=CONTEXT_MODES,
    )
    max_input_length: int = option(2048, "longest prompt (the chat history, as sent) a turn may send", min=1)
    env_error_reward: float = option(0.0, "reward given to a trajectory ended by an environment error")
    score_env_errors: bool = option(
        False,
        "train on trajectories ended by an environment error, scored env_error_reward; false: they are "
        "invalid (never trained, outside group statistics and pass@k, counted in rollout/invalid_share)",
    )
    drift_sample_rate: float = option(
        0.125,
        "context=tokens: share of trajectories measuring rollout/retokenize_drift_rate (costs a render)",
        min=0.0,
        max=1.0,
    )
    env_concurrency: int = option(
        32,
        "environment calls running at once per agent loop (worker threads of its "
        "pool; a hung call's worker is replaced)",
        min=1,
    )
    # Python-only settings (an experiment sets them from other keys, or leaves the defaults).
    # data.samples_per_prompt's declaration (the schema takes it under that name)
    n_samples_per_prompt: int = option(4, "trajectories per prompt (the group size of the estimator)", min=1)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # rollout.sampling + max_new_tokens
    max_model_length: Optional[int] = option(
        None, "max_new_tokens is clamped so prompt + response fits this context; null = no clamp", min=1
    )
    append_eos: bool = option(True, "append the EOS (loss_mask 0) to a turn that did not end on one")
    env_timeout_s: float = option(30.0, "seconds one environment call may take", gt=0.0)
    context_limit_reward: float = option(0.0, "reward of a trajectory whose first prompt is already too long")

    def __post_init__(self) -> None:
        check_options(self)

    def problems(self) -> list[tuple[str, str]]:
        """(key, why) per bad setting: `rollout.<key>` for the experiment's keys, the field otherwise."""
        return [
            (f"rollout.{key}" if key in ROLLOUT_KEYS else f"AgentLoopConfig.{key}", why)
            for key, why in option_problems(self)
        ]

    @classmethod
    def from_section(cls, rollout: Any, **settings: Any) -> "AgentLoopConfig":
        """From an experiment's `rollout` section (its `ROLLOUT_KEYS`), plus Python-only `settings`."""
        return cls(**{key: getattr(rollout, key) for key in ROLLOUT_KEYS}, **settings)


class AgentLoop:
    """Runs trajectories against a generator (an `Engine` or a fleet) and environments."""

    def __init__(
        self,
        generator: Generator,
        tokenizer: Any,
        env_factory: Union[str, Callable[[], Environment]],
        config: AgentLoopConfig,
        eos_token_ids: Optional[Sequence[int]] = None,
    ):
        self.generator = generator
        self.tokenizer = tokenizer
        self.env_factory = (lambda: make_env(env_factory)) if isinstance(env_factory, str) else env_factory
        self.config = config
        if eos_token_ids is None:
            eos = tokenizer.eos_token_id
            if eos is None:
                raise ValueError("the tokenizer has no eos_token_id: pass eos_token_ids= to AgentLoop")
            eos_token_ids = [eos]
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._env = EnvCaller(config.env_concurrency, config.env_timeout_s)
        self.activity = NO_ACTIVITY  # where generation time goes (`track`)
        self.after_trajectory = AfterTrajectory()  # a judge's verdict, a teacher's scores (hooks.py)

    # ---- public ---------------------------------------------------------------------------

    async def rollout(
        self,
        samples: Sequence[dict[str, Any]],
        seed: Optional[int] = None,
        on_trajectory_done: Optional[Callable[[list[Step]], None]] = None,
        request_tag: str = "",
    ) -> list[Step]:
        """`rollout_groups` as one flat list of steps, group after group."""
        return flat_steps(await self.rollout_groups(samples, seed, on_trajectory_done, request_tag))

    async def rollout_groups(
        self,
        samples: Sequence[dict[str, Any]],
        seed: Optional[int] = None,
        on_trajectory_done: Optional[Callable[[list[Step]], None]] = None,
        request_tag: str = "",
    ) -> list[RolloutGroup]:
        """One `RolloutGroup` per sample: its `n_samples_per_prompt` trajectories, in sample order.

        With `seed`, every turn's request carries a `sampling_seed` derived from (seed,
        trajectory, turn): the rollout is reproducible whichever engine serves each turn.
        `on_trajectory_done(steps)` is called as each trajectory finishes (progress bars).
        `request_tag` prefixes the engine request ids (`<tag><trajectory>/turn<k>`): rollouts
        that may run concurrently with others of the same prompts (evaluation during async
        training) need their own, since an engine refuses a request id already in flight.
        """
        prompt_ids = checked_prompt_ids(samples)
        limit = asyncio.Semaphore(self.config.max_concurrency)

        async def one(sample: dict, traj_id: TrajectoryID) -> list[Step]:
            async with limit:
                steps = await self.run_trajectory(sample, traj_id, seed=seed, request_tag=request_tag)
            await self.after_trajectory(steps, sample)
            if on_trajectory_done is not None:
                on_trajectory_done(steps)
            return steps

        try:
            async with asyncio.TaskGroup() as tg:  # an engine failure cancels the rest and propagates
                tasks = [
                    tg.create_task(one(sample, TrajectoryID(pid, k)))
                    for sample, pid in zip(samples, prompt_ids)
                    for k in range(self.config.n_samples_per_prompt)
                ]
        except BaseExceptionGroup as group:  # the fleet lost every engine: one error, not one per trajectory
            lost = engine_loss(group)
            if lost is not None:
                raise lost from None
            raise
        n = self.config.n_samples_per_prompt
        groups = [
            RolloutGroup(pid, [t.result() for t in tasks[i * n : (i + 1) * n]]) for i, pid in enumerate(prompt_ids)
        ]
        _warn_if_env_errors_dominate(groups, self._env.stats())
        return groups

    async def run_trajectory(
        self, sample: dict[str, Any], traj_id: TrajectoryID, seed: Optional[int] = None, request_tag: str = ""
    ) -> list[Step]:
        cfg = self.config
        try:
            env = await self._env.call(self.env_factory, name="environment factory")
            messages = await self._checked_call(env.reset, sample, check=check_reset_output, name="env.reset")
            tools = await self._env_tools(env)
        except EnvError as e:  # any env failure ends only this trajectory
            step = self._placeholder(traj_id, [self.eos_token_ids[0]], "env_error", cfg.env_error_reward, e)
            self._mark_env_error(step)
            return [step]

        steps: list[Step] = []
        total_reward = 0.0
        prompt = render_prompt(self.tokenizer, messages, tools)
        # Per trajectory: the re-tokenised chat when drift is measured (turn 0: both modes agree),
        # and in token mode the template's rendering of the chat so far (the next delta's head).
        ctx = _Context(retokenized=prompt if self._measures_drift(traj_id) else None)
        for turn in range(cfg.max_turns):
            if len(prompt) > cfg.max_input_length:
                if not steps:
                    return [
                        self._placeholder(
                            traj_id,
                            prompt[: cfg.max_input_length],
                            "context_limit",
                            cfg.context_limit_reward,
                            None,
                            prompt_len=len(prompt),
                        )
                    ]
                steps[-1].stop_reason = "context_limit"
                break
            with self.activity.active(GENERATION):
                result = await self._generate_turn(
                    prompt,
                    self._sampling_for(len(prompt), turn_seed(seed, traj_id, turn)),
                    rid=f"{request_tag}{traj_id}/turn{turn}",
                    session=f"{request_tag}{traj_id}",
                )
            step, response = self._make_step(traj_id, turn, prompt, result)
            steps.append(step)
            if result.finish_reason == "abort":  # the engine dropped the request: no answer to score
                step.metadata[INVALID] = "abort" if result.abort_reason is None else f"abort ({result.abort_reason})"
                break
            text = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
            try:
                observation, reward, done, info = await self._checked_call(
                    env.step, text, check=check_step_output, name="env.step"
                )
            except EnvError as e:
                step.stop_reason = "env_error"
                step.metadata["error"] = f"{type(e).__name__}: {e}"
                step.metadata["error_traceback"] = error_traceback(e)
                total_reward = cfg.env_error_reward
                self._mark_env_error(step)
                break
            if info.get(INVALID):  # the environment's own verdict: its reward is no outcome
                step.metadata[INVALID] = f"env: {info[INVALID]}"
                total_reward += reward
                break
            total_reward += reward
            step.turn_reward = reward
            step.metadata["env_reward"] = reward
            step.metadata["env_info"] = info
            if done:
                break
            if turn + 1 < cfg.max_turns:  # a next turn will be sent
                prompt = self._next_prompt(step, prompt, response, ctx, messages, text, observation, tools)
                messages = messages + [{"role": "assistant", "content": text}] + observation
        else:
            steps[-1].stop_reason = "max_turns"
        steps[-1].is_last_step = True
        steps[-1].reward = total_reward
        return steps

    async def _generate_turn(self, prompt: list[int], sampling: SamplingParams, rid: str, session: str):
        """One turn's generation, continued across weight updates (`rollout/agent/continuation.py`)."""
        return await generate_continued(self.generator, prompt, sampling, rid, session)

    def _mark_env_error(self, step: Step) -> None:
        """An environment failure is infrastructure, not a wrong answer: invalid unless configured to score it."""
        if not self.config.score_env_errors:
            step.metadata[INVALID] = "env_error"

    def close(self) -> None:
        """Ends the environment call pool's idle workers (a later rollout starts new ones)."""
        self._env.close()

    async def _checked_call(self, method: Callable, arg: Any, check: Callable, name: str) -> Any:
        """`check(method(arg))`, both under the env call's deadline and guard: the check touches
        env-defined objects (`__float__`, `__reduce__`, `__bool__` may hang or raise anything)."""
        if inspect.iscoroutinefunction(method):
            out = await self._env.call(method, arg, name=name)
            return await self._env.call(check, out, name=f"{name} (checking its result)")
        return await self._env.call(lambda: check(method(arg)), name=name)

    async def _env_tools(self, env: Any) -> Optional[list[dict]]:
        """The environment's tool schemas (its `tools` attribute or method), checked; None when it
        has none. Looked up statically first, so environments without tools cost no env call."""
        if inspect.getattr_static(env, "tools", None) is None:
            return None
        tools = await self._env.call(read_tools, env, name="env.tools")
        if inspect.iscoroutinefunction(tools):  # an async method: its result is checked below
            tools = await self._env.call(tools, name="env.tools")
            return await self._env.call(check_tools, tools, name="env.tools (checking its result)")
        return tools

    def track(self, activity) -> None:
        """Report generation and environment calls to `activity` (a time_budget.ActivityClock)."""
        self.activity = self._env.activity = activity

    def env_stats(self) -> dict[str, int]:
        """Environment call counters since this loop was built: calls, errors, timeouts, stuck_threads."""
        return self._env.stats()

    def metrics(self) -> dict[str, float]:
        """The after-trajectory hooks' counts since the last call (judge, teacher)."""
        return self.after_trajectory.metrics()

    # ---- helpers ----------------------------------------------------------------------------

    def _measures_drift(self, traj_id: TrajectoryID) -> bool:
        """Retokenize mode measures every trajectory (free: the next prompt is the re-tokenised
        chat); token mode a `drift_sample_rate` share, picked by the trajectory id's hash."""
        rate = self.config.drift_sample_rate
        if self.config.context == "retokenize" or rate >= 1.0:
            return True
        return rate > 0.0 and _unit_hash(traj_id) < rate

    def _next_prompt(
        self,
        step: Step,
        prompt: list[int],
        response: list[int],
        ctx: "_Context",
        messages: list[dict],
        text: str,
        observation: list[dict],
        tools: Optional[list[dict]] = None,
    ) -> list[int]:
        """The next turn's prompt in this loop's context mode (`response`: `step`'s response ids as
        a list). A trajectory that measures drift records it on `step` (the same measurement in
        both modes)."""
        after = None
        if ctx.retokenized is not None or self.config.context == "retokenize":
            after = render_prompt(
                self.tokenizer, messages + [{"role": "assistant", "content": text}] + observation, tools
            )
        if ctx.retokenized is not None:
            step.metadata["retokenize_drift"] = retokenize_drifted(ctx.retokenized, response, after)
            ctx.retokenized = after
        if self.config.context == "retokenize":
            return after
        delta, ctx.head = turn_delta(self.tokenizer, messages, text, observation, tools, head=ctx.head)
        return extend_context(self.tokenizer, prompt, response, delta, self.eos_token_ids)

    def _sampling_for(self, prompt_len: int, seed: Optional[int] = None) -> SamplingParams:
        cfg = self.config
        changes: dict[str, Any] = {}
        if seed is not None:
            changes["sampling_seed"] = seed
        if cfg.max_model_length is not None:
            room = max(0, cfg.max_model_length - prompt_len)
            if room < cfg.sampling.max_new_tokens:
                changes["max_new_tokens"] = room
        if not changes:
            return cfg.sampling
        # A copy of the validated params with values this loop computed (an in-range 63-bit
        # seed, a room >= 0): validating the whole object again per turn was pure overhead.
        params = copy.copy(cfg.sampling)
        params.__dict__.update(changes)
        return params

    def _make_step(
        self, traj_id: TrajectoryID, turn: int, prompt: list[int], result: GenerateResult
    ) -> tuple[Step, list[int]]:
        """The turn's step, and its response ids as a list (the next prompt extends them)."""
        response = list(result.output_ids)
        logprobs = list(result.logprobs)
        versions = list(result.token_weight_versions or [result.weight_version] * len(response))
        # provenance pairs routes with log-probs: only worth carrying with the routes (routing replay)
        forwards = (
            None if result.token_forwards is None or result.route_forwards is None else list(result.token_forwards)
        )
        loss_mask = [1] * len(response)
        if (
            self.config.append_eos
            and result.finish_reason != "abort"
            and (not response or response[-1] not in self.eos_token_ids)
        ):
            # Appended after the fact: no real log-prob, never trained on.
            response.append(self.eos_token_ids[0])
            loss_mask.append(0)
            logprobs.append(0.0)
            versions.append(versions[-1] if versions else result.weight_version)
            if forwards is not None:
                forwards.append(-1)  # no forward pass sampled it
        stop_reason = {"stop": "stop", "length": "length"}.get(result.finish_reason, "abort")
        step = Step(
            trajectory_id=traj_id,
            prompt_ids=_tensor(prompt, "q", torch.long),
            response_ids=_tensor(response, "q", torch.long),
            loss_mask=_tensor(loss_mask, "q", torch.long),
            rollout_logprobs=_tensor(logprobs, "f", torch.float32),
            reward=0.0,
            is_last_step=False,
            stop_reason=stop_reason,
            weight_versions=_tensor(versions, "q", torch.long),
            metadata={"turn": turn, "finish_reason": result.finish_reason, "engine": result.engine},
            # MoE routing replay: the engine's experts for prompt + response positions (-1 unknown)
            routed_experts=pad_to_tokens(result.routed_experts, len(prompt) + len(response)),
            # provenance: which forward pass computed each route and each log-prob (-1 unknown)
            route_forwards=_padded_forwards(result.route_forwards, len(prompt) + len(response)),
            logprob_forwards=None if forwards is None else _tensor(forwards, "q", torch.long),
        )
        return step, response

    def _placeholder(self, traj_id, prompt, stop_reason, reward, error, prompt_len=None) -> Step:
        """A zero-trainable-token last step that keeps the trajectory (and its group) counted."""
        metadata: dict[str, Any] = {"turn": 0}
        if error is not None:
            metadata["error"] = f"{type(error).__name__}: {error}"
            metadata["error_traceback"] = error_traceback(error)
        if prompt_len is not None:
            metadata["untruncated_prompt_len"] = prompt_len
        return Step(
            trajectory_id=traj_id,
            prompt_ids=prompt,
            response_ids=[],
            loss_mask=[],
            rollout_logprobs=[],
            reward=reward,
            is_last_step=True,
            stop_reason=stop_reason,
            weight_versions=[],
            metadata=metadata,
        )


def checked_prompt_ids(samples: Sequence[dict[str, Any]]) -> list[str]:
    """The samples' prompt ids; each must be there and unique (a group is one prompt's trajectories)."""
    prompt_ids = [str(s.get("prompt_id", "")) for s in samples]
    for i, pid in enumerate(prompt_ids):
        if not pid:
            raise ValueError(f"sample {i} has no 'prompt_id'")
    if len(set(prompt_ids)) != len(prompt_ids):
        dup = sorted({p for p in prompt_ids if prompt_ids.count(p) > 1})
        raise ValueError(f"duplicate prompt_id(s) in samples: {dup[:5]}")
    return prompt_ids


@dataclass
class _Context:
    """What a trajectory carries from turn to turn to build the next prompt cheaply."""

    retokenized: Optional[list[int]] = None  # the re-tokenised chat, when this trajectory measures drift
    head: Optional[str] = None  # token mode: the template's rendering of the chat with the generation prompt


def _tensor(values: list, typecode: str, dtype: torch.dtype) -> Any:
    """`values` as a 1-D tensor through a packed array, several times faster than `torch.tensor`
    on a list (it was most of a step's cost); anything the array refuses (an empty list, odd
    types) is left to `Step`'s own conversion, so the result and its checks are the same."""
    try:
        packed = array.array(typecode, values)
    except (TypeError, ValueError, OverflowError):
        return values
    if not packed:
        return values
    return torch.frombuffer(packed, dtype=dtype).clone()  # a tensor owning ordinary storage


def _padded_forwards(forwards: Optional[torch.Tensor], num_tokens: int) -> Optional[torch.Tensor]:
    """The engine's route forward ids for the step's positions, -1 where it reported none."""
    if forwards is None:
        return None
    out = torch.full((num_tokens,), -1, dtype=torch.long)
    n = min(forwards.numel(), num_tokens)
    out[:n] = forwards[:n]
    return out


def _unit_hash(traj_id: TrajectoryID) -> float:
    """A stable number in [0, 1) per trajectory id (the same in every process and run)."""
    digest = hashlib.blake2b(f"{traj_id.prompt_id}/{traj_id.sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def turn_seed(seed: Optional[int], traj_id: TrajectoryID, turn: int) -> Optional[int]:
    """A stable 63-bit seed per (rollout seed, trajectory, turn)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(
        f"{seed}/{traj_id.prompt_id}/{traj_id.sample_index}/{turn}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") >> 1


def _warn_if_env_errors_dominate(groups: list[RolloutGroup], stats: dict[str, int]) -> None:
    """Once per rollout with env_error trajectories: how many, the commonest errors and one sample
    traceback; a rollout where most trajectories failed trains on nothing, so it says so loudly."""
    last = [t[-1] for g in groups for t in g.trajectories]
    failed = [s for s in last if s.stop_reason == "env_error"]
    if not failed:
        return
    common = Counter(str(s.metadata.get("error", "?"))[:120] for s in failed).most_common(3)
    sample = next((s for s in failed if s.metadata.get("error_traceback")), failed[0])
    where = sample.metadata.get("error_traceback") or "(no traceback: a timeout or a result rejected at the boundary)"
    loud = "most trajectories fail, nothing to learn from: " if 2 * len(failed) > len(last) else ""
    log.warning(
        "rollout: %s%d of %d trajectories ended in env_error (env calls so far: %s); most common: %s\n"
        "sample (trajectory %s):\n%s",
        loud,
        len(failed),
        len(last),
        stats,
        "; ".join(f"{n}x {e}" for e, n in common),
        sample.trajectory_id,
        where.rstrip(),
    )


async def rollout(
    generator: Generator,
    tokenizer: Any,
    env: Union[str, Callable[[], Environment]],
    samples: Sequence[dict[str, Any]],
    config: AgentLoopConfig,
) -> list[Step]:
    """One-shot convenience: run every sample's trajectories and return their steps."""
    loop = AgentLoop(generator, tokenizer, env, config)
    try:
        return await loop.rollout(samples)
    finally:
        loop.close()
