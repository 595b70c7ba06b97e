"""Users' own environments without writing a registration module.

- `env.name: my_pkg.my_env:MyEnv`: a dotted path (`module:attribute`) to an Environment class, a
  factory returning one, or an `EnvSpec`. The class or factory may carry `tokenizer` (a shipped
  tokenizer name) and `dataset` (a callable returning samples) attributes; without `dataset`
  the samples come from `env.dataset`.
- `env.reward_fn: my_pkg.rewards:score`: only a reward function. `RewardFnEnv` opens with the
  sample's `prompt` (a string, or a list of chat messages) and calls
  `score(response, sample)` (or `score(response, sample, turn=t)` when it takes `turn`) after
  every assistant turn. A number ends the episode with that reward; `(reward, message)` gives
  the reward and continues with `message` as the next user turn (`None` ends it), so the same
  function drives single-turn and multi-turn tasks. Each call's reward is that turn's own
  (`Step.turn_reward`, what turn-level estimators credit); the trajectory's is their sum.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable

from megatron_stepwise.envs.base import EnvSpec, Message, StepOutput, get_env_spec, list_envs, register_env
from megatron_stepwise.errors import UserError


class EnvPathError(UserError, ValueError):
    """A dotted path that does not name something usable; the message names the path and why."""


def is_dotted_path(name: str) -> bool:
    return ":" in name


def load_object(path: str, *, key: str) -> Any:
    """`module.sub:attr.attr` -> the object; an error naming `key` and the path on failure."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise EnvPathError(f"{key}={path!r}: expected module:name (e.g. my_pkg.my_env:MyEnv)")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # the user's module: report any failure to import it, not just ImportError
        raise EnvPathError(
            f"{key}={path!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); run from the directory "
            "that holds it, or put that directory on PYTHONPATH"
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvPathError(f"{key}={path!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def _needs_dataset(path: str) -> Callable[..., list]:
    def dataset(**_: Any) -> list:
        raise EnvPathError(f"environment {path!r} ships no dataset: set env.dataset")

    dataset.ships_none = True  # validation asks for env.dataset without calling this
    return dataset


def spec_from_path(path: str) -> EnvSpec:
    """The EnvSpec of `env.name: module:Name`."""
    obj = load_object(path, key="env.name")
    if isinstance(obj, EnvSpec):
        return obj if obj.name == path else dataclasses.replace(obj, name=path)
    if not callable(obj):
        raise EnvPathError(f"env.name={path!r} is a {type(obj).__name__}, not an Environment class or factory")
    dataset = getattr(obj, "dataset", None)
    eval_dataset = getattr(obj, "eval_dataset", None)
    tokenizer = getattr(obj, "tokenizer", None)
    return EnvSpec(
        name=path,
        factory=obj,
        dataset=dataset if callable(dataset) else _needs_dataset(path),
        tokenizer=tokenizer if isinstance(tokenizer, str) else None,
        description=(inspect.getdoc(obj) or "").split("\n")[0],
        required_fields=tuple(getattr(obj, "required_fields", ()) or ()),
        eval_dataset=eval_dataset if callable(eval_dataset) else None,
    )


class RewardFnEnv:
    """An environment made of a reward function (see the module docstring)."""

    def __init__(self, reward_fn: Callable[..., Any], name: str = "reward_fn"):
        self.reward_fn, self.name = reward_fn, name
        try:
            params = inspect.signature(reward_fn).parameters
        except (TypeError, ValueError):
            params = {}
        self._pass_turn = "turn" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.sample: dict[str, Any] = {}
        self.turn = 0

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        prompt = sample.get("prompt")
        self.sample, self.turn = sample, 0
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
            return [dict(m) for m in prompt]
        raise ValueError(
            f"sample {sample.get('prompt_id')!r}: 'prompt' must be a string or a list of chat "
            f"messages (got {type(prompt).__name__}); map a column to it with env.fields.prompt"
        )

    def step(self, assistant_text: str) -> StepOutput:
        kwargs = {"turn": self.turn} if self._pass_turn else {}
        result = self.reward_fn(assistant_text, self.sample, **kwargs)
        self.turn += 1
        reward, message = result if isinstance(result, tuple) else (result, None)
        if message is None:
            return [], float(reward), True, {}
        return [{"role": "user", "content": str(message)}], float(reward), False, {}


def reward_fn_spec(path: str) -> EnvSpec:
    """The EnvSpec of `env.reward_fn: module:function` (samples from env.dataset)."""
    fn = load_object(path, key="env.reward_fn")
    if not callable(fn):
        raise EnvPathError(f"env.reward_fn={path!r} is a {type(fn).__name__}, not a function")
    return EnvSpec(
        name=f"reward_fn:{path}",
        factory=lambda: RewardFnEnv(fn, path),
        dataset=_needs_dataset(f"env.reward_fn={path}"),
        required_fields=("prompt",),
        description=f"prompts scored by {path}",
    )


def resolve_env_spec(name: str, reward_fn: str | None = None) -> EnvSpec:
    """The environment of a config's `env.reward_fn` (it wins) or `env.name`: a registered name, or
    a `module:Name` dotted path (imported and registered under that name once)."""
    if reward_fn:
        return reward_fn_spec(reward_fn)
    if is_dotted_path(name) and name not in list_envs():
        return register_env(spec_from_path(name))
    return get_env_spec(name)
