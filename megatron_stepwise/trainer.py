"""The RL loop: rollout -> advantages -> prompt mini-batches -> Megatron steps -> weight sync.

Every training rank runs `Trainer.run()`. Global rank 0 also drives the rollout fleet: it rolls
out, then broadcasts the steps to every rank over a gloo group, so all ranks see the same
mini-batches (the plugin gives each DP rank its share of the micro-batches). One iteration:

1. draw `prompts_per_iteration` prompts and roll out `samples_per_prompt` trajectories each;
2. validate, apply trajectory-group filters, optionally prefix-merge consecutive steps;
3. outcome advantages per trajectory, broadcast to every step times its own loss mask;
4. split into prompt mini-batches (each one optimizer step), over `epochs` passes; old-policy
   log-probs are recomputed only when a mini-batch is trained after the policy moved;
5. push the new weights to the fleet, log one JSON line, checkpoint.

In this synchronous mode the fleet is idle while the trainer trains, so pushing the weights
once after the iteration's last optimizer step is what pushing after every step would give.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_stepwise.algo.advantages import compute_advantages
from megatron_stepwise.algo.batching import prompt_minibatches, validate_steps
from megatron_stepwise.algo.merge import merge_steps
from megatron_stepwise.config import ExperimentConfig
from megatron_stepwise.metrics import MetricsLogger, read_metrics, rollout_metrics, summarize_run
from megatron_stepwise.types import Step, StepBatch

log = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """What a checkpoint must hold besides model and optimizer to resume exactly."""

    iteration: int = 0
    weight_version: int = 0
    dataset: Optional[dict] = None
    async_pending: Optional[list] = None  # async mode: prompts drawn but not trained yet


class Trainer:
    def __init__(self, cfg: ExperimentConfig):
        from megatron_stepwise import components

        self.cfg = cfg
        for module in cfg.trainer.imports:
            importlib.import_module(module)
        self.layout = components.init_runtime(cfg)
        self.rank = dist.get_rank()
        self.is_driver = self.rank == 0
        # Rollouts and small decisions travel between ranks as objects on a CPU group, whatever
        # the training backend is.
        self.host_group = dist.new_group(backend="gloo")

        self.tokenizer = components.load_tokenizer(cfg)
        self.hf_config = components.model_config(cfg, self.tokenizer)
        self.chunks = components.build_policy(cfg, self.hf_config)
        self.ref_chunks = components.build_reference(cfg, self.hf_config, self.chunks) if cfg.algo.loss.kl_coef > 0 else None
        self.optimizer = components.build_optimizer(cfg, self.chunks)
        self.scheduler = components.build_scheduler(cfg, self.optimizer)
        self.plugin = components.build_plugin(cfg, self.tokenizer)
        self.dataset = components.build_dataset(cfg)
        self.state = TrainerState()
        self.checkpoints = components.Checkpoints(cfg, self)
        resumed = self.checkpoints.resume()
        if resumed is not None:
            self.state = resumed
            self.dataset.load_state_dict(resumed.dataset)

        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.fleet = self.agent = self.logger = None
        if self.is_driver:
            self.loop = asyncio.new_event_loop()
            self.fleet = components.build_fleet(cfg, self.hf_config, self.tokenizer)
            self.loop.run_until_complete(self.fleet.wait_ready())
            self.agent = components.build_agent_loop(cfg, self.fleet, self.tokenizer)
            self.logger = MetricsLogger(
                cfg.run_dir, tensorboard=cfg.logging.tensorboard, wandb_project=cfg.logging.wandb.project,
                wandb_name=cfg.logging.wandb.name or cfg.name, config=cfg.to_dict(),
                resume_iteration=self.state.iteration,
            )
        self.weight_sync = components.build_weight_sync(cfg, self.fleet, self.hf_config, self.loop)
        # The engines start from their own random init: give them the trainer's weights.
        self._sync_weights()
        self.async_driver = None
        if cfg.async_.enabled:  # rollouts overlap training; it replaces `iteration`
            from megatron_stepwise.async_driver import AsyncDriver

            self.async_driver = AsyncDriver(self)

    # ------------------------------------------------------------------------------- loop
    def run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        history = []
        if self.state.iteration >= cfg.trainer.iterations and self.is_driver:
            log.info("nothing to do: the checkpoint in %s is at iteration %d = trainer.iterations "
                     "(raise trainer.iterations to continue, or checkpoint.resume=never to start over)",
                     cfg.checkpoint_dir, self.state.iteration)
        progress = self._progress()
        try:
            while self.state.iteration < cfg.trainer.iterations:
                evaluation = self._maybe_evaluate()
                metrics = self.iteration()
                metrics.update(evaluation)
                every = cfg.checkpoint.every
                if (every and self.state.iteration % every == 0) or self.state.iteration == cfg.trainer.iterations:
                    t = time.perf_counter()
                    self.checkpoints.save()
                    metrics["time/checkpoint"] = time.perf_counter() - t
                history.append(metrics)
                if self.is_driver:
                    self.logger.log(self.state.iteration - 1, metrics)
                    if progress is not None:
                        progress.update(1)
                        progress.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
            if cfg.checkpoint.export_hf:
                self.checkpoints.export_hf()
        finally:
            if progress is not None:
                progress.close()
        if history and self.is_driver:
            log.info("%s", summarize_run(read_metrics(cfg.run_dir), cfg.run_dir))
        return history

    def iteration(self) -> dict[str, Any]:
        if self.async_driver is not None:
            return self.async_driver.iteration()
        cfg = self.cfg
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        steps, rollout_info = self._rollout()
        times["time/rollout"] = time.perf_counter() - t0

        t = time.perf_counter()
        validate_steps(steps, vocab_size=self.hf_config["vocab_size"])
        metrics: dict[str, Any] = dict(rollout_info)
        metrics.update(rollout_metrics(steps))
        steps, filter_metrics = self._filter_groups(steps)
        metrics.update(filter_metrics)
        metrics["batch/rows_before_merge"] = len(steps)
        metrics["batch/tokens_before_merge"] = sum(s.num_tokens for s in steps)
        if cfg.data.merge_steps:
            steps, stats = merge_steps(steps)
            metrics["batch/rows_after_merge"] = stats.rows_after
            metrics["batch/tokens_after_merge"] = stats.tokens_after
        adv_metrics: dict[str, Any] = {}
        advantages = compute_advantages(
            steps, cfg.algo.estimator, metrics=adv_metrics, **cfg.algo.estimator_options
        )
        metrics.update({f"advantages/{k}": v for k, v in adv_metrics.items()})
        batches = self._minibatches(steps, advantages)
        times["time/prepare"] = time.perf_counter() - t

        t = time.perf_counter()
        self._old_and_reference_logprobs(batches)
        times["time/old_logprobs"] = time.perf_counter() - t

        t = time.perf_counter()
        train_metrics = []
        for _ in range(cfg.data.epochs):
            for batch in batches:
                train_metrics.append(self.plugin.train_minibatch(self.chunks, self.optimizer, batch, lr_scheduler=self.scheduler))
        times["time/train"] = time.perf_counter() - t
        metrics.update(_mean_metrics(train_metrics, prefix="train/"))
        metrics["train/optimizer_steps"] = len(train_metrics)
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        trained_tokens = sum(int(b.lengths.sum()) for b in batches) * cfg.data.epochs
        metrics["perf/train_tokens_per_s"] = trained_tokens / max(times["time/train"], 1e-9)

        self.state.iteration += 1
        self.state.weight_version += 1
        t = time.perf_counter()
        metrics.update(self._sync_weights())
        times["time/weight_sync"] = time.perf_counter() - t
        times["time/iteration"] = time.perf_counter() - t0
        metrics.update(times)
        metrics["weight_version"] = self.state.weight_version
        return metrics

    # ---------------------------------------------------------------------------- pieces
    def _rollout(self) -> tuple[list[Step], dict[str, Any]]:
        """Rank 0 rolls out (with dynamic sampling if enabled); every rank gets the steps."""
        return self.from_driver(self._driver_rollout, "rollout")

    def from_driver(self, produce: Callable[[], Any], what: str) -> Any:
        """Run `produce` on rank 0 and hand its result to every rank.

        A rank-0 error is raised on every rank (none is left waiting in a collective). Rank 0's
        data position travels with the result: only rank 0 draws prompts, and every rank's
        checkpoint must hold the same position.
        """
        payload: list[Any] = [None]
        error: Optional[BaseException] = None
        if self.is_driver:
            try:
                payload[0] = ("ok", produce(), self.dataset.state_dict())
            except Exception as e:  # every rank must leave the broadcast, then all raise
                # As text: the exception itself may not pickle (Ray and HTTP client errors hold
                # locks and sockets), and a failed pickle would leave the other ranks waiting.
                error, payload[0] = e, ("error", f"{type(e).__name__}: {e}", None)
        dist.broadcast_object_list(payload, src=0, group=self.host_group)
        kind, result, dataset_state = payload[0]
        if kind == "error":
            raise RuntimeError(f"{what} failed on rank 0 at iteration {self.state.iteration}: {result}") from error
        self.dataset.load_state_dict(dataset_state)
        return result

    def _driver_rollout(self) -> tuple[list[Step], dict[str, Any]]:
        cfg = self.cfg
        t = time.perf_counter()
        samples = self.dataset.next(cfg.data.prompts_per_iteration)
        with self._rollout_progress(len(samples)) as done:
            steps = self.loop.run_until_complete(self.agent.rollout(samples, seed=self._rollout_seed(0), on_trajectory_done=done))
        rounds = 1
        if cfg.algo.filters.dynamic_sampling:
            # Keep rolling out fresh prompts until enough groups carry a learning signal.
            while _count_informative_groups(steps) < cfg.data.prompts_per_iteration and rounds < cfg.algo.filters.max_sampling_rounds:
                more = self.dataset.next(cfg.data.prompts_per_iteration)
                seen = {s.trajectory_id.prompt_id for s in steps}
                more = [m for m in more if m["prompt_id"] not in seen]
                if more:
                    steps = steps + self.loop.run_until_complete(self.agent.rollout(more, seed=self._rollout_seed(rounds)))
                rounds += 1
        elapsed = time.perf_counter() - t
        generated = sum(int(s.response_ids.numel()) for s in steps)
        info = {"rollout/sampling_rounds": rounds, "perf/rollout_tokens_per_s": generated / max(elapsed, 1e-9)}
        info.update({f"fleet/{k}": v for k, v in self.fleet.metrics().items() if isinstance(v, (int, float))})
        return steps, info

    def _maybe_evaluate(self) -> dict[str, Any]:
        """Reward of the current policy on the eval prompts (rank 0 only; no training)."""
        every = self.cfg.trainer.eval_every
        if not (every and self.is_driver and self.state.iteration % every == 0):
            return {}
        from megatron_stepwise.components import eval_samples

        t = time.perf_counter()
        steps = self.loop.run_until_complete(
            self.agent.rollout(eval_samples(self.cfg, self.dataset), seed=self._rollout_seed(-1))
        )
        out = {f"eval/{k}": v for k, v in rollout_metrics(steps).items() if k.startswith(("reward/", "rollout/turns"))}
        out["time/eval"] = time.perf_counter() - t
        return out

    def _rollout_seed(self, round_: int) -> int:
        """Sampling seeds depend only on (seed, iteration, round): a resumed run samples the same."""
        return (self.cfg.trainer.seed * 1_000_003 + self.state.iteration) * 31 + round_

    def _filter_groups(self, steps: list[Step]) -> tuple[list[Step], dict[str, Any]]:
        """Trajectory-group filters; keeps whole prompt groups and a multiple of the mini-batch size."""
        cfg = self.cfg
        groups = _group_rows(steps)
        keep = list(groups)
        if cfg.algo.filters.zero_variance or cfg.algo.filters.dynamic_sampling:
            keep = [g for g in keep if _group_has_variance(steps, groups[g])]
        target = cfg.data.prompts_per_iteration if cfg.algo.filters.dynamic_sampling else len(keep)
        usable = min(len(keep), target)
        usable -= usable % cfg.data.prompts_per_minibatch
        metrics = {
            "filter/groups_in": len(groups),
            "filter/groups_dropped_zero_variance": len(groups) - len(keep),
            "filter/groups_trained": usable,
        }
        if usable == 0:
            if cfg.algo.filters.zero_variance or cfg.algo.filters.dynamic_sampling:
                log.warning("iteration %d: no prompt group with reward variance; no optimizer step", self.state.iteration)
            return [], metrics
        kept = set(keep[:usable])
        return [s for s in steps if s.trajectory_id.prompt_id in kept], metrics

    def _minibatches(self, steps: list[Step], advantages: list[torch.Tensor]) -> list[StepBatch]:
        from megatron_stepwise.megatron.packing import set_response_field

        if not steps:
            return []
        adv_of = {id(s): a for s, a in zip(steps, advantages)}
        batches = []
        for mb in prompt_minibatches(steps, self.cfg.data.prompts_per_minibatch):
            if not any(s.num_trainable for s in mb):
                continue  # e.g. every trajectory hit the context limit on its first prompt
            batch = StepBatch.from_steps(mb)
            set_response_field(batch, "advantages", [adv_of[id(s)] for s in mb])
            batches.append(batch)
        return batches

    def _old_and_reference_logprobs(self, batches: list[StepBatch]) -> None:
        """Old-policy log-probs are needed once the policy moves inside the iteration."""
        needs_old = len(batches) * self.cfg.data.epochs > 1
        for batch in batches:
            if needs_old:
                batch.token_fields["old_logprobs"] = self.plugin.compute_logprobs_flat(self.chunks, batch)
            if self.ref_chunks is not None:
                batch.token_fields["ref_logprobs"] = self.plugin.compute_logprobs_flat(self.ref_chunks, batch)

    def _sync_weights(self) -> dict[str, float]:
        """Collective: every rank converts its shard; rank 0 pushes to the fleet."""
        return self.weight_sync.push(self.chunks, self.state.weight_version)

    @contextlib.contextmanager
    def _rollout_progress(self, num_prompts: int):
        """A per-trajectory progress bar under the iterations bar (when logging.progress)."""
        if not self.cfg.logging.progress:
            yield None
            return
        from tqdm import tqdm

        total = num_prompts * self.cfg.data.samples_per_prompt
        with tqdm(total=total, desc="rollout", unit="traj", leave=False, position=1) as bar:
            yield lambda _steps: bar.update(1)

    def _progress(self):
        if not (self.is_driver and self.cfg.logging.progress):
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.trainer.iterations, initial=self.state.iteration, desc="iterations", unit="it")

    def close(self) -> None:
        if getattr(self, "async_driver", None) is not None:
            self.async_driver.close()
        self.weight_sync.close()
        if self.is_driver:
            if self.fleet is not None:
                self.loop.run_until_complete(self.fleet.shutdown())
            if self.agent is not None:
                self.agent.close()
            if self.logger is not None:
                self.logger.close()
            if self.loop is not None:
                self.loop.close()


def _group_rows(steps: list[Step]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(steps):
        if not s.is_padding:
            groups.setdefault(s.trajectory_id.prompt_id, []).append(i)
    return groups


def _group_has_variance(steps: list[Step], rows: list[int]) -> bool:
    rewards = {steps[i].reward for i in rows if steps[i].is_last_step}
    return len(rewards) > 1


def _count_informative_groups(steps: list[Step]) -> int:
    groups = _group_rows(steps)
    return sum(_group_has_variance(steps, rows) for rows in groups.values())


def _mean_metrics(items: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Average each metric over the iteration's optimizer steps (finite values only)."""
    out: dict[str, float] = {}
    for key in {k for m in items for k in m}:
        values = [m[key] for m in items if key in m and isinstance(m[key], (int, float)) and math.isfinite(m[key])]
        if values:
            out[prefix + key] = sum(values) / len(values)
    return out
