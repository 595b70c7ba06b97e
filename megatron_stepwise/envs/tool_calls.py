"""Tool calls as chat models write them: schemas for `tools=`, a parser, tool-result messages.

`function_tool` builds the OpenAI / Hugging Face function schemas an environment passes as
`tools=`; `parse_tool_calls(text, tools)` returns every call block of a turn in order, each a
`ToolCall` or a `ToolCallError` whose message is written for the model, so a malformed call can
be answered with a `tool_message` instead of failing the trajectory. `format` picks the syntax
(`TOOL_CALL_FORMATS`: `hermes`, `glm`, `llama3_json`); none raises on model output.
No Megatron, torch or Ray imports: environments import this in their own processes.

The formats and what the parser checks: docs/custom_envs.md, 'Tools: `tools=`, `<tool_call>` and
`model.chat_template`' and 'Tool-call formats and parsing'.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

TOOL_CALL_FORMATS = ("hermes", "glm", "llama3_json")
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TAG = re.compile(re.escape(TOOL_CALL_OPEN) + "|" + re.escape(TOOL_CALL_CLOSE))
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}
_SHOWN = 200  # characters of a bad block quoted back in its error


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: `index` is its position among the turn's <tool_call> blocks."""

    index: int
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A block that is not a valid call; `message` is meant to be shown to the model."""

    index: int
    message: str
    text: str  # the block's body (or what followed an unterminated <tool_call>)
    name: Optional[str] = None  # the tool named, when the block got that far


@dataclass(frozen=True)
class ParsedTurn:
    """Every <tool_call> block of a turn, in order, and the text outside them."""

    blocks: list[Union[ToolCall, ToolCallError]] = field(default_factory=list)
    text: str = ""

    @property
    def calls(self) -> list[ToolCall]:
        return [b for b in self.blocks if isinstance(b, ToolCall)]

    @property
    def errors(self) -> list[ToolCallError]:
        return [b for b in self.blocks if isinstance(b, ToolCallError)]


def function_tool(name: str, description: str, parameters: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A function schema for `tools=` (`parameters` is a JSON schema of an object)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": parameters if parameters is not None else {"type": "object", "properties": {}},
        },
    }


def tool_function(tool: dict[str, Any]) -> dict[str, Any]:
    """The function part of a schema: `{"name", "description", "parameters"}` (both shapes accepted)."""
    inner = tool.get("function")
    return inner if isinstance(inner, dict) else tool


def tool_names(tools: Sequence[dict[str, Any]]) -> list[str]:
    return [str(tool_function(t).get("name")) for t in tools]


def tool_message(content: str, name: Optional[str] = None, tool_call_id: Optional[str] = None) -> dict[str, str]:
    """A tool-result message (role "tool") to return as (part of) an observation."""
    message = {"role": "tool", "content": str(content)}
    if name is not None:
        message["name"] = name
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    return message


def check_tools(tools: Any) -> Optional[list[dict[str, Any]]]:
    """Validate an environment's tool schemas; returns a plain JSON copy (None when there are none).

    Raises ValueError naming what is wrong: not a list of dicts, not JSON-serialisable, a schema
    without a function name, or two tools of the same name.
    """
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of function schemas (dicts), got {type(tools).__name__}")
    if not tools:
        return None
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}] must be a function schema (dict), got {type(tool).__name__}")
    try:
        plain = json.loads(json.dumps(list(tools)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"tools must be JSON-serialisable: {e}") from None
    names = []
    for i, tool in enumerate(plain):
        name = tool_function(tool).get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"tools[{i}] has no function name (expected {{'type': 'function', 'function': "
                f"{{'name': ..., 'parameters': ...}}}})"
            )
        names.append(name)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"tools declares {', '.join(map(repr, duplicates))} more than once")
    return plain


def parse_tool_calls(text: str, tools: Optional[Sequence[dict[str, Any]]] = None, format: str = "hermes") -> ParsedTurn:
    """Every tool call of `text`, in order, written in `format` (see the module docstring).

    With `tools`, a call must name one of them and its arguments must fit its parameters.
    A `</tool_call>` without an opening tag is left in the text.
    """
    if format not in TOOL_CALL_FORMATS:
        raise ValueError(f"tool call format must be one of {', '.join(TOOL_CALL_FORMATS)}, got {format!r}")
    by_name = {tool_function(t).get("name"): tool_function(t) for t in tools} if tools is not None else None
    if format == "llama3_json":
        return _parse_llama3_json(text, by_name)
    blocks: list[Union[ToolCall, ToolCallError]] = []
    outside: list[str] = []
    pos = 0
    open_at: Optional[int] = None  # where the body of the block being read starts
    for tag in _TAG.finditer(text):
        if tag.group() == TOOL_CALL_OPEN:
            if open_at is not None:  # a new block opens before the last one closed
                blocks.append(_unterminated(len(blocks), text[open_at : tag.start()], reopened=True))
            else:
                outside.append(text[pos : tag.start()])
            open_at = tag.end()
        elif open_at is not None:
            blocks.append(_parse_block(len(blocks), text[open_at : tag.start()], by_name, format))
            open_at, pos = None, tag.end()
    if open_at is not None:
        blocks.append(_unterminated(len(blocks), text[open_at:], reopened=False))
    else:
        outside.append(text[pos:])
    return ParsedTurn(blocks, "".join(outside).strip())


def _unterminated(index: int, body: str, *, reopened: bool) -> ToolCallError:
    where = "before the next <tool_call>" if reopened else "(the turn may have hit its token limit)"
    return ToolCallError(
        index, f"tool call {index + 1}: <tool_call> is not closed by </tool_call> {where}", body.strip()[:_SHOWN]
    )


def _parse_block(
    index: int, body: str, by_name: Optional[dict], format: str = "hermes"
) -> Union[ToolCall, ToolCallError]:
    body = body.strip()  # error positions count from the JSON's first character
    shown = body[:_SHOWN]

    def error(message: str, name: Optional[str] = None) -> ToolCallError:
        return ToolCallError(index, f"tool call {index + 1}: {message}", shown, name)

    if not body:
        return error('empty; write {"name": ..., "arguments": {...}} between the tags')
    if format == "glm":
        return _checked(index, *_glm_call(body), by_name, error)
    if body.startswith("<function="):
        return _checked(index, *_xml_call(body), by_name, error)
    try:
        value = json.loads(body, strict=False)  # strict=False: raw newlines/tabs inside strings
    except json.JSONDecodeError as e:
        return error(f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno})")
    except RecursionError:  # model output can nest brackets deeper than Python's decoder recurses
        return error("invalid JSON (nested too deeply)")
    if not isinstance(value, dict):
        return error(f'must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {_json_type(value)}')
    name = value.get("name")
    if "name" not in value:
        return error('has no "name" (the tool to call)')
    if not isinstance(name, str) or not name:
        return error(f'"name" must be a non-empty string, got {json.dumps(name)[:50]}')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's shape: the arguments object encoded as a string
        try:
            arguments = json.loads(arguments, strict=False) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return error(f'"arguments" is a string that is not valid JSON ({e.msg} at column {e.colno})', name)
        except RecursionError:
            return error('"arguments" is a string that is not valid JSON (nested too deeply)', name)
    if not isinstance(arguments, dict):
        return error(f'"arguments" must be a JSON object, got {_json_type(arguments)}', name)
    return _checked(index, name, arguments, None, by_name, error)


def _checked(
    index: int, name: Optional[str], arguments: dict, problem: Optional[str], by_name: Optional[dict], error
) -> Union[ToolCall, ToolCallError]:
    """The call, or the error of a parse `problem`, an unknown tool or arguments that do not fit."""
    if problem:
        return error(problem, name)
    if by_name is not None:
        if name not in by_name:
            available = ", ".join(sorted(map(str, by_name))) or "none"
            return error(f"unknown tool {name!r} (available: {available})", name)
        problem = _argument_problem(arguments, by_name[name].get("parameters"))
        if problem:
            return error(f"{name}: {problem}", name)
    return ToolCall(index, name, arguments)


_XML_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.S)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _loose_value(text: str) -> Any:
    """A parameter value: JSON when it parses (numbers, objects...), else the text itself."""
    try:
        return json.loads(text, strict=False)
    except (ValueError, RecursionError):
        return text


def _xml_call(body: str) -> tuple[Optional[str], dict, Optional[str]]:
    """(name, arguments, problem) of Qwen3-Coder's `<function=NAME><parameter=KEY>v</parameter>`."""
    match = _XML_FUNCTION.match(body)
    name = match.group(1).strip() if match else ""
    if not name:
        return None, {}, "<function=...> names no function"
    args = {k.strip(): _loose_value(v) for k, v in _XML_PARAMETER.findall(match.group(2))}
    return name, args, None


