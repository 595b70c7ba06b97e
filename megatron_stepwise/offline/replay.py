"""Offline replay: iteration K's optimizer steps again, from its dump and the checkpoint before it.

No engines and no environments: every rank builds the policy, optimizer and scheduler at the
(possibly new) layout, loads `checkpoints/iter_K` (saved after K iterations, i.e. before
iteration K ran), rebuilds K's mini-batches from `rollouts/iter_K.parquet` and trains them
through the trainer's own `TrainingRound` (old-policy and reference log-probs first when the
trainer computed them, then one optimizer step per mini-batch and epoch). The loss is
normalised once per mini-batch, so the same steps give the same update at any layout:
bit-identical at the layout of the run, equal to fp32 rounding at another. Rank 0 reports each step's loss and grad norm
beside the recorded ones, and the largest parameter difference to `checkpoints/iter_K+1`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_stepwise.compose import components
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.hf.arch import GPTArch
from megatron_stepwise.loop.training_round import TrainingRound
from megatron_stepwise.mcore.train.model import unwrap
from megatron_stepwise.mcore.weights.checkpoint_errors import CheckpointError
from megatron_stepwise.mcore.weights.dist_checkpoint import load_checkpoint
from megatron_stepwise.rundir.dump_trust import load_tokenizer
from megatron_stepwise.rundir.dumps import Dump

log = logging.getLogger(__name__)

COMPARED = ("loss", "grad_norm", "entropy", "pg_loss")


def checkpoint_path(cfg, iteration: int) -> Path:
    return cfg.rundir.checkpoint(iteration)


def replay(cfg, dump: Dump, *, trusted: bool = False) -> dict[str, Any]:
    """Collective over every rank of `cfg`'s layout; returns the report (the same on every rank).

    The tokenizer loads without running its own code, and without a download unless `trusted`
    (rundir/dump_trust.py)."""
    k = dump.iteration
    components.init_runtime(cfg)
    key = "model.tokenizer" if cfg.model.tokenizer else "model.hf_checkpoint" if cfg.model.hf_checkpoint else "env.name"
    tokenizer = load_tokenizer(components.tokenizer_name(cfg), trusted=trusted, key=key)
    arch = components.policy_model(cfg, tokenizer).arch  # parsed once for the replay
    chunks = components.build_policy(cfg, arch)
    ref = components.build_reference(cfg, arch, chunks) if cfg.algo.loss.kl_coef > 0 else None
    optimizer = components.build_optimizer(cfg, chunks)
    scheduler = components.build_scheduler(cfg, optimizer)
    plugin = components.build_plugin(cfg, tokenizer)
    start = checkpoint_path(cfg, k)
    if start.is_dir():
        load_checkpoint(chunks, optimizer, scheduler, path=start)
    elif k != 0:  # iteration 0 starts from the seeded initialisation the trainer built
        raise CheckpointError(
            f"replay of iteration {k} needs the checkpoint saved before it, {start}, which does not "
            f"exist (train with checkpoint.every dividing {k} and a checkpoint.keep_last that keeps it)"
        )
    dp_rank, _ = components.data_parallel()
    shards = [plugin.plan_shards(chunks, batch, only=dp_rank)[0] for batch in dump.minibatches]
    # The rounds the trainer made: one per iteration synchronously, one per mini-batch async.
    rounds = [[s] for s in shards] if cfg.async_.enabled else [shards]
    # the trainer's own round; no divergence check, so a diverged step is reported, not raised
    training = TrainingRound(plugin, chunks, optimizer, scheduler, epochs=cfg.data.epochs, ref_chunks=ref)
    steps = [metrics for round_ in rounds for metrics in training.run(round_)]
    recorded = dump.meta.get("train_metrics") or []
    report: dict[str, Any] = {
        "iteration": k,
        "layout": _layout_name(cfg),
        "recorded_layout": _layout_name_of(dump.meta.get("config") or {}),
        "steps": [
            {**{f"{key}": m.get(key) for key in COMPARED}, **{f"recorded_{key}": r.get(key) for key in COMPARED}}
            for m, r in zip(steps, recorded + [{}] * len(steps))
        ],
    }
    report["max_abs_diff"] = {
        key: _max_diff([s[key] for s in report["steps"]], [s[f"recorded_{key}"] for s in report["steps"]])
        for key in COMPARED
    }
    after = checkpoint_path(cfg, k + 1)
    report["params_checkpoint"] = str(after) if after.is_dir() else None
    report["params_max_abs_diff"] = _param_diff(cfg, arch, chunks, after) if after.is_dir() else None
    return report


def _layout_name(cfg) -> str:
    p = cfg.parallel
    world = dist.get_world_size()
    return f"TP{p.tensor} PP{p.pipeline} CP{p.context} DP{p.data_parallel_size(world)}"


def _layout_name_of(config: dict) -> str:
    p, launch = config.get("parallel") or {}, config.get("launch") or {}
    world = int(launch.get("nnodes", 1)) * int(launch.get("nproc_per_node", 1))
    tp, pp, cp = (int(p.get(k, 1)) for k in ("tensor", "pipeline", "context"))
    return f"TP{tp} PP{pp} CP{cp} DP{world // max(tp * pp * cp, 1)}"


def _max_diff(got: list, want: list) -> Optional[float]:
    pairs = [(a, b) for a, b in zip(got, want) if a is not None and b is not None]
    if not pairs:
        return None
    return max(abs(a - b) if not (math.isnan(a) and math.isnan(b)) else 0.0 for a, b in pairs)


def _param_diff(cfg: ExperimentConfig, arch: GPTArch, chunks: list[torch.nn.Module], path: Path) -> float:
    """Largest |replayed - saved| parameter over every rank, the saved ones loaded at this layout."""
    saved = components.build_policy(cfg, arch)
    load_checkpoint(saved, path=path, load_optimizer=False, load_rng=False)
    worst = torch.zeros(1, dtype=torch.float64)
    for mine, theirs in zip(chunks, saved):
        theirs_params = dict(unwrap(theirs).named_parameters())
        for name, p in unwrap(mine).named_parameters():
            diff = (p.detach().double().cpu() - theirs_params[name].detach().double().cpu()).abs()
            if diff.numel():
                worst = torch.maximum(worst, diff.max().reshape(1))
    if dist.get_world_size() > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)
