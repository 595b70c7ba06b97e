"""What validation needs to know about the machine: installed extras, model configs, registries.

Kept apart from the checks so tests can substitute a fake `Probes` (no real sglang, no hub).
Everything here is cheap (nothing imports megatron-core, torch or transformers, nothing downloads),
except the one-time conversion of a GGUF model source (hf/gguf.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path

from megatron_stepwise.data.files import DatasetFacts
from megatron_stepwise.envs.base import EnvSpec, list_envs
from megatron_stepwise.envs.custom import resolve_env_spec
from megatron_stepwise.hf import hub
from megatron_stepwise.hf.hub import looks_like_path
from megatron_stepwise.hf.presets import PRESETS

# Registries of pluggable names that config validation checks itself (a function returning the
# names registered so far). Estimators and policy losses are checked by
# megatron_stepwise.algo.losses.check_loss_compatibility.
REGISTRIES = {
    "env": list_envs,
}


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

    def env_spec(self, name: str, reward_fn: str | None) -> "EnvSpec | str":
        """The environment of env.name / env.reward_fn (dotted paths are imported); the error text."""
        try:
            return resolve_env_spec(name, reward_fn)
        except Exception as e:  # a user's module failing to import is a finding, not a crash
            return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"

    def dataset_facts(self, path: str, split: str) -> "DatasetFacts | str":
        """Rows and columns of a dataset file, directory or cached hub id; the error text."""
        from megatron_stepwise.data.files import dataset_facts

        try:
            return dataset_facts(path, split=split)
        except Exception as e:  # unreadable file, missing split, hub id not cached while offline
            return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"

    def shipped_facts(self, spec: EnvSpec, options: Mapping) -> "DatasetFacts | str":
        """Rows and fields of an environment's own dataset (the shipped sets are small)."""
        from megatron_stepwise.data.files import with_prompt_ids

        try:
            samples = with_prompt_ids(spec.dataset(**options))
        except Exception as e:
            return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        columns = tuple(dict.fromkeys(k for s in samples[:1] for k in s))
        return DatasetFacts(len(samples), columns, f"the shipped {spec.name} dataset")

    def presets(self) -> Mapping | None:
        """Model presets (e.g. `tiny`): preset name -> HF config dict."""
        return PRESETS

    def registered(self, kind: str) -> set[str] | None:
        """Names in a plugin registry (None would mean the registry is not available)."""
        return set(REGISTRIES[kind]())

    def gguf_problem(self, value: str, key: str) -> str | None:
        """What stops a GGUF source from being used (file, extra, architecture); None = usable."""
        from megatron_stepwise.hf import gguf

        try:
            path = gguf.gguf_file(value, key=key)
            if gguf.locate_converted(value) is None:
                missing = gguf.missing_dependencies()
                if missing:
                    return f"{value!r}: converting a GGUF file needs {', '.join(missing)}: {gguf.EXTRA_HINT}"
                gguf.read_architecture(path, key=key)
        except gguf.GGUFError as e:
            return str(e).removeprefix(f"{key}=")
        return None

    def model_config(self, hf_config: str) -> tuple[Mapping, str] | None:
        """The HF config dict of a model source and where it was read, when it can be read offline.
        A GGUF source is converted here on first use (once; hf/gguf.py), so its architecture is checked."""
        if hub.is_gguf_source(hf_config):
            from megatron_stepwise.hf import gguf

            try:
                directory = gguf.materialize(hf_config)
            except gguf.GGUFError:
                return None  # reported by the model checks
            return _read_json(directory / "config.json", f"{hf_config} ({directory / 'config.json'})")
        path = Path(hf_config).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            return _read_json(path, str(path))
        presets = self.presets()
        if presets is not None and hf_config in presets:
            preset = presets[hf_config]
            preset = preset if isinstance(preset, Mapping) else getattr(preset, "to_dict", lambda: {})()
            return preset, f"preset {hf_config}"
        if "/" in hf_config and not looks_like_path(hf_config):
            found = self.locate_model(hf_config, hub.CONFIG_FILES)
            if found is not None and (found / "config.json").is_file():
                return _read_json(found / "config.json", f"{hf_config} ({found / 'config.json'})")
        return None

    def locate_model(self, value: str, files=hub.CONFIG_FILES) -> Path | None:
        """The local directory or cached hub snapshot holding `files` of `value`; None = not here.

        Never downloads: validation must not touch the network.
        """
        return hub.locate_offline(value, files)

    def hub_offline(self) -> bool:
        """HF_HUB_OFFLINE=1 here: nothing may be downloaded."""
        return hub.hub_offline()

    def output_dir_problem(self, directory: str) -> str | None:
        """Why the run could not create or write `directory` (a file is in the way, a parent is
        read-only); None = it can. Nothing is created."""
        path = Path(directory).expanduser().absolute()
        if path.exists() and not path.is_dir():
            return f"{directory} is a file, not a directory"
        probe = path
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            return f"{directory} cannot be created: {probe} is a file"
        try:  # a real write: permission bits do not tell root, read-only mounts or /proc
            with tempfile.TemporaryFile(dir=probe):
                pass
        except OSError as e:
            where = "is not writable" if probe == path else f"cannot be created: {probe} is not writable"
            return f"{directory} {where} ({e.strerror or e})"
        return None


def _read_json(path: Path, source: str) -> tuple[Mapping, str] | None:
    try:
        return json.loads(path.read_text()), source
    except (OSError, ValueError):
        return None


class ClusterProbes(Probes):
    """`validate --skip-local-checks`: checks a recipe for other machines (a GPU recipe from a CPU
    login node), so it assumes what only those nodes can say: their packages (sglang,
    transformer-engine) are installed and their Hugging Face cache holds the models."""

    def has_module(self, name: str) -> bool:
        return True

    def locate_model(self, value: str, files=hub.CONFIG_FILES) -> Path | None:
        return hub.locate_offline(value, files) or Path(value)

    def hub_offline(self) -> bool:
        return False

    def output_dir_problem(self, directory: str) -> str | None:
        return None  # the run's directories are on the nodes' file systems, not this one's
