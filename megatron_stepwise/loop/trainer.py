"""The RL loop: one training loop fed by a mini-batch source.

Every training rank runs `Trainer.run()`; global rank 0 also drives the rollout fleet. Each
iteration is `source.rounds_per_iteration` rounds of: take prompt mini-batches from the source,
prepare them and hand each rank its shard, compute old / reference log-probs when needed, one
optimizer step per mini-batch and epoch, push the new weights to the fleet. Then one JSON line
of metrics, and rollout dumps and checkpoints at their intervals.

The rounds step by step, sync vs async sources and colocation: docs/architecture.md,
'The training loop's rounds'.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from tqdm import tqdm

from megatron_stepwise.algo.distill import distill_means
from megatron_stepwise.algo.prepare import add_counts
from megatron_stepwise.compose import components
from megatron_stepwise.compose.placement import log_placement
from megatron_stepwise.compose.served import ServedModels
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.loop.async_source import AsyncRollouts
from megatron_stepwise.loop.checkpointer import Checkpointer, TrainerState
from megatron_stepwise.loop.colocate import Colocation
from megatron_stepwise.loop.divergence import check_finite
from megatron_stepwise.loop.evaluation import Evaluator
from megatron_stepwise.loop.handoff import Handoff
from megatron_stepwise.loop.sources import Driver, SyncRollouts, rollout_seed
from megatron_stepwise.loop.training_round import TrainingRound
from megatron_stepwise.metrics.collapse import EntropyWatch
from megatron_stepwise.metrics.core import MetricsLogger, iteration_line, mean_metrics, summarize_run, write_eval
from megatron_stepwise.metrics.starvation import StarvationWatch
from megatron_stepwise.rundir.dump_recorder import DumpRecorder, assemble_logprobs
from megatron_stepwise.rundir.dumps import write_dump
from megatron_stepwise.rundir.jsonl import read_metrics
from megatron_stepwise.time_budget import ActivityClock, TimeBudget, budget_line
from megatron_stepwise.workers.agent_workers import AgentWorkers, resolve_agent_workers

log = logging.getLogger(__name__)


def rollout_devices(cfg) -> int:
    """Devices the rollout fleet holds: its GPUs, or one per engine on a CPU-only run."""
    return cfg.launch.rollout_gpus() if cfg.launch.gpus_per_node else cfg.rollout.num_engines


@contextmanager
def timed(times: dict[str, float], key: str):
    """Add the seconds the block takes to `times[key]`."""
    start = time.perf_counter()
    yield
    times[key] = times.get(key, 0.0) + time.perf_counter() - start


# Longer than the fleet's own start-up bounds (engines' health checks and agent workers' first
# answers, 5 minutes each), which fail on rank 0 naming what did not start.
FLEET_START_TIMEOUT = timedelta(minutes=15)


class Trainer:
    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        for module in cfg.trainer.imports:
            importlib.import_module(module)
        components.init_runtime(cfg)
        self.is_driver = dist.get_rank() == 0

        self.tokenizer = components.load_tokenizer(cfg)
        self.model = components.policy_model(cfg, self.tokenizer)  # the architecture, parsed once
        self.chunks = components.build_policy(cfg, self.model.arch)
        self.ref_chunks = (
            components.build_reference(cfg, self.model.arch, self.chunks) if cfg.algo.loss.kl_coef > 0 else None
        )
        self.optimizer = components.build_optimizer(cfg, self.chunks)
        self.scheduler = components.build_scheduler(cfg, self.optimizer)
        self.plugin = components.build_plugin(cfg, self.tokenizer)
        # a non-finite loss or grad norm ends the run at its step, before the push
        self.training_round = TrainingRound(
            self.plugin,
            self.chunks,
            self.optimizer,
            self.scheduler,
            epochs=cfg.data.epochs,
            ref_chunks=self.ref_chunks,
            check=lambda m: check_finite(
                m, iteration=self.state.iteration, clip_grad=cfg.optim.clip_grad, resumed_from=self.resumed_from
            ),
        )
        self.dataset = components.build_dataset(cfg)
        self.state = TrainerState()
        # Rollouts and small decisions travel between ranks as objects on a CPU group, whatever
        # the training backend is, and with the configured timeout (a frozen rank 0 fails the job then).
        dp_rank, dp_size = components.data_parallel()
        self.handoff = handoff = Handoff(
            self.dataset,
            components.cpu_group(cfg),
            dp_rank=dp_rank,
            timeout=timedelta(minutes=cfg.parallel.timeout_minutes),
        )
        # rank 0 decides every DP rank's shard of each mini-batch (the layout is the same everywhere)
        self.recorder = DumpRecorder(cfg.trainer.dump_rollouts or 0)
        sources = dict(
            dataset=self.dataset,
            handoff=handoff,
            vocab_size=self.model.arch.vocab_size,
            decide=functools.partial(self.plugin.decide_shards, self.chunks),
            dp_size=dp_size,
            recorder=self.recorder,
        )
        if cfg.async_.enabled:
            self.source = AsyncRollouts(
                cfg,
                version=lambda: self.state.weight_version,
                **sources,
            )
        else:
            self.source = SyncRollouts(
                cfg,
                progress=self._rollout_progress if cfg.logging.progress and sys.stderr.isatty() else None,
                **sources,
            )
        self.checkpoints = Checkpointer(
            cfg,
            chunks=self.chunks,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            parts={"trainer": self.state, "dataset": self.dataset, "rollouts": self.source},
        )
        # the iteration a resume starts at (None: a fresh run); a divergence at it blames the checkpoint
        self.resumed_from = self.state.iteration if self.checkpoints.resume() else None

        self.driver: Optional[Driver] = None
        self.evaluator: Optional[Evaluator] = None
        self.logger = None
        self.entropy_watch = EntropyWatch()  # warns when the policy collapses (metrics/collapse.py)
        # stops a run whose iterations train nothing (metrics/starvation.py); every rank decides alike
        self.starvation = StarvationWatch(
            max_input_length=cfg.rollout.max_input_length,
            patience=cfg.trainer.max_idle_iterations,
            speak=self.is_driver,
        )
        self.activity = ActivityClock()  # generation and environment time of the in-process agent loop
        self.devices = dist.get_world_size() + (0 if cfg.rollout.colocate else rollout_devices(cfg))
        # While rank 0 starts the fleet (engines and agent workers load: minutes for a large model
        # or on a busy node) the other ranks wait on a group of their own, bounded by the fleet's
        # start-up limits, not by parallel.timeout_minutes (which may be short, to fail fast mid-run).
        start_group = components.cpu_group(cfg, timeout=max(FLEET_START_TIMEOUT, handoff.timeout))
        if self.is_driver:
            self.driver = self._start_driver()
            judge = self.driver.served.fleets.get("judge")
            self.evaluator = (
                Evaluator(cfg, self.driver.fleet, self.tokenizer, self.dataset, judge)
                if cfg.trainer.eval_every
                else None
            )
            self.logger = MetricsLogger(
                cfg.run_dir,
                tensorboard=cfg.logging.tensorboard,
                wandb_project=cfg.logging.wandb.project,
                wandb_name=cfg.logging.wandb.name or cfg.name,
                config=cfg.to_dict(),
                resume_iteration=self.state.iteration,
            )
        dist.barrier(group=start_group)  # the fleet is up (or rank 0 has failed, naming what did not start)
        dist.destroy_process_group(start_group)
        self.weight_sync = components.build_weight_sync(
            cfg, self.driver and self.driver.fleet, self.model, self.driver and self.driver.loop
        )
        if cfg.rollout.colocate and cfg.async_.enabled:  # validation says so too, naming the keys
            raise ValueError("rollout.colocate=true needs async.enabled=false: released engines cannot roll out")
        self.colocation = Colocation(cfg.rollout.colocate, self.driver, handoff)
        # The engines start from their own random init: give them the trainer's weights.
        self.push_weights()
        self.source.start(self.driver)
        if self.driver is not None:
            self._log_placement()

    def _log_placement(self) -> None:
        agent, fleet = self.driver.agent, self.driver.fleet
        if not hasattr(fleet, "engine_table"):  # a fleet of no Ray actors (a test's stand-in): nothing to place
            return
        workers = [w.handle for w in agent.workers] if isinstance(agent, AgentWorkers) else []
        engines = [s.handle for s in fleet.engine_table() if s.alive]
        log_placement({"engines": engines, "agent workers": workers})

    def _start_driver(self) -> Driver:
        """Rank 0's rollout side: the policy's fleet, the second models' (teacher, judge), the agents."""
        loop = asyncio.new_event_loop()
        fleet = components.build_fleet(self.cfg, self.model, self.tokenizer)
        served = ServedModels.build(self.cfg, self.tokenizer)  # their engines load beside the policy's
        loop.run_until_complete(served.wait_ready(fleet))
        return Driver(loop, fleet, self._agents(fleet, loop, served), served)

    def _agents(self, fleet, loop, served: ServedModels):
        """The agent loop in this process, or `rollout.agent_workers` Ray actors."""
        n = resolve_agent_workers(self.cfg)
        if n == 0:
            agent = components.build_agent_loop(self.cfg, fleet, self.tokenizer, served.fleets)
            agent.track(self.activity)
            return agent
        log.info("agent loop: %d agent workers (%.3g CPUs each)", n, self.cfg.rollout.agent_worker_cpus)
        workers = AgentWorkers(self.cfg, fleet, n, served=served)
        loop.run_until_complete(workers.wait_ready())
        return workers

    # ------------------------------------------------------------------------------- loop
    def run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        history = []
        if self.state.iteration >= cfg.trainer.iterations and self.is_driver:
            log.info(
                "nothing to do: the checkpoint in %s is at iteration %d = trainer.iterations "
                "(raise trainer.iterations to continue, or checkpoint.resume=never to start over)",
                cfg.checkpoint_dir,
                self.state.iteration,
            )
        progress = self._progress()
        checkpoint_s: Optional[float] = None
        try:
            while self.state.iteration < cfg.trainer.iterations:
                evaluation = self.evaluate()
                metrics = self.iteration()
                metrics.update(evaluation)
                if checkpoint_s is not None:  # the save after the previous iteration, timed
                    metrics["time/checkpoint"] = checkpoint_s
                history.append(metrics)
                if self.is_driver:
                    self.entropy_watch.observe(self.state.iteration - 1, metrics)
                    self.logger.log(self.state.iteration - 1, metrics)
                    if progress is not None:
                        progress.update(1)
                        progress.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
                    else:  # no bar (logging.progress=false, or output to a file): one line per iteration
                        log.info("%s", iteration_line(self.state.iteration, cfg.trainer.iterations, metrics))
                # The line is written before its iteration's checkpoint: a kill between the two
                # repeats the iteration on resume (its line is replaced), where the other order
                # lost the line for good.
                checkpoint_s = None
                every = cfg.checkpoint.every
                if (every and self.state.iteration % every == 0) or self.state.iteration == cfg.trainer.iterations:
                    start = time.perf_counter()
                    self.checkpoints.save()
                    checkpoint_s = time.perf_counter() - start
                self.starvation.observe(self.state.iteration - 1, metrics)  # after its line is written
            if history and self.is_driver and cfg.trainer.eval_every and cfg.eval_.at_end:
                # the final policy, in <run_dir>/eval/final.json (metrics.jsonl stays one line per iteration)
                write_eval(cfg.run_dir, "final", self.state.iteration, self.evaluate(force=True))
            if cfg.checkpoint.export_hf:
                components.export_hf(cfg, self.chunks, self.model, self.tokenizer)
        finally:
            if progress is not None:
                progress.close()
        if history and self.is_driver:
            records = read_metrics(cfg.run_dir)
            log.info("%s", summarize_run(records, cfg.run_dir))
            if (line := budget_line(records)) is not None:
                log.info("%s", line)
        return history

    def iteration(self) -> dict[str, Any]:
        """`rounds_per_iteration` rounds of take -> prepare -> score -> train -> push."""
        budget = TimeBudget(activity=self.activity)
        times: dict[str, float] = defaultdict(float)
        metrics: dict[str, Any] = {}
        counts, train_metrics, sync_metrics = [], [], []
        skipped = trained_tokens = 0
        dumping = self.recorder.begin(self.state.iteration)  # the same decision on every rank
        dumped_logprobs: list = []
        # the dump records each shard's log-probs under the weights its round starts from
        dump = (lambda shards: dumped_logprobs.extend(map(self.trainer_logprobs, shards))) if dumping else None
        version = self.state.weight_version  # the weights this iteration's first step trains
        for _ in range(self.source.rounds_per_iteration):
            with budget.rollout(lambda: self.handoff.produce_seconds), timed(times, "time/rollout"):
                round_ = self.source.take(self.state.iteration)
            if round_ is None:
                skipped += 1
                continue
            times["time/prepare"] += round_.metrics.get("time/prepare", 0.0)  # on rank 0, inside the take
            metrics.update(round_.metrics)
            counts += round_.counts
            skipped += round_.skipped
            shards = round_.shards
            # colocated: the engines' memory is Megatron's from here until the push
            with budget.part("train"), self.source.overlap(), self.colocation.released(self.state.iteration, times):
                train_metrics += self.training_round.run(shards, clock=functools.partial(timed, times), inspect=dump)
                trained_tokens += sum(s.decision.tokens for s in shards) * self.cfg.data.epochs
            self.state.weight_version += 1
            with budget.part("weight_push"), self.colocation.resumed(times), timed(times, "time/weight_sync"):
                # colocated: weights' memory back first, KV cache after; async: in-flight turns pause
                sync_metrics.append(self.push_weights())
        self.state.iteration += 1
        if dumping:
            with budget.part("host"), timed(times, "time/dump"):
                self.write_dump(dumped_logprobs, train_metrics, version)

        metrics.update(add_counts(counts))
        metrics.update(distill_means(metrics))
        metrics.update(self.source.iteration_metrics())
        metrics.update(mean_metrics(train_metrics, prefix="train/"))
        metrics["train/optimizer_steps"] = len(train_metrics)
        metrics["train/skipped_steps"] = skipped
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["perf/train_tokens_per_s"] = trained_tokens / max(times["time/train"], 1e-9)
        metrics.update(mean_metrics(sync_metrics, prefix=""))
        metrics.update(times)
        metrics.update(budget.finish(tokens=trained_tokens, devices=self.devices))
        metrics["time/iteration"] = metrics["budget/wall"]
        metrics["weight_version"] = self.state.weight_version
        return metrics

    def trainer_logprobs(self, shard) -> tuple:
        """(DP rank, rows in the mini-batch, row offsets, flat log-probs) of this rank's shard under
        the weights it is about to train with: the old-policy log-probs when the round scored them,
        else one forward pass."""
        flat = shard.token_fields.get("old_logprobs")
        if flat is None:
            flat = self.plugin.compute_logprobs_flat(self.chunks, shard)
        return shard.decision.dp_rank, shard.decision.rows, shard.batch.offsets, flat

    def write_dump(self, pieces: list, train_metrics: list[dict[str, float]], weight_version: int) -> None:
        """Collective: every rank's shard log-probs to rank 0, which writes the iteration's dump."""
        gathered: Optional[list] = [None] * dist.get_world_size() if self.is_driver else None
        dist.gather_object(pieces, gathered, dst=0, group=self.handoff.group)
        if not self.is_driver:
            return
        captured = self.recorder.minibatches
        for m, cap in enumerate(captured):
            by_dp = {p[0]: p[1:] for rank_pieces in gathered for p in rank_pieces[m : m + 1]}
            cap.trainer_logprobs = assemble_logprobs(cap.batch, list(by_dp.values()))
        iteration = self.state.iteration - 1
        path = self.cfg.rundir.dump(iteration)
        try:
            write_dump(
                path,
                captured,
                iteration=iteration,
                weight_version=weight_version,
                config=self.cfg.to_dict(),
                train_metrics=train_metrics,
                epochs=self.cfg.data.epochs,
                tokenizer=components.tokenizer_name(self.cfg),
            )
        except OSError as e:  # a dump is for looking at: training goes on without it
            log.warning("iteration %d: could not write the rollout dump %s: %s", iteration, path, e)

    def push_weights(self) -> dict[str, float]:
        """Collective: every rank converts its shard; rank 0 pushes to the fleet."""
        return self.weight_sync.push(self.chunks, self.state.weight_version) or {}

    def evaluate(self, force: bool = False) -> dict[str, Any]:
        """Every eval set, every `trainer.eval_every` iterations or when `force`d (rank 0 only;
        loop/evaluation.py)."""
        every = self.cfg.trainer.eval_every
        if not (every and self.is_driver and (force or self.state.iteration % every == 0)):
            return {}
        seed = rollout_seed(self.cfg.trainer.seed, self.state.iteration, -1)
        return self.driver.run(self.evaluator.evaluate(seed))

    # ---------------------------------------------------------------------------- output
    def _rollout_progress(self, total: int):
        """A per-trajectory progress bar under the iterations bar."""

        @contextmanager
        def bar():
            with tqdm(total=total, desc="rollout", unit="traj", leave=False, position=1) as b:
                yield lambda _steps: b.update(1)

        return bar()

    def _progress(self):
        if not (self.is_driver and self.cfg.logging.progress and sys.stderr.isatty()):
            return None

        return tqdm(total=self.cfg.trainer.iterations, initial=self.state.iteration, desc="iterations", unit="it")

    def close(self) -> None:
        self.source.close()
        self.weight_sync.close()
        if self.evaluator is not None:
            self.evaluator.close()
        if self.driver is not None:
            self.driver.run(self.driver.fleet.shutdown())
            self.driver.run(self.driver.served.shutdown())
            self.driver.agent.close()
            self.driver.loop.close()
        if self.logger is not None:
            self.logger.close()
