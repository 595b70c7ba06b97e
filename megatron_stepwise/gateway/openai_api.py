"""OpenAI's chat/completions and completions: requests in, answers and server-sent events out."""

from __future__ import annotations

import json
from typing import Any, Iterator, Optional

from megatron_stepwise.gateway.call import Answer, Call, flag, max_tokens_of, sampling_of, stop_of
from megatron_stepwise.gateway.errors import bad
from megatron_stepwise.gateway.messages import openai_messages, openai_tools


def one_choice(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("n", f"only n=1 is supported (each call is one step of one trajectory), got {n!r}")


def chat_call(body: dict) -> Call:
    """A chat/completions request as a `Call`; 400 naming the field it cannot take."""
    one_choice(body)
    tool_choice = body.get("tool_choice")
    if tool_choice is not None and not (isinstance(tool_choice, (str, dict))):
        raise bad("tool_choice", "must be none, auto, required or a function")
    options = body.get("stream_options") or {}
    return Call(
        messages=openai_messages(body.get("messages")),
        tools=openai_tools(body.get("tools")),
        max_tokens=max_tokens_of(body, "max_completion_tokens", "max_tokens"),
        stop=stop_of(body.get("stop")),
        stream=flag(body, "stream"),
        logprobs=flag(body, "logprobs"),
        model=str(body.get("model") or "policy"),
        sampling=sampling_of(body),
        parse_tools=tool_choice != "none",
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
    )


def completion_prompt(body: dict) -> Any:
    """A completions request's `prompt`: a string, or token ids (sent to the engine as they are)."""
    one_choice(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise bad("prompt", "must be one non-empty string or one list of token ids")


def _usage(a: Answer) -> dict:
    return {
        "prompt_tokens": a.prompt_tokens,
        "completion_tokens": a.completion_tokens,
        "total_tokens": a.prompt_tokens + a.completion_tokens,
    }


def _tool_calls(a: Answer) -> list[dict]:
    return [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for cid, name, args in a.calls
    ]


def _logprobs(a: Answer) -> dict:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(a.token_texts, a.logprobs)
        ]
    }


def chat_answer(call: Call, a: Answer) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": a.text if a.text or not a.calls else None}
    if a.calls:
        message["tool_calls"] = _tool_calls(a)
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": a.finish,
        "logprobs": _logprobs(a) if call.logprobs else None,
    }
    return {
        "id": a.id,
        "object": "chat.completion",
        "created": a.created,
        "model": call.model,
        "choices": [choice],
        "usage": _usage(a),
    }


def chat_events(call: Call, a: Answer) -> Iterator[Optional[dict]]:
    """The chunks of a streamed answer (None ends the stream: `data: [DONE]`). The engine answers
    a call whole, so the chunks follow its end: role, text, each tool call, the finish."""

    def chunk(delta: dict, finish: Optional[str] = None, **extra: Any) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, **extra}
        return {
            "id": a.id,
            "object": "chat.completion.chunk",
            "created": a.created,
            "model": call.model,
            "choices": [choice],
        }

    yield chunk({"role": "assistant", "content": ""})
    if a.text:
        yield chunk({"content": a.text}, logprobs=_logprobs(a) if call.logprobs else None)
    for k, tc in enumerate(_tool_calls(a)):
        yield chunk({"tool_calls": [{"index": k, **tc}]})
    yield chunk({}, a.finish)
    if call.include_usage:
        yield {
            "id": a.id,
            "object": "chat.completion.chunk",
            "created": a.created,
            "model": call.model,
            "choices": [],
            "usage": _usage(a),
        }
    yield None


def completion_answer(model: str, a: Answer, logprobs: bool) -> dict:
    lp = None
    if logprobs:
        lp = {"tokens": a.token_texts, "token_logprobs": a.logprobs, "top_logprobs": None, "text_offset": None}
    choice = {"index": 0, "text": a.text, "finish_reason": a.finish, "logprobs": lp}
    return {
        "id": a.id,
        "object": "text_completion",
        "created": a.created,
        "model": model,
        "choices": [choice],
        "usage": _usage(a),
    }


def completion_events(model: str, a: Answer, logprobs: bool) -> Iterator[Optional[dict]]:
    whole = completion_answer(model, a, logprobs)
    yield {**whole, "usage": None}
    yield None


def models_answer(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "megatron-stepwise"}]}
