"""The model and the parallel layout: the world size, the architecture's splits and window, the
checkpoint an explicit hf_config must describe, and the files the model keys name."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

from megatron_stepwise.config.checker import Checker
from megatron_stepwise.config.probes import Probes
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.hf import hub
from megatron_stepwise.hf.arch import GPTArch, ModelConfigError, arch_from_hf, split_problems
from megatron_stepwise.hf.hub import looks_like_path

# `ray start` reserves these for its workers (--min/max-worker-port defaults) and refuses a
# head port among them.
RAY_WORKER_PORTS = (10002, 19999)


def check_parallel(
    cfg: ExperimentConfig, check: Checker, probes: Probes, world_size: int | None, source: str | None
) -> None:
    par, launch = cfg.parallel, cfg.launch
    if world_size is None:
        world_size = launch.world_size()
        source = f"launch.nnodes {launch.nnodes} x launch.nproc_per_node {launch.nproc_per_node}"
    mp = par.model_parallel_size()
    if world_size % mp:
        check.fail(
            "parallel",
            f"world size {world_size} ({source}) is not a multiple of parallel.tensor "
            f"{par.tensor} x parallel.pipeline {par.pipeline} x parallel.context "
            f"{par.context} = {mp}",
            "parallel.tensor",
            "parallel.pipeline",
            "parallel.context",
            "launch.nnodes",
            "launch.nproc_per_node",
        )
    if par.sequence_parallel and par.tensor == 1:
        check.fail(
            "parallel.sequence_parallel",
            "needs parallel.tensor > 1 (it shards activations across the tensor-parallel group)",
            "parallel.tensor",
        )
    if RAY_WORKER_PORTS[0] <= launch.ray_port <= RAY_WORKER_PORTS[1]:
        check.fail(
            "launch.ray_port",
            f"{launch.ray_port} is inside Ray's default worker port range "
            f"{RAY_WORKER_PORTS[0]}-{RAY_WORKER_PORTS[1]}: the Ray head the launch "
            "scripts start would refuse it; use e.g. 6379",
        )
    if launch.gpus_per_node and launch.nproc_per_node > launch.gpus_per_node:
        check.fail(
            "launch.nproc_per_node",
            f"{launch.nproc_per_node} training ranks per node but launch.gpus_per_node is {launch.gpus_per_node}",
            "launch.gpus_per_node",
        )
    value, key = cfg.model.architecture()
    found = probes.model_config(value)
    if found is None:
        return
    hf, source = found
    try:
        arch = arch_from_hf(hf)
    except ModelConfigError as e:
        check.fail(key, f"{e} ({source})")
        return
    _check_against_checkpoint(cfg, check, probes, arch, source)
    longest = cfg.rollout.max_input_length + cfg.rollout.max_new_tokens
    # A real model's window (pretrained, or a real config trained from scratch); a preset's is nominal.
    presets = probes.presets()
    real_window = cfg.model.hf_checkpoint or presets is None or value not in presets
    if real_window and longest > arch.max_position_embeddings:
        check.fail(
            "rollout.max_input_length",
            f"+ rollout.max_new_tokens = {longest} tokens exceed the model's "
            f"context window of {arch.max_position_embeddings} ({source})",
            "rollout.max_new_tokens",
        )
    reported = set()
    for size, why in split_problems(arch, tp=par.tensor, pp=par.pipeline, ep=par.expert):
        if size not in reported:  # one problem per key
            reported.add(size)
            check.fail(f"parallel.{size}", f"{why} ({source})", key)
    loss = cfg.algo.loss
    for key in ("router_aux_coef", "router_z_coef"):
        if getattr(loss, key) and not arch.num_experts:
            check.fail(
                f"algo.loss.{key}",
                f"{getattr(loss, key)} needs a mixture-of-experts model; {source} has no router",
                key,
            )
    if cfg.algo.routing_replay and not arch.num_experts:
        check.fail("algo.routing_replay", f"needs a mixture-of-experts model; {source} has no router", key)
    if par.expert > 1 and world_size % mp == 0 and (world_size // (par.tensor * par.pipeline)) % par.expert:
        check.fail(
            "parallel.expert",
            f"{par.expert} does not divide data x context parallel = "
            f"{world_size // (par.tensor * par.pipeline)} (experts are split over "
            "those ranks)",
            "parallel.tensor",
            "parallel.pipeline",
        )


def _check_against_checkpoint(
    cfg: ExperimentConfig, check: Checker, probes: Probes, arch: GPTArch, source: str
) -> None:
    """An explicit hf_config must describe the checkpoint's own architecture (the weights fix it)."""
    model = cfg.model
    if not (model.hf_config and model.hf_checkpoint):
        return
    found = probes.model_config(model.hf_checkpoint)
    if found is None:
        return
    try:
        own = arch_from_hf(found[0])
    except ModelConfigError as e:
        check.fail("model.hf_checkpoint", f"{e} ({found[1]})")
        return
    differ = [
        f"{f.name} {getattr(arch, f.name)} vs {getattr(own, f.name)}"
        for f in dataclasses.fields(own)
        if f.name not in ("init_std", "attention_dropout") and getattr(arch, f.name) != getattr(own, f.name)
    ]
    if differ:
        check.fail(
            "model.hf_config",
            f"{model.hf_config!r} ({source}) is not the architecture of "
            f"model.hf_checkpoint={model.hf_checkpoint!r} ({found[1]}): "
            f"{'; '.join(differ[:3])}; set model.hf_config=null to use the checkpoint's",
            "model.hf_checkpoint",
        )


