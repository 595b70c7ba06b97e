"""Named model configs (HF keys) and resolution of `model.hf_config`.

Importable without megatron-core: the config validator uses it to check head/layer divisibility.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

PRESETS: dict[str, dict[str, Any]] = {
    # The CPU experiment and CI model: ~60k parameters, learns the `echo` task in minutes.
    "tiny": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1024,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    },
}


def resolve_hf_config(name_or_path: str, *, vocab_size: Optional[int] = None) -> dict[str, Any]:
    """An HF config dict from a preset name, a config.json, or a model directory.

    For presets, `vocab_size` (the tokenizer's) replaces the preset's so model and tokenizer agree.
    """
    if name_or_path in PRESETS:
        cfg = dict(PRESETS[name_or_path])
        if vocab_size is not None:
            cfg["vocab_size"] = int(vocab_size)
        return cfg
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"model.hf_config={name_or_path!r}: not a preset ({', '.join(PRESETS)}), a config.json or a directory with one"
        )
    with open(path) as f:
        return json.load(f)
