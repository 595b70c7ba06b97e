"""Where model configs, tokenizers and checkpoints come from: a local path or a Hugging Face hub id.

One resolver for `model.hf_config`, `model.tokenizer` and `model.hf_checkpoint` (presets and
shipped tokenizer names are handled by their callers first; GGUF files by hf/gguf.py). A hub id is looked up in the local
Hugging Face cache, then downloaded unless HF_HUB_OFFLINE=1. Importing this module is cheap:
no megatron, ray, torch or transformers; huggingface_hub is imported only for hub ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from megatron_stepwise.hf.errors import ModelSourceError
from megatron_stepwise.hf.gguf import is_gguf_source, locate_converted, materialize

# allow_patterns of what one use of a repository needs. The FIRST pattern must match a file for a
# cached snapshot to count as present (a snapshot may hold only the files of an earlier use).
CONFIG_FILES = ("config.json",)
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template.*",
    "config.json",
    "generation_config.json",
)
CHECKPOINT_FILES = ("*.safetensors", "*.json")  # import_hf reads safetensors; *.json: config, index

_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_cache_dir() -> Path:
    """The hub cache, from the environment now (huggingface_hub.constants freezes it at import)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now: no network attempt at all."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def looks_like_path(value: str) -> bool:
    """True for values meant as local paths (a hub id like Qwen/Qwen2.5-3B is not one)."""
    return value.startswith(("/", "./", "../", "~")) or value.endswith((".json", ".yaml", ".jsonl"))


def _local(value: str) -> Path | None:
    """The directory a local value names (a config.json names its directory), if it exists."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    return None


def _has_first(directory: Path, files: Sequence[str]) -> bool:
    return any(directory.glob(files[0]))


def _from_cache(repo_id: str, files: Sequence[str]) -> Path | None:
    """The cached snapshot of `repo_id` holding `files`, without any network access."""
    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True, allow_patterns=list(files))
    except Exception:  # not cached, incomplete, malformed id, no huggingface_hub: all mean "not here"
        return None
    path = Path(found)
    return path if _has_first(path, files) else None


def locate_offline(value: str, files: Sequence[str] = CONFIG_FILES) -> Path | None:
    """A local directory or cached hub snapshot for `value`, or None; never raises, never downloads."""
    if not value:  # Path("") is the working directory
        return None
    if is_gguf_source(value):
        return locate_converted(value)
    local = _local(value)
    if local is not None:
        return local
    return None if looks_like_path(value) else _from_cache(value, files)


def resolve_model_dir(value: str, *, key: str, files: Sequence[str] = CONFIG_FILES, also_tried: str = "") -> Path:
    """The directory holding `value`'s files: a local path, a cached hub snapshot, or a fresh download.

    `key` (e.g. `model.hf_config`) and `also_tried` (e.g. `a preset (tiny)`) only word the error.
    Raises ModelSourceError when nothing is found, or when the download is impossible or fails.
    """
    if is_gguf_source(value):  # converted once into a cached HF directory (hf/gguf.py)
        return materialize(value, key=key)
    found = locate_offline(value, files)
    if found is not None:
        return found
    tried = f"not {also_tried}, " if also_tried else ""
    where = f"{key}={value!r}: {tried}"
    if not value or looks_like_path(value):
        raise ModelSourceError(f"{where}no such file or directory")
    cache = f"{hub_cache_dir()}, set by HF_HOME / HF_HUB_CACHE"
    if hub_offline():
        raise ModelSourceError(
            f"{where}not a local path, and not in the Hugging Face cache ({cache}) while "
            "HF_HUB_OFFLINE=1; download it first or unset HF_HUB_OFFLINE"
        )
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(value, cache_dir=hub_cache_dir(), allow_patterns=list(files)))
    except Exception as e:  # unknown or gated repo, bad id, no network: say which key failed and why
        raise ModelSourceError(
            f"{where}not a local path, not in the Hugging Face cache ({cache}), and "
            f"downloading it failed: {type(e).__name__}: {e}"
        ) from e
    if not _has_first(path, files):
        raise ModelSourceError(f"{key}={value!r}: the hub repository has no {files[0]} file")
    return path
