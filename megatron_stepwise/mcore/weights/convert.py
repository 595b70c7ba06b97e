"""Hugging Face checkpoints in and out of megatron model chunks, at any TP / PP, in buckets.

`iter_stage_buckets` (this stage's weights as HF tensors, in buckets), `stream_hf_buckets`
(every bucket, delivered on global rank 0), `export_hf` (an HF directory that transformers and
SGLang load, renamed into place when complete) and `import_hf` (start from a pretrained model).
Every rank must call (and, for the iterators, exhaust) them: they are collective. The name and
layout mapping itself is in `weights/hf_mapping.py` (pure functions). `export_hf`
takes an HF config and parses it once; below it everything takes the parsed `GPTArch`
(`export_model` the `ModelSpec`, when config.json must be written too).

Each entry point and which ranks do the work: docs/weights.md, 'Hugging Face checkpoints' and
'Conversion entry points and ownership'.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import deque
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist

from megatron_stepwise.hf.arch import GPTArch, HFConfig, ModelSpec, arch_from_hf, model_spec
from megatron_stepwise.hf.end_of_turn import write_generation_config
from megatron_stepwise.hf.presets import ARCHITECTURES
from megatron_stepwise.mcore.runtime.runtime import comm_device, current_layout
from megatron_stepwise.mcore.weights import full_views as W
from megatron_stepwise.mcore.weights.fileops import fsync_dir, make_staging_dir, raise_together
from megatron_stepwise.mcore.weights.hf_mapping import (
    EMBED,
    OUTPUT,
    WeightConversionError,
    check_hf_names,
    from_hf,
    hf_names_for,
    to_hf,
)

Bucket = list[tuple[str, torch.Tensor]]
INDEX_FILE = "model.safetensors.index.json"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def _is_worker(layout) -> bool:
    """This rank belongs to the one replica (DP 0, CP 0) that converts weights."""
    return layout.dp_rank == 0 and layout.cp_rank == 0


def _is_stage_owner(layout) -> bool:
    return _is_worker(layout) and layout.tp_rank == 0


def _drain(collective: Iterator) -> None:
    """Take part in a collective iterator's gathers without keeping what it yields."""
    deque(collective, maxlen=0)


def check_model_matches(chunks: list, arch: GPTArch) -> None:
    """Raise (naming the HF config key) when the megatron model was not built for `arch`.

    Depends only on configs, so every rank decides the same way before any collective.
    """
    from megatron_stepwise.mcore.train.model import unwrap

    model = unwrap(chunks[0])
    cfg = model.config
    pairs = [
        ("num_hidden_layers", arch.num_layers, "num_layers", cfg.num_layers),
        ("hidden_size", arch.hidden_size, "hidden_size", cfg.hidden_size),
        ("intermediate_size", arch.ffn_hidden_size, "ffn_hidden_size", cfg.ffn_hidden_size),
        ("num_attention_heads", arch.num_heads, "num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", arch.num_kv_heads, "num_query_groups", cfg.num_query_groups or cfg.num_attention_heads),
        ("head_dim", arch.head_dim, "kv_channels", cfg.kv_channels),
        ("qkv bias (qwen2 / attention_bias)", arch.qkv_bias, "add_qkv_bias", bool(cfg.add_qkv_bias)),
        (
            "tie_word_embeddings",
            arch.tie_word_embeddings,
            "share_embeddings_and_output_weights",
            bool(model.share_embeddings_and_output_weights),
        ),
    ]
    for hf_key, hf_value, mcore_key, mcore_value in pairs:
        if hf_value != mcore_value:
            raise WeightConversionError(
                f"HF config {hf_key}={hf_value} but the megatron model has {mcore_key}={mcore_value}"
            )
    if model.vocab_size < arch.vocab_size:
        raise WeightConversionError(
            f"HF config vocab_size={arch.vocab_size} but the megatron model has only {model.vocab_size} rows"
        )


# ----------------------------------------------------------------------------- streaming


def _stage_canonical(
    chunks: list, dtype: Optional[torch.dtype], *, worker: bool = True
) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
    """(canonical name, full tensor) for this stage; the tensor only on a worker's TP rank 0 (else
    None). Experts split over EP come from every EP rank (a collective over the EP group, which
    EP peers outside the converting replica, `worker=False`, join for the experts only)."""
    keep = worker and current_layout().tp_rank == 0
    for model, name, param in _exported_params(chunks):
        if not worker and not W.is_expert(name):
            continue
        full = W.gather_full(param.data, param, name, model)  # collective over TP
        for each, tensor in W.all_experts(name, full, model):  # collective over EP for experts
            yield each, ((tensor if dtype is None else tensor.to(dtype)).cpu() if keep else None)


