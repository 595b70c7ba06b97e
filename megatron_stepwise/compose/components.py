"""Builders that turn an `ExperimentConfig` into the trainer's parts.

Each function builds one thing from its config section, so a user with their own Megatron loop
can take the pieces they need (model, optimizer, plugin, fleet) without the `Trainer`. The
package's own modules are imported at the top (they load Megatron, Ray and transformers only
when used); Megatron's optimizer and the fleet's modules (aiohttp, Ray) are imported by the
builder that needs them, so importing this file loads no Megatron. `policy_model` parses the
model's architecture once; the builders take the result.
"""

from __future__ import annotations

import copy
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from megatron_stepwise.compose.served import after_trajectory
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.data.files import open_samples, with_prompt_ids
from megatron_stepwise.data.prompts import PromptDataset
from megatron_stepwise.envs.base import EnvSpec
from megatron_stepwise.envs.custom import resolve_env_spec
from megatron_stepwise.hf.arch import GPTArch, ModelSpec, model_spec, validate_parallel
from megatron_stepwise.hf.end_of_turn import end_of_turn
from megatron_stepwise.hf.gguf import is_gguf_source
from megatron_stepwise.hf.hub import CHECKPOINT_FILES, resolve_model_dir
from megatron_stepwise.hf.presets import resolve_hf_config
from megatron_stepwise.hf.tokenizers import load_tokenizer as hf_tokenizer
from megatron_stepwise.mcore.runtime.runtime import ParallelLayout, current_layout, init_distributed
from megatron_stepwise.mcore.train.model import model_chunks_from_arch, unwrap
from megatron_stepwise.mcore.train.plugin import StepwisePlugin
from megatron_stepwise.mcore.weights.convert import export_model, import_hf
from megatron_stepwise.mcore.weights.sync import WeightSync
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig, Generator
from megatron_stepwise.rollout.fleet.session_routing import RoutingPolicy, make_policy

if TYPE_CHECKING:
    import asyncio

    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from torch.distributed import ProcessGroup
    from transformers import PreTrainedTokenizerBase

    from megatron_stepwise.gateway.agents import AgentRollout
    from megatron_stepwise.rollout.engines.protocol import SamplingParams
    from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ runtime
def init_runtime(cfg: ExperimentConfig) -> ParallelLayout:
    p = cfg.parallel
    return init_distributed(
        p.tensor,
        p.pipeline,
        p.context,
        expert_parallel=p.expert,
        seed=cfg.trainer.seed,
        timeout_minutes=p.timeout_minutes,
    )


def data_parallel() -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel size), from megatron's parallel state."""
    layout = current_layout()
    return layout.dp_rank, layout.dp


def cpu_group(cfg: ExperimentConfig, timeout: Optional[timedelta] = None) -> ProcessGroup:
    """A gloo group of all ranks for objects (rollouts, decisions) with the configured timeout
    (or `timeout`): torch's `new_group` otherwise gives gloo its own 30-minute default, whatever
    the world has."""
    return dist.new_group(backend="gloo", timeout=timeout or timedelta(minutes=cfg.parallel.timeout_minutes))


# ------------------------------------------------------------------------ tokenizer/model
def tokenizer_name(cfg: ExperimentConfig) -> str:
    """model.tokenizer, else the HF checkpoint's, else the environment's shipped vocabulary."""
    if cfg.model.tokenizer:
        return cfg.model.tokenizer
    if cfg.model.hf_checkpoint:
        return cfg.model.hf_checkpoint
    spec = env_spec(cfg)
    if spec.tokenizer is None:
        raise ValueError(f"env.name={cfg.env.name!r} ships no tokenizer: set model.tokenizer")
    return spec.tokenizer


def load_tokenizer(cfg: ExperimentConfig) -> PreTrainedTokenizerBase:
    m = cfg.model
    key = "model.tokenizer" if m.tokenizer else "model.hf_checkpoint" if m.hf_checkpoint else "env.name"
    # the key names the source in errors; model.chat_template replaces its chat template (every render)
    return hf_tokenizer(tokenizer_name(cfg), key=key, chat_template=m.chat_template)


def policy_model(cfg: ExperimentConfig, tokenizer: PreTrainedTokenizerBase) -> ModelSpec:
    """The policy's HF config dict and its architecture, parsed once here for the whole run
    (the builders below take the `GPTArch`); presets take the tokenizer's vocabulary size."""
    source, key = cfg.model.architecture()
    model = model_spec(resolve_hf_config(source, vocab_size=len(tokenizer), key=key))
    validate_parallel(model.arch, tp=cfg.parallel.tensor, pp=cfg.parallel.pipeline, tokenizer_vocab_size=len(tokenizer))
    return model


