"""The run's second models (teacher, judge): their engine groups and the hooks that use them.

Each is a `RolloutFleet` of its own, built from its config section (`teacher:`, `judge:`), on
rank 0 beside the policy's fleet, never sent a weight push and shut down with it. The agent
loop (in the driver, or in each agent worker through engine views of these fleets) runs the
judge and the teacher on every finished trajectory (rollout/agent/hooks.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from megatron_stepwise.errors import UserError
from megatron_stepwise.hf.hub import CHECKPOINT_FILES, resolve_model_dir
from megatron_stepwise.hf.tokenizers import load_tokenizer
from megatron_stepwise.rollout.agent.hooks import AfterTrajectory
from megatron_stepwise.rollout.judge import Judge
from megatron_stepwise.rollout.served_model import ServedModelConfig
from megatron_stepwise.rollout.teacher import TeacherScorer

if TYPE_CHECKING:
    from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

log = logging.getLogger(__name__)

ROLES = ("teacher", "judge")


def model_dir(section: ServedModelConfig, key: str) -> str:
    """The served model's HF directory (a GGUF source converted once, a hub id looked up or fetched)."""
    return str(resolve_model_dir(section.hf_checkpoint, key=f"{key}.hf_checkpoint", files=CHECKPOINT_FILES))


def tokenizer_of(section: ServedModelConfig, key: str):
    source = section.tokenizer or section.hf_checkpoint
    return load_tokenizer(source, key=f"{key}.tokenizer" if section.tokenizer else f"{key}.hf_checkpoint")


def check_same_vocabulary(policy_tokenizer, teacher_tokenizer, key: str = "teacher") -> None:
    """Token-level scores compare the two models token by token: refuse another vocabulary by name."""
    mine, theirs = policy_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if mine == theirs:
        return
    differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
    raise UserError(
        f"{key}.hf_checkpoint: the teacher's tokenizer ({len(theirs)} entries) differs from the policy's "
        f"({len(mine)}), e.g. {differ}; its log-probs would score other tokens than the policy sampled "
        f"(set {key}.tokenizer, or pick a teacher of the policy's family)"
    )


def build_served_fleet(cfg, section: ServedModelConfig, key: str) -> RolloutFleet:
    """The engine group of one served model (embedded CPU engines or SGLang servers)."""
    from megatron_stepwise.rollout.engines.sglang import SGLangServerConfig
    from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
    from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

    path, specs = model_dir(section, key), []
    tokenizer = section.tokenizer or path
    for i in range(section.num_engines):
        if section.engine == "embedded":
            seed = cfg.trainer.seed + 2000 + i
            spec = EngineSpec(
                "local", path, path, tokenizer, seed, torch_threads=1, num_cpus=0.5, prefix_cache_tokens=4096
            )
        elif section.sglang.servers:
            spec = EngineSpec(kind="http", url=section.sglang.server_url(i), tp_size=section.engine_tp)
        else:
            port, extra = section.sglang.base_port + i, list(section.sglang.extra_args)
            server = SGLangServerConfig(path, section.sglang.host, port, tp_size=section.engine_tp, extra_args=extra)
            spec = EngineSpec(
                kind="sglang", sglang=server, tp_size=section.engine_tp, num_cpus=1, num_gpus=section.engine_tp
            )
        specs.append(spec)
    return RolloutFleet(
        specs,
        max_concurrency=section.max_concurrency,
        max_retries=cfg.rollout.max_retries,
        max_restarts=cfg.rollout.max_restarts,
        request_timeout_s=section.timeout_s,
        ray_address=cfg.rollout.ray_address,
        engine_call_timeout_s=cfg.weight_sync.engine_timeout_s,
    )


def standalone_judge(cfg) -> Optional[Any]:
    """The judge's engine in this process, for `eval` without a fleet (None: no judge): embedded,
    or a client of the first of `judge.sglang.servers`."""
    section = cfg.judge
    if not (section.enabled and cfg.env.judge.enabled):
        return None
    if section.engine == "sglang":
        if not section.sglang.servers:
            raise UserError(
                "judge.engine=sglang: evaluating without training runs no fleet, so it cannot launch the judge's "
                "servers; list running ones in judge.sglang.servers, or use judge.engine=embedded"
            )
        from megatron_stepwise.rollout.engines.sglang import SGLangClient

        return SGLangClient(section.sglang.server_url(0), tp_size=section.engine_tp)
    from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine

    path = model_dir(section, "judge")
    return LocalEngine(path, weights=path, tokenizer=tokenizer_of(section, "judge"), seed=cfg.trainer.seed + 2000)


@dataclass
class ServedModels:
    """Rank 0's served second models, by role ("teacher", "judge"); absent roles are not configured."""

    fleets: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, cfg, policy_tokenizer) -> "ServedModels":
        """Every configured role's fleet, its engines starting (`wait_ready` waits for them)."""
        out = cls()
        if cfg.teacher.enabled:
            check_same_vocabulary(policy_tokenizer, tokenizer_of(cfg.teacher, "teacher"))
        for role in ROLES:
            section = getattr(cfg, role)
            if section.enabled:
                out.fleets[role] = build_served_fleet(cfg, section, role)
                log.info(
                    "%s: %d %s engine(s) serving %s", role, section.num_engines, section.engine, section.hf_checkpoint
                )
        return out

    async def wait_ready(self, *others) -> None:
        """Every served fleet (and `others`, e.g. the policy's fleet) answers its health checks."""
        await asyncio.gather(*(fleet.wait_ready() for fleet in [*others, *self.fleets.values()]))

    def tables(self) -> dict[str, list]:
        """Each fleet's engine table, for agent workers' own views (`EngineView.refresh`)."""
        return {role: fleet.engine_table() for role, fleet in self.fleets.items()}

    def report_dead(self, deaths: dict[str, list[tuple[int, int]]]) -> None:
        for role, dead in deaths.items():
            for index, incarnation in dead:
                self.fleets[role].report_dead(index, incarnation)

    async def shutdown(self) -> None:
        for fleet in self.fleets.values():
            await fleet.shutdown()


def after_trajectory(cfg, generators: dict[str, Any], policy_tokenizer: Any, training: bool = True) -> AfterTrajectory:
    """The hooks a rollout runs on each finished trajectory: the judge's verdict (`env.judge`,
    with the judge model's generator), then, in training rollouts, the teacher's scores (`teacher:`)."""
    hooks = []
    if "judge" in generators:
        judge_tokenizer = tokenizer_of(cfg.judge, "judge")
        hooks.append(Judge(generators["judge"], judge_tokenizer, cfg.env.judge, policy_tokenizer))
    if "teacher" in generators and training:
        hooks.append(TeacherScorer(generators["teacher"], cfg.rollout.sampling.temperature))
    return AfterTrajectory(hooks)
