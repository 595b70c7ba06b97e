"""Using a dump's stored config without trusting it (`view`, `replay`).

A run directory may come from someone else, and its dump's config names Python modules
(`trainer.imports`, `env.name: pkg.mod:Env`, `env.reward_fn`), tokenizer directories (whose
`auto_map` asks transformers to run their code) and hub ids (downloads). By default `view` and
`replay` import none of those modules, never download (HF_HUB_OFFLINE), and load tokenizers with
`trust_remote_code=False` (so transformers never prompts); the tokenizer to decode with is read
from the dump itself (the name the trainer recorded). `--trust-dump-code` (TRUST_FLAG) restores
the imports and downloads for a dump the user trusts; remote tokenizer code still never runs.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from megatron_stepwise.config.probes import Probes
from megatron_stepwise.envs import EnvSpec
from megatron_stepwise.loop.dumps import DumpError

TRUST_FLAG = "--trust-dump-code"  # the flag of `view` and `replay` (cli/view.py spells it too)


class NeedsTrustError(DumpError):
    """What the dump needs can only come from code it names; the message names the key and the flag."""


def stay_offline() -> None:
    """No hub access from this process or its children (huggingface_hub reads the variable once,
    at import: an already imported one is told too)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True


def named_modules(config: dict) -> list[str]:
    """The config keys that name code to import, as `key=value` (empty for a config using only built-ins)."""
    env, trainer = config.get("env") or {}, config.get("trainer") or {}
    found = [f"trainer.imports={m!r}" for m in trainer.get("imports") or []]
    if env.get("reward_fn"):
        found.append(f"env.reward_fn={env['reward_fn']!r}")
    if ":" in str(env.get("name") or ""):
        found.append(f"env.name={env['name']!r}")
    return found


def needs_trust_hint(config: dict) -> str:
    """A sentence for errors that may come from modules left unimported ('' when none are named)."""
    names = named_modules(config)
    if not names:
        return ""
    return f"the dump's config names code that was not imported ({', '.join(names)}): pass {TRUST_FLAG} to import it"


def tokenizer_source(meta: dict[str, Any], *, trusted: bool) -> str:
    """What the run's token ids decode with: the name the trainer recorded in the dump, else the
    config's model.tokenizer / model.hf_checkpoint, else the environment's shipped tokenizer
    (a built-in environment; another one's module is imported only when `trusted`)."""
    if meta.get("tokenizer"):
        return str(meta["tokenizer"])
    config = meta.get("config") or {}
    model, env = config.get("model") or {}, config.get("env") or {}
    for key in ("tokenizer", "hf_checkpoint"):
        if model.get(key):
            return str(model[key])
    name, reward_fn = str(env.get("name") or "echo"), env.get("reward_fn")
    if trusted:
        from megatron_stepwise.envs.custom import resolve_env_spec

        spec = resolve_env_spec(name, reward_fn)
    elif reward_fn or ":" in name:
        key, value = ("env.reward_fn", reward_fn) if reward_fn else ("env.name", name)
        raise NeedsTrustError(
            f"the dump records no tokenizer and {key}={value!r} is a module that is not imported "
            f"by default: pass {TRUST_FLAG} to import it (or set model.tokenizer)"
        )
    else:
        from megatron_stepwise.envs import get_env_spec

        try:
            spec = get_env_spec(name)
        except Exception as e:
            raise NeedsTrustError(
                f"the dump records no tokenizer and env.name={name!r} is not a built-in environment "
                f"(trainer.imports registered it?): pass {TRUST_FLAG} to import them (or set model.tokenizer)"
            ) from e
    if spec.tokenizer is None:
        raise DumpError(f"env.name={name!r} ships no tokenizer and the dump's config sets no model.tokenizer")
    return spec.tokenizer


def load_tokenizer(source: str, *, trusted: bool, key: str = "model.tokenizer"):
    """A transformers tokenizer for `source` (a shipped name, a local directory, a cached hub id or
    converted GGUF): `trust_remote_code=False` always; a download only when `trusted` and not offline."""
    from transformers import AutoTokenizer

    from megatron_stepwise.hf import hub
    from megatron_stepwise.hf.tokenizers import TOKENIZER_NAMES, tokenizer_dir

    if source in TOKENIZER_NAMES:
        path = tokenizer_dir(source)
    else:
        path = hub.locate_offline(source, hub.TOKENIZER_FILES)
        if path is None and trusted:
            path = hub.resolve_model_dir(source, key=key, files=hub.TOKENIZER_FILES)
        if path is None:
            raise NeedsTrustError(
                f"{key}={source!r} is neither a shipped tokenizer, a local directory nor in the Hugging Face "
                f"cache, and downloading is off by default: download it first, or pass {TRUST_FLAG}"
            )
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=not trusted)
    except Exception as e:  # e.g. a tokenizer_config.json whose auto_map names code of its own
        raise DumpError(
            f"{key}={source!r} ({path}) does not load without running code of its own, which view and replay "
            f"never run: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e


def _accepts_anything(*_: Any, **__: Any) -> None:
    return None


class DumpProbes(Probes):
    """Config validation of an untrusted dump's config: no module imported (user registries are
    unknown, so not checked), no dataset read (replay reads none), nothing downloaded. An
    environment named by module path stands as a stub taking any option, with the dump's tokenizer."""

    def __init__(self, tokenizer: Optional[str] = None):
        self.tokenizer = tokenizer
        self.skipped: list[str] = []

    def import_module(self, name: str) -> str | None:
        self.skipped.append(name)
        return None

    def registered(self, kind: str) -> set[str] | None:
        return None

    def env_spec(self, name: str, reward_fn: str | None) -> "EnvSpec | str":
        if not reward_fn and ":" not in name:
            from megatron_stepwise.envs import get_env_spec

            try:
                return get_env_spec(name)
            except Exception:
                pass
        return EnvSpec(
            name=reward_fn or name, factory=_accepts_anything, dataset=_accepts_anything, tokenizer=self.tokenizer
        )

    def dataset_facts(self, path: str, split: str):
        return None

    def shipped_facts(self, spec: EnvSpec, options):
        return None

    def hub_offline(self) -> bool:
        return True