def sglang_model_path(cfg: ExperimentConfig) -> str:
    """What SGLang servers load: the checkpoint (a GGUF source as its converted directory), else the config."""
    path = cfg.model.hf_checkpoint or cfg.model.architecture()[0]
    return str(resolve_model_dir(path, key="model.hf_checkpoint")) if is_gguf_source(path) else path


def _use_te(cfg: ExperimentConfig) -> Optional[bool]:
    """model.transformer_impl: te / local, or None = TE when importable."""
    return {"auto": None, "te": True, "local": False}[cfg.model.transformer_impl]


def _build_options(cfg: ExperimentConfig) -> dict[str, Any]:
    """The model builder's keyword arguments from the model section (the local spec's options)."""
    return {
        "use_te": _use_te(cfg),
        "config_overrides": _model_overrides(cfg),
        "packed_attention": cfg.model.packed_attention,
        "fused_elementwise": cfg.model.fused_elementwise,
    }


def build_policy(cfg: ExperimentConfig, arch: GPTArch) -> list[torch.nn.Module]:
    init = None
    if cfg.model.hf_checkpoint:
        # A local directory, the cached hub snapshot, or a download of its weights; before the model is built.
        hf_dir = resolve_model_dir(cfg.model.hf_checkpoint, key="model.hf_checkpoint", files=CHECKPOINT_FILES)

        def init(chunks: list[torch.nn.Module]) -> None:
            import_hf(chunks, hf_dir)

    return model_chunks_from_arch(
        arch,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        init=init,
        **_build_options(cfg),
    )


def build_reference(
    cfg: ExperimentConfig, arch: GPTArch, policy_chunks: list[torch.nn.Module]
) -> list[torch.nn.Module]:
    """A frozen copy of the initial policy for the KL term (same sharding as the policy)."""
    state = [copy.deepcopy(unwrap(c).state_dict()) for c in policy_chunks]

    def init(chunks: list[torch.nn.Module]) -> None:
        for chunk, sd in zip(chunks, state):
            chunk.load_state_dict(sd)

    ref = model_chunks_from_arch(arch, wrap=False, init=init, **_build_options(cfg))
    for chunk in ref:
        chunk.requires_grad_(False)
        chunk.eval()
    return ref


def use_bf16(cfg: ExperimentConfig) -> bool:
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "bf16" if torch.cuda.is_available() else "fp32"
    return dtype == "bf16"


def _model_overrides(cfg: ExperimentConfig) -> dict[str, Any]:
    overrides: dict[str, Any] = {"sequence_parallel": cfg.parallel.sequence_parallel and cfg.parallel.tensor > 1}
    if cfg.algo.routing_replay:  # the routers replay the engine's experts (mcore/train/routing_replay.py)
        overrides["moe_enable_routing_replay"] = True
    if use_bf16(cfg):
        overrides["dtype"] = torch.bfloat16
    return overrides


# ------------------------------------------------------------------------ optimizer
def build_optimizer(cfg: ExperimentConfig, chunks: list[torch.nn.Module]) -> MegatronOptimizer:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # Megatron: when a run trains

    o = cfg.optim
    bf16 = use_bf16(cfg)
    config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.eps,
        clip_grad=o.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, chunks)


