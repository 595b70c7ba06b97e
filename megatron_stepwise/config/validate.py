"""Semantic checks of a typed config: layouts, combinations, the machine. One problem per finding.

Type and unknown-key problems are found while building the dataclasses (fields.build); a key
that failed there is "bad" and the checks here that involve it stay quiet, so the user sees
the root cause once instead of a cascade.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from pathlib import Path

from megatron_stepwise.config.errors import ConfigProblem
from megatron_stepwise.config.fields import config_fields, is_config_class, origin_of
from megatron_stepwise.config.probes import Probes
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.hf import hub
from megatron_stepwise.hf.arch import GPTArch, ModelConfigError, arch_from_hf, split_problems
from megatron_stepwise.hf.hub import looks_like_path
from megatron_stepwise.options import is_registry

_KEY_RE = re.compile(r"^[a-z_]+(\.[a-z_]+)+$")
# `ray start` reserves these for its workers (--min/max-worker-port defaults) and refuses a
# head port among them.
RAY_WORKER_PORTS = (10002, 19999)
SGLANG_INSTALL_HINT = "pip install 'megatron-stepwise[sglang]'"  # README says the same
_SERVER_RE = re.compile(r"^(https?://)?[A-Za-z0-9_.\-]+:\d{1,5}/?$")


class _Checker:
    def __init__(self, bad_keys: set[str], origins: dict[str, str]):
        self.bad_keys, self.origins = bad_keys, origins
        self.problems: list[ConfigProblem] = []

    def _is_bad(self, key: str) -> bool:
        while key:
            if key in self.bad_keys:
                return True
            key = key.rpartition(".")[0]
        return False

    def fail(self, key: str, message: str, *involved: str) -> None:
        """Record a problem at `key`, unless it or a key it involves already failed to parse."""
        if any(self._is_bad(k) for k in (key, *involved)):
            return
        self.problems.append(ConfigProblem(key, message, origin_of(self.origins, key)))


def validate(
    cfg: ExperimentConfig,
    *,
    world_size: int | None = None,
    world_size_source: str | None = None,
    bad_keys: set[str] | None = None,
    origins: dict[str, str] | None = None,
    probes: Probes | None = None,
) -> list[ConfigProblem]:
    """Every semantic problem of `cfg` (empty when it can run)."""
    check = _Checker(bad_keys or set(), origins or {})
    probes = probes or Probes()
    _check_imports(cfg, check, probes)  # first: imported modules fill the registries checked below
    _check_declared(cfg, check)
    _check_parallel(cfg, check, probes, world_size, world_size_source)
    _check_model(cfg, check, probes)
    _check_rollout(cfg, check, probes)
    _check_data(cfg, check)
    _check_algo(cfg, check)
    check_loss_combinations(cfg, check)
    _check_async(cfg, check)
    _check_colocate(cfg, check)
    _check_optim(cfg, check)
    _check_env(cfg, check, probes)
    _check_outputs(cfg, check, probes)
    _check_sizes(cfg, check)
    return check.problems


INT32_MAX = 2**31 - 1  # token positions, packed-sequence offsets (cu_seqlens) and row counts are int32
MAX_BUCKET_MB = 1 << 20  # one weight bucket is held in host memory: 1 TiB is past any node


def _check_sizes(cfg: ExperimentConfig, check: _Checker) -> None:
    """Sizes each key's own bounds allow but no run can have (they fail deep inside a run)."""
    ro, data = cfg.rollout, cfg.data
    if ro.engine == "sglang" and not ro.sglang.servers:
        last = ro.sglang.base_port + ro.num_engines - 1
        if last > 65535:
            check.fail(
                "rollout.sglang.base_port",
                f"{ro.sglang.base_port} + rollout.num_engines {ro.num_engines} - 1 = port {last}, past 65535",
                "rollout.num_engines",
            )
    if cfg.weight_sync.bucket_mb > MAX_BUCKET_MB:
        check.fail(
            "weight_sync.bucket_mb",
            f"{cfg.weight_sync.bucket_mb} MiB: one bucket is held in memory (at most {MAX_BUCKET_MB})",
        )
    longest = ro.max_input_length + ro.max_new_tokens
    if longest > INT32_MAX:
        check.fail(
            "rollout.max_input_length",
            f"+ rollout.max_new_tokens = {longest} tokens: past the {INT32_MAX} positions a sequence can have",
            "rollout.max_new_tokens",
        )
    if data.max_tokens_per_microbatch > INT32_MAX:
        check.fail(
            "data.max_tokens_per_microbatch",
            f"{data.max_tokens_per_microbatch}: past the {INT32_MAX} tokens a packed micro-batch can index",
        )
    samples = max(data.samples_per_prompt, cfg.eval_.samples_per_prompt or 0)
    if data.prompts_per_iteration * samples > INT32_MAX:
        check.fail(
            "data.prompts_per_iteration",
            f"{data.prompts_per_iteration} x {samples} samples per prompt = "
            f"{data.prompts_per_iteration * samples} trajectories per iteration: past {INT32_MAX}",
            "data.samples_per_prompt",
            "eval.samples_per_prompt",
        )


