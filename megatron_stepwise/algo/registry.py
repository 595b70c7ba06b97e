"""A name -> function registry with one flag per entry (advantage estimators: their kind;
policy losses: sequence-level or not)."""

from __future__ import annotations

from typing import Any, Callable


class Registry:
    """Functions registered by decorator under a name, each with a `flag` (a bool or a kind).

    `key` and `what` make the error for an unknown name: "<key>=<name> is not a registered <what>".
    """

    def __init__(self, key: str, what: str, error: type[Exception] = ValueError):
        self.key, self.what, self.error = key, what, error
        self._entries: dict[str, tuple[Callable, Any]] = {}

    def register(self, name: str, flag: Any = False) -> Callable[[Callable], Callable]:
        def deco(fn: Callable) -> Callable:
            self._entries[name] = (fn, flag)
            return fn

        return deco

    def names(self) -> list[str]:
        return sorted(self._entries)

    def lookup(self, name: str) -> tuple[Callable, Any]:
        """(function, flag) registered under `name`."""
        if name not in self._entries:
            raise self.error(f"{self.key}={name!r} is not a registered {self.what}; known: {', '.join(self.names())}")
        return self._entries[name]
