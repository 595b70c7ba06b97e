"""Client messages as the chat template's messages, and the keys that say two are the same.

Both APIs are turned into one form, the messages `apply_chat_template` renders: `{"role",
"content": str}`, an assistant's `tool_calls` as `{"type": "function", "function": {"name",
"arguments": dict}}`, a tool result as `{"role": "tool", "content", "tool_call_id"}`. `message_key`
is what the prefix check compares: role, text and calls (names and arguments), not the ids a
client gives its calls, nor whitespace-free reformatting of their JSON.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from megatron_stepwise.envs.tool_calls import ParsedTurn, check_tools, tool_function
from megatron_stepwise.gateway.errors import bad

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MessageKey = tuple


def text_of(content: Any, where: str) -> str:
    """A message content's text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"must be a string or a list of content parts, got {type(content).__name__}")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            raise bad(f"{where}[{j}].type", f"only text parts are supported, got {kind!r}")
    return "".join(out)


def arguments_of(raw: Any, where: str) -> Any:
    """A call's arguments as a dict (OpenAI sends them as a JSON string)."""
    if isinstance(raw, dict):
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw  # rendered as the client wrote it
    raise bad(where, f"must be a JSON object or a string, got {type(raw).__name__}")


def openai_messages(messages: Any) -> list[dict]:
    """`messages` of a chat/completions request in the template's form; 400 naming the field."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with a role")
        role = ROLES.get(m.get("role"))
        if role is None:
            raise bad(f"{where}.role", f"must be one of {sorted(ROLES)}, got {m.get('role')!r}")
        message: dict[str, Any] = {"role": role, "content": text_of(m.get("content"), f"{where}.content")}
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise bad(f"{where}.tool_calls", "must be a list")
            message["tool_calls"] = [_openai_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if role == "tool" and m.get("tool_call_id") is not None:
            message["tool_call_id"] = str(m["tool_call_id"])
        out.append(message)
    return out


def _openai_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where}.function", "must be an object with a name and arguments")
    return template_call(fn["name"], arguments_of(fn.get("arguments"), f"{where}.function.arguments"), call.get("id"))


def template_call(name: str, arguments: Any, call_id: Optional[str] = None) -> dict:
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        call["id"] = str(call_id)
    return call


def openai_tools(tools: Any) -> Optional[list[dict]]:
    """A request's `tools` (OpenAI function tools), checked like an environment's; None if none."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", "must be a list of function tools")
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or (t.get("type", "function") != "function"):
            raise bad(f"tools[{i}].type", "only function tools are supported")
    try:
        return check_tools(tools)
    except ValueError as e:
        raise bad("tools", str(e)) from None


def reply_message(parsed: ParsedTurn, text: str) -> dict:
    """The assistant message the gateway returns for a sampled `text` (its calls parsed)."""
    calls = parsed.calls
    if not calls:
        return {"role": "assistant", "content": text}
    return {
        "role": "assistant",
        "content": parsed.text,
        "tool_calls": [template_call(c.name, c.arguments) for c in calls],
    }


def message_key(message: dict) -> MessageKey:
    """What makes two template messages the same turn (ids and JSON layout aside)."""
    calls = tuple(
        (tool_function(c).get("name"), json.dumps(tool_function(c).get("arguments"), sort_keys=True))
        for c in message.get("tool_calls") or ()
    )
    return message["role"], message.get("content") or "", calls


def tools_key(tools: Optional[list[dict]]) -> str:
    return json.dumps(tools or [], sort_keys=True)
