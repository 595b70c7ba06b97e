"""One model call in neither API's shape: what the client asked (`Call`), what it gets (`Answer`)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_stepwise.gateway.errors import bad

SAMPLING_FIELDS = ("temperature", "top_p", "top_k")


@dataclass
class Call:
    """A chat call: template messages and tools, and the client's settings."""

    messages: list[dict]
    tools: Optional[list[dict]] = None
    max_tokens: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    logprobs: bool = False
    model: str = "policy"
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature/top_p/top_k the client sent
    parse_tools: bool = True  # tool_choice "none": tools rendered, calls left as text
    include_usage: bool = False  # OpenAI stream_options.include_usage


@dataclass
class Answer:
    """What the engine sampled for a call, ready for either API."""

    id: str
    created: int
    text: str  # the reply's text outside tool calls (all of it when there are none)
    calls: list[tuple[str, str, dict]]  # (call id, tool name, arguments)
    finish: str  # "stop", "length" or "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    token_texts: list[str]
    logprobs: list[float]


def max_tokens_of(body: dict, *names: str) -> Optional[int]:
    """The first of `names` the body sets, as a positive integer (400 naming it otherwise)."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise bad(name, f"must be an integer >= 1, got {value!r}")
        return int(value)
    return None


def stop_of(value: Any, name: str = "stop") -> list[str]:
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) and s for s in values):
        raise bad(name, "must be a non-empty string or a list of them")
    return list(values)


def sampling_of(body: dict) -> dict[str, Any]:
    """The sampling fields the client set (the gateway compares them with the trainer's)."""
    return {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}


def flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {value!r}")
    return value
