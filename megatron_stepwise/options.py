"""Declaring option dataclasses once: every key's default, help, bounds and choices in one place.

A key is a dataclass field made with `option(...)`; a nested group of keys is a `section(...)`.
The declaration is read by both users of such a class:

- the YAML loader (`megatron_stepwise.config`) builds the dataclass from a file, checks every
  value against its declaration and reports each problem with its dotted key and origin; the
  reference docs (docs/config.md) are generated from the same help, bounds and choices;
- Python code constructing the class directly gets the same checks from `check_options` in the
  class's `__post_init__`: an `OptionError` (a ValueError) naming the dotted key, with the same
  message the loader reports.

Choices are a tuple of allowed values, or a zero-argument function returning them: a plugin
registry, read when the value is checked, so names registered later (by `trainer.imports`
modules) count. The loader checks registry choices only after those modules are imported.

Pure Python on purpose: `megatron_stepwise.algo` declares its configs with it and must not
import the config package (or Megatron, Ray, YAML).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import difflib
import functools
import math
import typing
from typing import Any, Callable, Iterator, Sequence, Union

from megatron_stepwise.errors import UserError

Choices = Union[Sequence[Any], Callable[[], Sequence[Any]]]

_UNCHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("megatron_stepwise_unchecked", default=False)


def option(
    default: Any,
    help: str,
    *,
    key: str | None = None,
    min: float | None = None,
    max: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
    choices: Choices | None = None,
) -> Any:
    """A key: its default, one-line help, optional YAML name, numeric bounds and allowed values."""
    if choices is not None and not callable(choices):
        choices = tuple(choices)
    meta = {"help": help, "key": key, "min": min, "max": max, "gt": gt, "lt": lt, "choices": choices}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=functools.partial(copy.deepcopy, default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def option_of(cls: type, name: str) -> Any:
    """The option `name` of the option dataclass `cls` as a field of another class: the same
    default, help, bounds and choices, declared once (e.g. the `rollout` section's agent-loop
    keys are `rollout.agent_loop.AgentLoopConfig`'s)."""
    f = _option_field(cls, name)
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    return dataclasses.field(default=f.default, metadata=f.metadata)


def _option_field(cls: type, name: str) -> dataclasses.Field:
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if f is None or "help" not in f.metadata:
        raise TypeError(f"{cls.__name__} declares no option {name!r}")  # a bug in a schema
    return f


def problem_of(cls: type, name: str, value: Any) -> str | None:
    """Why `value` breaks the bounds or choices of option `name` of `cls`, or None: for code that
    takes one declared knob as a plain value (a request field, a function argument)."""
    return value_problem(value, _option_field(cls, name).metadata)


def takes_options(owner: type, names: Sequence[str]) -> Callable[[type], type]:
    """Class decorator (below `@dataclass`): the options `names` of `owner` that the class does not
    declare itself are appended as its fields (`option_of`), so a key the owner adds to `names`
    needs no second edit in the schema."""

    def add(cls: type) -> type:
        own = cls.__dict__["__annotations__"]  # the class declares fields of its own
        hints = typing.get_type_hints(owner)
        for name in names:
            if name not in own:
                own[name] = hints[name]
                setattr(cls, name, option_of(owner, name))
        return cls

    return add


def section(cls: type, help: str, *, key: str | None = None) -> Any:
    """A nested group of keys (another option dataclass)."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "key": key})


def yaml_key(f: dataclasses.Field) -> str:
    """The name a field has in YAML (`async` cannot be a Python attribute, so it is `async_`)."""
    return f.metadata.get("key") or f.name


def show(value: Any) -> str:
    """A value as quoted in messages (repr, shortened)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------------------------- choices


def is_registry(meta: Any) -> bool:
    """Whether a field's choices come from a registry (a function read at check time)."""
    return callable(meta.get("choices"))


def choices_of(meta: Any) -> tuple | None:
    """A field's allowed values now (a registry's current names), or None when any value goes."""
    choices = meta.get("choices")
    if choices is None:
        return None
    return tuple(choices()) if callable(choices) else tuple(choices)


def choice_problem(value: Any, choices: Sequence[Any], *, registry: bool = False) -> str | None:
    """Why `value` is not among `choices` (with the closest one suggested), or None."""
    if value in choices and (not choices or type(value) is type(choices[0])):
        return None
    hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    extra = f"; did you mean {hint[0]!r}?" if hint else ""
    names = ", ".join(map(str, choices))
    if registry:
        return f"{show(value)} is not registered; known: {names}{extra}"
    return f"must be one of {names} (got {show(value)}){extra}"


# ----------------------------------------------------------------------------- bounds


def bounds_problem(value: Any, meta: Any) -> str | None:
    """Why a number breaks a field's bounds, or None (also for None and non-numbers)."""
    if value is None or not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        # Every float key: NaN passes no comparison below (so no bound would catch it) and an
        # inf learning rate or reward would only surface as NaN losses iterations later.
        return f"must be a finite number (got {value})"
    if meta.get("min") is not None and value < meta["min"]:
        return f"must be >= {meta['min']} (got {value})"
    if meta.get("max") is not None and value > meta["max"]:
        return f"must be <= {meta['max']} (got {value})"
    if meta.get("gt") is not None and value <= meta["gt"]:
        return f"must be > {meta['gt']} (got {value})"
    if meta.get("lt") is not None and value >= meta["lt"]:
        return f"must be < {meta['lt']} (got {value})"
    return None


def bounds_help(meta: Any) -> str:
    """The numeric bounds of a field as text for the docs ("" when unbounded)."""
    parts = []
    for name, sym in (("min", ">="), ("gt", ">"), ("max", "<="), ("lt", "<")):
        if meta.get(name) is not None:
            parts.append(f"{sym} {meta[name]}")
    return ", ".join(parts)


def value_problem(value: Any, meta: Any, *, registries: bool = True) -> str | None:
    """Why `value` breaks its field's declared bounds or choices, or None.

    `registries=False` skips choices that come from a registry (the loader checks those once
    the modules that register names are imported).
    """
    bound = bounds_problem(value, meta)
    if bound or value is None:
        return bound
    if registries or not is_registry(meta):
        choices = choices_of(meta)
        if choices is not None:
            return choice_problem(value, choices, registry=is_registry(meta))
    return None


# ----------------------------------------------------------------------------- checking instances


def option_problems(obj: Any) -> list[tuple[str, str]]:
    """(YAML key, why) for each field of an option dataclass whose value breaks its declaration."""
    out = []
    for f in dataclasses.fields(obj):
        why = value_problem(getattr(obj, f.name), f.metadata)
        if why:
            out.append((yaml_key(f), why))
    return out


class OptionError(UserError, ValueError):
    """A value that breaks its option's declaration; `key` is the dotted config key."""

    def __init__(self, key: str, why: str):
        super().__init__(f"{key}: {why}")
        self.key, self.why = key, why


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Construct option dataclasses without their `__post_init__` checks.

    For the config loader, which checks the same declarations itself and reports every problem
    at once (with the file each value came from) instead of stopping at the first.
    """
    token = _UNCHECKED.set(True)
    try:
        yield
    finally:
        _UNCHECKED.reset(token)


def check_options(obj: Any, prefix: str = "") -> None:
    """Raise `OptionError` for the first problem of `obj` (call it from `__post_init__`).

    The problems are `obj.problems()` when the class defines it (its options' problems plus
    combinations of keys), else `option_problems(obj)`; `prefix` is the dotted path of the
    section (`algo.loss.`). Does nothing inside `unchecked()`.
    """
    if _UNCHECKED.get():
        return
    problems = obj.problems() if hasattr(obj, "problems") else option_problems(obj)
    if problems:
        key, why = problems[0]
        raise OptionError(prefix + key, why)
