"""Strict readers for the fields of the embedded server's JSON requests.

Each one takes the value as JSON gave it and refuses, with a `BadRequest` naming the endpoint and
the field, anything that is not that type: no `"1"` for a number, no `1.0` or `true` for an
integer, no `"false"` for a flag (which Python's truthiness would read as true). SGLang's own
server (pydantic) refuses these too, so a client that works here works there.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from megatron_stepwise.errors import UserError


class BadRequest(UserError, ValueError):
    """A request the server refuses with 400, the message naming what was wrong."""


MISSING = object()


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object (an empty body is `{}`)."""
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError included
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _field(where: str, name: str, kind: str, value: Any) -> BadRequest:
    return BadRequest(f"{where}: {name} must be {kind}, got {value!r}"[:500])


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def flag(body: dict, name: str, where: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _field(where, name, "true or false", value)
    return value


def integer(body: dict, name: str, where: str, default: Any = MISSING) -> Any:
    value = body.get(name)
    if value is None:
        if default is MISSING:
            raise BadRequest(f"{where}: {name} is required")
        return default
    if not is_int(value):
        raise _field(where, name, "an integer", value)
    return value


def text(body: dict, name: str, where: str, default: Any = MISSING) -> Any:
    value = body.get(name)
    if value is None:
        if default is MISSING:
            raise BadRequest(f"{where}: {name} is required")
        return default
    if not isinstance(value, str):
        raise _field(where, name, "a string", value)
    return value


def text_list(body: dict, name: str, where: str) -> list[str]:
    value = body.get(name)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _field(where, name, "a list of strings", value)
    return value


def token_ids(value: Any, where: str, name: str = "input_ids") -> list[int]:
    if not isinstance(value, list) or not value or not all(is_int(t) for t in value):
        raise _field(where, name, "a non-empty list of integer token ids", value)
    return value


_VERSION = re.compile(r"-?[0-9]+")


MAX_VERSION = 2**63 - 1  # versions count optimizer steps; the trainer and checkpoints keep them as int64


def version(value: Any, where: str, name: str = "weight_version") -> Optional[int]:
    """SGLang sends weight versions as strings; this engine counts them as integers (0 and up)."""
    if value is None:
        return None
    if isinstance(value, str) and _VERSION.fullmatch(value) and len(value) <= 20:
        value = int(value)
    if is_int(value) and 0 <= value <= MAX_VERSION:
        return value
    raise _field(where, name, f"an integer from 0 to {MAX_VERSION} (or a string of its digits)", value)


def one_or_each(value: Any, n: int, check, kind: str, where: str, name: str) -> list:
    """A per-prompt field of a batch: one value for every prompt, or a list of n values."""
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise BadRequest(f"{where}: a batch of {n} prompts needs {n} {name} values, got {len(values)}")
    for v in values:
        if not check(v):
            raise _field(where, name, kind, v)
    return values
