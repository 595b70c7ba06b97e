"""Reading experiment YAML: `defaults:` inheritance, `a.b.c=value` overrides, provenance of keys.

Merge rules: a file's `defaults:` (a path or a list of paths relative to that file) are merged
depth-first in order, then the file's own keys; later wins. Mappings merge key by key; an
explicit empty mapping (`{}`) and any other value (lists included) replace the earlier one.
A key written twice in one mapping is an error (YAML would silently keep the last one).
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml

from megatron_stepwise.config.errors import ConfigProblem
from megatron_stepwise.config.fields import config_fields, is_config_class
from megatron_stepwise.errors import UserError

COMMAND_LINE = "command line"
_KEY_RE = re.compile(r"^[A-Za-z_][\w+\-]*(\.[A-Za-z_][\w+\-]*)*$")


class ComposeError(UserError):
    """A file could not be read at all; carries the problems found."""

    def __init__(self, problems: list[ConfigProblem]):
        super().__init__("; ".join(map(str, problems)))
        self.problems = problems


def _record(origins: dict[str, str], data: Any, label: str, prefix: str = "") -> None:
    """Mark every dotted key of `data` as coming from `label`."""
    if isinstance(data, dict):
        for k, v in data.items():
            path = f"{prefix}{k}"
            origins[path] = label
            _record(origins, v, label, path + ".")


def deep_merge(base: dict, top: dict) -> dict:
    """Merge `top` into `base` in place (mappings recursively, everything else replaced). An
    empty mapping replaces too: it is how a child file clears an inherited one."""
    for k, v in top.items():
        if isinstance(v, dict) and v and isinstance(base.get(k), dict):
            deep_merge(base[k], v)
        else:
            base[k] = v
    return base


MAX_CONFIG_BYTES = 1 << 20  # experiment files are a few KB: anything this large is not one
MAX_CONFIG_NODES = 100_000  # values after expanding YAML aliases: stops "billion laughs" and cycles
MAX_CONFIG_DEPTH = 64  # nesting levels; a config has a handful, and the parser recurses per level


class _TooDeep(Exception):
    pass


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses what it would otherwise accept silently or crash on: a key
    written twice in one mapping (the last one would win unseen: two `optim:` sections), and an
    integer too long for Python to convert (a ValueError, not a YAML error)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                    continue  # `<<:` merges are meant to be overridden by the keys beside them
                key = self.construct_object(key_node)
                if key in first:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first at line {first[key] + 1}): YAML would silently keep only the last one",
                        key_node.start_mark,
                    )
                first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            digits = sum(c.isdigit() for c in str(node.value))
            raise yaml.constructor.ConstructorError(
                None, None, f"integer of {digits} digits is too large for any key", node.start_mark
            ) from None


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def _load_yaml(text: str) -> Any:
    """`yaml.safe_load` (with `_StrictLoader`), nesting the parser cannot recurse through as `_TooDeep`."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except RecursionError:
        raise _TooDeep from None


def _check_depth(data: Any) -> None:
    """`_TooDeep` past MAX_CONFIG_DEPTH levels (after `_expanded_size_ok`: the walk is bounded)."""
    todo = [(data, 1)]
    while todo:
        item, depth = todo.pop()
        if depth > MAX_CONFIG_DEPTH:
            raise _TooDeep
        if isinstance(item, (dict, list)):
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))


def _expanded_size_ok(data: Any) -> bool:
    """Whether `data`, with every alias expanded, has at most MAX_CONFIG_NODES values (a recursive
    structure never does). Stops counting at the limit, so a bomb costs nothing to detect."""
    todo, seen = [data], 0
    while todo:
        item = todo.pop()
        seen += 1
        if seen > MAX_CONFIG_NODES:
            return False
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return True


def _read_yaml(path: Path, problems: list[ConfigProblem]) -> dict | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        problems.append(ConfigProblem("<file>", f"cannot read {path}: {e.strerror or e}"))
        return None
    if len(raw) > MAX_CONFIG_BYTES:
        problems.append(
            ConfigProblem("<file>", f"{path} is over {MAX_CONFIG_BYTES >> 20} MiB: not an experiment config")
        )
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        problems.append(ConfigProblem("<file>", f"{path} is not a UTF-8 text file (byte {e.start}): not a YAML config"))
        return None
    try:
        data = _load_yaml(text)
    except _TooDeep:
        problems.append(
            ConfigProblem(
                "<yaml>", f"{path}: nested more than {MAX_CONFIG_DEPTH} levels deep: not an experiment config"
            )
        )
        return None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(e, "problem", None) or str(e)
        problems.append(ConfigProblem("<yaml>", f"{path}:{where} YAML syntax error: {reason}"))
        return None
    if data is None:
        return {}
    if not _expanded_size_ok(data):
        problems.append(
            ConfigProblem(
                "<yaml>",
                f"{path}: YAML aliases expand to more than {MAX_CONFIG_NODES} values "
                "(or refer to themselves): not an experiment config",
            )
        )
        return None
    try:
        _check_depth(data)
    except _TooDeep:
        problems.append(
            ConfigProblem(
                "<yaml>", f"{path}: nested more than {MAX_CONFIG_DEPTH} levels deep: not an experiment config"
            )
        )
        return None
    if not isinstance(data, dict):
        problems.append(ConfigProblem("<root>", f"{path}: expected a mapping of sections, got {type(data).__name__}"))
        return None
    return data