def _exported_params(chunks: list) -> Iterator[tuple[Any, str, Any]]:
    """(unwrapped model, canonical name, parameter) of this stage's chunks, in export order."""
    from megatron_stepwise.mcore.train.model import unwrap

    for chunk in chunks:
        model = unwrap(chunk)
        for name, param in W.canonical_params(chunk):
            if name != EMBED or model.pre_process:  # the last stage's tied copy: stage 0 exports the original
                yield model, name, param


def _joins_expert_gathers(layout) -> bool:
    """Whether this rank, outside the converting replica, holds experts the replica needs: its EP
    group contains a worker. Collective over the EP group (every rank calls it) when EP > 1."""
    ep, _, group = W.expert_parallel()
    if ep == 1:
        return False
    flags = [None] * ep
    dist.all_gather_object(flags, _is_worker(layout), group=group)
    return not _is_worker(layout) and any(flags)


def bucketize(pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (one big tensor: alone)."""
    bucket: Bucket = []
    size = 0
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def iter_stage_buckets(
    chunks: list, arch: GPTArch, *, bucket_mb: float = 512, dtype: Optional[torch.dtype] = None
) -> Iterator[Bucket]:
    """This pipeline stage's HF tensors in buckets. Yields on the stage owner (DP 0, CP 0, TP 0);
    the stage's other TP ranks run the gathers and yield nothing; other replicas return at once."""
    layout = current_layout()
    if _joins_expert_gathers(layout):
        return _drain(_stage_canonical(chunks, dtype, worker=False))  # the EP gathers only
    if not _is_worker(layout):
        return
    canonical = _stage_canonical(chunks, dtype)
    if layout.tp_rank != 0:
        return _drain(canonical)  # the TP (and EP) gathers
    pairs = (pair for name, full in canonical for pair in to_hf(name, full, arch))
    yield from bucketize(pairs, int(bucket_mb * 2**20))


def stream_hf_buckets(
    chunks: list, arch: GPTArch, *, bucket_mb: float = 512, dtype: Optional[torch.dtype] = None
) -> Iterator[Bucket]:
    """Every HF bucket of the whole model, yielded on global rank 0 only (stage order).

    Collective: every rank must iterate it to the end (the other ranks yield nothing).
    """
    from megatron.core import parallel_state as ps

    layout = current_layout()
    local = iter_stage_buckets(chunks, arch, bucket_mb=bucket_mb, dtype=dtype)
    if layout.pp == 1 or not _is_worker(layout):
        yield from local
        return
    group = ps.get_pipeline_model_parallel_group()
    stage_ranks = dist.get_process_group_ranks(group)  # the owner of each stage, in stage order
    device = comm_device()
    if layout.rank == stage_ranks[0]:
        yield from local
        for src in stage_ranks[1:]:
            while True:
                header = [None]
                dist.recv_object_list(header, src=src, group=group)
                if header[0] is None:
                    break
                bucket = []
                for name, shape, tensor_dtype in header[0]:
                    buf = torch.empty(shape, dtype=tensor_dtype, device=device)
                    dist.recv(buf, src=src, group=group)
                    bucket.append((name, buf.cpu()))
                yield bucket
    elif _is_stage_owner(layout):
        for bucket in local:
            dist.send_object_list([[(n, tuple(t.shape), t.dtype) for n, t in bucket]], dst=stage_ranks[0], group=group)
            for _, tensor in bucket:
                dist.send(tensor.to(device).contiguous(), dst=stage_ranks[0], group=group)
        dist.send_object_list([None], dst=stage_ranks[0], group=group)
    else:
        _drain(local)


def stage_hf_metadata(chunks: list, arch: GPTArch, *, dtype: Optional[torch.dtype] = None) -> list[tuple]:
    """(HF name, shape, dtype) of this stage's tensors in stream order, computed on meta tensors
    (no data, no communication)."""
    out = []
    for model, name, param in _exported_params(chunks):
        meta = torch.empty(W.full_shape(param, name), dtype=dtype or param.dtype, device="meta")
        for each in W.expert_names(name, model):  # every EP rank's expert, in stream order
            out += [(hf, tuple(t.shape), t.dtype) for hf, t in to_hf(each, meta, arch)]
    return out


def hf_metadata(chunks: list, arch: GPTArch, *, dtype: Optional[torch.dtype] = None) -> Optional[list[tuple]]:
    """Every HF tensor's (name, shape, dtype), in the order `stream_hf_buckets` delivers them,
    on global rank 0 (None elsewhere). Collective (one small gather)."""
    layout = current_layout()
    mine = stage_hf_metadata(chunks, arch, dtype=dtype) if _is_stage_owner(layout) else None
    gathered = [None] * layout.world_size if layout.rank == 0 else None
    dist.gather_object((layout.pp_rank, mine), gathered, dst=0)
    if layout.rank != 0:
        return None
    stages = sorted(((pp_rank, part) for pp_rank, part in gathered if part is not None), key=lambda x: x[0])
    return [item for _, part in stages for item in part]


# ----------------------------------------------------------------------------- export


def hf_config_object(hf_config: HFConfig, dtype: Optional[torch.dtype] = None):
    """A transformers `PretrainedConfig` (architectures and dtype filled in) from a config or dict."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(hf_config, PretrainedConfig):
        config = hf_config.__class__.from_dict(hf_config.to_dict())
    elif isinstance(hf_config, dict):
        fields = dict(hf_config)
        if "model_type" not in fields:
            raise WeightConversionError("hf_config needs a 'model_type' (e.g. 'qwen2' or 'llama')")
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        raise WeightConversionError(
            f"hf_config must be a transformers config or a dict of HF keys, got {type(hf_config).__name__}"
        )
    if not getattr(config, "architectures", None):
        config.architectures = [ARCHITECTURES[config.model_type]]
    if dtype is not None:
        config.dtype = str(dtype).split(".")[-1]
    return config


def save_tokenizer(tokenizer: Any, out_dir: Union[str, os.PathLike]) -> None:
    """A tokenizer object (`save_pretrained`) or a directory whose tokenizer files are copied."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(out_dir))
        return
    src = Path(tokenizer)
    if not src.is_dir():
        raise WeightConversionError(f"tokenizer {tokenizer!r} is neither a tokenizer object nor a directory")
    copied = [f for f in _TOKENIZER_FILES if (src / f).is_file()]
    if not copied:
        raise WeightConversionError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, ...) in {src}")
    for f in copied:
        shutil.copy2(src / f, Path(out_dir) / f)


