"""What one agent run yields: its outcome (reward, per-call rewards, info), or why it failed."""

from __future__ import annotations

import math
from typing import Any, Optional

from megatron_stepwise.errors import UserError

Outcome = tuple[float, Optional[list[float]], dict]


class AgentError(UserError, ValueError):
    """A bad `env.agent`: not a function, or what it returned is no outcome (fix the agent)."""


class AgentFailure(Exception):
    """An agent run that ended its own trajectory: `reason` becomes its `invalid_reason`, `info`
    (an agent command's stderr tail, its exit code) its last step's `agent_info`."""

    def __init__(self, reason: str, info: Optional[dict] = None):
        super().__init__(reason)
        self.reason, self.info = reason, dict(info or {})


def outcome_of(out: Any) -> Outcome:
    """(reward, per-call rewards or None, info) of what `solve` returned (or a command printed)."""
    if isinstance(out, dict):
        if "reward" not in out:
            raise AgentError(f"the agent returned a dict without 'reward': {sorted(out)}")
        turns = out.get("turn_rewards")
        info = out.get("info") or {}
        if not isinstance(info, dict):
            raise AgentError(f"the agent's 'info' must be a dict, got {type(info).__name__}")
        if turns is not None and not isinstance(turns, list):
            raise AgentError(f"the agent's 'turn_rewards' must be a list, got {type(turns).__name__}")
        reward = _number(out["reward"], "reward")
        return reward, None if turns is None else [_number(t, "turn_rewards") for t in turns], dict(info)
    return _number(out, "reward"), None, {}


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AgentError(f"the agent's {what} must be a finite number, got {value!r:.100}")
    return float(value)
