"""Declaring config keys (`option`, `section`) and turning nested dicts into typed dataclasses.

Every key is a dataclass field with a default and a one-line help in its metadata, so the
reference docs and the type checks are generated from the same declaration. Supported types:
int, float, bool, str, Optional[T], Literal[...] (enums), list[T], dict[str, T], Any and
nested config dataclasses. `option`, `section` and the bounds/choices checks live in
`megatron_stepwise.options` (pure Python, so `algo/` can declare its configs with them, e.g.
`algo.losses.LossConfig` for `algo.loss`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, Literal, Union

from megatron_stepwise.config.errors import ConfigProblem
from megatron_stepwise.options import (
    choice_problem,
    is_registry,
    unchecked,
    value_problem,
    yaml_key,
)
from megatron_stepwise.options import show as _show

_NoneType = type(None)


@functools.lru_cache(maxsize=None)
def config_fields(cls: type) -> tuple[tuple[str, dataclasses.Field, Any], ...]:
    """(yaml name, field, resolved type) for each field of a config dataclass, in order."""
    hints = typing.get_type_hints(cls)
    return tuple((yaml_key(f), f, hints[f.name]) for f in dataclasses.fields(cls))


def is_config_class(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key path of a config class, sections included."""
    out = []
    for name, _, tp in config_fields(cls):
        path = prefix + name
        out.append(path)
        if is_config_class(tp):
            out += all_keys(tp, path + ".")
    return out


def _optional_inner(tp: Any) -> Any | None:
    """T for Optional[T] (or T | None), else None."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not _NoneType]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def describe_type(tp: Any) -> str:
    """Human-readable type for the docs and error messages."""
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{describe_type(inner)} | null"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return f"list[{describe_type(item)}]"
    if origin is dict:
        return "dict"
    if tp is Any:
        return "any"
    if is_config_class(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def describe_field(f: dataclasses.Field, tp: Any) -> str:
    """The type of a key for the docs: its fixed choices when it declares some, else `describe_type`."""
    choices = f.metadata.get("choices")
    if choices is None or is_registry(f.metadata):
        return describe_type(tp)
    text = " | ".join(map(str, choices))
    return f"{text} | null" if _optional_inner(tp) is not None else text


class _Mismatch(Exception):
    """A value that does not fit its declared type (message says what was expected)."""


def coerce(value: Any, tp: Any) -> Any:
    """Check `value` against `tp`; return it (ints widened to float where a float is expected).

    YAML 1.1 reads `1e-6` (no dot) as a string, so float keys also accept numeric strings.
    """
    inner = _optional_inner(tp)
    if inner is not None:
        return None if value is None else coerce(value, inner)
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        problem = choice_problem(value, typing.get_args(tp))
        if problem:
            raise _Mismatch(problem)
        return value
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch(f"expected a list, got {_show(value)}")
        (item,) = typing.get_args(tp) or (Any,)
        out = []
        for i, v in enumerate(value):
            try:
                out.append(coerce(v, item))
            except _Mismatch as e:
                raise _Mismatch(f"item {i}: {e}") from None
        return out
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch(f"expected a mapping, got {_show(value)}")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise _Mismatch(f"mapping keys must be strings, got {_show(bad[0])}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch(f"expected true or false, got {_show(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -(2**63) <= value < 2**63:  # torch, numpy and the launchers take 64-bit integers
                raise _Mismatch(f"{_show(value)} is out of range (a 64-bit integer)")
            return value
        raise _Mismatch(f"expected an integer, got {_show(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise _Mismatch(f"expected a number, got {_show(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch(f"expected a string, got {_show(value)}")
    raise TypeError(f"unsupported config type {tp!r}")  # a bug in a schema, not a user error


def _initials(name: str) -> str:
    return "".join(word[:1] for word in name.split("_") if word)


def suggest_key(root: type, path: str) -> str | None:
    """The valid dotted key closest to an unknown one: a sibling first (by spelling, then by
    abbreviation: `learning_rate` -> `lr`), then anywhere."""
    keys = all_keys(root)
    parent, _, leaf = path.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if not close and "_" in leaf:  # the long name of an abbreviated key (other trainers spell it out)
        close = [s for s in siblings if s == _initials(leaf)]
    if close:
        return f"{parent}.{close[0]}" if parent else close[0]
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf]
    if same_leaf:
        return same_leaf[0]
    close = difflib.get_close_matches(path, keys, n=1, cutoff=0.75)
    return close[0] if close else None


def build(
    cls: type,
    data: Any,
    problems: list[ConfigProblem],
    *,
    root: type | None = None,
    prefix: str = "",
    origins: dict[str, str] | None = None,
    bad_keys: set[str] | None = None,
) -> Any:
    """Build `cls` from a nested dict, appending a problem per unknown key or wrong type.

    A key with a wrong value keeps its default (and is added to `bad_keys`) so the rest of the
    config is still built and checked: every problem is reported in one pass.
    """
    root = root or cls
    origins = origins or {}
    bad_keys = bad_keys if bad_keys is not None else set()

    def report(key: str, message: str) -> None:
        bad_keys.add(key)
        problems.append(ConfigProblem(key, message, origin_of(origins, key)))

    if data is None:
        data = {}
    if not isinstance(data, dict):
        report(prefix.rstrip(".") or "<root>", f"expected a mapping of keys, got {_show(data)}")
        return cls()
    fields = config_fields(cls)
    known = {name for name, _, _ in fields}
    for key in data:
        if key not in known:
            path = f"{prefix}{key}"
            hint = suggest_key(root, path)
            report(path, "unknown key" + (f"; did you mean {hint!r}?" if hint else ""))
    kwargs = {}
    for name, f, tp in fields:
        if name not in data:
            continue
        path, value = prefix + name, data[name]
        if is_config_class(tp):
            kwargs[f.name] = build(
                tp, value, problems, root=root, prefix=path + ".", origins=origins, bad_keys=bad_keys
            )
            continue
        try:
            value = coerce(value, tp)
        except _Mismatch as e:
            literal = typing.get_origin(_optional_inner(tp) or tp) is Literal  # choices already listed
            report(path, str(e) if literal else f"{e} (type: {describe_field(f, tp)})")
            continue
        # Registry choices wait for validate, which imports trainer.imports (they register names) first.
        problem = value_problem(value, f.metadata, registries=False)
        if problem:
            report(path, problem)
            continue
        kwargs[f.name] = value
    with unchecked():  # what the class's own checks would raise is reported here and by validate
        return cls(**kwargs)


def origin_of(origins: dict[str, str], key: str) -> str | None:
    """Where a key's value came from: the key itself, or its closest ancestor that has an origin."""
    while key:
        if key in origins:
            return origins[key]
        key = key.rpartition(".")[0]
    return None


def to_dict(obj: Any) -> Any:
    """A config dataclass as plain nested dicts/lists, keyed by YAML names."""
    if is_config_class(type(obj)):
        return {name: to_dict(getattr(obj, f.name)) for name, f, _ in config_fields(type(obj))}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