def export_hf(
    chunks: list,
    out_dir: Union[str, os.PathLike],
    hf_config: HFConfig,
    tokenizer: Any = None,
    *,
    bucket_mb: float = 1024,
    dtype: Optional[torch.dtype] = None,
    overwrite: bool = False,
    on_bucket: Optional[Callable[[Bucket], None]] = None,
) -> Path:
    """Write the model as an HF directory; collective over all ranks; returns `out_dir`.

    hf_config: the HF config (object or dict) the model was built from, parsed here once; the
    rest as `export_model`.
    """
    return export_model(
        chunks,
        out_dir,
        model_spec(hf_config),
        tokenizer,
        bucket_mb=bucket_mb,
        dtype=dtype,
        overwrite=overwrite,
        on_bucket=on_bucket,
    )


def export_model(
    chunks: list,
    out_dir: Union[str, os.PathLike],
    model: ModelSpec,
    tokenizer: Any = None,
    *,
    bucket_mb: float = 1024,
    dtype: Optional[torch.dtype] = None,
    overwrite: bool = False,
    on_bucket: Optional[Callable[[Bucket], None]] = None,
) -> Path:
    """`export_hf` for a caller that holds the parsed model (the run, a weight sync).

    `dtype` (default: the parameters' own) is also recorded in config.json. Written to
    `out_dir.partial` first and renamed by rank 0 once complete. `on_bucket` sees each bucket a
    rank writes, just before it is written (a weight sync samples the bucket beside the write).
    """
    from safetensors.torch import save_file

    arch = model.arch
    check_model_matches(chunks, arch)
    layout = current_layout()
    out = Path(out_dir)
    partial = out.with_name(out.name + ".partial")
    # Decided from the shared filesystem by every rank alike, before any collective.
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise WeightConversionError(f"export directory {out} exists and is not empty (pass overwrite=True)")
    make_staging_dir(partial, "export directory", WeightConversionError)

    weight_map: dict[str, str] = {}
    total_bytes = 0
    for k, bucket in enumerate(iter_stage_buckets(chunks, arch, bucket_mb=bucket_mb, dtype=dtype)):
        fname = f"model-pp{layout.pp_rank:03d}-{k:05d}.safetensors"
        if on_bucket is not None:
            on_bucket(bucket)  # first: a weight sync samples the bucket beside the write
        save_file(dict(bucket), str(partial / fname), metadata={"format": "pt"})
        for name, tensor in bucket:
            weight_map[name] = fname
            total_bytes += tensor.numel() * tensor.element_size()
    if layout.rank == 0 and dtype is None:
        dtype = next(p for p in chunks[0].parameters()).dtype
    gathered = [None] * layout.world_size if layout.rank == 0 else None
    dist.gather_object((weight_map, total_bytes), gathered, dst=0)

    error = None
    if layout.rank == 0:
        try:
            full_map = {name: f for part, _ in gathered for name, f in part.items()}
            check_hf_names(full_map, arch)
            index = {
                "metadata": {"total_size": sum(size for _, size in gathered)},
                "weight_map": dict(sorted(full_map.items())),
            }
            (partial / INDEX_FILE).write_text(json.dumps(index, indent=2))
            hf_config_object(model.hf_config, dtype).save_pretrained(str(partial))
            if tokenizer is not None:
                save_tokenizer(tokenizer, partial)
                if hasattr(tokenizer, "apply_chat_template"):  # the end-of-turn ids engines stop on
                    write_generation_config(partial, model.hf_config, tokenizer)
            if out.exists():
                shutil.rmtree(out)
            os.replace(partial, out)
            fsync_dir(out.parent)
        except Exception as e:  # reported on every rank below
            error = f"export to {out} failed: {e}"
    raise_together(error, WeightConversionError)
    dist.barrier()
    return out


