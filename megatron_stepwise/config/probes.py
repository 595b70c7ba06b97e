"""What validation needs to know about the machine: installed extras, model shapes, registries.

Kept apart from the checks so tests can substitute a fake `Probes` (no real sglang, no hub).
Everything here is cheap: nothing imports megatron-core, torch or transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """The parts of an HF model config that constrain the parallel layout."""

    num_attention_heads: int
    num_key_value_heads: int
    num_layers: int
    source: str

    @classmethod
    def from_hf_dict(cls, cfg: Mapping, source: str) -> "ModelShape | None":
        try:
            heads = int(cfg["num_attention_heads"])
            return cls(heads, int(cfg.get("num_key_value_heads") or heads), int(cfg["num_hidden_layers"]), source)
        except (KeyError, TypeError, ValueError):
            return None


# Where registries of pluggable names live that config validation checks itself (module,
# attributes: a mapping, or a function returning names). Estimators and policy losses are
# checked by megatron_stepwise.algo.losses.check_loss_compatibility. A registry that cannot
# be found means "cannot check", never "unknown".
REGISTRIES = {
    "env": ("megatron_stepwise.envs", ("list_envs", "list_environments", "ENVIRONMENTS")),
}
# Model presets (e.g. `tiny`): a module importable without megatron-core holding PRESETS,
# a mapping of preset name -> HF config dict.
PRESETS_MODULE = "megatron_stepwise.megatron.presets"


def looks_like_path(value: str) -> bool:
    """True for values meant as local paths (a hub id like Qwen/Qwen2.5-3B is not one)."""
    return value.startswith(("/", "./", "../", "~")) or value.endswith((".json", ".yaml", ".jsonl"))


class Probes:
    """Real probes of this machine."""

    def has_module(self, name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    def import_module(self, name: str) -> str | None:
        """Import a user module (it registers plugins); the error text on failure."""
        try:
            importlib.import_module(name)
        except Exception as e:  # any failure of user code is reported, not raised
            return f"{type(e).__name__}: {e}"
        return None

    def presets(self) -> Mapping | None:
        try:
            module = importlib.import_module(PRESETS_MODULE)
        except ImportError:
            return None
        return getattr(module, "PRESETS", None)

    def registered(self, kind: str) -> set[str] | None:
        """Names in a plugin registry, or None when the registry is not available."""
        module_name, attrs = REGISTRIES[kind]
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return None
        for attr in attrs:
            found = getattr(module, attr, None)
            if isinstance(found, Mapping):
                return set(found)
            if callable(found):
                return set(found())
        return None

    def model_shape(self, hf_config: str) -> ModelShape | None:
        """Heads and layers of a model config, when it can be read offline."""
        path = Path(hf_config).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            try:
                return ModelShape.from_hf_dict(json.loads(path.read_text()), str(path))
            except (OSError, ValueError):
                return None
        presets = self.presets()
        if presets is not None and hf_config in presets:
            preset = presets[hf_config]
            preset = preset if isinstance(preset, Mapping) else getattr(preset, "to_dict", lambda: {})()
            return ModelShape.from_hf_dict(preset, f"preset {hf_config}")
        if "/" in hf_config and not looks_like_path(hf_config):
            return self._cached_hub_shape(hf_config)
        return None

    def _cached_hub_shape(self, repo_id: str) -> ModelShape | None:
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        try:
            found = try_to_load_from_cache(repo_id, "config.json")
        except Exception:  # malformed repo ids raise validation errors of the hub library
            return None
        if isinstance(found, str) and Path(found).is_file():
            return ModelShape.from_hf_dict(json.loads(Path(found).read_text()), found)
        return None
