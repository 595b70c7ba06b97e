"""Asynchronous training: the fleet keeps rolling out while the trainer trains (`async.enabled`).

Rank 0 runs a producer on its asyncio event loop: it starts a prompt group whenever the
`GroupBuffer` admits one and files every finished group in it (staleness bound, admission,
drop/requeue and group filters: see `rollout/buffer.py`). Each optimizer step:

1. rank 0 takes exactly `prompts_per_minibatch` finished groups (waiting if needed) and
   broadcasts their steps to every rank; groups carry a variable number of step rows;
2. validate, optional prefix merge, outcome advantages within each group;
3. train one optimizer step. While rank 0's main thread is inside Megatron, its event loop runs
   in a helper thread, so turns keep being generated, environments stepped, groups started;
4. push the new weights with partial rollouts: turns in flight are paused, get the new weights
   and continue (each token records the weight version that produced it).

Off-policy correction. A mini-batch is trained once, as it arrives, so the trainer's "old"
policy is the current one (PPO ratio 1) and the behaviour policy is the rollout's: the loss's
truncated importance weight `min(pi_theta / pi_rollout, algo.loss.tis_cap)` per token
(tis=token) or per step (tis=sequence) corrects for the lag; the config validator requires it.
Metrics report the staleness of the trained tokens (async/token_staleness_*: trainer version
minus producing version), the share of trajectories a weight update reached mid-way, the
importance weights (train/tis_weight_mean, _max, train/tis_capped_frac) and the buffer's
counters (async/groups_*).

One iteration is `prompts_per_iteration / prompts_per_minibatch` optimizer steps, as in
synchronous mode, so learning-rate schedules and checkpoint intervals mean the same; the weight
version advances once per optimizer step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from typing import Any, Optional

import torch

from megatron_stepwise.algo.advantages import compute_advantages
from megatron_stepwise.algo.batching import validate_steps
from megatron_stepwise.algo.merge import merge_steps
from megatron_stepwise.metrics import rollout_metrics
from megatron_stepwise.rollout.buffer import (
    GroupBuffer,
    group_has_variance,
    trained_token_staleness,
    trajectory_version_spread,
)
from megatron_stepwise.trainer import _mean_metrics  # one averaging rule for both modes
from megatron_stepwise.types import Step, StepBatch

log = logging.getLogger(__name__)


@contextlib.contextmanager
def loop_in_thread(loop: Optional[asyncio.AbstractEventLoop]):
    """Run `loop` in a helper thread for the duration of the block (no-op for None).

    Megatron stays on the main thread (its CPU compatibility layer is a thread-local torch
    function mode); everything else touches the loop only with `run_until_complete` while the
    helper is stopped, as the synchronous trainer does.
    """
    if loop is None:
        yield
        return
    thread = threading.Thread(target=loop.run_forever, name="rollout-loop", daemon=True)
    thread.start()
    try:
        yield
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


class AsyncDriver:
    """Replaces `Trainer.iteration` when `async.enabled` (see module docstring)."""

    def __init__(self, trainer):
        cfg = trainer.cfg
        self.trainer = trainer
        self.groups_per_step = cfg.data.prompts_per_minibatch
        self.steps_per_iteration = cfg.data.prompts_per_iteration // cfg.data.prompts_per_minibatch
        self.version = trainer.state.weight_version
        self.buffer: Optional[GroupBuffer] = None
        if not trainer.is_driver:
            return
        filters = cfg.algo.filters
        self.buffer = GroupBuffer(
            self.groups_per_step,
            cfg.async_.max_staleness,
            cfg.async_.stale_policy,
            keep_group=group_has_variance if (filters.zero_variance or filters.dynamic_sampling) else None,
            base_version=self.version,
        )
        # A resumed run first rolls out the prompts its checkpoint had drawn but not trained.
        self.buffer.requeue_samples(trainer.state.async_pending or [])
        # Filters may discard this many groups while one optimizer step waits before it is skipped
        # (the synchronous trainer's dynamic sampling gives up after as many rollout rounds).
        self.starve_limit = filters.max_sampling_rounds * cfg.data.prompts_per_iteration
        trainer.fleet.partial_rollouts = True
        self._waiters: list[asyncio.Future] = []
        self._tasks: set[asyncio.Task] = set()
        self._error: Optional[BaseException] = None
        self._producer = trainer.loop.create_task(self._produce())

    # ------------------------------------------------------------------ rank 0: event loop side
    def _notify(self) -> None:
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()

    async def _changed(self) -> None:
        f = asyncio.get_running_loop().create_future()
        self._waiters.append(f)
        await f

    async def _produce(self) -> None:
        t = self.trainer
        while True:
            while self._error is None and self.buffer.can_start(t.fleet.weight_version):
                group = self.buffer.start(t.fleet.weight_version, draw=lambda: t.dataset.next(1)[0])
                task = asyncio.get_running_loop().create_task(self._rollout(group))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await self._changed()

    async def _rollout(self, group) -> None:
        t = self.trainer
        try:
            # A per-group seed: reproducible sampling per turn whichever engine serves it.
            seed = t.cfg.trainer.seed * 1_000_003 + group.serial
            steps = await t.agent.rollout([group.rollout_sample()], seed=seed)
            self.buffer.finish(group.serial, steps, self.version)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - surfaces in the trainer's next take
            self._error = RuntimeError(f"rollout of prompt group {group.group_id!r} failed: {e!r}")
            self._error.__cause__ = e
        finally:
            self._notify()

    async def _take(self) -> Optional[list]:
        self._notify()  # the version may have moved: the producer may start more groups
        while True:
            if self._error is not None:
                raise self._error
            if self._producer.done():  # it only ends by raising (e.g. a sample without prompt_id)
                self._producer.result()
            groups = self.buffer.take(self.groups_per_step, self.version)
            self._notify()  # evictions and takes free admission slots
            if groups is not None:
                return groups
            if self.buffer.starved(self.starve_limit):
                self.buffer.skip_step()
                return None
            await self._changed()

    # ------------------------------------------------------------------ every rank
    def _next_minibatch(self) -> Optional[tuple[list[Step], dict[str, Any]]]:
        """Rank 0 takes the step's groups; every rank gets (steps, info), or None to skip."""
        return self.trainer.from_driver(self._take_groups, "async rollout")

    def _take_groups(self) -> Optional[tuple[list[Step], dict[str, Any]]]:
        """Rank 0: this optimizer step's groups as (steps, info), or None when filters starve it."""
        groups = self.trainer.loop.run_until_complete(self._take())
        if groups is None:
            return None
        steps = [s for g in groups for s in g.steps]
        staleness = [self.version - g.start_version for g in groups]
        info = {"group_staleness_max": max(staleness), "group_staleness_mean": sum(staleness) / len(staleness),
                "requeued_groups": sum(g.attempt > 0 for g in groups)}
        return steps, info

    def _prepare(self, steps: list[Step]) -> tuple[Optional[StepBatch], dict[str, Any]]:
        from megatron_stepwise.megatron.packing import set_response_field

        cfg = self.trainer.cfg
        validate_steps(steps, vocab_size=self.trainer.hf_config["vocab_size"])
        metrics: dict[str, Any] = {"batch/rows_before_merge": len(steps),
                                   "batch/tokens_before_merge": sum(s.num_tokens for s in steps)}
        if cfg.data.merge_steps:
            steps, stats = merge_steps(steps)
            metrics["batch/rows_after_merge"] = stats.rows_after
            metrics["batch/tokens_after_merge"] = stats.tokens_after
        adv_metrics: dict[str, Any] = {}
        advantages = compute_advantages(steps, cfg.algo.estimator, metrics=adv_metrics, **cfg.algo.estimator_options)
        metrics.update({f"advantages/{k}": v for k, v in adv_metrics.items()})
        if not any(s.num_trainable for s in steps):
            return None, metrics  # e.g. every trajectory hit the context limit on its first prompt
        batch = StepBatch.from_steps(steps)
        set_response_field(batch, "advantages", advantages)
        return batch, metrics

    def iteration(self) -> dict[str, Any]:
        t = self.trainer
        t0 = time.perf_counter()
        times: dict[str, float] = defaultdict(float)
        trained_steps: list[Step] = []
        staleness: list[torch.Tensor] = []
        step_metrics: list[dict[str, Any]] = []
        train_metrics: list[dict[str, float]] = []
        sync_metrics: list[dict[str, float]] = []
        skipped = 0
        trained_tokens = 0
        for _ in range(self.steps_per_iteration):
            clock = time.perf_counter()
            got = self._next_minibatch()
            times["time/wait_rollout"] += time.perf_counter() - clock
            if got is None:
                skipped += 1
                log.warning("iteration %d: group filters discarded %d groups without %d informative ones; "
                            "optimizer step skipped", t.state.iteration, self.starve_limit, self.groups_per_step)
                continue
            steps, info = got
            trained_steps += steps
            staleness.append(trained_token_staleness(steps, self.version))
            with loop_in_thread(t.loop):  # rollouts go on while this rank prepares and trains
                clock = time.perf_counter()
                batch, prep = self._prepare(steps)
                if batch is not None and t.ref_chunks is not None:
                    batch.token_fields["ref_logprobs"] = t.plugin.compute_logprobs_flat(t.ref_chunks, batch)
                times["time/prepare"] += time.perf_counter() - clock
                step_metrics.append({**prep, **{f"async/{k}": v for k, v in info.items()}})
                if batch is None:
                    skipped += 1
                    continue
                clock = time.perf_counter()
                train_metrics.append(t.plugin.train_minibatch(t.chunks, t.optimizer, batch, lr_scheduler=t.scheduler))
                times["time/train"] += time.perf_counter() - clock
                trained_tokens += int(batch.lengths.sum())
            self.version += 1
            t.state.weight_version = self.version
            clock = time.perf_counter()
            sync_metrics.append(t._sync_weights() or {})  # partial rollouts: in-flight turns pause, update, go on
            times["time/weight_sync"] += time.perf_counter() - clock
        t.state.iteration += 1
        metrics = self._metrics(t0, times, trained_steps, staleness, step_metrics, train_metrics, skipped, trained_tokens)
        metrics.update(_mean_metrics(sync_metrics, prefix=""))
        return metrics

    def _metrics(self, t0, times, trained_steps, staleness, step_metrics, train_metrics, skipped, trained_tokens):
        t = self.trainer
        metrics: dict[str, Any] = {}
        if trained_steps:
            metrics.update(rollout_metrics(trained_steps))
        metrics.update(_mean_metrics(step_metrics, prefix=""))
        if step_metrics:
            metrics["async/group_staleness_max"] = max(m.get("async/group_staleness_max", 0) for m in step_metrics)
            metrics["async/requeued_groups"] = sum(m.get("async/requeued_groups", 0) for m in step_metrics)
        tokens = torch.cat(staleness) if staleness else torch.zeros(0, dtype=torch.long)
        if tokens.numel():
            metrics["async/token_staleness_min"] = int(tokens.min())
            metrics["async/token_staleness_max"] = int(tokens.max())
            metrics["async/token_staleness_mean"] = float(tokens.double().mean())
        spread = trajectory_version_spread(trained_steps)
        if spread:
            # trajectories that a weight update reached mid-way (partial rollouts)
            metrics["async/trajectories_spanning_versions"] = sum(x > 0 for x in spread) / len(spread)
            metrics["async/trajectory_version_spread_max"] = max(spread)
        metrics.update(_mean_metrics(train_metrics, prefix="train/"))
        metrics["train/optimizer_steps"] = len(train_metrics)
        metrics["train/skipped_steps"] = skipped
        metrics["train/lr"] = t.optimizer.param_groups[0]["lr"]
        metrics["perf/train_tokens_per_s"] = trained_tokens / max(times.get("time/train", 0.0), 1e-9)
        if t.is_driver:
            metrics.update(self.buffer.metrics())
            metrics.update({f"fleet/{k}": v for k, v in t.fleet.metrics().items() if isinstance(v, (int, float))})
        metrics.update(times)
        metrics["time/iteration"] = time.perf_counter() - t0
        metrics["weight_version"] = self.version
        return metrics

    # ------------------------------------------------------------------ checkpoints and shutdown
    def pending_samples(self) -> list[dict[str, Any]]:
        """Samples drawn but not trained yet (rank 0; [] elsewhere). A checkpoint stores them as
        `async_pending`; a resumed driver rolls them out first, so no drawn prompt is skipped."""
        return self.buffer.pending_samples() if self.buffer is not None else []

    def close(self) -> None:
        """Stop the producer and the groups in flight (rank 0); the trainer then shuts the fleet."""
        if self.buffer is None:
            return
        tasks = [self._producer, *self._tasks]
        for task in tasks:
            task.cancel()
        self.trainer.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
