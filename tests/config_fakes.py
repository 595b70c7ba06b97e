"""A stand-in for the machine probes of config validation (tests import it as `config_fakes`)."""

from __future__ import annotations

from megatron_stepwise.config import ModelShape, Probes


class FakeProbes(Probes):
    """Probes with chosen answers: installed modules, model shapes, presets and registries."""

    def __init__(self, modules=("sglang",), shapes=None, presets=None, registries=None):
        self.modules = set(modules)
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

    def model_shape(self, hf_config):
        if hf_config in self.shapes:
            heads, kv, layers = self.shapes[hf_config]
            return ModelShape(heads, kv, layers, f"fake {hf_config}")
        return super().model_shape(hf_config)  # local config.json files are read for real