def compose(path: str | Path, origins: dict[str, str] | None = None) -> tuple[dict, dict[str, str]]:
    """The merged dict of a YAML file and its `defaults:` chain, and where each key came from."""
    origins = {} if origins is None else origins
    problems: list[ConfigProblem] = []
    merged = _compose(Path(path), [], origins, problems)
    if problems:
        raise ComposeError(problems)
    return merged, origins


def _compose(path: Path, stack: list[Path], origins: dict[str, str], problems: list[ConfigProblem]) -> dict:
    resolved = path.resolve()
    if resolved in stack:
        chain = " -> ".join(p.name for p in stack + [resolved])
        problems.append(ConfigProblem("defaults", f"inheritance cycle: {chain}", str(stack[-1])))
        return {}
    if not path.is_file():
        where = str(stack[-1]) if stack else None
        problems.append(ConfigProblem("defaults" if stack else "<file>", f"no such config file: {path}", where))
        return {}
    data = _read_yaml(path, problems)
    if data is None:
        return {}
    parents = data.pop("defaults", [])
    if isinstance(parents, str):
        parents = [parents]
    merged: dict = {}
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        problems.append(ConfigProblem("defaults", "expected a file path or a list of file paths", str(path)))
        parents = []
    for parent in parents:
        deep_merge(merged, _compose(path.parent / parent, stack + [resolved], origins, problems))
    _record(origins, data, str(path))
    return deep_merge(merged, data)


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", YAML-parsed value). Raises ValueError naming what is wrong."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _KEY_RE.match(key):
        raise ValueError(f"override {text!r} is not of the form section.key=value")
    try:
        value = _load_yaml(raw)
    except _TooDeep:
        raise ValueError(f"override {key}=...: nested more than {MAX_CONFIG_DEPTH} levels deep") from None
    except yaml.YAMLError as e:
        if raw.lstrip()[:1] in ("[", "{") or "too large" in str(getattr(e, "problem", "")):
            reason = getattr(e, "problem", e)
            shown = text if len(text) <= 80 else text[:60] + "..."  # a 5,000-digit value is not echoed
            raise ValueError(f"override {shown!r}: cannot parse the value as YAML ({reason})") from None
        value = raw  # e.g. `a=b: c`, which YAML reads as a mapping error: keep it as text
    if not _expanded_size_ok(value):
        raise ValueError(f"override {key}=...: its YAML aliases expand to more than {MAX_CONFIG_NODES} values")
    try:
        _check_depth(value)
    except _TooDeep:
        raise ValueError(f"override {key}=...: nested more than {MAX_CONFIG_DEPTH} levels deep") from None
    return key, value


def _walks_into_value(schema: type | None, parts: list[str]) -> str | None:
    """The prefix of `parts` that names a plain value in the schema (so nothing can be set below it)."""
    if schema is None:
        return None
    tp: Any = schema
    for i, part in enumerate(parts[:-1]):
        if not is_config_class(tp):
            return None  # inside a free mapping (e.g. env.options): anything goes
        match = [t for name, _, t in config_fields(tp) if name == part]
        if not match:
            return None  # unknown key: reported with a suggestion when the config is built
        tp = match[0]
        if not is_config_class(tp) and typing.get_origin(tp) is not dict and tp is not Any:
            return ".".join(parts[: i + 1])
    return None


def apply_overrides(
    data: dict,
    overrides: Iterable[str],
    origins: dict[str, str],
    problems: list[ConfigProblem],
    schema: type | None = None,
) -> dict:
    """Set each `a.b.c=value` in the nested dict (creating sections as needed)."""
    for text in overrides:
        try:
            key, value = parse_override(text)
        except ValueError as e:
            problems.append(ConfigProblem(text.partition("=")[0].strip() or text, str(e), COMMAND_LINE))
            continue
        parts = key.split(".")
        leaf = _walks_into_value(schema, parts)
        if leaf:
            problems.append(ConfigProblem(key, f"{leaf} is a value, not a section", COMMAND_LINE))
            continue
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                problems.append(ConfigProblem(key, f"{prefix} holds a value ({child!r}), not a section", COMMAND_LINE))
                break
            node = child
        else:
            node[parts[-1]] = value
            origins[key] = COMMAND_LINE
            _record(origins, value, COMMAND_LINE, key + ".")
    return data
