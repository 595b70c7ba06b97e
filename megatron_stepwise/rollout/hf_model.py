"""Hugging Face causal LMs for the embedded engine: build from a config, load HF-named weights.

The trainer pushes weights under Hugging Face parameter names (`model.embed_tokens.weight`,
`model.layers.N.self_attn.q_proj.weight`, ..., `lm_head.weight`); these helpers check every
name and shape before touching the model so a bad push fails with a message naming the tensor.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from megatron_stepwise.hf.presets import tiny_config
from megatron_stepwise.rollout.engine import NamedTensors

ModelConfigLike = Union[str, os.PathLike, Mapping[str, Any], "PretrainedConfig"]  # noqa: F821


def tiny_qwen2_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, **overrides: Any) -> dict:
    """The `tiny` preset's Qwen2 config (`presets.tiny_config`) for a tokenizer of `vocab_size`;
    `overrides` are HF keys."""
    return tiny_config(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, **overrides)


def load_config(model_config: ModelConfigLike):
    """A transformers `PretrainedConfig` from a config object, a dict, a config.json, or a model dir."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_config, PretrainedConfig):
        return model_config
    if isinstance(model_config, Mapping):
        d = dict(model_config)
        if "model_type" not in d:
            raise ValueError("model config dict needs a 'model_type' (e.g. 'qwen2' or 'llama')")
        return AutoConfig.for_model(d.pop("model_type"), **d)
    path = Path(model_config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model config not found: {model_config} (expected a config.json or a directory with one)")
    with open(path) as f:
        return load_config(json.load(f))


def build_causal_lm(
    model_config: ModelConfigLike,
    weights: Optional[Union[str, os.PathLike]] = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """An eval-mode causal LM: random init from `seed`, then `weights` (safetensors dir) if given."""
    from transformers import AutoModelForCausalLM

    config = load_config(model_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    if weights is not None:
        load_safetensors_dir(model, weights)
    return model


# transformers keeps a MoE layer's experts fused in memory (`experts.gate_up_proj` [E, 2I, H] =
# [gate; up] per expert, `experts.down_proj` [E, H, I]); checkpoints and weight pushes name each
# expert's matrices, as the hub files do.
_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _target(params: Mapping[str, torch.Tensor], name: str) -> Optional[torch.Tensor]:
    """The parameter, or the view of a fused expert tensor, that checkpoint tensor `name` fills."""
    if name in params:
        return params[name]
    m = _EXPERT.match(name)
    if not m:
        return None
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    fused = params.get(f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
    if fused is None or e >= fused.shape[0]:
        return None
    if proj == "down_proj":
        return fused[e]
    gate, up = fused[e].chunk(2, dim=0)
    return gate if proj == "gate_proj" else up


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state in checkpoint names (fused experts split per expert), detached copies."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            for e, rows in enumerate(tensor):
                gate, up = rows.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e, matrix in enumerate(tensor):
                out[f"{prefix}.{e}.down_proj.weight"] = matrix
        else:
            out[name] = tensor
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def load_named_tensors(model: torch.nn.Module, named_tensors: NamedTensors) -> int:
    """Copy HF-named tensors into the model in place (a subset is fine: bucketed pushes).

    Every name and shape is validated before anything is written, so a bad push leaves the model
    untouched. Returns how many tensors were loaded.
    """
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers()))
    targets = []
    for name, tensor in items:
        target = _target(params, name)
        if target is None:
            hint = sorted(params)[:4]
            raise KeyError(f"weight {name!r} is not a parameter of the model (HF names expected, e.g. {hint})")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"weight {name!r}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
            )
        targets.append(target)
    with torch.no_grad():
        for target, (_, tensor) in zip(targets, items):
            target.copy_(tensor.to(target.dtype))
    return len(items)


def load_safetensors_dir(model: torch.nn.Module, path: Union[str, os.PathLike]) -> int:
    """Load every `*.safetensors` file in `path` (HF names) into the model."""
    from safetensors.torch import load_file

    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    count = 0
    for f in files:
        count += load_named_tensors(model, load_file(str(f)))
    return count


def save_safetensors_dir(model: torch.nn.Module, path: Union[str, os.PathLike]) -> Path:
    """Write the model's parameters in HF names to `path/model.safetensors` (tests and tools)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = checkpoint_state(model)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"))
    model.config.save_pretrained(str(path))
    return path