def check_model(cfg: ExperimentConfig, check: Checker, probes: Probes) -> None:
    model = cfg.model
    for key, files in (
        ("hf_config", hub.CONFIG_FILES),
        ("hf_checkpoint", hub.CHECKPOINT_FILES),
        ("tokenizer", hub.TOKENIZER_FILES),
    ):
        value = getattr(model, key)
        if value and hub.is_gguf_source(value):
            problem = probes.gguf_problem(value, f"model.{key}")
            if problem:
                check.fail(f"model.{key}", problem)
            continue
        if not value or Path(value).expanduser().exists():
            continue
        if looks_like_path(value):
            check.fail(f"model.{key}", f"no such file or directory: {value}")
        elif "/" in value and not model.allow_download and probes.locate_model(value, files) is None:
            # A hub id (presets and shipped tokenizers have no "/") that this node cannot resolve offline.
            check.fail(
                f"model.{key}",
                f"{value!r} is neither a local path nor in the Hugging Face cache "
                f"({hub.hub_cache_dir()}, looked for {files[0]}); download it first "
                f"(hf download {value}) or set model.allow_download=true",
                "model.allow_download",
            )
    if model.allow_download and probes.hub_offline():
        needs = [
            getattr(model, k)
            for k, files in (
                ("hf_config", hub.CONFIG_FILES),
                ("hf_checkpoint", hub.CHECKPOINT_FILES),
                ("tokenizer", hub.TOKENIZER_FILES),
            )
            if getattr(model, k)
            and "/" in getattr(model, k)
            and not looks_like_path(getattr(model, k))
            and probes.locate_model(getattr(model, k), files) is None
        ]
        if needs:
            check.fail(
                "model.allow_download",
                f"is true but HF_HUB_OFFLINE=1 forbids downloading {needs[0]!r}, "
                "which is not in the local Hugging Face cache; download it first "
                f"(hf download {needs[0]}) or unset HF_HUB_OFFLINE",
            )
    hf = model.hf_config
    if hf and not hub.is_gguf_source(hf) and not looks_like_path(hf) and "/" not in hf:  # a preset
        presets = probes.presets()
        if presets is not None and hf not in presets and not Path(hf).exists():
            hint = difflib.get_close_matches(hf, list(presets), n=1)
            check.fail(
                "model.hf_config",
                f"unknown preset {hf!r} (presets: {', '.join(sorted(presets))})"
                + (f"; did you mean {hint[0]!r}?" if hint else ""),
            )
    if model.chat_template:  # a missing file or a template that does not compile, before anything starts
        from megatron_stepwise.hf.chat_templates import chat_template_problem

        problem = chat_template_problem(model.chat_template)
        if problem:
            check.fail("model.chat_template", problem)
    if model.transformer_impl == "te" and not probes.has_module("transformer_engine"):
        check.fail(
            "model.transformer_impl",
            "te needs transformer-engine (pip install megatron-stepwise[te]); use auto or local",
        )