def _check_imports(cfg: ExperimentConfig, check: _Checker, probes: Probes) -> None:
    for name in cfg.trainer.imports:
        error = probes.import_module(name)
        if error:
            check.fail("trainer.imports", f"cannot import {name!r}: {error}")


def _check_declared(obj, check: _Checker, prefix: str = "") -> None:
    """What sections find wrong with themselves (`problems()`, e.g. `algo.loss`).

    Building the config already checked every key's bounds and fixed choices (a bad value was
    reported and reset to its default); left are choices from registries (filled by
    trainer.imports, imported just before) and combinations of keys of one section.
    """
    fields = config_fields(type(obj))
    for name, f, tp in fields:
        if is_config_class(tp):
            _check_declared(getattr(obj, f.name), check, f"{prefix}{name}.")
    if not callable(getattr(obj, "problems", None)):
        return
    metas = {name: f.metadata for name, f, _ in fields}
    for key, why in obj.problems():
        if is_registry(metas.get(key, {})):
            why += " (custom ones are registered by a module listed in trainer.imports)"
        check.fail(prefix + key, why)


def _check_parallel(
    cfg: ExperimentConfig, check: _Checker, probes: Probes, world_size: int | None, source: str | None
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
    cfg: ExperimentConfig, check: _Checker, probes: Probes, arch: GPTArch, source: str
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


def _check_model(cfg: ExperimentConfig, check: _Checker, probes: Probes) -> None:
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


def _check_rollout(cfg: ExperimentConfig, check: _Checker, probes: Probes) -> None:
    ro, sg, launch = cfg.rollout, cfg.rollout.sglang, cfg.launch
    for i, server in enumerate(sg.servers):
        if not _SERVER_RE.match(server):
            check.fail("rollout.sglang.servers", f"item {i} {server!r} is not host:port or http://host:port")
    if sg.router_url and not _SERVER_RE.match(sg.router_url):
        check.fail("rollout.sglang.router_url", f"{sg.router_url!r} is not http://host:port")
    if sg.router_url and cfg.algo.routing_replay:
        # sglang-router 0.3.x forwards /generate without return_routed_experts
        check.fail(
            "rollout.sglang.router_url",
            "routing replay (algo.routing_replay) needs the routed experts, "
            "which sglang-router drops; unset router_url (the fleet routes "
            "itself) or algo.routing_replay",
            "algo.routing_replay",
        )
    if ro.engine == "embedded":
        for key in ("servers", "router_url"):
            if getattr(sg, key):
                check.fail(
                    f"rollout.sglang.{key}",
                    "is set but rollout.engine is embedded; set rollout.engine=sglang to use SGLang servers",
                    "rollout.engine",
                )
        if ro.engine_tp != 1:
            check.fail(
                "rollout.engine_tp", "the embedded engine is one CPU process; engine_tp must be 1", "rollout.engine"
            )
        return
    # SGLang: either servers already running, or servers the fleet launches on GPUs.
    if sg.servers:
        if len(sg.servers) != ro.num_engines:
            check.fail(
                "rollout.num_engines",
                f"is {ro.num_engines} but rollout.sglang.servers lists {len(sg.servers)} servers",
                "rollout.sglang.servers",
            )
        return
    if sg.router_url:
        check.fail(
            "rollout.sglang.servers",
            "rollout.sglang.router_url is set but no servers are listed: weight updates go to every server directly",
            "rollout.sglang.router_url",
        )
        return
    if not probes.has_module("sglang"):
        check.fail(
            "rollout.engine",
            "sglang launches servers but the sglang package is not installed "
            f"({SGLANG_INSTALL_HINT}), and no running servers are "
            "listed in rollout.sglang.servers",
        )
    if launch.gpus_per_node and ro.engine_tp > launch.gpus_per_node:
        check.fail(
            "rollout.engine_tp",
            f"an engine cannot span nodes: engine_tp {ro.engine_tp} > launch.gpus_per_node {launch.gpus_per_node}",
            "launch.gpus_per_node",
        )
        return
    need, have = ro.num_engines * ro.engine_tp, launch.rollout_gpus()
    if ro.colocate:  # the engines share the training GPUs (and take any rollout-only node's)
        have = (launch.nnodes + launch.rollout_nodes) * launch.gpus_per_node
    if need > have:
        check.fail(
            "rollout.num_engines",
            f"{ro.num_engines} engines x engine_tp {ro.engine_tp} need {need} "
            f"GPUs but the launch layout leaves {have} to rollout (launch: "
            f"{launch.nnodes} training nodes with {launch.gpus_per_node} GPUs, "
            f"{launch.nproc_per_node} used for training, rollout_nodes "
            f"{launch.rollout_nodes})",
            "rollout.engine_tp",
            "launch.nnodes",
            "launch.gpus_per_node",
            "launch.nproc_per_node",
            "launch.rollout_nodes",
        )


def _check_data(cfg: ExperimentConfig, check: _Checker) -> None:
    data, ro = cfg.data, cfg.rollout
    if data.prompts_per_iteration % data.prompts_per_minibatch:
        check.fail(
            "data.prompts_per_minibatch",
            f"{data.prompts_per_minibatch} does not divide "
            f"data.prompts_per_iteration {data.prompts_per_iteration} "
            "(each mini-batch is a fixed number of prompts)",
            "data.prompts_per_iteration",
        )
    longest = ro.max_input_length + ro.max_new_tokens
    if data.max_tokens_per_microbatch < longest:
        check.fail(
            "data.max_tokens_per_microbatch",
            f"{data.max_tokens_per_microbatch} cannot hold one step "
            f"of rollout.max_input_length + rollout.max_new_tokens = "
            f"{longest} tokens",
            "rollout.max_input_length",
            "rollout.max_new_tokens",
        )


def _check_algo(cfg: ExperimentConfig, check: _Checker) -> None:
    from megatron_stepwise.algo import advantages

    algo, data = cfg.algo, cfg.data
    _check_turn_estimator(cfg, check)  # imports turn_credit, which registers the turn estimators
    if data.samples_per_prompt == 1:
        # Outcome and turn estimators compare the trajectories of a prompt (the registry's kinds).
        name = algo.estimator
        if name in advantages.list_estimators() and not advantages.is_temporal_estimator(name):
            check.fail(
                "data.samples_per_prompt",
                f"is 1 but algo.estimator {name} compares the trajectories of a prompt: every advantage would be 0",
                "algo.estimator",
            )
            return  # the filters below fail for the same reason; one fix solves both
        for key in ("zero_variance", "dynamic_sampling"):
            if getattr(algo.filters, key):
                check.fail(
                    f"algo.filters.{key}",
                    "a group of one trajectory (data.samples_per_prompt=1) has "
                    "no reward variance: every group would be dropped",
                    "data.samples_per_prompt",
                )


def _check_turn_estimator(cfg: ExperimentConfig, check: _Checker) -> None:
    """A turn-level estimator's options, and per-turn rewards to credit (docs/credit.md)."""
    from megatron_stepwise.algo import advantages, turn_credit

    name = cfg.algo.estimator
    if name not in advantages.list_estimators() or not advantages.is_turn_estimator(name):
        return
    if cfg.rollout.max_turns == 1:
        check.fail(
            "algo.estimator",
            f"{name} credits each turn with the rewards from it on, but "
            "rollout.max_turns=1 leaves one turn per trajectory and no per-turn "
            "rewards: use its outcome estimator (rloo, grpo, dr_grpo)",
            "rollout.max_turns",
        )
    for key, message in turn_credit.check_turn_options(name, dict(cfg.algo.estimator_options)):
        check.fail(key, message, "algo.estimator")


# Keys the loss checks of megatron_stepwise.algo read: a parse error in any of them silences them.
_LOSS_KEYS = ("algo.estimator", "algo.loss", "data.merge_steps", "rollout.max_turns")


def check_loss_combinations(cfg: ExperimentConfig, check: _Checker) -> None:
    """Estimator and loss options that cannot work (together, or with merged steps).

    Delegated to `megatron_stepwise.algo.losses.check_loss_compatibility`, which knows the
    estimator registry (custom estimators included) and which losses are sequence-level; its
    messages start with the offending key (`algo.loss.reduction='step_mean' cannot ...`). The
    loss section's own checks (`LossConfig.problems()`) ran in `_check_declared`.
    """
    from megatron_stepwise.algo import advantages, losses

    errors = losses.check_loss_compatibility(
        cfg.algo.loss,
        merge_steps=cfg.data.merge_steps,
        estimator=cfg.algo.estimator,
        multi_step=cfg.rollout.max_turns > 1,
    )
    names = {"algo.estimator": advantages.list_estimators()}
    for error in errors:
        key = _leading_key(error, "algo")
        message = _after_key(error)
        if key in names and "not a registered" in error:
            hint = difflib.get_close_matches(_value_at(cfg, key), names[key], n=1)
            message += (
                f"; did you mean {hint[0]!r}?" if hint else ""
            ) + " (custom ones are registered by a module listed in trainer.imports)"
        check.fail(key, message, *_LOSS_KEYS)


def _leading_key(message: str, fallback: str) -> str:
    head = message.split("=", 1)[0]
    return head if "=" in message and _KEY_RE.match(head) else fallback


def _after_key(message: str) -> str:
    """`algo.loss.tis='sequence' cannot ...` -> `'sequence' cannot ...` (the key is shown separately)."""
    head, sep, rest = message.partition("=")
    return rest if sep and _KEY_RE.match(head) else message


def _value_at(cfg: ExperimentConfig, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _check_async(cfg: ExperimentConfig, check: _Checker) -> None:
    a = cfg.async_
    if not a.enabled:
        return
    if a.max_staleness == 0:
        check.fail(
            "async.max_staleness",
            "0 allows no overlap of rollout and training; set async.enabled=false for synchronous training",
            "async.enabled",
        )
    if cfg.algo.loss.tis == "none":
        check.fail(
            "algo.loss.tis",
            "async.enabled=true trains on rollouts of older weights: set "
            "algo.loss.tis to token or sequence to correct for the policy lag",
            "async.enabled",
        )
    if cfg.data.epochs != 1:
        check.fail(
            "data.epochs",
            f"{cfg.data.epochs}: async.enabled=true trains each mini-batch once, as "
            "its groups arrive; set data.epochs=1",
            "async.enabled",
        )
    if a.pause_mode == "in_place" and cfg.rollout.engine != "embedded":
        check.fail(
            "async.pause_mode",
            f"in_place keeps a paused turn's KV as computed, which only the embedded engine does; "
            f"rollout.engine is {cfg.rollout.engine}: use retract or abort",
            "rollout.engine",
        )


def _check_colocate(cfg: ExperimentConfig, check: _Checker) -> None:
    ro = cfg.rollout
    if not ro.colocate:
        return
    if cfg.async_.enabled:
        check.fail(
            "rollout.colocate",
            "true gives the engines' memory to training between rollouts, so rollout "
            "cannot overlap training as async.enabled=true needs; set one of them "
            "to false",
            "async.enabled",
        )
    if ro.engine == "sglang" and cfg.weight_sync.mode == "distributed":
        check.fail(
            "rollout.colocate",
            "true puts an engine on the GPU of a training rank, and one NCCL group "
            "cannot hold two ranks on the same GPU: set weight_sync.mode=tensor "
            "(CUDA IPC handles) or disk",
            "weight_sync.mode",
        )
    launch = cfg.launch
    if ro.engine == "sglang" and cfg.weight_sync.mode == "tensor" and launch.nnodes + launch.rollout_nodes > 1:
        check.fail(
            "rollout.colocate",
            "true with weight_sync.mode=tensor sends CUDA IPC handles of rank 0's "
            "tensors, which only engines on rank 0's node can open; on "
            f"{launch.nnodes + launch.rollout_nodes} nodes set weight_sync.mode=disk",
            "weight_sync.mode",
            "launch.nnodes",
            "launch.rollout_nodes",
        )


def _check_optim(cfg: ExperimentConfig, check: _Checker) -> None:
    opt, data = cfg.optim, cfg.data
    if opt.min_lr > opt.lr:
        check.fail("optim.min_lr", f"{opt.min_lr} is above optim.lr {opt.lr}", "optim.lr")
    if data.prompts_per_iteration % data.prompts_per_minibatch == 0:
        steps = cfg.total_optimizer_steps
        if opt.warmup_steps > steps:
            check.fail(
                "optim.warmup_steps",
                f"{opt.warmup_steps} exceeds the {steps} optimizer steps of the run "
                "(trainer.iterations x data.epochs x mini-batches per iteration)",
                "trainer.iterations",
                "data.epochs",
                "data.prompts_per_iteration",
                "data.prompts_per_minibatch",
            )


_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def _check_outputs(cfg: ExperimentConfig, check: _Checker, probes: Probes) -> None:
    if not _SAFE_NAME.fullmatch(cfg.name) or ".." in cfg.name:
        # The default run directory is runs/<name>: a path in the name would write elsewhere.
        check.fail(
            "name",
            f"{cfg.name!r} must be a plain name (letters, digits, . _ + -, no path); choose "
            "another directory with logging.run_dir",
            "logging.run_dir",
        )
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "never") and not Path(resume).expanduser().exists():
        check.fail("checkpoint.resume", f"is neither auto, never nor an existing checkpoint path: {resume!r}")
    # The directories the run writes, checked before anything starts (not a traceback at the first write).
    outputs = {"logging.run_dir": cfg.run_dir}
    if cfg.checkpoint.dir:
        outputs["checkpoint.dir"] = cfg.checkpoint.dir
    if cfg.weight_sync.mode == "disk" and cfg.weight_sync.dir:
        outputs["weight_sync.dir"] = cfg.weight_sync.dir
    for key, directory in outputs.items():
        problem = probes.output_dir_problem(directory)
        if problem:
            check.fail(key, problem)
    if cfg.logging.tensorboard and not probes.has_module("tensorboard"):
        check.fail("logging.tensorboard", "needs the tensorboard package (pip install tensorboard)")
    if cfg.logging.wandb.project and not probes.has_module("wandb"):
        check.fail("logging.wandb.project", "W&B logging needs the wandb package (pip install wandb)")


def _check_env(cfg: ExperimentConfig, check: _Checker, probes: Probes) -> None:
    env = cfg.env
    if env.agent:
        problem = _agent_problem(env.agent)
        if problem:
            check.fail("env.agent", problem)
    # env.name keeps its default (echo, also what tiny_cpu.yaml names) unless the user chose another one.
    if env.reward_fn and env.name != type(env)().name:
        check.fail(
            "env.reward_fn",
            f"is set and so is env.name ({env.name!r}): the reward function is the environment; set only one",
            "env.name",
        )
        return
    dotted = ":" in env.name or bool(env.reward_fn)
    names = probes.registered("env")
    if not dotted and names is not None and env.name not in names:
        hint = difflib.get_close_matches(env.name, sorted(names), n=1)
        check.fail(
            "env.name",
            f"unknown environment {env.name!r} (registered: {', '.join(sorted(names))})"
            + (f"; did you mean {hint[0]!r}?" if hint else ""),
        )
        return
    missing_file = False
    for key in ("dataset", "eval_dataset"):
        value = getattr(env, key)
        if value and looks_like_path(value) and not Path(value).expanduser().exists():
            check.fail(f"env.{key}", f"no such file: {value}")
            missing_file = True
    spec = probes.env_spec(env.name, env.reward_fn)
    if isinstance(spec, str):
        if dotted:  # a registered name that is unknown was reported above, when the registry was known
            check.fail("env.reward_fn" if env.reward_fn else "env.name", spec)
        return
    unknown = _unaccepted_options(spec.factory, env.options)
    if unknown:
        check.fail(
            "env.options",
            f"environment {spec.name!r} takes no option {', '.join(map(repr, unknown))} "
            f"(it accepts: {', '.join(_accepted_options(spec.factory)) or 'none'})",
        )
    if spec.tokenizer is None and not (cfg.model.tokenizer or cfg.model.hf_checkpoint):
        check.fail(
            "model.tokenizer",
            f"environment {spec.name!r} ships no tokenizer: set model.tokenizer (or model.hf_checkpoint)",
            "model.hf_checkpoint",
        )
    if not missing_file:
        _check_dataset(cfg, check, probes, spec)


def _agent_problem(path: str) -> str | None:
    """Why `env.agent` names no function (its module is imported, as env.name's is); None if it does."""
    from megatron_stepwise.envs.custom import load_object

    try:
        agent = load_object(path, key="env.agent")
    except Exception as e:  # the user's module failing to import is a finding, not a crash
        return str(e).removeprefix(f"env.agent={path!r}: ")
    return None if callable(agent) else f"{path!r} is not a function"


def _accepted_options(factory) -> list[str]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _unaccepted_options(factory, options: dict) -> list[str]:
    """Keys of env.options the factory cannot take (none when it takes **kwargs or is opaque):
    a typo would otherwise fail every trajectory at start-up instead of here."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return []
    accepted = set(_accepted_options(factory))
    return sorted(k for k in options if k not in accepted)


def _check_dataset(cfg: ExperimentConfig, check: _Checker, probes: Probes, spec) -> None:
    """The samples exist, hold the fields the environment reads, and are enough for one iteration."""
    env = cfg.env
    if env.fields and not (env.dataset or env.eval_dataset):
        check.fail(
            "env.fields",
            "maps the columns of env.dataset / env.eval_dataset files, but neither is set "
            "(the environment's shipped dataset already has its fields)",
            "env.dataset",
        )
    if not env.dataset and getattr(spec.dataset, "ships_none", False):
        check.fail("env.dataset", f"environment {spec.name!r} ships no dataset: set env.dataset")
        return
    if env.dataset:
        facts = probes.dataset_facts(env.dataset, env.dataset_split)
    else:
        unknown = _unaccepted_options(spec.dataset, env.dataset_options)
        if unknown:  # typically inherited from a config written for another environment (tiny_cpu's echo)
            check.fail(
                "env.dataset_options",
                f"the dataset of environment {spec.name!r} takes no option "
                f"{', '.join(map(repr, unknown))} (it accepts: "
                f"{', '.join(_accepted_options(spec.dataset)) or 'none'}); options "
                "written for another environment? override with "
                "env.dataset_options={}",
            )
            return
        facts = probes.shipped_facts(spec, env.dataset_options)
    if isinstance(facts, str):  # the file, or the shipped dataset's options (env.dataset null)
        check.fail("env.dataset" if env.dataset else "env.dataset_options", facts, "env.dataset_split")
        return
    if facts is None:
        return
    ok = _check_fields(cfg, check, facts, "env.dataset", spec)
    if env.eval_dataset:
        eval_facts = probes.dataset_facts(env.eval_dataset, env.eval_split)
        if isinstance(eval_facts, str):
            check.fail("env.eval_dataset", eval_facts, "env.eval_split")
        elif eval_facts is not None:
            _check_fields(cfg, check, eval_facts, "env.eval_dataset", spec)
    data = cfg.data
    if ok and facts.num_rows < data.prompts_per_iteration:
        check.fail(
            "data.prompts_per_iteration",
            f"{data.prompts_per_iteration} prompts per iteration but "
            f"{facts.description} has {facts.num_rows}: lower it or use a "
            "larger env.dataset",
            "env.dataset",
        )


def _check_fields(cfg: ExperimentConfig, check: _Checker, facts, key: str, spec) -> bool:
    """env.fields name existing columns, and every field the environment reads is there."""
    columns = facts.columns
    # env.fields maps the columns of env.dataset and env.eval_dataset, not of a shipped dataset.
    fields = cfg.env.fields if (key == "env.eval_dataset" or cfg.env.dataset) else {}
    ok = True
    for target, column in fields.items():
        if column not in columns:
            check.fail(
                f"env.fields.{target}",
                f"column {column!r} is not in {facts.description} (columns: {', '.join(columns)})",
                key,
            )
            ok = False
    for field in spec.required_fields:
        if field not in columns and field not in fields:
            check.fail(
                key,
                f"{facts.description} has no field {field!r}, which environment {spec.name!r} "
                f"reads (columns: {', '.join(columns)}); map a column to it with env.fields.{field}",
            )
            ok = False
    return ok
