"""A rollout fleet: N engine actors on Ray behind one `generate` with routing and fault handling.

Engines are embedded (`local`), launched SGLang servers (`sglang`) or running servers (`http`).
A session's turns stick to one engine (prefix-cache reuse), new sessions go to the least busy.
Weight updates pause, update, flush and resume every engine behind a gate (in-flight requests
continue with `partial_rollouts`); every generation reports its weight version. A failed request
is retried on another engine and a dead engine restarted at the current weights, so each turn
resolves exactly once. Colocated mode releases and resumes engine memory. `score` (a teacher's
log-probs of given tokens, for distillation) is routed, limited and retried as `generate` is.

Routing, updates, faults and colocated mode in detail: docs/scale.md,
'Fleet routing, updates and faults'.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, Optional

from megatron_stepwise.rollout.agent.loop import AgentLoopConfig
from megatron_stepwise.rollout.engines.protocol import (
    EngineError,
    EngineReleasedError,
    FleetLost,
    GenerateResult,
    NamedTensors,
    RetryConfig,
    SamplingParams,
    memory_tags,
)
from megatron_stepwise.rollout.engines.sglang import TensorHandles, serialize_tensors_sglang
from megatron_stepwise.rollout.fleet.actor_loss import actor_gone_errors
from megatron_stepwise.rollout.fleet.engine_actor import EngineActor, EngineSpec
from megatron_stepwise.rollout.fleet.engine_router import EngineRouter, EngineSlot, RequestCounters
from megatron_stepwise.rollout.fleet.ray_nodes import actor_nodes, node_address
from megatron_stepwise.rollout.fleet.ray_room import check_room
from megatron_stepwise.rollout.fleet.ray_start import ensure_ray
from megatron_stepwise.rollout.fleet.session_routing import RoutingPolicy

log = logging.getLogger(__name__)


def weight_update_ranks(specs: list[EngineSpec]) -> tuple[list[int], int]:
    """`rank_offset` of each engine in a weight-update group whose rank 0 is the trainer, and the
    group's world size (1 + every engine's ranks)."""
    offsets, next_rank = [], 1
    for spec in specs:
        offsets.append(next_rank)
        next_rank += spec.group_ranks
    return offsets, next_rank


@dataclass
class FleetMetrics(RequestCounters):
    engine_failures: int = 0
    restarts: int = 0
    removed_engines: int = 0
    weight_updates: int = 0
    frozen_engines: int = 0  # engines that did not answer an update in time (killed, restarted)


@dataclass
class _Slot(EngineSlot):
    spec: Optional[EngineSpec] = None
    restarts: int = 0
    cause: str = ""  # why it is out of service, for FleetLost


async def _awaited(awaitable):
    """Any awaitable (a Ray ObjectRef too) as a coroutine that asyncio.wait_for can cancel."""
    return await awaitable


def _one_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


def _sampled_answers(answers: dict[int, Any]) -> list[dict[str, Any]]:
    """An update's answers with `sample_weights` (see `RolloutFleet.update_weights_from_disk`), by index."""
    out = []
    for index, answer in sorted(answers.items()):
        if answer is None:
            answer = {"unverified": True, "reason": "died during the update, so it is not verified"}
        elif not isinstance(answer, dict):
            answer = {"unverified": True, "reason": f"answered the update with {answer!r}, not its samples"}
        out.append({"index": index, **answer})
    return out


def _spawn_actor(spec: EngineSpec, index: int, incarnation: int):
    """The fleet's default engine: a Ray actor running `EngineActor`."""
    import ray

    check_room(f"engine {index}", spec.num_cpus, spec.num_gpus)
    actor = ray.remote(EngineActor).options(
        num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_concurrency=1000, max_restarts=0
    )
    return actor.remote(spec, f"engine{index}.{incarnation}")


