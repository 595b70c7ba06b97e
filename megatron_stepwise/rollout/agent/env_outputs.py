"""What an environment returns, checked at the boundary before the agent loop uses it.

Environments are user code: `reset` and `step` may return anything. These checks turn a bad
result into an `EnvError` naming what was wrong, which ends only that trajectory; what passes
cannot break the batch later. They touch env-defined objects (`__float__`, `__reduce__`,
`__bool__`), so the agent loop runs them through `EnvCaller`, under the call's deadline.
`error_traceback` keeps the last frames of what an environment raised, for the user.
"""

from __future__ import annotations

import inspect
import math
import pickle
import traceback
from typing import Any

from megatron_stepwise.envs.tool_calls import check_tools
from megatron_stepwise.rollout.agent.env_calls import EnvError


def _check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise EnvError(
            f"env.{where} must return a list of {{'role': str, 'content': str}} messages, got {messages!r:.200}"
        )
    return messages


def read_tools(env: Any) -> Any:
    """`env.tools` (called when it is a plain method) and checked; an async method is returned as is."""
    tools = getattr(env, "tools", None)
    if inspect.iscoroutinefunction(tools):
        return tools
    if callable(tools):
        tools = tools()
    return check_tools(tools)


def check_reset_output(messages: Any) -> list[dict]:
    return _check_messages(messages, "reset")


def check_step_output(out: Any) -> tuple[list[dict], float, bool, dict]:
    """The boundary check of env.step's result: what passes here cannot break the batch later
    (a NaN reward poisons every advantage of its group; an unpicklable info fails the broadcast
    to the training ranks and so the whole run). It runs env-defined code (`__float__`,
    `__reduce__`, `__bool__`), so it runs under the env call's deadline and guard."""
    if not isinstance(out, tuple) or len(out) != 4:
        raise EnvError(f"env.step must return (observation_messages, reward, done, info), got {out!r:.200}")
    observation, reward, done, info = out
    if isinstance(reward, (str, bytes)):
        raise EnvError(f"env.step reward must be a number, got {reward!r:.100}")
    try:
        reward = float(reward)
    except (TypeError, ValueError, OverflowError) as e:
        raise EnvError(f"env.step reward must be a number, got {reward!r:.100}") from e
    if not math.isfinite(reward):
        raise EnvError(f"env.step returned a non-finite reward ({reward})")
    if info is not None and not isinstance(info, dict):
        raise EnvError(f"env.step info must be a dict, got {type(info).__name__}")
    info = dict(info or {})
    try:
        pickle.dumps(info)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the env's bug
        raise EnvError(
            f"env.step info must be picklable (it travels to every training rank): {type(e).__name__}: {e}"
        ) from e
    return _check_messages(list(observation or []), "step"), reward, bool(done), info


def error_traceback(error: BaseException, frames: int = 4) -> str:
    """The last `frames` frames (file:line) of what the environment raised (the cause of an
    `EnvError`), so a user can find the line without a debugger; "" when there is no traceback."""
    cause = error.__cause__ or error
    if cause.__traceback__ is None:
        return ""
    lines = traceback.format_exception(type(cause), cause, cause.__traceback__, limit=-frames)
    return "".join(lines)[-2000:]
