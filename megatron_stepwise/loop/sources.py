"""Where the trainer's mini-batches come from, and the synchronous source.

A mini-batch source hands the trainer `Round`s: mini-batches (each one optimizer step) that are
trained together, after which the trainer pushes new weights. The synchronous source
(`SyncRollouts`) makes one round per iteration: roll out every prompt of the iteration with the
fleet idle, then train. The asynchronous one (`async_source.AsyncRollouts`) makes one round per
optimizer step while the fleet keeps going. Both have the same surface: `rounds_per_iteration`,
`start`, `take`, `overlap`, `iteration_metrics`, `state_dict`/`load_state_dict`, `close`.

Rank 0 decides everything once: it validates and filters the rollout, splits it into prompt
mini-batches, and makes the round (`rounds.decide_round`): each mini-batch prepared (merge,
advantages) on rank 0 or by the agent workers that keep its rows, decided from its row table (the
plugin's `decide_shards`) and cut into one shard per data-parallel rank; each rank then receives only
its own shards (`rounds.hand_off`). With rows held by agent workers, a worker that dies (or freezes)
holding some is replaced, its groups are rolled out again with their own seeds, and the round is
decided and handed off anew.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_stepwise.algo.advantages import is_temporal_estimator
from megatron_stepwise.algo.groups import PromptGroup, flat_steps
from megatron_stepwise.algo.prepare import prepare, prepare_rows
from megatron_stepwise.algo.validate import validate_steps
from megatron_stepwise.fault_injection import before_rollout
from megatron_stepwise.loop.rounds import Round, RowsOnRank0, decide_round, hand_off
from megatron_stepwise.metrics.core import rollout_metrics
from megatron_stepwise.rundir.dump_recorder import DumpRecorder
from megatron_stepwise.workers.worker_rows import HoldRequest, RowFetcher, RowsInWorkers

if TYPE_CHECKING:
    import asyncio

    from megatron_stepwise.algo.rows import RowTable
    from megatron_stepwise.algo.shards import ShardDecision
    from megatron_stepwise.compose.served import ServedModels
    from megatron_stepwise.rollout.agent.loop import AgentLoop
    from megatron_stepwise.rollout.fleet.fleet import RolloutFleet
    from megatron_stepwise.workers.agent_workers import AgentWorkers

log = logging.getLogger(__name__)


def rollout_seed(seed: int, index: int, sub: Optional[int] = None) -> int:
    """Sampling seeds depend only on the run seed and where the rollout is (iteration and round,
    or the async group's serial): a resumed run samples the same."""
    base = seed * 1_000_003 + index
    return base if sub is None else base * 31 + sub


@dataclass
class Driver:
    """Rank 0's rollout side: the event loop, the fleet and the agent loop that uses it."""

    loop: asyncio.AbstractEventLoop
    fleet: RolloutFleet
    agent: AgentLoop | AgentWorkers
    served: Optional[ServedModels] = None  # the teacher's and the judge's engines (compose/served.py)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def fleet_metrics(self) -> dict[str, float]:
        out = {f"fleet/{k}": v for k, v in self.fleet.metrics().items() if isinstance(v, (int, float))}
        if hasattr(self.agent, "metrics"):  # agent workers
            out.update(self.agent.metrics())
        return out


def bind_prepare(cfg, fn: Callable = prepare) -> Callable:
    """`fn` (`algo.prepare`'s `prepare` or `prepare_rows`) with the run's settings bound: the
    estimator (`algo.estimator`, `algo.estimator_options`), merging (`data.merge_steps`) and the
    budget a merged row stays within (`data.max_tokens_per_microbatch`)."""
    return functools.partial(
        fn,
        estimator=cfg.algo.estimator,
        estimator_options=dict(cfg.algo.estimator_options),
        distill_coef=cfg.algo.opd_coef,
        merge_steps=cfg.data.merge_steps,
        max_tokens=cfg.data.max_tokens_per_microbatch,
    )


def holds_rows(cfg) -> bool:
    """Whether the rollout's rows stay in the agent workers, in synchronous and asynchronous
    training alike (the same answer on every rank, from the config alone). Temporal estimators
    see the whole mini-batch at once, so they take the driver's path."""
    workers = cfg.rollout.agent_workers
    if cfg.rollout.handoff != "workers" or workers == 0:
        return False
    if workers is None and cfg.rollout.engine == "embedded":
        return False
    return not is_temporal_estimator(cfg.algo.estimator)


class SyncRollouts:
    """The synchronous source: one round per iteration (see module docstring)."""

    rounds_per_iteration = 1

    def __init__(
        self,
        cfg,
        *,
        dataset,
        handoff,
        vocab_size: int,
        decide: Callable[[RowTable], list[ShardDecision]],
        dp_size: int,
        progress: Optional[Callable] = None,
        recorder: Optional[DumpRecorder] = None,
    ):
        self.cfg = cfg
        self.dataset, self.handoff, self.vocab_size = dataset, handoff, vocab_size
        self.prepare_rows = bind_prepare(cfg, prepare_rows)  # what a worker holding rows runs
        self.on_rank0 = RowsOnRank0(bind_prepare(cfg), recorder)  # the rows prepared here instead
        # rank 0 decides from the row tables (`decide`: the plugin's decide_shards)
        self.decide, self.dp_size, self.recorder = decide, dp_size, recorder
        # rows left in the agent workers: each replica fetches its own
        self.fetcher = RowFetcher(timeout_s=cfg.rollout.agent_worker_timeout_s) if holds_rows(cfg) else None
        self._round: Optional[tuple] = None  # rank 0: the last round, (mini-batches, metrics, hold request)
        self._origins: dict[str, tuple[dict, int]] = {}  # rank 0: prompt id -> (sample, seed) of this iteration
        self.progress = progress  # progress(num_trajectories) -> context manager yielding a per-trajectory callback
        self.driver: Optional[Driver] = None

    def start(self, driver: Optional[Driver]) -> None:
        self.driver = driver

    def take(self, iteration: int) -> Optional[Round]:
        """This rank's round: rank 0 rolls out the iteration's prompts and decides it."""
        resolve = self.fetcher.resolve if self.fetcher is not None else None
        fetched = self.fetcher.bytes_fetched if self.fetcher is not None else 0
        try:
            round_ = hand_off(
                self.handoff,
                "rollout",
                iteration,
                functools.partial(self._decide, iteration),
                functools.partial(self._redo, iteration),
                resolve=resolve,
                retries=self.cfg.rollout.max_retries,
            )
            if self.fetcher is not None and round_ is not None:  # this replica's share (rank 0 logs its own)
                round_.metrics["handoff/rows_fetched_bytes"] = self.fetcher.bytes_fetched - fetched
            return round_
        finally:
            if resolve is not None and self.driver is not None:
                self.driver.agent.release(iteration)  # every replica has its rows (or failed): drop them

    def _decide(self, iteration: int) -> list[Round]:
        """Rank 0: roll out (validated where the rows are), filter, split into mini-batches, make the round."""
        before_rollout(iteration)  # test fault injection (fault_injection.py): a no-op unless its variable is set
        hold = self._hold_request(iteration)
        groups, metrics = self._rollout(iteration, hold)
        metrics.update(rollout_metrics(groups, success_threshold=self.cfg.eval_.success_threshold))
        groups, filtered = self._filter_groups(groups, iteration)
        metrics.update(filtered)
        k = self.cfg.data.prompts_per_minibatch
        self._round = ([groups[i : i + k] for i in range(0, len(groups), k)], metrics, hold)
        return self._make_round()

    def _redo(self, iteration: int, lost: set[str]) -> list[Round]:
        """Rank 0, after a replica found holders gone: replace them and decide the round again."""
        assert self._round is not None and self._round[2].key == iteration, "no held round to redo"
        self.driver.agent.replace(lost, "its rows could not be fetched")
        return self._make_round()

    def _make_round(self) -> list[Round]:
        """Rank 0: the round's shards, from rows prepared here or held by the workers (every
        group's holder alive first: `_roll_out_lost`)."""
        minibatches, metrics, hold = self._round
        if hold is None:
            holder = self.on_rank0
            if self.fetcher is not None:
                metrics = {**metrics, "agents/rows_held": 0.0}
        else:
            self._roll_out_lost(minibatches, hold)
            holder = RowsInWorkers.here(hold.key)
            metrics = {**metrics, **self.driver.fleet_metrics(), "agents/rows_held": 1.0}
        return decide_round(minibatches, holder, decide=self.decide, dp_size=self.dp_size, metrics=metrics)

    def _roll_out_lost(self, minibatches: list[list], hold: HoldRequest) -> None:
        """Rank 0: held groups whose holder is gone are rolled out again, with their own samples
        and seeds (they sample as before)."""
        agent = self.driver.agent
        for _ in range(self.cfg.rollout.max_retries + 2):
            alive = agent.holders()
            stale = [(i, j) for i, mb in enumerate(minibatches) for j, g in enumerate(mb) if g.holder not in alive]
            if not stale:
                break
            by_seed: dict[int, list[tuple[int, int]]] = {}
            for i, j in stale:
                by_seed.setdefault(self._origins[minibatches[i][j].prompt_id][1], []).append((i, j))
            for seed, where in by_seed.items():
                samples = [self._origins[minibatches[i][j].prompt_id][0] for i, j in where]
                again = self.driver.run(agent.rollout_groups(samples, seed=seed, hold=hold))
                for (i, j), group in zip(where, again):
                    minibatches[i][j] = group
            agent.regenerated_groups += len(stale)

    def _hold_request(self, iteration: int) -> Optional[HoldRequest]:
        """Rank 0: ask the workers to keep the rows, unless this iteration is dumped (the dump
        is written on rank 0, from the rows)."""
        if self.fetcher is None or (self.recorder is not None and self.recorder.active):
            return None
        return HoldRequest(iteration, self.prepare_rows, self.vocab_size)

    def _rollout(self, iteration: int, hold: Optional[HoldRequest] = None) -> tuple[list[PromptGroup], dict[str, Any]]:
        """Rank 0: roll out (with dynamic sampling if enabled): groups whose rows came here,
        validated; or, with `hold`, held groups (their workers validated the rows)."""
        cfg, driver = self.cfg, self.driver
        t = time.perf_counter()
        samples = self.dataset.next(cfg.data.prompts_per_iteration)
        seed = rollout_seed(cfg.trainer.seed, iteration, 0)
        self._origins = {s["prompt_id"]: (s, seed) for s in samples}
        held = {"hold": hold} if hold is not None else {}
        progress = (
            self.progress(len(samples) * cfg.data.samples_per_prompt) if self.progress else contextlib.nullcontext()
        )
        with progress as done:
            groups = driver.run(driver.agent.rollout_groups(samples, seed=seed, on_trajectory_done=done, **held))
        rounds = 1
        if cfg.algo.filters.dynamic_sampling:
            # Keep rolling out fresh prompts until enough groups carry a learning signal.
            while (
                sum(g.summary().has_reward_variance for g in groups) < cfg.data.prompts_per_iteration
                and rounds < cfg.algo.filters.max_sampling_rounds
            ):
                seen = {g.prompt_id for g in groups}
                more = [m for m in self.dataset.next(cfg.data.prompts_per_iteration) if m["prompt_id"] not in seen]
                if more:
                    seed = rollout_seed(cfg.trainer.seed, iteration, rounds)
                    self._origins.update({m["prompt_id"]: (m, seed) for m in more})
                    groups = groups + driver.run(driver.agent.rollout_groups(more, seed=seed, **held))
                rounds += 1
        elapsed = time.perf_counter() - t
        generated = sum(g.summary().generated_tokens for g in groups)
        info = {"rollout/sampling_rounds": rounds, "perf/rollout_tokens_per_s": generated / max(elapsed, 1e-9)}
        info.update(driver.fleet_metrics())
        if hold is None:
            validate_steps(flat_steps(groups), vocab_size=self.vocab_size)
        return groups, info

    def _filter_groups(self, groups: list[PromptGroup], iteration: int) -> tuple[list[PromptGroup], dict[str, Any]]:
        """Group filters; keeps a multiple of the mini-batch size of whole prompt groups."""
        cfg = self.cfg
        filters = cfg.algo.filters
        keep = groups
        if filters.zero_variance or filters.dynamic_sampling:
            keep = [g for g in groups if g.summary().has_reward_variance]
        target = cfg.data.prompts_per_iteration if filters.dynamic_sampling else len(keep)
        usable = min(len(keep), target)
        usable -= usable % cfg.data.prompts_per_minibatch
        metrics = {
            "filter/groups_in": len(groups),
            "filter/groups_dropped_zero_variance": len(groups) - len(keep),
            "filter/groups_trained": usable,
        }
        if usable == 0 and (filters.zero_variance or filters.dynamic_sampling):
            log.warning("iteration %d: no prompt group with reward variance; no optimizer step", iteration)
        return keep[:usable], metrics

    def overlap(self):
        return contextlib.nullcontext()  # the fleet is idle while this source's batches train

    def iteration_metrics(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
