"""A stand-in for the machine probes of config validation (tests import it as `config_fakes`)."""

from __future__ import annotations

from pathlib import Path

from megatron_stepwise.config.probes import Probes
from megatron_stepwise.hf.presets import tiny_config


class FakeProbes(Probes):
    """Probes with chosen answers: installed modules, model shapes, presets, registries, hub cache.

    Hub ids are all "in the cache" (as on the cluster the recipes are for) except `hub_missing`.
    """

    def __init__(self, modules=("sglang",), shapes=None, presets=None, registries=None, hub_missing=()):
        self.modules = set(modules)
        self.hub_missing = set(hub_missing)
        self.shapes = shapes or {}
        self._presets = presets
        self.registries = registries or {}

    def has_module(self, name):
        return name in self.modules

    def presets(self):
        return self._presets

    def registered(self, kind):
        names = self.registries.get(kind)
        return None if names is None else set(names)

    def model_config(self, hf_config):
        if hf_config in self.shapes:
            heads, kv, layers, *experts = self.shapes[hf_config]  # (heads, KV heads, layers[, experts])
            moe = {"model_type": "qwen3_moe", "num_experts": experts[0]} if experts else {}
            # a real model's context window (the recipes' lengths are checked against it)
            return (
                tiny_config(num_heads=heads, num_kv_heads=kv, num_layers=layers, max_position_embeddings=32768, **moe),
                f"fake {hf_config}",
            )
        return super().model_config(hf_config)  # local config.json files are read for real

    def locate_model(self, value, files=("config.json",)):
        if Path(value).expanduser().exists():
            return super().locate_model(value, files)
        return None if value in self.hub_missing else Path("/fake-hub-cache") / value
