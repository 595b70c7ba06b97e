"""Config problems: each names the dotted key it is about; all are reported together."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_stepwise.errors import UserError


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config, attached to the dotted key that is wrong."""

    key: str
    message: str
    origin: str | None = None  # the file (or "command line") the offending value came from

    def __str__(self) -> str:
        where = f" [{self.origin}]" if self.origin else ""
        return f"{self.key}: {self.message}{where}"


class ConfigError(UserError, ValueError):
    """A config that cannot run. `problems` holds one entry per problem, each naming its key."""

    def __init__(self, problems: list[ConfigProblem], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        super().__init__(self.render())

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.problems]

    def render(self) -> str:
        n = len(self.problems)
        head = f"{self.source}: " if self.source else ""
        lines = [f"{head}{n} config problem{'s' if n != 1 else ''}:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)
