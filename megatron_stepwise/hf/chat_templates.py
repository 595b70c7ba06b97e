"""`model.chat_template`: a chat template that replaces the tokenizer's own.

The value is either the Jinja template itself (recognised by `{{` or `{%` in it) or the path of a
file: a `.jinja` (or any text) file holding the template, or a Hugging Face `chat_template.json`
(`{"chat_template": "..."}`). `read_chat_template` returns the template text after compiling it
with transformers' own chat-template compiler (the sandboxed Jinja environment `apply_chat_template`
uses, with its `tojson` filter and `generation` tag), so a template that cannot compile fails
validation, naming the key, instead of the first rollout.

The override is applied where the tokenizer is loaded (`hf/tokenizers.load_tokenizer(...,
chat_template=...)`), and that tokenizer renders every prompt: the agent loop renders the chat and
sends token ids to the engines, which never render (the embedded engine decodes only; SGLang gets
`input_ids` on `/generate`). `checkpoint.export_hf` saves the tokenizer with its template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from megatron_stepwise.errors import UserError

KEY = "model.chat_template"


class ChatTemplateSourceError(UserError, ValueError):
    """`model.chat_template` names no readable file or holds a template that does not compile."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
        self.key, self.problem = key, problem


def is_inline(value: str) -> bool:
    return "{{" in value or "{%" in value


def read_chat_template(value: str, *, key: str = KEY) -> str:
    """The template text of `value` (inline, or a file's), checked to compile."""
    if is_inline(value):
        text, source = value, "the inline template"
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ChatTemplateSourceError(
                key,
                f"no such file: {value} (give a .jinja file, or the Jinja "
                "template itself inline: a value with {{ or {% in it)",
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateSourceError(key, f"cannot read {value}: {e}") from None
        source = str(path)
        if path.suffix == ".json":  # an HF chat_template.json
            try:
                text = json.loads(text)["chat_template"]
            except (ValueError, KeyError, TypeError):
                raise ChatTemplateSourceError(
                    key, f'{value} is not a chat_template.json ({{"chat_template": "<template>"}})'
                ) from None
            if not isinstance(text, str):
                raise ChatTemplateSourceError(key, f'{value}: "chat_template" must be a string')
    if not text.strip():
        raise ChatTemplateSourceError(key, f"{source} is empty")
    problem = compile_problem(text)
    if problem:
        raise ChatTemplateSourceError(key, f"{source} does not compile: {problem}")
    return text


def chat_template_problem(value: str, *, key: str = KEY) -> Optional[str]:
    """What is wrong with `value` as `model.chat_template` (None when it is usable)."""
    try:
        read_chat_template(value, key=key)
    except ChatTemplateSourceError as e:
        return e.problem
    return None


def compile_problem(text: str) -> Optional[str]:
    """Why the template does not compile (line and message), or None."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # another transformers layout: plain sandboxed Jinja (no `generation` tag)
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters.setdefault("tojson", lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw))
        compile_template = env.from_string
    try:
        compile_template(text)
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateSyntaxError/AssertionError and transformers' checks
        line = getattr(e, "lineno", None)
        message = getattr(e, "message", None) or str(e)
        return f"{type(e).__name__}" + (f" at line {line}" if line else "") + f": {message}"
    return None
