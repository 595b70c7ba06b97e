"""llama.cpp's tokenizer test vectors through the trainer's tokenizer loading path.

The real Qwen2 (Qwen2/2.5/3) and Llama 3 vocabularies, converted to Hugging Face format, are
loaded with `load_tokenizer(dir)` exactly as `model.tokenizer=<dir>` is; every input of
llama.cpp's `.gguf.inp` must encode to the ids of its `.gguf.out` line and decode back.
Needs `STEPWISE_TOKENIZERS_SRC` (.ci/run sets it where the third-party copy exists).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_stepwise.hf.tokenizers import load_tokenizer

SRC = os.environ.get("STEPWISE_TOKENIZERS_SRC")
pytestmark = pytest.mark.skipif(
    not SRC,
    reason="STEPWISE_TOKENIZERS_SRC is not set: llama.cpp's vocabularies and test vectors are needed; "
    ".ci/run sets it where the third-party copy exists",
)

# Where Hugging Face's tokenizer and llama.cpp's disagree (the archive's README counts it: 45/46):
# llama.cpp's Llama 3 pre-tokenizer splits this Vietnamese text differently.
KNOWN_DIFFERENCES = {"llama-bpe": {"Cửa Việt"}}


@pytest.mark.parametrize("vocab", ["qwen2", "llama-bpe"])
def test_llama_cpp_vectors_through_load_tokenizer(vocab):
    tok = load_tokenizer(str(Path(SRC) / "hf" / vocab))
    base = Path(SRC) / "vocab" / f"ggml-vocab-{vocab}.gguf"
    inputs = base.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = base.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(inputs) == len(outputs) and len(inputs) > 40
    differ = set()
    for i, (text, line) in enumerate(zip(inputs, outputs)):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if ids != [int(x) for x in line.split()]:
            differ.add(text)
        assert tok.decode(ids) == text, f"{vocab} vector {i}: {text!r} does not decode back"
    assert differ == KNOWN_DIFFERENCES.get(vocab, set()), f"{vocab}: vectors that differ: {sorted(differ)}"
