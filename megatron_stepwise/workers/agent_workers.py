"""Agent workers: the agent loop in Ray actors spread over the cluster (`rollout.agent_workers`).

Each worker holds its own tokenizer, chat template, environment pool and event loop, and routes
its turns to the engines itself (`EngineView`): no turn passes through the driver. The driver's
`AgentWorkers` is a drop-in for `AgentLoop` (`rollout`, `env_stats`, `close`), so the sync and
async sources, evaluation and dynamic sampling use workers unchanged. It hands out prompt groups
(a few per call when a rollout has many, one in async mode) to the least busy worker and gets
back `RolloutGroup`s (columnar on the wire, no per-step tensor pickling), with the engines the
worker found dead (the fleet restarts them), its request counts (the fleet's metrics) and, with
`env.agent`, its gateway's counts (`gateway/*`, `rollout/prefix_breaks`: the driver's `metrics`).
A worker that dies is restarted and its unfinished
groups are re-issued to a live one, counted in `agents/worker_restarts` and
`agents/reissued_groups`; sampling seeds depend only on the trajectory and turn, so a re-issued
group samples as it would have. A worker that answers no liveness ping for
`rollout.agent_worker_timeout_s` (frozen: SIGSTOP, a hung event loop) is killed and treated the
same. Groups whose rows died with a worker are rolled out again by the source that decides on
them, synchronous or asynchronous (`replace`, `holders`; `agents/regenerated_groups`); the
asynchronous one drops each group's rows on its own (`drop`). With `async.rollout_bank` a worker
writes the bank file of each group it holds, and a resumed run's banked groups are adopted by a
worker (`adopt`: it reads the file and holds the rows), so their rows never pass through rank 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import math
import os
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from megatron_stepwise.algo.groups import RolloutGroup, flat_steps, pack_groups, unpack_groups
from megatron_stepwise.compose import components
from megatron_stepwise.compose.served import ROLES, ServedModels
from megatron_stepwise.errors import RunFailure, UserError
from megatron_stepwise.rollout.agent.loop import checked_prompt_ids
from megatron_stepwise.rollout.engines.protocol import engine_loss
from megatron_stepwise.rollout.fleet.actor_loss import actor_gone_errors
from megatron_stepwise.rollout.fleet.engine_router import EngineSlot, EngineView, RequestCounters
from megatron_stepwise.rollout.fleet.ray_room import check_room
from megatron_stepwise.steps import Step, StepBatch
from megatron_stepwise.workers.rollout_bank import read_group
from megatron_stepwise.workers.worker_rows import NAMESPACE, HeldGroup, HeldRows, HoldRequest, bank_held

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from megatron_stepwise.config.schema import ExperimentConfig
    from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

log = logging.getLogger(__name__)

CHUNKS_PER_WORKER = 4  # a synchronous rollout's groups go out in at least this many calls per worker
START_TIMEOUT_S = 300.0  # a worker's first answer (imports, tokenizer) may take this long on a loaded node


class AgentWorkersNotStarted(UserError, TimeoutError):
    """The agent workers' actors never started (Ray had no room for them): a resource setting to fix."""


def ping_schedule(timeout_s: float, started: bool) -> tuple[float, float]:
    """(seconds between the last answered ping and the next one, seconds that one may take): a
    worker that freezes right after answering is given up `timeout_s` later, never twice that
    (one wait for the reply, then a ping with a wait of its own, took up to 2 x timeout_s). A
    worker that never answered yet gets START_TIMEOUT_S at least (Ray may still be starting it)."""
    interval = timeout_s / 4
    if not started:
        return interval, max(timeout_s, START_TIMEOUT_S)
    return interval, timeout_s - interval


class WorkerCrashLoop(RunFailure):
    """The same prompt groups killed their agent worker every time they were rolled out: the
    environment's code, its memory, or the node under it."""


class WorkerUnresponsive(TimeoutError):
    """An agent worker answered no liveness ping within `rollout.agent_worker_timeout_s`."""


def resolve_agent_workers(cfg, ray_nodes: Optional[int] = None) -> int:
    """`rollout.agent_workers`, with null resolved: 0 for the embedded engine, else 2 per Ray node."""
    if cfg.rollout.agent_workers is not None:
        return int(cfg.rollout.agent_workers)
    if cfg.rollout.engine == "embedded":
        return 0
    if ray_nodes is None:
        import ray

        ray_nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return 2 * max(1, ray_nodes)


