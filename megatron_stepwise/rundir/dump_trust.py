"""Using a dump's stored config without trusting it (`view`, `replay`).

A run directory may come from someone else, and its dump's config names Python modules
(`trainer.imports`, `env.name: pkg.mod:Env`, `env.reward_fn`), tokenizer directories (whose
`auto_map` asks transformers to run their code) and hub ids (downloads). By default `view` and
`replay` import none of those modules, never download (HF_HUB_OFFLINE), and load tokenizers with
`trust_remote_code=False` (so transformers never prompts); the tokenizer to decode with is read
from the dump itself (the name the trainer recorded). `--trust-dump-code` (TRUST_FLAG) restores
the imports and downloads for a dump the user trusts; remote tokenizer code still never runs.

This module reads files only (the viewer uses it); validating the dump's config (`DumpProbes`)
and the environment's shipped tokenizer of an older dump live in offline/dump_trust.py.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from megatron_stepwise.rundir.dump_table import DumpError

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


def recorded_tokenizer(meta: dict[str, Any]) -> Optional[str]:
    """What the run's token ids decode with, as its files say: the name the trainer recorded in
    the dump, else the dump's config's model.tokenizer / model.hf_checkpoint; None when they name
    none (an older dump of an environment's shipped vocabulary: offline/dump_trust.py asks the
    environment)."""
    if meta.get("tokenizer"):
        return str(meta["tokenizer"])
    model = (meta.get("config") or {}).get("model") or {}
    for key in ("tokenizer", "hf_checkpoint"):
        if model.get(key):
            return str(model[key])
    return None


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
