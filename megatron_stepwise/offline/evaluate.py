"""Evaluate a policy without training (`megatron-stepwise eval`): an HF directory, a Megatron
checkpoint (loaded in this process at TP1/PP1 and exported as an HF directory) or the initial
policy, served by one embedded engine and scored on every eval set (loop/evaluation.py) with the
seeds training's evaluation of that iteration used. cli/eval.py parses the command and calls
`evaluate` and `write_result`.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command's modules load when it runs (fast --help)
    from transformers import PreTrainedTokenizerBase

    from megatron_stepwise.config.schema import ExperimentConfig
    from megatron_stepwise.hf.arch import ModelSpec


def single_process_layout() -> list[str]:
    """The overrides that make a config run in this one process (one rank, one engine)."""
    return [
        "parallel.tensor=1",
        "parallel.pipeline=1",
        "parallel.context=1",
        "parallel.expert=1",
        "parallel.sequence_parallel=false",
        "parallel.use_distributed_optimizer=false",
        "launch.nnodes=1",
        "launch.nproc_per_node=1",
        "rollout.num_engines=1",
    ]


def evaluate(cfg, *, checkpoint: str | None = None, hf: str | None = None) -> tuple[dict, str, int, dict]:
    """(metrics, a name for the policy evaluated, its iteration, every set's rewards by prompt). Sampling seeds are those of training's
    evaluation at the checkpoint's iteration (0 for an HF directory or the initial policy)."""
    import asyncio

    from megatron_stepwise.compose import components
    from megatron_stepwise.compose.served import standalone_judge
    from megatron_stepwise.loop.evaluation import Evaluator, standalone_engine
    from megatron_stepwise.loop.sources import rollout_seed

    if hf is not None and not os.path.isdir(hf):
        raise FileNotFoundError(f"--hf {hf}: no such directory")
    if checkpoint is None and hf is None and os.path.isdir(cfg.checkpoint_dir) and _has_checkpoint(cfg.checkpoint_dir):
        checkpoint = cfg.checkpoint_dir
    tokenizer = components.load_tokenizer(cfg)
    model = components.policy_model(cfg, tokenizer)  # the architecture, parsed once for the command
    weights, source, iteration = hf, os.path.basename(os.path.normpath(hf)) if hf else "initial", 0
    if checkpoint is not None:
        weights, source, iteration = checkpoint_as_hf(cfg, checkpoint, model, tokenizer)
    engine = standalone_engine(cfg, tokenizer, model.hf_config, weights)
    judge = standalone_judge(cfg)  # env.judge's rewards, as in training's evaluation
    evaluator = Evaluator(cfg, engine, tokenizer, components.build_dataset(cfg), judge)
    try:
        # the seeds training's evaluation of this iteration used: the same trajectories, same metrics
        metrics = asyncio.run(evaluator.evaluate(seed=rollout_seed(cfg.trainer.seed, iteration, -1)))
    finally:
        evaluator.close()
    return metrics, source, iteration, evaluator.outcomes


def _has_checkpoint(directory: str) -> bool:
    return any(name.startswith("iter_") for name in os.listdir(directory))


def checkpoint_as_hf(
    cfg: ExperimentConfig, checkpoint: str, model: ModelSpec, tokenizer: PreTrainedTokenizerBase
) -> tuple[str, str, int]:
    """Load a Megatron checkpoint at TP1/PP1 in this process and write it as an HF directory."""
    import torch.distributed as dist

    from megatron_stepwise.compose import components
    from megatron_stepwise.mcore.runtime.runtime import free_port
    from megatron_stepwise.mcore.weights.convert import export_model
    from megatron_stepwise.mcore.weights.dist_checkpoint import load_checkpoint
    from megatron_stepwise.rundir.paths import iteration_name

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    components.init_runtime(cfg)
    try:
        chunks = components.build_policy(cfg, model.arch)
        latest = os.path.basename(os.path.normpath(checkpoint)).startswith("iter_")
        state = load_checkpoint(
            chunks,
            ckpt_dir=None if latest else checkpoint,
            path=checkpoint if latest else None,
            load_optimizer=False,
            load_rng=False,
        )
        if state is None:
            raise FileNotFoundError(f"--checkpoint {checkpoint}: no checkpoint there")
        out = str(cfg.rundir.eval_export(state["iteration"]))
        source = iteration_name(state["iteration"])
        export_model(chunks, out, model, tokenizer=tokenizer, overwrite=True)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return out, source, int(state["iteration"])


def write_result(out: str, metrics: dict, source: str, iteration: int, outcomes: dict) -> None:
    """The metrics and every set's rewards by prompt as JSON at `out` (its directory made)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {"source": source, "iteration": iteration, **metrics, "outcomes": outcomes}, f, indent=1, sort_keys=True
        )
