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

With agent workers (`rollout.handoff: workers`, the default) the rows stay where they were made,
as in synchronous training (`worker_rows.py`): each group is validated, prepared and kept by its
worker under the group's serial, and rank 0 receives its `HeldGroup` (summary, row table and the
staleness summary `TokenVersions`). The buffer, the filters, the metrics and the mini-batch
decision read only those; each replica fetches its rows from the workers, and the workers drop a
group's rows once it is trained, filtered or evicted. A worker lost while it holds a group (it
died, or froze and a fetch found it unanswering) is replaced and the group rolled out again with
its own seed before the step is decided again (`agents/regenerated_groups`).

The rollout bank (`async.rollout_bank`, `workers/rollout_bank.py`) keeps each finished group on disk until
it is trained, written where its rows are: by its agent worker when the workers keep the rows (rank
0 records the file's name from the `HeldGroup`), else by rank 0. A resumed run reads the bank on rank
0 and trains the groups it may reuse instead of rolling their prompts out again: an agent worker
adopts each (reads its file, holds its rows), or, with the rows through rank 0, the group joins the
buffer directly.

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
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_stepwise.algo.groups import flat_steps
from megatron_stepwise.algo.prepare import prepare_rows
from megatron_stepwise.algo.validate import validate_steps
from megatron_stepwise.loop.checkpointer import config_hash, run_id
from megatron_stepwise.loop.group_buffer import Group, GroupBuffer
from megatron_stepwise.loop.rounds import Round, RowsOnRank0, decide_round, hand_off
from megatron_stepwise.loop.sources import Driver, bind_prepare, holds_rows, rollout_seed
from megatron_stepwise.metrics.core import rollout_metrics
from megatron_stepwise.workers.bank_recovery import adopt_held, banked_rollout, open_bank
from megatron_stepwise.workers.rollout_bank import BankedGroup, RolloutBank
from megatron_stepwise.workers.worker_rows import HeldGroup, HoldRequest, RowFetcher, RowsInWorkers, TokenVersions

if TYPE_CHECKING:
    from megatron_stepwise.algo.groups import RolloutGroup
    from megatron_stepwise.algo.rows import RowTable
    from megatron_stepwise.algo.shards import ShardDecision
    from megatron_stepwise.rundir.dump_recorder import DumpRecorder

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
    that had finished are reused from the bank instead (workers/bank_recovery.py).
    """

    def __init__(
        self,
        cfg,
        *,
        dataset,
        handoff,
        vocab_size: int,
        version: Callable[[], int],
        decide: Callable[[RowTable], list[ShardDecision]],
        dp_size: int,
        recorder: Optional[DumpRecorder] = None,
    ):
        self.prompts_per_minibatch = cfg.data.prompts_per_minibatch
        self.rounds_per_iteration = cfg.data.minibatches_per_iteration
        self.seed = cfg.trainer.seed
        self.success_threshold = cfg.eval_.success_threshold
        self.dataset, self.handoff, self.vocab_size, self.version = dataset, handoff, vocab_size, version
        self.dp_size = dp_size
        self.prepare_rows = bind_prepare(cfg, prepare_rows)  # what a worker holding rows runs
        self.on_rank0 = RowsOnRank0(bind_prepare(cfg), recorder)  # the rows prepared here instead
        # Rank 0 decides from the groups' row tables (`decide`, the plugin's decide_shards). Rows
        # left in the agent workers: each replica fetches its own (`fetcher`). A dumped iteration
        # needs the rows on rank 0, and groups are rolled out before anyone knows which iteration
        # trains them: dumps keep the whole run on rank 0's path.
        self.decide = decide
        self.fetcher = (
            RowFetcher(timeout_s=cfg.rollout.agent_worker_timeout_s)
            if holds_rows(cfg) and not cfg.trainer.dump_rollouts
            else None
        )
        self.max_retries = cfg.rollout.max_retries
        self._step: Optional[list[Group]] = None  # rank 0: the groups of the step being handed off
        self._bytes_sent = 0  # rank 0's hand-off bytes at the last iteration's metrics
        filters = cfg.algo.filters
        self._buffer_args = (self.prompts_per_minibatch, cfg.async_)
        self._keep_group = (
            (lambda g: g.summary().has_reward_variance) if (filters.zero_variance or filters.dynamic_sampling) else None
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
        self._dir, self._hash = cfg.run_dir, config_hash(cfg)  # with its run id: the owner a bank file names
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
            *self._buffer_args,
            keep_group=self._keep_group,
            base_version=self.version(),
            on_discard=self._discard,
            draws=self._draws,
        )
        self._waiters: list[asyncio.Future] = []
        self._tasks: set[asyncio.Task] = set()
        self._started_at: dict[int, float] = {}  # serial -> when its rollout started (stall messages)
        self._error: Optional[BaseException] = None
        recovered = self._open_bank() if self._use_bank else {}
        draws = self._pending_draws or [None] * len(self._pending)
        for sample, draw in zip(self._pending, draws):
            if draw in recovered:  # its group finished before the kill: trained, not rolled out again
                self._recover(self.buffer.start_recovered(self.version(), sample, draw), recovered[draw])
        rest = [(s, d) for s, d in zip(self._pending, draws) if d not in recovered]
        self.buffer.requeue_samples([s for s, _ in rest], self._pending_draws and [d for _, d in rest])
        self._producer = driver.loop.create_task(self._produce())

    def _open_bank(self) -> dict[int, BankedGroup]:
        """Rank 0: the bank, and by draw the banked groups a resume reuses (`bank_recovery.py`)."""
        resumed = self._resumed and self._pending_draws is not None  # not a checkpoint from before the bank
        pending = list(zip(self._pending, self._pending_draws)) if resumed else None
        self.bank, found = open_bank(self._dir, pending, self._draws, self.version(), run_id(self._dir), self._hash)
        return found

    def _recover(self, group: Group, banked: BankedGroup) -> None:
        """A started group takes its banked rollout: at once when the rows come to rank 0, else
        once an agent worker has adopted it (`_adopt_held`)."""
        if self.fetcher is None:
            rollout = banked_rollout(banked, group.group_id)
            self.buffer.adopt(group, rollout, banked.start_version, banked.attempt, self.version())
            return
        self._started_at[group.serial] = time.monotonic()
        self._spawn(self._adopt_held(group, banked))

    async def _adopt_held(self, group: Group, banked: BankedGroup) -> None:
        """An agent worker holds the banked group's rows; if none can, its prompt is rolled out again."""
        hold = HoldRequest(group.serial, self.prepare_rows, self.vocab_size)
        held = await adopt_held(self.driver.agent, self.bank, banked, group.group_id, hold)
        if held is None:
            await self._rollout(group)
            return
        self._started_at.pop(group.serial, None)
        self.buffer.adopt(group, held, banked.start_version, banked.attempt, self.version())
        self._notify()

    def _spawn(self, coroutine) -> None:
        task = self.driver.loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _discard(self, group: Group) -> None:
        """The buffer let a finished group go untrained (filtered, evicted): its worker drops the
        rows, and its bank file goes (a re-queued sample's next attempt writes its own)."""
        if self.fetcher is not None:
            self.driver.agent.drop([group.rollout])
        if self.bank is not None:
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
                try:
                    group = self.buffer.start(fleet.weight_version, draw=self._draw)
                except Exception as e:  # noqa: BLE001 - the trainer's next take raises it, at once
                    self._error = RuntimeError(
                        f"async training: drawing prompt {self.buffer.counters.started + 1} from the dataset "
                        f"failed: {type(e).__name__}: {e}"
                    )
                    self._error.__cause__ = e
                    self._notify()
                    return
                banked = self.bank.claim(group.draw, group.sample) if self.bank is not None else None
                if banked is not None:  # a draw re-issued after a resume: its group was banked
                    self._recover(group, banked)
                    self._notify()
                    continue
                self._started_at[group.serial] = time.monotonic()
                self._spawn(self._rollout(group))
            await self._changed()

    def _draw(self) -> dict[str, Any]:
        drawn = self.dataset.next(1)
        if not drawn:
            raise LookupError("it returned no sample (exhausted)")
        return drawn[0]

    async def _rollout_group(self, group: Group) -> RolloutGroup | HeldGroup:
        """One group's rollout: a RolloutGroup, or a HeldGroup when its worker keeps the rows (held
        under the group's serial). A per-group seed: reproducible sampling per turn whichever
        engine serves it, and a group rolled out again samples with the same seed."""
        hold = {}
        if self.fetcher is not None:  # the worker also writes the group's bank file, where the rows are
            ticket = self._ticket(group) if self.bank is not None else None
            hold = {"hold": HoldRequest(group.serial, self.prepare_rows, self.vocab_size, ticket)}
        (rollout,) = await self.driver.agent.rollout_groups(
            [group.rollout_sample()], seed=rollout_seed(self.seed, group.serial), **hold
        )
        return rollout

    async def _rollout_groups(self, groups: list[Group]) -> list[RolloutGroup | HeldGroup]:
        return await asyncio.gather(*(self._rollout_group(g) for g in groups))

    async def _rollout(self, group) -> None:
        try:
            rollout = await self._rollout_group(group)
            self._started_at.pop(group.serial, None)
            await self._bank(group, rollout)
            self.buffer.finish(group.serial, rollout, self.version())
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

    def _ticket(self, group: Group):
        return self.bank.ticket(group.draw, group.sample, group.group_id, group.start_version, group.attempt)

    async def _bank(self, group: Group, rollout: RolloutGroup | HeldGroup) -> None:
        """A finished group's bank file, on disk before the buffer has the group (a kill from then
        on keeps it): the holder wrote it when the rows stay in the workers (rank 0 records its
        name), else rank 0 writes it, off the event loop."""
        if self.bank is None:
            return
        if self.fetcher is not None:
            self.bank.record(rollout.bank, draw=group.draw)
        else:
            await asyncio.to_thread(self.bank.put, BankedGroup.of(self._ticket(group), rollout, self.version()))

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
        """Rank 0: this step's groups, prepared and cut into one shard per DP rank (or decided
        from their row tables) while the fleet keeps rolling out."""
        groups = self.driver.loop.run_until_complete(self.next_groups())
        if groups is None:
            log.warning(
                "iteration %d: group filters discarded %d groups without %d informative ones; optimizer step skipped",
                iteration,
                self.starve_limit,
                self.prompts_per_minibatch,
            )
            return [None] * self.dp_size
        self._step = groups
        return self._make_round(iteration)

    def _make_round(self, iteration: int) -> list[Round]:
        """Rank 0: the step's shards, from rows prepared here or held by the workers (every
        group's holder alive first: `_regenerate_lost`), while the fleet keeps rolling out."""
        groups = self._step
        if self.fetcher is None:  # the rows came to rank 0
            validate_steps(flat_steps([g.rollout for g in groups]), vocab_size=self.vocab_size)
            holder, metrics = self.on_rank0, {}
        else:
            self._regenerate_lost(groups)
            holder, metrics = RowsInWorkers.here(iteration), {"agents/rows_held": 1.0}
        with loop_in_thread(self.driver.loop):
            minibatches = [[g.rollout for g in groups]]
            return decide_round(minibatches, holder, decide=self.decide, dp_size=self.dp_size, metrics=metrics)

    def _regenerate_lost(self, groups: list[Group]) -> None:
        """Rank 0: groups whose holder is gone (it died, or was replaced after a fetch found it
        frozen) are rolled out again on the live workers, with their own seeds."""
        agent = self.driver.agent
        for _ in range(self.max_retries + 2):
            alive = agent.holders()
            lost = [g for g in groups if g.rollout.holder not in alive]
            if not lost:
                return
            log.warning(
                "async training: the agent workers holding prompt groups %s are gone; rolling them out again",
                [g.group_id for g in lost][:4],
            )
            again = self.driver.run(self._rollout_groups(lost))
            for g, rollout in zip(lost, again):
                g.rollout = rollout
                if self.bank is not None:  # its new bank file, of a group this step trains
                    self.bank.record(rollout.bank, draw=g.draw)
                    self.bank.trained([g.draw])
            agent.regenerated_groups += len(lost)
        raise RuntimeError(
            f"async training: the agent workers holding prompt groups {[g.group_id for g in groups]} kept dying"
        )

    def _redo(self, iteration: int, lost: set[str]) -> list[Round]:
        """Rank 0, after a replica found holders gone: replace them and decide the step again."""
        self.driver.agent.replace(lost, "its rows could not be fetched")
        return self._make_round(iteration)

    def _record(self, groups: list[Group]) -> None:
        """Rank 0: a handed-off step's groups, for the iteration's metrics (summaries only)."""
        version = self.version()
        staleness = [version - g.start_version for g in groups]
        it = self._iteration
        for g in groups:
            versions = g.rollout.versions if self.fetcher is not None else TokenVersions.of(g.rollout.trajectories)
            it["groups"].append(g.rollout)
            it["staleness"].update(versions.staleness(version))
            it["spreads"] += versions.spreads
        it["group_staleness_max"].append(max(staleness))
        it["group_staleness_mean"].append(sum(staleness) / len(staleness))
        it["requeued"].append(sum(g.attempt > 0 for g in groups))

    # ------------------------------------------------------------------ every rank
    def take(self, iteration: int) -> Optional[Round]:
        """This rank's shard of the optimizer step's mini-batch, or None when filters starve it.
        With rows in the workers, a fetch that found holders gone makes rank 0 replace them, roll
        their groups out again and hand the step off anew (every rank retries alike)."""
        resolve = self.fetcher.resolve if self.fetcher is not None else None
        try:
            round_ = hand_off(
                self.handoff,
                "async rollout",
                iteration,
                functools.partial(self._decide, iteration),
                functools.partial(self._redo, iteration),
                resolve=resolve,
                retries=self.max_retries,
            )
            if self._step is not None:
                self._record(self._step)
            return round_
        finally:
            if self._step is not None and resolve is not None:
                self.driver.agent.drop([g.rollout for g in self._step])  # fetched (or failed for good)
            self._step = None

    def overlap(self):
        """Rollouts go on while this rank prepares and trains."""
        return loop_in_thread(self.driver.loop if self.driver is not None else None)

    def reset_metrics(self) -> None:
        self._iteration = {
            "spreads": [],
            "groups": [],
            "staleness": Counter(),
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
        tokens: Counter[int] = it["staleness"]  # trained tokens by staleness
        total = sum(tokens.values())
        if total:
            metrics["async/token_staleness_min"] = min(tokens)
            metrics["async/token_staleness_max"] = max(tokens)
            metrics["async/token_staleness_mean"] = sum(k * n for k, n in tokens.items()) / total
            clamped = Counter({max(k, 0): 0 for k in tokens})
            for k, n in tokens.items():
                clamped[max(k, 0)] += n
            for k in range(max(clamped) + 1):  # the histogram
                metrics[f"async/token_staleness/{k}"] = clamped[k] / total
        spread = it["spreads"]
        if spread:
            # trajectories that a weight update reached mid-way (partial rollouts)
            metrics["async/trajectories_spanning_versions"] = sum(x > 0 for x in spread) / len(spread)
            metrics["async/trajectory_version_spread_max"] = max(spread)
        if self.bank is not None:
            metrics["async/bank_groups_discarded"] = float(self.bank.discarded)
        if self.buffer is not None:
            metrics.update(self.buffer.metrics())
            metrics.update(self.driver.fleet_metrics())
            metrics["agents/rows_held"] = 1.0 if self.fetcher is not None else 0.0
            # what rank 0 sent the other ranks: shards of rows, or manifests with rows held
            sent = getattr(self.handoff, "bytes_sent", 0)
            metrics["handoff/rank0_bytes_sent"] = float(sent - self._bytes_sent)
            self._bytes_sent = sent
        self.reset_metrics()
        return metrics