def _glm_call(body: str) -> tuple[Optional[str], dict, Optional[str]]:
    """(name, arguments, problem) of GLM's `NAME<arg_key>KEY</arg_key><arg_value>v</arg_value>`."""
    name = body.split("<arg_key>", 1)[0].strip()
    if not name or any(c in name for c in "<>{}\n"):
        return None, {}, "write the function name first, then <arg_key>...</arg_key><arg_value>...</arg_value> pairs"
    args = {k.strip(): _loose_value(v) for k, v in _GLM_ARGUMENT.findall(body)}
    return name, args, None


def _parse_llama3_json(text: str, by_name: Optional[dict]) -> ParsedTurn:
    """Llama 3.x custom tool calls: the turn is the call(s) `{"name", "parameters"}`, else text."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].strip()
    if not body.startswith("{"):
        return ParsedTurn([], text.strip())
    blocks: list[Union[ToolCall, ToolCallError]] = []
    decoder, pos = json.JSONDecoder(strict=False), 0
    while pos < len(body):
        index, rest = len(blocks), body[pos:]

        def error(message: str, name: Optional[str] = None, index: int = index, rest: str = rest) -> ToolCallError:
            return ToolCallError(index, f"tool call {index + 1}: {message}", rest[:_SHOWN], name)

        try:
            value, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            blocks.append(error(f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno})"))
            break
        except RecursionError:
            blocks.append(error("invalid JSON (nested too deeply)"))
            break
        pos = end
        name = value.get("name") if isinstance(value, dict) else None
        arguments = value.get("parameters", value.get("arguments", {})) if isinstance(value, dict) else None
        if not isinstance(name, str) or not name:
            blocks.append(error('must be a JSON object {"name": ..., "parameters": {...}}'))
        elif not isinstance(arguments, dict):
            blocks.append(error(f'"parameters" must be a JSON object, got {_json_type(arguments)}', name))
        else:
            blocks.append(_checked(index, name, arguments, None, by_name, error))
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
        if pos < len(body) and body[pos] != "{":
            return ParsedTurn(blocks, body[pos:].strip())
    return ParsedTurn(blocks, "")


def _argument_problem(arguments: dict[str, Any], parameters: Any) -> Optional[str]:
    if not isinstance(parameters, dict):
        return None
    properties = parameters.get("properties") or {}
    missing = [k for k in parameters.get("required") or [] if k not in arguments]
    if missing:
        return f"missing required argument{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}"
    if parameters.get("additionalProperties") is False:
        extra = [k for k in arguments if k not in properties]
        if extra:
            return f"unexpected argument{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))}"
    for key, value in arguments.items():
        spec = properties.get(key)
        expected = spec.get("type") if isinstance(spec, dict) else None
        if expected is None:
            continue
        types = [expected] if isinstance(expected, str) else list(expected)
        if not any(_is_type(value, t) for t in types):
            return f"argument {key!r} must be {' or '.join(types)}, got {_json_type(value)}"
    return None


def _is_type(value: Any, json_type: str) -> bool:
    if json_type not in _JSON_TYPES:
        return True  # a type this check does not know: accept
    if isinstance(value, bool) and json_type in ("integer", "number"):
        return False
    return isinstance(value, _JSON_TYPES[json_type])


def _json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, name):
            return "an integer" if name == "integer" else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
    return type(value).__name__