@dataclass
class WorkerReply:
    """The groups (columnar on the wire), what the worker learnt about the engines meanwhile and
    its agent's counts since its last reply (`env.agent`'s gateway: `gateway/*`,
    `rollout/prefix_breaks`; none for the native agent loop)."""

    groups: list[RolloutGroup] | list[HeldGroup]  # held: the worker keeps the rows
    dead_engines: list[tuple[int, int]]
    requests: RequestCounters
    agent_counts: dict[str, float] = dataclasses.field(default_factory=dict)
    served_dead: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)  # teacher, judge

    def __getstate__(self) -> dict:  # all the reply's groups as one columnar batch
        held = bool(self.groups) and isinstance(self.groups[0], HeldGroup)
        groups = self.groups if held else pack_groups(self.groups)
        return {
            "groups": groups,
            "held": held,
            "dead_engines": self.dead_engines,
            "requests": self.requests,
            "agent_counts": self.agent_counts,
            "served_dead": self.served_dead,
        }

    def __setstate__(self, state: dict) -> None:
        self.groups = state["groups"] if state["held"] else unpack_groups(state["groups"])
        self.dead_engines, self.requests = state["dead_engines"], state["requests"]
        self.agent_counts, self.served_dead = state["agent_counts"], state["served_dead"]


