"""The `env.agent*` keys: which agent makes the trajectories, and what bounds each one.

Declared here, next to the code that reads them; `config/schema.py`'s `EnvConfig` takes them
with `option_of`, so YAML, Python and the docs share one default, bound and help text.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Optional

from megatron_stepwise.options import check_options, option, option_problems

CLIENT_SAMPLING = ("ignore", "refuse")
# the keys of the `env` section that are AgentConfig's (same names there)
AGENT_KEYS = ("agent", "agent_command", "agent_timeout_s", "agent_max_calls", "agent_max_tokens", "client_sampling")


@dataclass
class AgentConfig:
    """How `env.agent` (a function) or `env.agent_command` runs: once per trajectory, through the gateway."""

    agent: Optional[str] = option(
        None,
        "module:function of your own agent (function or coroutine of sample, base_url, api_key) returning "
        "a reward or {reward, turn_rewards, info}; its OpenAI/Anthropic calls become the steps (docs/gateway.md)",
    )
    agent_command: Any = option(
        None,
        "a command line (string or list) run per trajectory in the sandbox, the sample as JSON on its stdin, "
        "OPENAI_BASE_URL/ANTHROPIC_BASE_URL its trajectory's; reward: its last stdout line "
        '{"reward": ...}, else env.reward_fn (docs/gateway.md)',
    )
    agent_timeout_s: float = option(
        300.0, "seconds one agent run may take; a run over it ends only its own trajectory (invalid)", gt=0.0
    )
    agent_max_calls: int = option(32, "model calls one trajectory may make; later calls are refused (400)", min=1)
    agent_max_tokens: int = option(
        65536, "prompt + sampled tokens one trajectory may use over all its calls; later calls are refused", min=1
    )
    client_sampling: str = option(
        "ignore",
        "a client's temperature/top_p/top_k differing from rollout.sampling: ignore (counted in "
        "gateway/ignored_sampling) or refuse (400); the trainer's sampling keeps log-probs exact",
        choices=CLIENT_SAMPLING,
    )

    def __post_init__(self) -> None:
        check_options(self, "env.")

    def problems(self) -> list[tuple[str, str]]:
        found = option_problems(self)
        if self.agent and self.agent_command:
            found.append(("agent_command", "is set and so is env.agent: your agent is one or the other; set only one"))
        elif self.agent_command is not None:
            try:
                self.argv()
            except ValueError as e:
                found.append(("agent_command", str(e)))
        return found

    def argv(self) -> list[str]:
        """`agent_command` as an argument list (a string is split as a shell would, no shell run)."""
        command = self.agent_command
        argv = shlex.split(command) if isinstance(command, str) else command
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
            raise ValueError(f"expected a command line or a non-empty list of non-empty strings, got {command!r:.100}")
        return list(argv)

    @classmethod
    def from_section(cls, env: Any) -> "AgentConfig":
        """From an experiment's `env` section (its `AGENT_KEYS`)."""
        return cls(**{key: getattr(env, key) for key in AGENT_KEYS})