def build_scheduler(cfg: ExperimentConfig, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # Megatron: when a run trains

    o = cfg.optim
    steps = max(cfg.total_optimizer_steps, 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.warmup_steps else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=max(steps, o.warmup_steps + 1),
        lr_decay_style=o.scheduler,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=steps,
        wd_incr_style="constant",
    )


def build_plugin(cfg: ExperimentConfig, tokenizer: PreTrainedTokenizerBase) -> StepwisePlugin:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # temperature: score what the engine sampled
    return StepwisePlugin(
        cfg.algo.loss,
        max_tokens_per_microbatch=cfg.data.max_tokens_per_microbatch,
        pad_token_id=pad,
        temperature=cfg.rollout.sampling.temperature,
    )


# ------------------------------------------------------------------------ data
def env_spec(cfg: ExperimentConfig) -> EnvSpec:
    """The environment: env.reward_fn, else env.name (registered, or a module:Name dotted path)."""
    return resolve_env_spec(cfg.env.name, cfg.env.reward_fn)


def build_dataset(cfg: ExperimentConfig) -> PromptDataset:
    if cfg.env.dataset:  # JSONL, Parquet or a datasets directory / hub id, read lazily
        samples = open_samples(cfg.env.dataset, fields=cfg.env.fields, split=cfg.env.dataset_split)
    else:  # the environment's own samples get row<N> ids where they have none, as files do
        samples = with_prompt_ids(env_spec(cfg).dataset(**cfg.env.dataset_options))
    return PromptDataset(samples, seed=cfg.data_seed, shuffle=cfg.data.shuffle)


def eval_samples(cfg: ExperimentConfig, dataset: PromptDataset) -> list[dict[str, Any]]:
    """env.eval_dataset, else the environment's held-out set, else a fixed set of training prompts
    (the same at every evaluation)."""
    if cfg.env.eval_dataset:
        source = open_samples(
            cfg.env.eval_dataset, fields=cfg.env.fields, split=cfg.env.eval_split, key="env.eval_dataset"
        )
        return source[:]  # evaluated whole at every evaluation
    held_out = env_spec(cfg).eval_dataset
    if held_out is not None:  # the environment's own held-out set
        return with_prompt_ids(held_out(**cfg.env.dataset_options))
    return dataset.samples[: cfg.data.prompts_per_iteration]


# ------------------------------------------------------------------------ rollout
def build_fleet(cfg: ExperimentConfig, model: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> RolloutFleet:
    """The rollout engines: embedded ones load `model.hf_config`, SGLang ones the checkpoint."""
    # the fleet's modules load aiohttp (and Ray when it starts): only rank 0 builds a fleet
    from megatron_stepwise.rollout.engines.sglang import SGLangServerConfig
    from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
    from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

    r = cfg.rollout
    specs = []
    arch = model.arch
    # MoE routing replay: every engine returns the experts it routed each token to
    routed = (arch.num_layers, arch.moe_topk) if cfg.algo.routing_replay else None
    for i in range(r.num_engines):
        if r.engine == "embedded":
            specs.append(
                EngineSpec(
                    kind="local",
                    model_config=model.hf_config,
                    tokenizer=tokenizer_name(cfg),
                    seed=cfg.trainer.seed + 1000 + i,
                    torch_threads=1,
                    num_cpus=0.5,
                    routed_experts=routed,
                    prefix_cache_tokens=r.embedded_cache_tokens,
                )
            )
        elif r.sglang.servers:
            specs.append(
                EngineSpec(
                    kind="http",
                    url=r.sglang.server_url(i),
                    tp_size=r.engine_tp,
                    routed_experts=routed,
                    generate_url=r.sglang.router_url,
                )
            )
        else:
            extra = list(r.sglang.extra_args)
            if routed and "--enable-return-routed-experts" not in extra:
                extra.append("--enable-return-routed-experts")  # else SGLang returns no routed experts
            if r.colocate and "--enable-memory-saver" not in extra:
                extra.append("--enable-memory-saver")  # else release_memory_occupation frees nothing
            server = SGLangServerConfig(
                model_path=sglang_model_path(cfg),
                host=r.sglang.host,
                port=r.sglang.base_port + i,
                tp_size=r.engine_tp,
                extra_args=extra,
            )
            specs.append(
                EngineSpec(
                    kind="sglang",
                    sglang=server,
                    tp_size=r.engine_tp,
                    num_cpus=1,
                    num_gpus=r.engine_tp,
                    routed_experts=routed,
                )
            )
    return RolloutFleet(
        specs,
        max_concurrency=r.max_concurrency,
        max_retries=r.max_retries,
        max_restarts=r.max_restarts,
        request_timeout_s=r.timeout_s,
        ray_address=r.ray_address,
        partial_rollouts=cfg.async_.enabled,  # async: updates pause turns mid-way
        pause_mode=cfg.async_.pause_mode,
        engine_call_timeout_s=cfg.weight_sync.engine_timeout_s,
        # async: a turn whose start version is past the bound is dropped at the update, not re-prefilled
        max_staleness=cfg.async_.max_staleness if cfg.async_.enabled else None,
        colocate=cfg.rollout.colocate,
        routing=routing_policy(cfg),
    )


def routing_policy(cfg: ExperimentConfig) -> RoutingPolicy:
    """The router policy `rollout.routing` names (the fleet's and every agent worker's)."""
    r = cfg.rollout
    return make_policy(r.routing, r.sticky_slack, r.routing_token_budget)


def build_agent_loop(
    cfg: ExperimentConfig, fleet: Generator, tokenizer: PreTrainedTokenizerBase, served: Optional[dict] = None
) -> AgentLoop:
    """The agent loop of `cfg` driving `fleet` (any generator: a fleet, an engine, a client);
    with `env.agent`, the user's agent through the gateway in its place (same interface).
    `served`: the second models' generators by role ("teacher", "judge"), whose hooks run on
    every finished trajectory (compose/served.py)."""
    agent = _agent_loop(cfg, fleet, tokenizer)
    if served:
        agent.after_trajectory = after_trajectory(cfg, served, tokenizer)
    return agent


def _agent_loop(cfg: ExperimentConfig, fleet: Generator, tokenizer: PreTrainedTokenizerBase) -> AgentLoop:
    r = cfg.rollout
    eot = end_of_turn(tokenizer)  # from the chat template and the model's generation_config.json
    if cfg.env.own_agent:
        return build_agent_rollout(cfg, fleet, tokenizer)
    loop_cfg = AgentLoopConfig.from_section(
        r,
        n_samples_per_prompt=cfg.data.samples_per_prompt,
        sampling=r.sampling.params(r.max_new_tokens),
        append_eos=eot.append is not None,
    )
    spec = env_spec(cfg)
    options = dict(cfg.env.options)
    ids = list(eot.ids) if eot.append is None else [eot.append] + [i for i in eot.ids if i != eot.append]
    return AgentLoop(fleet, tokenizer, lambda: spec.factory(**options), loop_cfg, eos_token_ids=ids)


def build_agent_rollout(
    cfg: ExperimentConfig,
    fleet: Generator,
    tokenizer: PreTrainedTokenizerBase,
    n_samples_per_prompt: Optional[int] = None,
    sampling: Optional[SamplingParams] = None,
) -> AgentRollout:
    """`env.agent` or `env.agent_command` run per trajectory against a gateway in front of `fleet` (docs/gateway.md);
    evaluation and `rollout -n` pass their own group size and sampling."""
    from megatron_stepwise.gateway.agents import AgentRollout  # aiohttp: only where it serves
    from megatron_stepwise.gateway.command_agent import CommandAgent
    from megatron_stepwise.gateway.config import AgentConfig
    from megatron_stepwise.gateway.server import GatewaySettings

    r = cfg.rollout
    eot = end_of_turn(tokenizer)
    settings = GatewaySettings(
        sampling=sampling or r.sampling.params(r.max_new_tokens),
        max_input_length=r.max_input_length,
        agent=AgentConfig.from_section(cfg.env),
        append_eos=eot.append is not None,
    )
    ids = list(eot.ids) if eot.append is None else [eot.append] + [i for i in eot.ids if i != eot.append]
    n = n_samples_per_prompt or cfg.data.samples_per_prompt
    agent = cfg.env.agent
    if cfg.env.agent_command is not None:  # run in the sandbox; its reward printed, or env.reward_fn's
        agent = CommandAgent(settings.agent.argv(), cfg.env.reward_fn, r.max_concurrency)
    return AgentRollout(fleet, tokenizer, agent, settings, ids, n, r.max_concurrency)


# ------------------------------------------------------------------------ weights
def build_weight_sync(
    cfg: ExperimentConfig,
    fleet: Optional[RolloutFleet],
    model: ModelSpec,
    loop: Optional[asyncio.AbstractEventLoop],
) -> WeightSync:
    """Pushes the policy to the fleet after each update (weight_sync.mode: disk | tensor | distributed)."""
    w = cfg.weight_sync
    return WeightSync(
        fleet, w.mode, model.hf_config, loop=loop, bucket_mb=w.bucket_mb, sync_dir=cfg.weight_sync_dir, verify=w.verify
    )


def export_hf(
    cfg: ExperimentConfig, chunks: list[torch.nn.Module], model: ModelSpec, tokenizer: PreTrainedTokenizerBase
) -> str:
    """An HF directory (safetensors + config + tokenizer) of the final policy, under the run dir."""
    out = str(cfg.rundir.hf_export)
    export_model(chunks, out, model, tokenizer=tokenizer, overwrite=True)
    if dist.get_rank() == 0:
        log.info("exported the policy as an HF checkpoint to %s", out)
    return out