# ----------------------------------------------------------------------------- import


def hf_tensor_files(hf_dir: Union[str, os.PathLike]) -> dict[str, Path]:
    """HF tensor name -> safetensors file, from the index or from the files' headers."""
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / f for name, f in weight_map.items()}
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise WeightConversionError(f"no *.safetensors files in {hf_dir} (only safetensors checkpoints are supported)")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            out.update({name: f for name in handle.keys()})
    return out


def load_hf_index(hf_dir: Union[str, os.PathLike]) -> dict:
    """The `model.safetensors.index.json` of an exported directory."""
    return json.loads((Path(hf_dir) / INDEX_FILE).read_text())


def load_hf_config(hf_dir: Union[str, os.PathLike]) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise WeightConversionError(f"{hf_dir} has no config.json (is it a Hugging Face model directory?)")
    return json.loads(path.read_text())


@torch.no_grad()
def import_hf(chunks: list, hf_dir: Union[str, os.PathLike], *, optimizer: Any = None) -> GPTArch:
    """Load an HF checkpoint directory into this rank's chunks (any TP/PP); returns its GPTArch.

    Every rank reads only the tensors of its own stage. Not a collective. Call before the
    optimizer is built, or pass it so that its fp32 main params are refreshed.
    """
    from safetensors import safe_open

    from megatron_stepwise.mcore.train.model import unwrap

    arch = arch_from_hf(load_hf_config(hf_dir))  # the checkpoint's own config.json, parsed once
    check_model_matches(chunks, arch)
    files = hf_tensor_files(hf_dir)
    check_hf_names(files, arch)
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(name: str) -> torch.Tensor:
            f = files[name]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            return handles[f].get_tensor(name)

        for chunk in chunks:
            model = unwrap(chunk)
            for name, param in W.canonical_params(chunk):
                shape = W.full_shape(param, name)
                hf = {n: read(n) for n in hf_names_for(name, arch)}
                full = from_hf(name, hf, arch, vocab_rows=shape[0] if name in (EMBED, OUTPUT) else None)
                if tuple(full.shape) != shape:
                    raise WeightConversionError(
                        f"{'/'.join(hf)} give megatron {name!r} the shape {tuple(full.shape)}, expected {shape}"
                    )
                param.data.copy_(W.shard_full(full, param, name, model).to(param.dtype))
    if optimizer is not None:
        optimizer.reload_model_params()
    return arch
