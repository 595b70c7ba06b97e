"""Tokenizers: `load_tokenizer` (a shipped tiny tokenizer by name, a local directory or a hub id).

Three tiny tokenizers ship with the package (no hub download), all ChatML-like with
`<|im_end|>` as EOS: `tiny_word` (the echo task's words), `tiny_char` (printable ASCII) and
`tiny_bpe` (a byte-level BPE whose sampled ids often re-encode differently, as with real
tokenizers). `tiny_char` and `tiny_bpe` use `TOOLS_CHAT_TEMPLATE`, which also renders tools;
`model.chat_template` replaces any tokenizer's template. `build_tokenizer_files` wrote the files
in `hf/data/`; regenerate them with `python -m megatron_stepwise.hf.tokenizers`.

Each tokenizer and the tools template in detail: docs/chat_conformance.md,
'The shipped tiny tokenizers'.
"""

from __future__ import annotations

import json
import string
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from megatron_stepwise.hf.hub import TOKENIZER_FILES, resolve_model_dir

DATA_DIR = Path(__file__).parent / "data"
SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
ROLES = ["system", "user", "assistant", "tool"]
ECHO_WORDS = ["say", "good", "no"] + [str(d) for d in range(10)]

# Word-level: tokens are separated by single spaces, so the template puts spaces around content.
WORD_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
# Plain ChatML (newline after the role and after each turn): what TOOLS_CHAT_TEMPLATE, the template
# of tiny_char and tiny_bpe, renders for chats without tools.
CHAR_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ChatML with tools (Hermes/Qwen style): our own wording. With `tools`, a system turn comes first
# (the chat's own system message, then the tool list and how to call); a leading system message is
# not repeated. Role "tool" renders as a `tool` turn wrapping the result in <tool_response>.
# (transformers compiles with trim_blocks: a newline right after a `%}` must be written {{ '\\n' }}.)
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nThese functions are available, as JSON schemas inside <tools></tools>:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments between <tool_call> tags, "
    'one block per call:\n<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n'
    "</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if not (tools and loop.first and m['role'] == 'system') %}"
    "{% if m['role'] == 'tool' %}<|im_start|>tool\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] if m['content'] is not none else '' }}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}{% for call in m['tool_calls'] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n{\"name\": {{ f['name'] | tojson }}, "
    "\"arguments\": {% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}"
    "{% endif %}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER_NAMES = ("tiny_word", "tiny_char", "tiny_bpe")

# The BPE's training text: the echo task's turns, the chat roles and a few sentences of the math
# and search tasks' kind. Small on purpose (a 384-token vocabulary for tiny models); repeated
# lines make their merges frequent enough to be learnt.
_BPE_SENTENCES = [
    "The answer is 42. What is 7 times 6? Let me think step by step.",
    "First add the numbers, then multiply the result by three and subtract one.",
    "<search>national animal of the country</search>",
    "<information>Doc 1(Title: the capital city) The capital lies on the river.</information>",
    "<answer>The Crane.</answer> I do not know the answer yet, so I will search again.",
    "print(sum(range(10)))  # the tool runs Python and returns its output",
]


def _bpe_corpus() -> list[str]:
    lines = [f"{role}\n" for role in ROLES] * 2
    for d in range(10):
        lines += [f"say {d}", f"good say {d}", f"no say {d}", f"{d}"]
    return lines + _BPE_SENTENCES * 2


def _train_bpe():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_bpe_corpus(), trainer=trainer)  # deterministic (a test rebuilds the shipped file)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok


def _backend(name: str):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if name == "tiny_bpe":
        return _train_bpe()
    if name == "tiny_word":
        words = ROLES + ECHO_WORDS
        pre = pre_tokenizers.WhitespaceSplit()
        decoder = None  # tokens are joined with spaces
    elif name == "tiny_char":
        words = list(dict.fromkeys(string.printable))  # digits, letters, punctuation, whitespace
        pre = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        decoder = decoders.Fuse()
    else:
        raise KeyError(f"unknown shipped tokenizer {name!r}; available: {TOKENIZER_NAMES}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre
    if decoder is not None:
        tok.decoder = decoder
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok


def build_tokenizer_files(name: str, out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _backend(name).save(str(out_dir / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": WORD_CHAT_TEMPLATE if name == "tiny_word" else TOOLS_CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def tokenizer_dir(name: str) -> Path:
    if name not in TOKENIZER_NAMES:
        raise KeyError(f"unknown shipped tokenizer {name!r}; available: {TOKENIZER_NAMES}")
    return DATA_DIR / f"{name}_tokenizer"


@lru_cache(maxsize=None)
def load_tokenizer(name_or_path: str, *, key: str = "model.tokenizer", chat_template: Optional[str] = None):
    """A transformers tokenizer: a shipped one by name, a local HF tokenizer directory, or a hub id.

    Hub ids come from the local HF cache, else are downloaded (megatron_stepwise.hf.hub); `key` names
    the config key in errors (ModelSourceError). `chat_template` (`model.chat_template`: inline Jinja
    or a file, hf/chat_templates.py) replaces the tokenizer's chat template; the tokenizer is shared
    (cached per arguments), so callers must not change it.
    """
    from transformers import AutoTokenizer

    if name_or_path in TOKENIZER_NAMES:
        path = tokenizer_dir(name_or_path)
    else:
        path = resolve_model_dir(
            name_or_path,
            key=key,
            files=TOKENIZER_FILES,
            also_tried=f"a shipped tokenizer ({', '.join(TOKENIZER_NAMES)})",
        )
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if chat_template:
        from megatron_stepwise.hf.chat_templates import read_chat_template

        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


if __name__ == "__main__":  # regenerate the shipped files
    for n in TOKENIZER_NAMES:
        print(build_tokenizer_files(n, tokenizer_dir(n)))
