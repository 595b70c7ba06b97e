"""Model FLOPs of one step-wise training step of a Llama/Qwen2-shaped model (for MFU figures).

Counted (multiply-add = 2 FLOPs; backward = 2x forward, so training = 3x forward):
- dense matmuls of the transformer layers: 6 * N_layers_params * tokens, where
  N_layers_params = per layer h*(q + 2*kv) (QKV) + q*h (output) + 3*h*ffn (SwiGLU gate, up,
  down), q = heads * head_dim, kv = kv_heads * head_dim; norms and biases are left out (< 0.1%);
- the output layer: 6 * vocab * h * trained_tokens. The plugin applies it only at positions with
  loss_mask 1 (`mcore/train/logprobs.py`); a full-logits implementation would pay it on every
  token (pass trained_tokens=tokens for that convention);
- causal attention per row of length L: QK^T and PV are 2 * q * L^2 each in full, half of it
  under the causal mask, so 2 * q * L^2 forward and 6 * q * L^2 per training step and layer.
  Packed rows (THD) pay it per row: sum over rows of L^2, never (sum L)^2.
The embedding lookup costs no FLOPs; activation recomputation is not counted (model FLOPs,
not hardware FLOPs). This is PaLM's "6N + attention" MFU convention with a causal attention
term and logits where the loss is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

# Published shapes (HF config.json keys) used for stated assumptions and GPU runs; no download.
QWEN2_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
}
for _cfg in QWEN2_CONFIGS.values():
    _cfg.update(
        {
            "model_type": "qwen2",
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 32768,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
        }
    )


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ModelShape":
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden=hidden,
            ffn=int(cfg["intermediate_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
        )

    @property
    def layer_matmul_params(self) -> int:
        """Weights of all transformer layers' linear layers (what every token multiplies)."""
        q, kv, h = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden
        return self.layers * (h * (q + 2 * kv) + q * h + 3 * h * self.ffn)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """Approximate parameter count (norms and biases left out)."""
        return self.layer_matmul_params + self.embedding_params * (1 if self.tied else 2)


def training_flops(shape: ModelShape, row_lengths: Iterable[int], trained_tokens: int) -> dict[str, float]:
    """Model FLOPs of forward + backward over `row_lengths` (see the module docstring)."""
    lengths = [int(n) for n in row_lengths]
    tokens = sum(lengths)
    dense = 6.0 * shape.layer_matmul_params * tokens
    output = 6.0 * shape.vocab * shape.hidden * trained_tokens
    attention = 6.0 * shape.layers * shape.heads * shape.head_dim * float(sum(n * n for n in lengths))
    return {"dense": dense, "output": output, "attention": attention, "total": dense + output + attention}
