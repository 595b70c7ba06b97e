"""A model's end-of-turn tokens, read from its own files rather than from per-family code.

- The token the chat template closes an assistant turn with (`<|im_end|>` for Qwen's ChatML,
  `<|eot_id|>` for Llama 3.x, `<｜end▁of▁sentence｜>` for DeepSeek): rendered from the template
  itself. It is the one the agent loop appends (loss_mask 0) to a turn that ended without it
  (a stop string, the length limit). Some templates close no turn (GLM-4.x: the next role token,
  `<|observation|>` or `<|user|>`, comes with the next message): then nothing is appended.
- Every id a turn may end on: that token, `eos_token_id` of the model's `generation_config.json`
  (an int or a list, as instruct models ship it: Llama 3.1 lists `<|end_of_text|>`, `<|eom_id|>`
  and `<|eot_id|>`) and the tokenizer's own EOS. A sampled one ends the turn; nothing is appended.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

# A reply no template rewrites, found again in the rendered text.
_MARK = "megatron-stepwise-end-of-turn-probe"


@dataclass(frozen=True)
class EndOfTurn:
    """`append`: the token appended to a turn that did not end on one of `ids` (the template's
    closing token; None when the template renders nothing after a reply); `ids`: every id that
    ends a turn, the closing token first."""

    append: Optional[int]
    ids: tuple[int, ...]


def template_closing(tokenizer: Any) -> tuple[Optional[int], bool]:
    """(the special token right after an assistant reply in the chat template's rendering, or
    None; whether the template renders anything after the reply at all)."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    at = text.rfind(_MARK)
    if at < 0:  # the template does not render replies verbatim: it closes them somehow
        return None, True
    after = tokenizer(text[at + len(_MARK) :], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return (int(after[0]) if after and after[0] in special else None), bool(after)


def generation_config_eos(model_dir: Optional[str]) -> list[int]:
    """`eos_token_id` of `model_dir/generation_config.json` as a list (empty without one)."""
    path = os.path.join(model_dir, "generation_config.json") if model_dir else None
    if not path or not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def end_of_turn(tokenizer: Any, model_dir: Optional[str] = None) -> EndOfTurn:
    """The model's end-of-turn tokens (module docstring); `model_dir` defaults to the tokenizer's."""
    if model_dir is None:
        name = getattr(tokenizer, "name_or_path", None)
        model_dir = name if name and os.path.isdir(name) else None
    closing, closes = template_closing(tokenizer) if getattr(tokenizer, "chat_template", None) else (None, True)
    ids = [closing] if closing is not None else []
    own = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for i in generation_config_eos(model_dir) + own:
        if i not in ids:
            ids.append(i)
    if not ids:
        raise ValueError(
            "the tokenizer has no eos_token and its chat template closes no turn: "
            "the model's generation_config.json must list eos_token_id"
        )
    # A template that closes turns with plain text (no special token) gets the first EOS, as before.
    return EndOfTurn(closing if closing is not None else (ids[0] if closes else None), tuple(ids))


def write_generation_config(directory: str | os.PathLike, hf_config: Any, tokenizer: Any) -> None:
    """Write `generation_config.json` (bos, every end-of-turn id as eos, pad) unless the directory
    has one: engines and transformers' `generate` stop on what it lists."""
    path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(path):
        return
    get = hf_config.get if isinstance(hf_config, dict) else lambda k: getattr(hf_config, k, None)
    ids = list(end_of_turn(tokenizer, model_dir=str(directory)).ids)
    pad = get("pad_token_id")
    generation = {
        "bos_token_id": get("bos_token_id"),
        "eos_token_id": ids[0] if len(ids) == 1 else ids,
        "pad_token_id": pad if pad is not None else ids[0],
    }
    with open(path, "w") as f:
        json.dump(generation, f, indent=2)
        f.write("\n")
