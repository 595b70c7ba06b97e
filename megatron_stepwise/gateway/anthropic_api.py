"""Anthropic's messages API: content blocks, tool_use / tool_result, streaming events."""

from __future__ import annotations

import json
from typing import Any, Iterator, Optional

from megatron_stepwise.envs.tool_calls import check_tools, function_tool
from megatron_stepwise.gateway.call import Answer, Call, flag, max_tokens_of, sampling_of, stop_of
from megatron_stepwise.gateway.errors import bad
from megatron_stepwise.gateway.messages import template_call, text_of

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def messages_call(body: dict) -> Call:
    """A messages request as a `Call` (max_tokens is required, as in Anthropic's API)."""
    max_tokens = max_tokens_of(body, "max_tokens")
    if max_tokens is None:
        raise bad("max_tokens", "is required")
    messages = []
    if body.get("system"):
        messages.append({"role": "system", "content": text_of(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "must be a non-empty list of messages")
    for i, m in enumerate(raw):
        messages += _messages_of(m, f"messages[{i}]")
    tool_choice = body.get("tool_choice") or {}
    return Call(
        messages=messages,
        tools=_tools(body.get("tools")),
        max_tokens=max_tokens,
        stop=stop_of(body.get("stop_sequences"), "stop_sequences"),
        stream=flag(body, "stream"),
        model=str(body.get("model") or "policy"),
        sampling=sampling_of(body),
        parse_tools=not (isinstance(tool_choice, dict) and tool_choice.get("type") == "none"),
    )


def _messages_of(m: Any, where: str) -> list[dict]:
    """One Anthropic message as template messages: a user turn's tool_result blocks become tool
    messages (in order, around its text); an assistant's tool_use blocks its tool_calls."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad(f"{where}.role", "must be user or assistant")
    role, content = m["role"], m.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise bad(f"{where}.content", "must be a string or a list of content blocks")
    if role == "assistant":
        text, calls = [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(str(b.get("text", "")))
            elif kind == "tool_use":
                calls.append(template_call(str(b.get("name")), b.get("input") or {}, b.get("id")))
            elif kind not in ("thinking", "redacted_thinking"):
                raise bad(
                    f"{where}.content[{j}].type", f"an assistant turn takes text and tool_use blocks, got {kind!r}"
                )
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        return [message]
    out: list[dict] = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += str(b.get("text", ""))
            else:
                out.append({"role": "user", "content": str(b.get("text", ""))})
        elif kind == "tool_result":
            result = text_of(b.get("content"), f"{where}.content[{j}].content")
            out.append({"role": "tool", "content": result, "tool_call_id": str(b.get("tool_use_id"))})
        else:
            raise bad(f"{where}.content[{j}].type", f"a user turn takes text and tool_result blocks, got {kind!r}")
    return out


def _tools(tools: Any) -> Optional[list[dict]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", "must be a list of tools")
    schemas = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad(f"tools[{i}].name", "a tool needs a name (client tools only: no server tools)")
        schemas.append(function_tool(t["name"], str(t.get("description", "")), t.get("input_schema")))
    try:
        return check_tools(schemas)
    except ValueError as e:
        raise bad("tools", str(e)) from None


def _content(a: Answer) -> list[dict]:
    blocks: list[dict] = [{"type": "text", "text": a.text}] if a.text or not a.calls else []
    return blocks + [{"type": "tool_use", "id": cid, "name": name, "input": args} for cid, name, args in a.calls]


def messages_answer(call: Call, a: Answer) -> dict:
    return {
        "id": a.id,
        "type": "message",
        "role": "assistant",
        "model": call.model,
        "content": _content(a),
        "stop_reason": STOP_REASONS[a.finish],
        "stop_sequence": None,
        "usage": {"input_tokens": a.prompt_tokens, "output_tokens": a.completion_tokens},
    }


def messages_events(call: Call, a: Answer) -> Iterator[tuple[str, dict]]:
    """(event, data) of a streamed answer: the whole answer's blocks, after the engine's end."""
    start = {**messages_answer(call, a), "content": [], "stop_reason": None}
    start["usage"] = {"input_tokens": a.prompt_tokens, "output_tokens": 0}
    yield "message_start", {"type": "message_start", "message": start}
    for k, block in enumerate(_content(a)):
        if block["type"] == "text":
            opening, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            opening = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield "content_block_start", {"type": "content_block_start", "index": k, "content_block": opening}
        yield "content_block_delta", {"type": "content_block_delta", "index": k, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": k}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": STOP_REASONS[a.finish], "stop_sequence": None},
            "usage": {"output_tokens": a.completion_tokens},
        },
    )
    yield "message_stop", {"type": "message_stop"}
