"""The environment protocol and the registry of environments.

An environment is created fresh for every trajectory: `reset(sample)` returns the opening
messages; `step(assistant_text)` returns `(observation_messages, reward, done, info)`, the
observation becoming part of the NEXT prompt; step rewards sum to the outcome reward. Methods
may be plain functions or coroutines. An optional `tools` attribute declares function schemas
that every prompt of the trajectory renders. Environments register with `register_env` on
import; importing `megatron_stepwise.envs` registers the built-in ones.

Tools, tool messages and extra message keys: docs/custom_envs.md, 'The environment protocol'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Optional, Protocol, runtime_checkable

Message = dict[str, str]
StepOutput = tuple[list[Message], float, bool, dict[str, Any]]


ToolSchema = dict[str, Any]


@runtime_checkable
class Environment(Protocol):
    """`reset` and `step` are required; `tools` (a list of `ToolSchema`, or a method returning
    one) is optional and read once per trajectory after `reset` (see the module docstring)."""

    def reset(self, sample: dict[str, Any]) -> list[Message]: ...

    def step(self, assistant_text: str) -> StepOutput: ...


@dataclass
class EnvSpec:
    """How to build an environment and where its prompts come from.

    `factory(**kwargs)` returns a new environment; `dataset(**kwargs)` returns the samples (each
    a dict with a unique "prompt_id"); `tokenizer` names the shipped tokenizer that suits it;
    `required_fields` are the sample fields `reset` reads (validation checks a dataset has them);
    `eval_dataset(**kwargs)`, when given, returns the environment's own held-out samples, evaluated
    when `env.eval_dataset` names no file (else evaluation uses a fixed set of training prompts).
    """

    name: str
    factory: Callable[..., Environment]
    dataset: Callable[..., list[dict[str, Any]]]
    tokenizer: Optional[str] = None
    description: str = ""
    required_fields: tuple[str, ...] = ()
    eval_dataset: Optional[Callable[..., list[dict[str, Any]]]] = None


_REGISTRY: dict[str, EnvSpec] = {}


def register_env(spec: EnvSpec) -> EnvSpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"environment {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def get_env_spec(name: str) -> EnvSpec:
    if name not in _REGISTRY:
        raise KeyError(f"unknown environment {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def make_env(name: str, **kwargs: Any) -> Environment:
    return get_env_spec(name).factory(**kwargs)


def list_envs() -> list[str]:
    return sorted(_REGISTRY)


@lru_cache(maxsize=None)
def read_jsonl(path: str) -> tuple[dict, ...]:
    """The rows of a shipped JSONL data file (read once)."""
    with open(path) as f:
        return tuple(json.loads(line) for line in f if line.strip())


def question_samples(path: str, num_prompts: Optional[int] = None, offset: int = 0) -> list[dict]:
    """Samples (prompt_id, question, answer) from a shipped JSONL question file."""
    rows = read_jsonl(str(path))[offset:]
    rows = rows if num_prompts is None else rows[:num_prompts]
    return [{"prompt_id": r["id"], "question": r["question"], "answer": r["answer"]} for r in rows]
