"""Asynchronous mini-batches (`async.enabled`): the fleet keeps rolling out while the trainer trains.

Rank 0 runs a producer on its asyncio event loop: it starts a prompt group whenever the
`GroupBuffer` admits one and files every finished group in it (staleness bound, admission,
drop/requeue and group filters: see `group_buffer.py`). Each round is one optimizer step:

1. rank 0 takes exactly `prompts_per_minibatch` finished groups (waiting if needed), prepares
   them (its event loop running meanwhile) and hands each rank its shard; groups carry a variable
   number of step rows;
2. every rank trains its shard while rank 0's event loop runs in a helper thread (`overlap`), so
   turns keep being generated, environments stepped, groups started;
3. the trainer pushes the new weights with partial rollouts: turns in flight are paused, get
   the new weights and continue (each token records the weight version that produced it).

Off-policy correction. A mini-batch is trained once, as it arrives, so the trainer's "old"
policy is the current one (PPO ratio 1) and the behaviour policy is the rollout's: the loss's
truncated importance weight `min(pi_theta / pi_rollout, algo.loss.tis_cap)` per token
(tis=token) or per step (tis=sequence) corrects for the lag; the config validator requires it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import threading
import time
from typing import Any, Callable, Optional

import torch

from megatron_stepwise.algo.groups import flat_steps
from megatron_stepwise.algo.validate import validate_steps
from megatron_stepwise.loop.group_buffer import GroupBuffer, trained_token_staleness, trajectory_version_spread
from megatron_stepwise.loop.rollout_bank import BankedGroup, RolloutBank, with_group_id
from megatron_stepwise.loop.sources import Driver, Round, rollout_seed, split_round
from megatron_stepwise.loop.training_batch import PrepareOptions
from megatron_stepwise.metrics.core import rollout_metrics

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


class AsyncRollouts:
    """The async mini-batch source. `version()` is the trainer's current weight version.

    Stateful for checkpoints: the prompts drawn but not trained yet (`state_dict`), which a
    resumed run rolls out first, so no drawn prompt is skipped; with `async.rollout_bank` those
    that had finished are reused from the bank instead (loop/rollout_bank.py).
    """

    def __init__(
        self,
        cfg,
        *,
        dataset,
        handoff,
        vocab_size: int,
        version: Callable[[], int],
        shard: Callable[[Any], list[Any]],
        dp_size: int,
        recorder: Any = None,
    ):
        self.prompts_per_minibatch = cfg.data.prompts_per_minibatch
        self.rounds_per_iteration = cfg.data.minibatches_per_iteration
        self.seed = cfg.trainer.seed
        self.success_threshold = cfg.eval_.success_threshold
        self.dataset, self.handoff, self.vocab_size, self.version = dataset, handoff, vocab_size, version
        self.dp_size = dp_size
        self.split = functools.partial(
            split_round, options=PrepareOptions.from_config(cfg), shard=shard, dp_size=dp_size, recorder=recorder
        )
        filters = cfg.algo.filters
        self._buffer_args = (self.prompts_per_minibatch, cfg.async_)
        self._keep_group = (
            operator.attrgetter("has_reward_variance") if (filters.zero_variance or filters.dynamic_sampling) else None
        )
        # Filters may discard this many groups while one optimizer step waits before it is skipped
        # (the synchronous source's dynamic sampling gives up after as many rollout rounds).
        self.starve_limit = filters.max_sampling_rounds * cfg.data.prompts_per_iteration
        self.stall_timeout_s = cfg.async_.stall_timeout_s
        self.driver: Optional[Driver] = None
        self.buffer: Optional[GroupBuffer] = None
        self._pending: list[dict[str, Any]] = []
        self._pending_draws: Optional[list[int]] = None
        self._draws = 0
        self._resumed = False
        self.run_dir = cfg.run_dir
        self.bank: Optional[RolloutBank] = None
        self._use_bank = cfg.async_.rollout_bank
        self._iteration: dict[str, list] = {}
        self.reset_metrics()

    # ------------------------------------------------------------------ life cycle
    def start(self, driver: Optional[Driver]) -> None:
        """Start producing on rank 0 (`driver` is None on the other ranks)."""
        if driver is None:
            return
        self.driver = driver
        self.buffer = GroupBuffer(
            *self._buffer_args, keep_group=self._keep_group, base_version=self.version(), draws=self._draws
        )
        recovered = self._open_bank() if self._use_bank else {}
        draws = self._pending_draws or [None] * len(self._pending)
        for sample, draw in zip(self._pending, draws):
            if draw in recovered:  # its group finished before the kill: trained, not rolled out again
                self._adopt(self.buffer.start_recovered(self.version(), sample, draw), recovered[draw])
        rest = [(s, d) for s, d in zip(self._pending, draws) if d not in recovered]
        self.buffer.requeue_samples([s for s, _ in rest], self._pending_draws and [d for _, d in rest])
        self._waiters: list[asyncio.Future] = []
        self._tasks: set[asyncio.Task] = set()
        self._started_at: dict[int, float] = {}  # serial -> when its rollout started (stall messages)
        self._error: Optional[BaseException] = None
        self._producer = driver.loop.create_task(self._produce())

    def _open_bank(self) -> dict[int, BankedGroup]:
        """Rank 0: a fresh run empties the bank; a resumed one gets, by draw, the banked groups of
        its pending samples (the bank keeps those of draws the dataset will re-issue, `_produce`)."""
        self.bank = RolloutBank(self.run_dir)
        if not self._resumed or self._pending_draws is None:  # a checkpoint from before the bank
            self.bank.clear()
            return {}
        recovery = self.bank.recover(list(zip(self._pending, self._pending_draws)), self._draws, self.version())
        if recovery.pending or recovery.reissued:
            log.info(
                "rollout bank: %d finished group(s) of pending prompts recovered, %d more held for "
                "prompts the dataset issues again",
                len(recovery.pending),
                len(recovery.reissued),
            )
        return recovery.pending

    def _adopt(self, group, banked: BankedGroup) -> None:
        """A started group takes its banked rollout (under the group id it was started with)."""
        outcome = self.buffer.adopt(
            group, with_group_id(banked.rollout, group.group_id), banked.start_version, banked.attempt, self.version()
        )
        if outcome != "ready":
            self.bank.drop(group.draw)

    def state_dict(self) -> dict[str, Any]:
        if self.buffer is None:
            return {"pending": [], "pending_draws": [], "draws": 0}
        return {
            "pending": self.buffer.pending_samples(),
            "pending_draws": self.buffer.pending_draws(),
            "draws": self.buffer.draws,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = list(state.get("pending") or [])
        draws = state.get("pending_draws")
        self._pending_draws = [int(d) for d in draws] if draws is not None else None
        self._draws = int(state.get("draws") or 0)
        self._resumed = True

    def after_save(self) -> None:
        """A checkpoint was saved: the bank keeps only what a resume from it may reuse."""
        if self.bank is not None:
            outstanding = [g.draw for g in self.buffer.outstanding_groups()]
            self.bank.checkpointed(outstanding, self.buffer.pending_draws(), self.version())

    def close(self) -> None:
        """Stop the producer and the groups in flight (rank 0); the trainer then shuts the fleet."""
        if self.buffer is None:
            return
        tasks = [self._producer, *self._tasks]
        for task in tasks:
            task.cancel()
        self.driver.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    # ------------------------------------------------------------------ rank 0: event loop side
    def _notify(self) -> None:
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()

    async def _changed(self, timeout: Optional[float] = None) -> bool:
        """Wait for the next `_notify`; False when `timeout` seconds passed first."""
        loop = asyncio.get_running_loop()
        f = loop.create_future()
        self._waiters.append(f)
        timer = loop.call_later(timeout, lambda: f.done() or f.set_result(False)) if timeout is not None else None
        try:
            return await f is not False
        finally:
            if timer is not None:
                timer.cancel()

    async def _produce(self) -> None:
        fleet = self.driver.fleet
        while True:
            while self._error is None and self.buffer.can_start(fleet.weight_version):
                group = self.buffer.start(fleet.weight_version, draw=lambda: self.dataset.next(1)[0])
                banked = self.bank.claim(group.draw, group.sample) if self.bank is not None else None
                if banked is not None:  # a draw re-issued after a resume: its group was banked
                    self._adopt(group, banked)
                    self._notify()
                    continue
                self._started_at[group.serial] = time.monotonic()
                task = asyncio.get_running_loop().create_task(self._rollout(group))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await self._changed()

    async def _rollout(self, group) -> None:
        try:
            # A per-group seed: reproducible sampling per turn whichever engine serves it.
            (rollout,) = await self.driver.agent.rollout_groups(
                [group.rollout_sample()], seed=rollout_seed(self.seed, group.serial)
            )
            self._started_at.pop(group.serial, None)
            if self.bank is not None:  # on disk before the buffer has it: a kill from here on keeps it
                await asyncio.to_thread(self.bank.put, self._banked(group, rollout))
            if self.buffer.finish(group.serial, rollout, self.version()) != "ready" and self.bank is not None:
                self.bank.drop(group.draw)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - surfaces in the trainer's next take
            self._error = RuntimeError(f"rollout of prompt group {group.group_id!r} failed: {e!r}")
            self._error.__cause__ = e
        finally:
            self._notify()

    async def next_groups(self) -> Optional[list]:
        """Rank 0: this optimizer step's groups, waiting for them; None when filters starve it."""
        self._notify()  # the version may have moved: the producer may start more groups
        progress, finished = time.monotonic(), self.buffer.counters.finished
        while True:
            if self._error is not None:
                raise self._error
            if self._producer.done():  # it only ends by raising (e.g. a sample without prompt_id)
                self._producer.result()
            groups = self.buffer.take(self.prompts_per_minibatch, self.version())
            self._notify()  # evictions and takes free admission slots
            if groups is not None:
                if self.bank is not None:
                    self.bank.trained(g.draw for g in groups)
                return groups
            if self.buffer.starved(self.starve_limit):
                self.buffer.skip_step()
                return None
            if self.buffer.counters.finished != finished:
                progress, finished = time.monotonic(), self.buffer.counters.finished
            waited = time.monotonic() - progress
            if waited >= self.stall_timeout_s:
                raise RuntimeError(f"{self._waiting_for(waited)}; async.stall_timeout_s={self.stall_timeout_s:g}")
            heartbeat = min(60.0, self.stall_timeout_s / 4)
            if not await self._changed(timeout=min(heartbeat, self.stall_timeout_s - waited)):
                if time.monotonic() - progress >= heartbeat:
                    log.warning("%s (still waiting)", self._waiting_for(time.monotonic() - progress))

    def _banked(self, group, rollout) -> BankedGroup:
        return BankedGroup(
            draw=group.draw,
            sample=group.sample,
            group_id=group.group_id,
            start_version=group.start_version,
            attempt=group.attempt,
            end_version=self.version(),
            rollout=rollout,
        )

    def _waiting_for(self, waited: float) -> str:
        """What the trainer is waiting for, for a stall warning or error."""
        buf, now = self.buffer, time.monotonic()
        in_flight = buf.outstanding_groups()
        oldest = next((g for g in in_flight if g.rollout is None), None)
        text = (
            f"async training: no prompt group finished for {waited:.0f} s; a mini-batch needs "
            f"{self.prompts_per_minibatch} groups, {buf.ready} ready, {buf.in_flight} in flight"
        )
        if oldest is not None:
            age = now - self._started_at.get(oldest.serial, now)
            text += (
                f" (oldest: group {oldest.group_id!r}, started at weight version {oldest.start_version}, "
                f"{age:.0f} s ago: an environment or engine call that does not return?)"
            )
        return text

    def _decide(self, iteration: int) -> list[Optional[Round]]:
        """Rank 0: this step's groups, validated, recorded for the metrics, prepared and cut into
        one shard per DP rank while the fleet keeps rolling out."""
        groups = self.driver.loop.run_until_complete(self.next_groups())
        if groups is None:
            log.warning(
                "iteration %d: group filters discarded %d groups without %d informative ones; optimizer step skipped",
                iteration,
                self.starve_limit,
                self.prompts_per_minibatch,
            )
            return [None] * self.dp_size
        steps = flat_steps(g.rollout for g in groups)
        validate_steps(steps, vocab_size=self.vocab_size)
        staleness = [self.version() - g.start_version for g in groups]
        it = self._iteration
        it["steps"] += steps
        it["groups"] += [g.rollout for g in groups]
        it["staleness"].append(trained_token_staleness(steps, self.version()))
        it["group_staleness_max"].append(max(staleness))
        it["group_staleness_mean"].append(sum(staleness) / len(staleness))
        it["requeued"].append(sum(g.attempt > 0 for g in groups))
        with loop_in_thread(self.driver.loop):
            return self.split([steps], {})

    # ------------------------------------------------------------------ every rank
    def take(self, iteration: int) -> Optional[Round]:
        """This rank's shard of the optimizer step's mini-batch, or None when filters starve it."""
        return self.handoff.to_ranks(lambda: self._decide(iteration), "async rollout", iteration)

    def overlap(self):
        """Rollouts go on while this rank prepares and trains."""
        return loop_in_thread(self.driver.loop if self.driver is not None else None)

    def reset_metrics(self) -> None:
        self._iteration = {
            "steps": [],
            "groups": [],
            "staleness": [],
            "group_staleness_max": [],
            "group_staleness_mean": [],
            "requeued": [],
        }

    def iteration_metrics(self) -> dict[str, Any]:
        """Trajectory metrics of what was trained, staleness, and the buffer's counters."""
        it = self._iteration
        metrics: dict[str, Any] = rollout_metrics(it["groups"], success_threshold=self.success_threshold)
        if it["group_staleness_max"]:
            metrics["async/group_staleness_max"] = max(it["group_staleness_max"])
            metrics["async/group_staleness_mean"] = sum(it["group_staleness_mean"]) / len(it["group_staleness_mean"])
            metrics["async/requeued_groups"] = sum(it["requeued"])
        tokens = torch.cat(it["staleness"]) if it["staleness"] else torch.zeros(0, dtype=torch.long)
        if tokens.numel():
            metrics["async/token_staleness_min"] = int(tokens.min())
            metrics["async/token_staleness_max"] = int(tokens.max())
            metrics["async/token_staleness_mean"] = float(tokens.double().mean())
            for k, n in enumerate(torch.bincount(tokens.clamp(min=0)).tolist()):  # the histogram
                metrics[f"async/token_staleness/{k}"] = n / tokens.numel()
        spread = trajectory_version_spread(it["steps"])
        if spread:
            # trajectories that a weight update reached mid-way (partial rollouts)
            metrics["async/trajectories_spanning_versions"] = sum(x > 0 for x in spread) / len(spread)
            metrics["async/trajectory_version_spread_max"] = max(spread)
        if self.buffer is not None:
            metrics.update(self.buffer.metrics())
        if self.bank is not None:
            metrics["async/bank_groups_discarded"] = float(self.bank.discarded)
            metrics.update(self.driver.fleet_metrics())
        self.reset_metrics()
        return metrics
