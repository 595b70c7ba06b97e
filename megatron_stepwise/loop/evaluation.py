"""Evaluation: the policy's reward, unbiased pass@k and maj@k on named eval sets.

The trainer evaluates every `trainer.eval_every` iterations (and the final policy with
`eval.at_end`); `megatron-stepwise eval` does the same alone, on a checkpoint or an HF directory.
An `Evaluator` owns an agent loop of its own, with the `eval` section's sampling settings
(temperature, samples per prompt), so evaluation never changes how training samples. Sets: the
default one (`env.eval_dataset`, else a fixed set of training prompts) logs `eval/<metric>`,
each of `eval.sets` logs `eval/<name>/<metric>`. A trajectory's answer for maj@k is the
environment's `info["answer"]` at its last turn, else the text of its last reply.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from megatron_stepwise.algo.groups import RolloutGroup
from megatron_stepwise.compose import components
from megatron_stepwise.compose.served import after_trajectory
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.data.files import open_samples
from megatron_stepwise.hf.hub import CHECKPOINT_FILES, resolve_model_dir
from megatron_stepwise.metrics.core import group_outcomes, majority_at_k, pass_ks, rollout_metrics
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.steps import Step

MAJ_MAX_SUBSETS = 20000  # maj@k enumerates k-subsets; larger k are left out


@dataclass
class EvalSet:
    name: str
    samples: list[dict[str, Any]]
    prefix: str  # metric key prefix: "eval/" for the default set, "eval/<name>/" for named ones


def eval_sets(cfg: ExperimentConfig, dataset) -> list[EvalSet]:
    """The default set and every named one of `eval.sets`, loaded once."""
    sets = [EvalSet("default", list(components.eval_samples(cfg, dataset)), "eval/")]
    for name, path in cfg.eval_.sets.items():
        samples = open_samples(path, fields=cfg.env.fields, split=cfg.env.eval_split, key=f"eval.sets.{name}")
        sets.append(EvalSet(name, samples[:], f"eval/{name}/"))
    return sets


def answer_of(step: Step, tokenizer) -> Optional[str]:
    """What a trajectory answered (its last step): the env's info["answer"], else its last reply."""
    info = step.metadata.get("env_info") or {}
    if info.get("answer") is not None:
        return str(info["answer"])
    text = tokenizer.decode(step.response_ids.tolist(), skip_special_tokens=True).strip()
    return text or None


def eval_metrics(groups: Sequence[RolloutGroup], tokenizer, success_threshold: float) -> dict[str, float]:
    """Reward, pass@k, maj@k, turns and stop reasons of one eval rollout's groups (keys without a prefix)."""
    base = rollout_metrics(groups, success_threshold=success_threshold)
    out = {
        k: v
        for k, v in base.items()
        if k.startswith(("reward/", "rollout/turns", "stop_reason/")) or k == "rollout/invalid_share"
    }
    outcomes = list(group_outcomes(groups).values())  # valid trajectories only
    out["prompts"] = float(len(outcomes))
    if not outcomes:
        return out
    n = min(len(g) for g in outcomes)
    for k in pass_ks(n):
        if math.comb(n, k) > MAJ_MAX_SUBSETS:
            continue
        out[f"reward/maj@{k}"] = sum(
            majority_at_k(
                [answer_of(s, tokenizer) for s in g], [s.reward >= success_threshold for s in g], k, MAJ_MAX_SUBSETS
            )
            for g in outcomes
        ) / len(outcomes)
    return out


def eval_agent_loop(cfg: ExperimentConfig, generator, tokenizer, judge=None):
    """An agent loop with the eval section's sampling: its temperature and samples per prompt;
    with `judge` (the judge model's generator) its verdicts are the rewards, as in training."""
    agent = _eval_agent_loop(cfg, generator, tokenizer)
    if judge is not None:
        agent.after_trajectory = after_trajectory(cfg, {"judge": judge}, tokenizer, training=False)
    return agent


def _eval_agent_loop(cfg: ExperimentConfig, generator, tokenizer):
    r, e = cfg.rollout, cfg.eval_
    sampling = r.sampling.params(r.max_new_tokens)
    if e.temperature is not None:
        sampling.temperature = e.temperature
    n = e.samples_per_prompt or cfg.data.samples_per_prompt
    if cfg.env.own_agent:  # the user's agent through a gateway of its own
        return components.build_agent_rollout(cfg, generator, tokenizer, n_samples_per_prompt=n, sampling=sampling)
    loop_cfg = AgentLoopConfig.from_section(r, n_samples_per_prompt=n, sampling=sampling)
    spec = components.env_spec(cfg)
    options = dict(cfg.env.options)
    return AgentLoop(generator, tokenizer, lambda: spec.factory(**options), loop_cfg)


class Evaluator:
    """Evaluates the policy the generator serves on every eval set (rank 0; the caller's event loop)."""

    def __init__(self, cfg: ExperimentConfig, generator, tokenizer, dataset, judge=None):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.sets = eval_sets(cfg, dataset)
        self.agent = eval_agent_loop(cfg, generator, tokenizer, judge)
        self.outcomes: dict[str, dict[str, list[float]]] = {}  # last evaluation: set -> prompt -> rewards

    async def evaluate(self, seed: int) -> dict[str, float]:
        """`eval/...` metrics of every set; the default set's keys are `eval/<metric>`."""
        out: dict[str, float] = {}
        start = time.perf_counter()
        for s in self.sets:
            # Its own request ids: async training may have groups of the same prompts in flight.
            groups = await self.agent.rollout_groups(s.samples, seed=seed, request_tag=s.prefix)
            self.outcomes[s.name] = {pid: [st.reward for st in g] for pid, g in group_outcomes(groups).items()}
            out.update(
                {
                    s.prefix + k: v
                    for k, v in eval_metrics(groups, self.tokenizer, self.cfg.eval_.success_threshold).items()
                }
            )
        out["time/eval"] = time.perf_counter() - start
        return out

    def close(self) -> None:
        self.agent.close()


def standalone_engine(cfg: ExperimentConfig, tokenizer, hf_config: dict, weights: Optional[str]):
    """One embedded engine in this process serving `weights` (an HF safetensors directory; None =
    model.hf_checkpoint, else the seeded random init): for `eval` and `rollout` without a fleet."""
    if cfg.rollout.engine != "embedded":
        raise ValueError(
            "rollout.engine=sglang: evaluating without training runs the embedded engine in this "
            "process; pass rollout.engine=embedded (a small model, on CPU) or evaluate during "
            "training (trainer.eval_every)"
        )
    if weights is None and cfg.model.hf_checkpoint:
        weights = str(resolve_model_dir(cfg.model.hf_checkpoint, key="model.hf_checkpoint", files=CHECKPOINT_FILES))
    return LocalEngine(
        hf_config,
        weights=weights,
        tokenizer=tokenizer,
        seed=cfg.trainer.seed + 1000,
        prefix_cache_tokens=cfg.rollout.embedded_cache_tokens,
    )
