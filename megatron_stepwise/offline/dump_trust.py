"""Using a dump's stored config without trusting it: the parts that need the config and the
environments (`replay`, and `view` of an older dump). The file-only rules (what is trusted, the
tokenizer the dump records, loading it without running its code) are rundir/dump_trust.py's.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_stepwise.config.probes import Probes
from megatron_stepwise.envs.base import EnvSpec, get_env_spec
from megatron_stepwise.envs.custom import resolve_env_spec
from megatron_stepwise.rundir.dump_table import DumpError
from megatron_stepwise.rundir.dump_trust import TRUST_FLAG, NeedsTrustError, recorded_tokenizer


def tokenizer_source(meta: dict[str, Any], *, trusted: bool) -> str:
    """What the run's token ids decode with: the name the trainer recorded in the dump, else the
    config's model.tokenizer / model.hf_checkpoint, else the environment's shipped tokenizer
    (a built-in environment; another one's module is imported only when `trusted`)."""
    recorded = recorded_tokenizer(meta)
    if recorded is not None:
        return recorded
    env = (meta.get("config") or {}).get("env") or {}
    name, reward_fn = str(env.get("name") or "echo"), env.get("reward_fn")
    if trusted:
        spec = resolve_env_spec(name, reward_fn)
    elif reward_fn or ":" in name:
        key, value = ("env.reward_fn", reward_fn) if reward_fn else ("env.name", name)
        raise NeedsTrustError(
            f"the dump records no tokenizer and {key}={value!r} is a module that is not imported "
            f"by default: pass {TRUST_FLAG} to import it (or set model.tokenizer)"
        )
    else:
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


def _accepts_anything(*_: object, **__: object) -> None:
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
