"""The collector of a config's problems, quiet about keys that already failed to parse.

Type and unknown-key problems are found while building the dataclasses (fields.build); a key
that failed there is "bad" and the checks that involve it stay quiet, so the user sees the root
cause once instead of a cascade.
"""

from __future__ import annotations

from megatron_stepwise.config.errors import ConfigProblem
from megatron_stepwise.config.fields import origin_of


class Checker:
    """The problems found so far; `fail` records one (each check module reports through it)."""

    def __init__(self, bad_keys: set[str], origins: dict[str, str]):
        self.bad_keys, self.origins = bad_keys, origins
        self.problems: list[ConfigProblem] = []

    def _is_bad(self, key: str) -> bool:
        while key:
            if key in self.bad_keys:
                return True
            key = key.rpartition(".")[0]
        return False

    def fail(self, key: str, message: str, *involved: str) -> None:
        """Record a problem at `key`, unless it or a key it involves already failed to parse."""
        if any(self._is_bad(k) for k in (key, *involved)):
            return
        self.problems.append(ConfigProblem(key, message, origin_of(self.origins, key)))
