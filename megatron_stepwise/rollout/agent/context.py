"""How the agent loop builds each turn's prompt: `retokenize` the chat, or extend the `tokens`.

`retokenize` renders the whole chat with the chat template and tokenises it every turn;
`tokens` builds turn t+1's prompt from ids only, `prompt[t+1] = prompt[t] + response[t] +
delta[t]`, where `delta[t]` is the tokenised template text between the sampled response and the
next generation (`template_delta`). `retokenize_drifted` measures whether re-tokenising after a
turn loses its sampled ids (`rollout/retokenize_drift_rate`).

Why token mode exists, how it follows templates that rewrite history, and tool schemas:
docs/chat_conformance.md, 'Building a turn's prompt'.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from megatron_stepwise.errors import UserError

CONTEXT_MODES = ("retokenize", "tokens")

# A history no template rewrites (one user turn, a plain reply without reasoning or tool calls);
# the reply is a marker found again in the rendered text.
_NEUTRAL_HISTORY = [{"role": "user", "content": "hi"}]
_NEUTRAL_REPLY = "<<<megatron-stepwise reply>>>"


class ChatTemplateError(UserError, ValueError):
    """The chat template cannot be extended turn by turn (token mode)."""


def render_text(
    tokenizer: Any, messages: list[dict], *, generation_prompt: bool, tools: Optional[list[dict]] = None
) -> str:
    """The chat template's text; `tools` (function schemas) is passed as `tools=` when given."""
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **extra)


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer: Any, messages: list[dict], tools: Optional[list[dict]] = None) -> list[int]:
    """Chat template with the generation prompt, re-tokenised from text (the step's prompt)."""
    return encode(tokenizer, render_text(tokenizer, messages, generation_prompt=True, tools=tools))


def template_delta(
    tokenizer: Any, history: list[dict], reply: str, observation: list[dict], tools: Optional[list[dict]] = None
) -> str:
    """The text the template puts after an assistant turn's content `reply`: the turn's closing,
    the `observation` messages and the next generation prompt (rendered with the same `tools`)."""
    return turn_delta(tokenizer, history, reply, observation, tools)[0]


def turn_delta(
    tokenizer: Any,
    history: list[dict],
    reply: str,
    observation: list[dict],
    tools: Optional[list[dict]] = None,
    head: Optional[str] = None,
) -> tuple[str, str]:
    """`template_delta`, and the rendering of the chat after the turn with the generation prompt:
    the next turn's `head`. `head` is this turn's (the rendering of `history` with the generation
    prompt) when the caller kept it from the previous turn, which saves rendering it again."""
    delta, extended = _delta_after(tokenizer, history, reply, observation, tools, find_reply=False, head=head)
    if delta is None:  # the template rewrites earlier turns: see the module docstring
        delta, _ = _delta_after(tokenizer, _NEUTRAL_HISTORY, _NEUTRAL_REPLY, observation, tools, find_reply=True)
    if delta is None:
        raise ChatTemplateError(
            "rollout.context=tokens: the chat template does not extend the chat when messages are added, even "
            "after a one-turn history (rendering with the new messages does not begin with the rendering "
            "without them); use rollout.context=retokenize with this template"
        )
    return delta, extended


def _delta_after(
    tokenizer: Any,
    history: list[dict],
    reply: str,
    observation: list[dict],
    tools: Optional[list[dict]],
    *,
    find_reply: bool,
    head: Optional[str] = None,
) -> tuple[Optional[str], str]:
    """(the delta, or None when the template does not extend here; the extended rendering)."""
    turn = [{"role": "assistant", "content": reply}]
    extended = render_text(tokenizer, history + turn + observation, generation_prompt=True, tools=tools)
    if find_reply:
        # The template may wrap the reply (an empty reasoning block before it) and wrap it
        # otherwise once a user message follows (Qwen3 renders that block only for turns after
        # the last user message): what follows the reply is the delta, provided the messages
        # before the assistant turn render unchanged.
        at = extended.rfind(reply)
        before = render_text(tokenizer, history, generation_prompt=False, tools=tools)
        return (None if at < 0 or not extended.startswith(before) else extended[at + len(reply) :]), extended
    closed = render_text(tokenizer, history + turn, generation_prompt=False, tools=tools)
    if not extended.startswith(closed):
        return None, extended
    # the reply must be rendered verbatim right after the generation prompt
    if head is None:
        head = render_text(tokenizer, history, generation_prompt=True, tools=tools)
    head += reply
    if not closed.startswith(head):
        return None, extended
    return extended[len(head) :], extended


def extend_context(
    tokenizer: Any, prompt: Sequence[int], response: Sequence[int], delta: str, eos_token_ids: Sequence[int]
) -> list[int]:
    """`prompt + response + tokens(delta)`, without a leading end-of-turn token of the delta that
    the response already ends with (sampled, or appended by the loop)."""
    delta_ids = encode(tokenizer, delta)
    if response and delta_ids and delta_ids[0] == response[-1] and response[-1] in eos_token_ids:
        delta_ids = delta_ids[1:]
    return list(prompt) + list(response) + delta_ids


def retokenize_drifted(
    retokenized_before: Sequence[int], response: Sequence[int], retokenized_after: Sequence[int]
) -> bool:
    """Whether re-tokenising the chat after a turn lost the ids of that turn (or of its history)."""
    expected = list(retokenized_before) + list(response)
    return list(retokenized_after[: len(expected)]) != expected