class AgentWorker:
    """The body of one agent worker actor."""

    def __init__(self, cfg, max_concurrency: int, name: str = ""):
        self.name = name  # its Ray actor name: training ranks fetch held rows by it
        self.held = HeldRows()
        # One worker is one core's agent loop: a tokenizer thread pool per short text only spins.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

        for module in cfg.trainer.imports:  # user environments register themselves on import
            importlib.import_module(module)
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_concurrency=max_concurrency))
        self.engines = EngineView(
            max_retries=cfg.rollout.max_retries,
            request_timeout_s=cfg.rollout.timeout_s,
            policy=components.routing_policy(cfg),
        )
        # the teacher's and the judge's engines, routed here as the policy's are (compose/served.py)
        self.served = {
            role: EngineView(max_retries=cfg.rollout.max_retries, request_timeout_s=getattr(cfg, role).timeout_s)
            for role in ROLES
            if getattr(cfg, role).enabled
        }
        self.agent = components.build_agent_loop(cfg, self.engines, components.load_tokenizer(cfg), self.served)

    def ready(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()

    def held_groups(self) -> int:
        """How many groups' rows this worker keeps (all rounds not yet released)."""
        return len(self.held.batches)

    async def rollout(
        self,
        samples: list[dict],
        seed: Optional[int],
        request_tag: str,
        engines: list[EngineSlot],
        hold: Optional[HoldRequest] = None,
        served: Optional[dict[str, list[EngineSlot]]] = None,
    ) -> WorkerReply:
        self.engines.refresh(engines)
        for role, table in (served or {}).items():
            self.served[role].refresh(table)
        groups = await self.agent.rollout_groups(samples, seed=seed, request_tag=request_tag)
        dead, requests = self.engines.take_report()
        served_dead = {role: view.take_report()[0] for role, view in self.served.items()}
        if hold is not None:  # keep the prepared rows here; the driver gets their summaries
            banked = await asyncio.to_thread(bank_held, groups, hold) if hold.bank is not None else [None] * len(groups)
            groups = [self.held.keep(g, hold, self.name, b) for g, b in zip(groups, banked)]
        counts = self.agent.metrics() if hasattr(self.agent, "metrics") else {}  # the gateway's (env.agent)
        return WorkerReply(groups, dead, requests, counts, served_dead)

    async def adopt(self, path: str, group_id: str, hold: HoldRequest) -> HeldGroup:
        """A resumed run's banked group: read (off the event loop) and held as if rolled out here."""
        banked = await asyncio.to_thread(read_group, path)
        return self.held.adopt(banked, group_id, hold, self.name)

    def take(self, runs: list[tuple[int, str, list[int]]]) -> StepBatch:
        return self.held.take(runs)

    def release(self, key: int) -> None:
        self.held.release(key)

    def drop(self, groups: list[tuple[int, str]]) -> None:
        self.held.drop(groups)

    def env_stats(self) -> dict[str, int]:
        return self.agent.env_stats()


def _spawn_worker(cfg, index: int, max_concurrency: int, name: str):
    import ray

    check_room(f"agent worker {name}", cfg.rollout.agent_worker_cpus)
    actor = ray.remote(AgentWorker).options(
        num_cpus=cfg.rollout.agent_worker_cpus,
        scheduling_strategy="SPREAD",
        max_restarts=0,
        max_concurrency=1000,
        name=name,
        namespace=NAMESPACE,
    )
    return actor.remote(cfg, max_concurrency, name)


@dataclass
class _Worker:
    index: int
    handle: ActorHandle
    busy: int = 0  # groups in flight on it
    incarnation: int = 0
    started: bool = False  # it has answered once: from then on a ping gets timeout_s, not START_TIMEOUT_S


class AgentWorkers:
    """The driver's side of `n` agent workers (see the module docstring)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        fleet: RolloutFleet,
        n: int,
        spawn: Optional[Callable[[ExperimentConfig, int, int, str], ActorHandle]] = None,
        served: Optional[ServedModels] = None,
    ):
        if n < 1:
            raise ValueError(f"rollout.agent_workers must be >= 1 here, got {n}")
        self.cfg, self.fleet = cfg, fleet
        self.served = served or ServedModels()  # the teacher's and the judge's fleets
        self.samples_per_prompt = cfg.data.samples_per_prompt
        # rollout.max_concurrency trajectories in flight in all; whole groups per worker
        per_worker = max(1, math.ceil(cfg.rollout.max_concurrency / n))
        self.groups_per_worker = max(1, per_worker // self.samples_per_prompt)
        self.max_reissues = cfg.rollout.max_retries + 1
        self.timeout_s = cfg.rollout.agent_worker_timeout_s
        self._concurrency = max(per_worker, self.samples_per_prompt)
        self._spawn = spawn or _spawn_worker
        self._token = uuid.uuid4().hex[:12]  # names this driver's workers apart from any other run's
        self.workers = [_Worker(i, self._new_actor(i, 0)) for i in range(n)]
        self._free = asyncio.Condition()
        self.worker_restarts = 0
        self.reissued_groups = 0
        self.regenerated_groups = 0  # counted by the source that rolls them out again
        self.agent_counts: Counter = Counter()  # the workers' agents' counts not yet reported

    async def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(w.handle.ready.remote() for w in self.workers)), timeout_s)
            for w in self.workers:
                w.started = True
        except asyncio.TimeoutError:
            cpus = self.cfg.rollout.agent_worker_cpus
            raise AgentWorkersNotStarted(
                f"{len(self.workers)} agent workers did not start within {timeout_s:.0f} s: Ray may not have "
                f"{len(self.workers)} x {cpus:g} free CPUs besides the engines' (rollout.agent_workers, "
                f"rollout.agent_worker_cpus; `ray status` shows what is pending)"
            ) from None

    # ---- the AgentLoop surface --------------------------------------------------------------

    async def rollout(
        self,
        samples: Sequence[dict[str, Any]],
        seed: Optional[int] = None,
        on_trajectory_done: Optional[Callable[[list[Step]], None]] = None,
        request_tag: str = "",
    ) -> list[Step]:
        return flat_steps(await self.rollout_groups(samples, seed, on_trajectory_done, request_tag))

    async def rollout_groups(
        self,
        samples: Sequence[dict[str, Any]],
        seed: Optional[int] = None,
        on_trajectory_done: Optional[Callable[[list[Step]], None]] = None,
        request_tag: str = "",
        hold: Optional[HoldRequest] = None,
    ) -> list:
        """One group per sample, in the order of the samples (as `AgentLoop.rollout_groups`); with
        `hold`, the workers keep each group's prepared rows and return `HeldGroup`s."""
        checked_prompt_ids(samples)
        # Several groups a call when there are many (fewer calls, less driver work per turn), yet
        # at least CHUNKS_PER_WORKER calls per worker so the load still balances, and at most half
        # a worker's groups, so its next call starts while the last one's stragglers finish.
        most = max(1, self.groups_per_worker // 2)
        size = max(1, min(most, len(samples) // (CHUNKS_PER_WORKER * len(self.workers))))
        chunks = [[dict(s) for s in samples[i : i + size]] for i in range(0, len(samples), size)]
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._chunk(chunk, seed, request_tag, on_trajectory_done, hold)) for chunk in chunks
                ]
        except BaseExceptionGroup as group:  # the fleet lost every engine: one error, not one per chunk
            lost = engine_loss(group)
            if lost is not None:
                raise lost from None
            raise
        return [g for t in tasks for g in t.result()]

    async def adopt(self, path: str, group_id: str, hold: HoldRequest) -> HeldGroup:
        """A live worker takes over a resumed run's banked group (`AgentWorker.adopt`); raises when
        the file is damaged or gone, or the worker died (restarted): the caller rolls it out again."""
        import ray

        worker = await self._acquire(1)
        incarnation = worker.incarnation
        try:
            return await self._answer(worker, worker.handle.adopt.remote(path, group_id, hold), f"adopting {path}")
        except (*actor_gone_errors(), WorkerUnresponsive) as e:
            self._restart(worker, incarnation, str(e) if isinstance(e, WorkerUnresponsive) else type(e).__name__)
            raise
        except ray.exceptions.RayTaskError as e:
            raise (e.cause if getattr(e, "cause", None) is not None else e) from None
        finally:
            await self._release(worker, 1)

    def env_stats(self) -> dict[str, int]:
        import ray

        total: dict[str, int] = {}
        try:
            replies = ray.get([w.handle.env_stats.remote() for w in self.workers], timeout=self.timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
            log.warning("environment statistics of the agent workers left out: %s", type(e).__name__)
            return total
        for stats in replies:
            for k, v in stats.items():
                total[k] = total.get(k, 0) + v
        return total

    def release(self, key: int) -> None:
        """The rows of round `key` (and earlier) are fetched: the workers drop them."""
        for w in self.workers:
            w.handle.release.remote(key)

    def drop(self, groups: Sequence[HeldGroup]) -> None:
        """These held groups are trained or discarded: their live holders drop their rows (a
        holder replaced since lost them already)."""
        by_name = {self._name(w.index, w.incarnation): w for w in self.workers}
        wanted: dict[str, list[tuple[int, str]]] = {}
        for g in groups:
            if g.holder in by_name:
                wanted.setdefault(g.holder, []).append((g.key, g.prompt_id))
        for name, keys in wanted.items():
            by_name[name].handle.drop.remote(keys)

    def metrics(self) -> dict[str, float]:
        """The workers' own counts, and their agents' counts since the last call (with `env.agent`:
        the gateway's `gateway/*` and `rollout/prefix_breaks`, as an agent in the driver reports them)."""
        agents, self.agent_counts = self.agent_counts, Counter()
        return {
            "agents/workers": float(len(self.workers)),
            "agents/worker_restarts": float(self.worker_restarts),
            "agents/reissued_groups": float(self.reissued_groups),
            "agents/regenerated_groups": float(self.regenerated_groups),
            **{k: float(v) for k, v in agents.items()},
        }

    def holders(self) -> set[str]:
        """The names of the workers alive now: a held group whose holder is not among them lost its rows."""
        return {self._name(w.index, w.incarnation) for w in self.workers}

    def replace(self, names: set[str], why: str) -> None:
        """Restart the workers of these names that still serve (their rows are lost: a fetch found
        them dead or unanswering); names of workers already replaced are ignored."""
        for w in self.workers:
            if self._name(w.index, w.incarnation) in names:
                self._restart(w, w.incarnation, why)

    def close(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass

    # ---- dispatch ----------------------------------------------------------------------------

    async def _acquire(self, groups: int) -> _Worker:
        async with self._free:
            while True:
                free = [w for w in self.workers if w.busy == 0 or w.busy + groups <= self.groups_per_worker]
                if free:
                    worker = min(free, key=lambda w: (w.busy, w.index))
                    worker.busy += groups
                    return worker
                await self._free.wait()

    async def _release(self, worker: _Worker, groups: int) -> None:
        async with self._free:
            worker.busy -= groups
            self._free.notify_all()

    async def _chunk(
        self,
        samples: list[dict],
        seed: Optional[int],
        tag: str,
        on_trajectory_done: Optional[Callable[[list[Step]], None]],
        hold: Optional[HoldRequest] = None,
    ) -> list:
        """Prompt groups rolled out by one worker in one call; re-issued whole if it dies."""
        import ray

        for attempt in range(self.max_reissues + 1):
            worker = await self._acquire(len(samples))
            incarnation = worker.incarnation
            tables = (self.fleet.engine_table(), hold, self.served.tables())
            call = worker.handle.rollout.remote(samples, seed, tag, *tables)
            what = f"rolling out prompt groups {[s.get('prompt_id') for s in samples][:4]}"
            try:
                reply = await self._answer(worker, call, what)
            except (*actor_gone_errors(), WorkerUnresponsive) as e:
                self._restart(worker, incarnation, str(e) if isinstance(e, WorkerUnresponsive) else type(e).__name__)
                if attempt == self.max_reissues:
                    last = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    raise WorkerCrashLoop(
                        f"prompt groups {[s.get('prompt_id') for s in samples][:4]}: their agent worker died "
                        f"{attempt + 1} times (rollout.max_retries + 2; last: {last[:300]}): the environment's "
                        "or reward function's code may end the process (os._exit, a crash in native code), or "
                        "the worker runs out of memory, or its node went away (Ray's worker logs say which)"
                    ) from None
                self.reissued_groups += len(samples)
                continue
            except ray.exceptions.RayTaskError as e:  # the agent loop's own error, as in-process
                raise (e.cause if getattr(e, "cause", None) is not None else e) from None
            finally:
                await self._release(worker, len(samples))
            for index, engine_incarnation in reply.dead_engines:
                self.fleet.report_dead(index, engine_incarnation)
            self.served.report_dead(reply.served_dead)
            self.fleet.add_request_counts(reply.requests)
            self.agent_counts.update(reply.agent_counts)
            if on_trajectory_done is not None:  # held groups: one call per trajectory, without its steps
                for group in reply.groups:
                    for trajectory in group.trajectories if hold is None else [[]] * len(group.summary().turns):
                        on_trajectory_done(trajectory)
            return reply.groups
        raise AssertionError("unreachable")

    async def _answer(self, worker: _Worker, call, what: str):
        """The worker's reply to `call`, however long the work takes while the worker answers
        liveness pings; WorkerUnresponsive once it has answered none for `timeout_s`."""
        reply = asyncio.ensure_future(call)
        ping = None
        try:
            while True:
                interval, bound = ping_schedule(self.timeout_s, worker.started)
                done, _ = await asyncio.wait({reply}, timeout=interval)
                if not done:
                    ping = asyncio.ensure_future(worker.handle.ready.remote())
                    done, _ = await asyncio.wait({reply, ping}, timeout=bound, return_when=asyncio.FIRST_COMPLETED)
                if reply in done:
                    worker.started = True
                    return reply.result()
                if ping not in done:
                    name = self._name(worker.index, worker.incarnation)
                    raise WorkerUnresponsive(
                        f"agent worker {name} answered no liveness ping for {interval + bound:g} s while {what} "
                        "(rollout.agent_worker_timeout_s): treated as dead"
                    )
                worker.started = True
        finally:
            reply.cancel()
            if ping is not None:
                ping.cancel()

    def _name(self, index: int, incarnation: int) -> str:
        return f"agent-{self._token}-{index}.{incarnation}"

    def _new_actor(self, index: int, incarnation: int):
        return self._spawn(self.cfg, index, self._concurrency, self._name(index, incarnation))

    def _restart(self, worker: _Worker, incarnation: int, why: str) -> None:
        """Replace a dead (or frozen) worker once (the other groups it held see the same death)."""
        if worker.incarnation != incarnation:
            return
        import ray

        log.warning("agent worker %s lost (%s); restarting it", self._name(worker.index, incarnation), why)
        try:
            ray.kill(worker.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - it is dead already
            pass
        worker.incarnation += 1
        worker.started = False
        worker.handle = self._new_actor(worker.index, worker.incarnation)
        self.worker_restarts += 1