class RolloutFleet:
    """N engine actors behind one `generate` (see module docstring)."""

    def __init__(
        self,
        specs: list[EngineSpec],
        max_concurrency: int = AgentLoopConfig.max_concurrency,
        max_retries: int = RetryConfig.max_retries,
        request_timeout_s: float = RetryConfig.timeout_s,
        restart_dead: bool = True,
        max_restarts: int = RetryConfig.max_restarts,
        ray_address: Optional[str] = None,
        ray_num_cpus: Optional[int] = None,
        partial_rollouts: bool = False,
        colocate: bool = False,
        spawn: Optional[Callable[[EngineSpec, int, int], Any]] = None,
        routing: Optional[RoutingPolicy] = None,
        pause_mode: str = "retract",
        max_staleness: Optional[int] = None,
        engine_call_timeout_s: float = 600.0,
    ):
        """`spawn(spec, index, incarnation)` starts an engine and returns its handle (whose
        `call.remote(method, ...)` reaches any `Engine` method); default: a Ray actor, Ray started
        on demand. Tests pass their own handles. `routing`: the router's policy (default sticky).
        With `partial_rollouts`, `pause_mode` is how an update pauses requests in flight
        ("retract": they continue, KV recomputed; "in_place": embedded engines only, they continue
        on their KV; "abort": they end, counted in `aborted_by_update`), and `max_staleness`
        (async.max_staleness) drops those that arrived more than that many versions before the
        new weights (`dropped_stale`): they could never be trained. `engine_call_timeout_s` bounds
        each engine's part of an update (pause, load, flush, resume) and other fleet-wide calls: an
        engine that does not answer in time (frozen, SIGSTOPped) is treated as dead: killed,
        restarted, the update replayed on it."""
        if not specs:
            raise ValueError("a fleet needs at least one EngineSpec")
        if pause_mode not in ("retract", "in_place", "abort"):
            raise ValueError(f"pause_mode must be 'retract', 'in_place' or 'abort', got {pause_mode!r}")
        if spawn is None:
            ensure_ray(ray_address, ray_num_cpus or max(4, len(specs) + 1))
        self._spawn = spawn or _spawn_actor
        self.max_retries = max_retries
        self.request_timeout_s = request_timeout_s
        self.restart_dead = restart_dead
        self.max_restarts = max_restarts
        self.weight_version = 0
        # False: a weight update waits for in-flight requests to finish (synchronous training).
        # True: it pauses them mid-turn; they continue with the new weights (partial rollouts).
        self.partial_rollouts = partial_rollouts
        self.pause_mode = pause_mode
        self.max_staleness = max_staleness
        self.engine_call_timeout_s = engine_call_timeout_s
        # True: engines share the trainer's GPUs (colocated mode): CUDA tensors go as IPC handles.
        self.colocate = colocate
        self._metrics = FleetMetrics()
        self._limit = asyncio.Semaphore(max_concurrency)
        self._slots = [_Slot(i, self._spawn(spec, i, 0), spec=spec) for i, spec in enumerate(specs)]
        self._router = EngineRouter(
            self._slots,
            max_retries=max_retries,
            request_timeout_s=request_timeout_s,
            on_dead=self._mark_dead,
            counters=self._metrics,
            policy=routing,
        )
        self._gate = asyncio.Event()
        self._gate.set()
        self._inflight = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._update_lock = asyncio.Lock()
        self._replay: Optional[Callable[[Any, int], Awaitable]] = None
        self._restarts: set[asyncio.Task] = set()
        self._released: set[str] = set()  # memory tags every engine has released (colocated mode)

    # ---- lifecycle --------------------------------------------------------------------------

    async def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until every engine answers a health check."""
        await asyncio.wait_for(asyncio.gather(*(s.handle.call.remote("health") for s in self._slots)), timeout_s)

    @property
    def num_alive(self) -> int:
        return sum(s.alive for s in self._slots)

    def engine(self, index: int):
        """The Ray actor handle of engine `index` as it is now (`handle.call.remote(method, ...)`
        reaches any `Engine` method). A restarted engine gets a new handle: ask again after a
        restart. For tests and drills; requests go through `generate`."""
        return self._slots[index].handle

    def outstanding(self, index: int) -> int:
        """Requests engine `index` is serving now (routing picks the engine with the fewest)."""
        return self._slots[index].outstanding

    def remove_engine(self, index: int) -> None:
        """Take engine `index` out of service, without restarting it: no request, no weight
        update reaches it (drills and tests; the fleet finds real deaths itself)."""
        slot = self._slots[index]
        if slot.alive:
            slot.alive = False
            slot.cause = "removed"
            self._metrics.removed_engines += 1

    def kill_engine(self, index: int) -> None:
        """Kill one engine's actor (fault-injection for tests and drills)."""
        import ray

        ray.kill(self._slots[index].handle, no_restart=True)

    async def shutdown(self) -> None:
        import ray

        for t in list(self._restarts):
            t.cancel()
        for s in self._slots:
            if s.alive:
                try:
                    await asyncio.wait_for(s.handle.shutdown.remote(), 10)
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
            ray.kill(s.handle, no_restart=True)
            s.alive = False

    def metrics(self) -> dict[str, Any]:
        m = asdict(self._metrics)
        m.update(alive_engines=self.num_alive, weight_version=self.weight_version)
        return m

    # ---- agent workers route their own requests ---------------------------------------------

    def engine_table(self) -> list[EngineSlot]:
        """The engines as they are now, for agent workers' own routers (`EngineView`)."""
        return [EngineSlot(s.index, s.handle, s.incarnation, s.alive) for s in self._slots]

    def report_dead(self, index: int, incarnation: int) -> None:
        """An agent worker found engine `index` dead: restart it as if the fleet had."""
        self._mark_dead(self._slots[index], incarnation)

    def add_request_counts(self, counts: RequestCounters) -> None:
        """Requests an agent worker routed itself count in `metrics()` like the fleet's own."""
        for key, value in asdict(counts).items():
            setattr(self._metrics, key, getattr(self._metrics, key) + value)

    # ---- generation -------------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: Optional[str] = None, session: Optional[str] = None
    ) -> GenerateResult:
        return await self._routed(lambda: self._router.generate(input_ids, sampling, rid, session))

    async def score(self, input_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """Teacher log-probs (`Engine.score`), routed, limited and retried as `generate` is."""
        return await self._routed(lambda: self._router.score(input_ids, start, temperature))

    async def _routed(self, request: Callable[[], Awaitable]) -> Any:
        """`request()` (one of the router's) under the concurrency limit, once no weight update
        runs; again once restarts finish if its engines died under it."""
        blocking = sorted(self._released & {"weights", "kv_cache"})
        if blocking:
            raise EngineReleasedError(
                f"the fleet's engines have released their {' and '.join(blocking)} memory "
                "(colocated mode): resume_memory_occupation before generating"
            )
        async with self._limit:
            while not self._gate.is_set():  # a weight update is in progress
                await self._gate.wait()
            self._inflight += 1
            self._drained.clear()
            try:
                for _ in range(self.max_retries + 1):
                    await self._wait_for_an_engine()
                    try:
                        return await request()
                    except EngineReleasedError:
                        raise
                    except EngineError as e:  # its engines died under it: again once restarts are done
                        if self.num_alive and not self._restarts:
                            raise
                        error = e
                await self._wait_for_an_engine()
                raise error
            finally:
                self._inflight -= 1
                if self._inflight == 0:
                    self._drained.set()

    async def _wait_for_an_engine(self) -> None:
        """Return once an engine is alive; `FleetLost` when every one is gone for good."""
        while self.num_alive == 0 and self._restarts:
            await self.wait_restarts()
        if self.num_alive == 0:
            causes = "; ".join(f"engine {s.index}: {s.cause or 'removed'}" for s in self._slots)
            raise FleetLost(f"every rollout engine is gone ({causes})")

    def _mark_dead(self, slot: _Slot, incarnation: int) -> None:
        if not slot.alive or slot.incarnation != incarnation:
            return  # already handled (another request saw the same death)
        slot.alive = False
        self._metrics.engine_failures += 1
        self._router.forget(slot.index)
        log.warning("engine %d is dead", slot.index)
        slot.cause = "died"
        if slot.restarts >= self.max_restarts:
            slot.cause = f"died again after {slot.restarts} restarts (the limit)"
            self._metrics.removed_engines += 1
        elif self.restart_dead and self._replay is not False:
            slot.restarts += 1
            task = asyncio.get_running_loop().create_task(self._restart(slot))
            self._restarts.add(task)
            task.add_done_callback(self._restarts.discard)
        else:
            slot.cause = (
                "died (not restartable: weights came over a distributed group)"
                if self.restart_dead
                else "died (restarts are off)"
            )
            self._metrics.removed_engines += 1

    async def _restart(self, slot: _Slot) -> None:
        import ray

        try:
            if ray.is_initialized():  # (a handle of a test's own spawn is no actor; never start Ray for it)
                ray.kill(slot.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - it is dead already
            pass
        async with self._update_lock:  # never come back in the middle of a weight update
            try:
                handle = self._spawn(slot.spec, slot.index, slot.incarnation + 1)
                await asyncio.wait_for(handle.call.remote("health"), 300)
                if self._replay is not None:
                    await self._replay(handle, self.weight_version)
                if self._released:  # colocated: give training the memory its peers gave
                    await handle.call.remote("release_memory_occupation", sorted(self._released))
                slot.handle, slot.incarnation, slot.alive = handle, slot.incarnation + 1, True
                self._metrics.restarts += 1
                log.warning("engine %d restarted at weight version %d", slot.index, self.weight_version)
            except Exception as e:  # noqa: BLE001
                log.exception("engine %d could not be restarted; removed from the fleet", slot.index)
                slot.cause = f"died, and its restart failed ({_one_line(e)})"
                self._metrics.removed_engines += 1

    async def wait_restarts(self) -> None:
        """Wait for engine restarts in progress (tests, orderly shutdown)."""
        while self._restarts:
            await asyncio.gather(*list(self._restarts), return_exceptions=True)

    # ---- colocated mode -----------------------------------------------------------------------

    async def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Every live engine frees the memory of `tags` (None = all), once in-flight requests are done."""
        tags = memory_tags(tags)
        async with self._update_lock:
            self._gate.clear()
            try:
                await self._drained.wait()  # engines release only when idle (SGLang asserts it)
                await self._fan_out("release_memory_occupation", list(tags))
                self._released.update(tags)
            finally:
                self._gate.set()

    async def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Every live engine takes back the memory of `tags` (None = all released ones).

        Colocated order after training: resume ["weights"], push the new weights, resume
        ["kv_cache"] (an update needs the weights' memory; the cache comes back last)."""
        tags = [t for t in memory_tags(tags) if t in self._released] if tags is None else list(memory_tags(tags))
        async with self._update_lock:
            await self._fan_out("resume_memory_occupation", tags)
            self._released.difference_update(tags)

    def released_memory(self) -> list[str]:
        """Memory tags the engines have released now."""
        return sorted(self._released)

    async def _fan_out(self, method: str, *args) -> None:
        live = [s for s in self._slots if s.alive]
        await asyncio.gather(*(self._guarded(lambda s: s.handle.call.remote(method, *args), s) for s in live))

    # ---- weights ----------------------------------------------------------------------------

    async def _update(
        self, call: Callable[[Any, int], Awaitable], weight_version: Optional[int], replay
    ) -> tuple[int, dict[int, Any]]:
        """Pause, load (`call`), flush and resume every live engine; the new version and the
        answer to `call` of each engine live when it began, by index (None: it died first)."""
        if "weights" in self._released:
            raise EngineReleasedError(
                "weight update while the engines' weights are released: resume_memory_occupation(['weights']) first"
            )
        async with self._update_lock:
            self._gate.clear()
            try:
                if not self.partial_rollouts:
                    await self._drained.wait()
                version = self.weight_version + 1 if weight_version is None else int(weight_version)
                live = [s for s in self._slots if s.alive]
                answers: dict[int, Any] = {s.index: None for s in live}

                async def load(s):
                    answers[s.index] = await call(s, version)

                phases = [
                    lambda s: s.handle.call.remote("pause", self.pause_mode),
                    load,
                    lambda s: s.handle.call.remote("flush_cache"),
                    lambda s: s.handle.call.remote("resume"),
                ]
                if self.partial_rollouts and self.max_staleness is not None:  # before they re-prefill
                    phases.insert(2, lambda s: s.handle.call.remote("abort_stale", version - self.max_staleness))
                for phase in phases:
                    await asyncio.gather(*(self._guarded(phase, s) for s in live))
                    live = [s for s in live if s.alive]
                self.weight_version = version
                self._replay = replay
                self._metrics.weight_updates += 1
                return version, answers
            finally:
                self._gate.set()

    async def _guarded(self, fn, slot: _Slot) -> Any:
        """One engine's part of an update (its answer; None if it died); an engine that dies
        meanwhile is handled like any death (its restart waits for this update and then replays it)."""
        incarnation = slot.incarnation
        try:
            return await asyncio.wait_for(_awaited(fn(slot)), self.engine_call_timeout_s)
        except asyncio.TimeoutError:
            log.warning(
                "engine %d did not answer a weight update or fleet-wide call within %.0f s "
                "(weight_sync.engine_timeout_s): treated as dead, restarted",
                slot.index,
                self.engine_call_timeout_s,
            )
            self._metrics.frozen_engines += 1
            self._mark_dead(slot, incarnation)
        except actor_gone_errors():
            self._mark_dead(slot, incarnation)

    async def update_weights_from_tensors(
        self, named_tensors: NamedTensors, weight_version: Optional[int] = None, *, sample_weights: bool = False
    ) -> Any:
        """Broadcast HF-named tensors to every engine (stored once in Ray's object store).
        `sample_weights`: as in `update_weights_from_disk`."""
        import ray

        items = dict(named_tensors.items()) if hasattr(named_tensors, "items") else dict(named_tensors)
        extra = {"sample_weights": True} if sample_weights else {}
        if self.colocate and any(v.is_cuda for v in items.values()):
            # Colocated on GPU: the engines map the trainer's tensors by CUDA IPC handles (SGLang's
            # own format), no copy through host memory. Handles die with this call's tensors, so a
            # restarted engine cannot replay them: it is removed instead (replay=False).
            ref = ray.put(TensorHandles(serialize_tensors_sglang(list(items.items()))))

            async def send(s, version):
                return await s.handle.call.remote("update_weights_from_tensors", ref, version, **extra)

            return await self._answer(send, weight_version, False, sample_weights)
        ref = ray.put({k: v.detach().cpu() for k, v in items.items()})

        async def replay(handle, version):
            await handle.call.remote("update_weights_from_tensors", ref, version)

        async def send(s, version):
            return await s.handle.call.remote("update_weights_from_tensors", ref, version, **extra)

        return await self._answer(send, weight_version, replay, sample_weights)

    async def update_weights_from_disk(
        self, path: str, weight_version: Optional[int] = None, *, sample_weights: bool = False
    ) -> Any:
        """Every engine loads the HF safetensors in `path`; returns the new weight version.

        With `sample_weights` each engine also takes, once it has applied the update and inside the
        same request, the values the trainer's sampled check compares (`weight_checks.samples_of`),
        and this returns one answer per engine live when the update began, by index:
        {"index", "engine", "weight_version", "samples", "sample_s"}, or {"index", "unverified":
        True, "reason"} for an engine that cannot sample (SGLang) or died during the update."""

        async def replay(handle, version):
            await handle.call.remote("update_weights_from_disk", str(path), version)

        async def send(s, version):
            extra = {"sample_weights": True} if sample_weights else {}
            return await s.handle.call.remote("update_weights_from_disk", str(path), version, **extra)

        return await self._answer(send, weight_version, replay, sample_weights)

    async def _answer(self, send, weight_version: Optional[int], replay, sample_weights: bool) -> Any:
        """`_update`, answered with the new version, or with every engine's answer when sampled."""
        version, answers = await self._update(send, weight_version, replay)
        return _sampled_answers(answers) if sample_weights else version

    async def verify_weights(self, checks: Any, weight_version: int) -> list[dict[str, Any]]:
        """Every live engine compares the trainer's record of a push (`weight_checks`) with the
        weights it holds: one dict per engine, {"index", "engine", "weight_version", "problems":
        {tensor: why}}, or {"index", "unverified": True} for an engine that cannot check (SGLang)."""
        import ray

        ref = ray.put(checks) if ray.is_initialized() else checks  # stored once for every engine
        results: dict[int, dict[str, Any]] = {}

        async def one(slot: _Slot) -> None:
            answer = await slot.handle.call.remote("verify_weights", ref, int(weight_version))
            results[slot.index] = {"index": slot.index, **(answer if answer is not None else {"unverified": True})}

        async with self._update_lock:  # never beside a weight update or a restart's replay
            await asyncio.gather(*(self._guarded(one, s) for s in self._slots if s.alive))
        return [results[i] for i in sorted(results)]

    async def weights_manifest(self, index: int) -> dict[str, Any]:
        """Engine `index`'s {"engine", "weight_version", "tensors": {HF name: {shape, dtype,
        sha256}}} (the embedded engine only)."""
        return await self._slots[index].handle.call.remote("weights_manifest")

    def weight_update_world_size(self) -> int:
        """World size of the group `init_weights_update_group` would open now (trainer + engine ranks)."""
        return weight_update_ranks([s.spec for s in self._slots if s.alive])[1]

    def weight_group_address(self) -> str:
        """Where the engines reach the trainer's weight-update store: loopback when every live
        engine runs on this node (the unauthenticated store stays private), else this node's
        cluster address (engines on other nodes cannot reach this node's loopback)."""
        here = node_address()
        engines = actor_nodes([s.handle for s in self._slots if s.alive])
        return "127.0.0.1" if all(node == here for node in engines) else here

    async def init_weights_update_group(
        self, master_address: str, master_port: int, group_name: str = "weight_update_group", backend: str = "gloo"
    ) -> int:
        """Every live engine joins one group with the trainer as rank 0, an SGLang engine with one
        rank per TP rank from its `rank_offset` (`weight_update_ranks`); returns the world size.

        The trainer must open its side (`weight_sync.open_group`) concurrently. Engines that die
        later cannot rejoin such a group, so they are removed rather than restarted.
        """
        live = [s for s in self._slots if s.alive]
        ranks, world_size = weight_update_ranks([s.spec for s in live])
        await asyncio.gather(
            *(
                s.handle.call.remote(
                    "init_weights_update_group", master_address, master_port, r, world_size, group_name, backend
                )
                for s, r in zip(live, ranks)
            )
        )
        return world_size

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: Optional[int] = None,
        *,
        sample_weights: bool = False,
    ) -> Any:
        """Engines receive by broadcast; run concurrently with the trainer's `weight_sync.broadcast`.
        `sample_weights`: as in `update_weights_from_disk`."""
        extra = {"sample_weights": True} if sample_weights else {}

        async def call(s, v):
            return await s.handle.call.remote(
                "update_weights_from_distributed", names, dtypes, shapes, group_name, v, **extra
            )

        return await self._answer(call, weight_version, False, sample_weights)
