"""Shared by the weight / checkpoint tests: tiny HF checkpoints on disk (the torchrun launcher is
`helpers.run_torchrun`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def hf_model(cfg: dict, seed: int = 0):
    """A transformers causal LM with random weights; 1-D tensors (norms, biases) perturbed so that
    a swapped or dropped norm/bias changes the outputs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(cfg)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def make_hf_dir(path: Path, cfg: dict, seed: int = 0) -> Path:
    hf_model(cfg, seed).save_pretrained(str(path))
    return path


def read_hf_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory (any number of safetensors files)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def make_tokenizer_dir(path: Path, vocab_size: int) -> Path:
    """A word-level fast tokenizer over tokens t0..t{V-1}, saved the HF way."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t0")
    fast.save_pretrained(str(path))
    return path


def load_json(path: Path):
    return json.loads(Path(path).read_text())
