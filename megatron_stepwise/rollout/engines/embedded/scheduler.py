"""The embedded engine's scheduler: continuous batching and admission on one model thread.

Requests queue on the event loop; one task runs the model between them on a single worker
thread, so the event loop stays responsive. Between two decode steps cancelled rows leave, the
KV is rebuilt after a weight load, queued requests are admitted (the oldest always, then each
whose uncached prompt fits `max_prefill_tokens`) and join the running batch, then one decode step
runs. The model lock keeps aborts and weight loads out of the middle of a step; a pause holds
the engine between two steps. A model-thread failure fails every request in flight and makes
the engine unhealthy until the next good load (`weights_replaced`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from typing import AsyncIterator, Optional

import torch

from megatron_stepwise.rollout.engines.embedded.batch import EngineParts, Request, RunningBatch
from megatron_stepwise.rollout.engines.protocol import EngineError, GenerateResult, SamplingParams

log = logging.getLogger(__name__)

#: How paused requests continue after a weight load (SGLang's /pause_generation modes).
PAUSE_MODES = ("retract", "in_place", "abort")


class Scheduler:
    """The queue, the requests in flight and the running batch of one `LocalEngine`.

    Args: see `LocalEngine` (max_batch_size, continuous_batching, max_prefill_tokens,
    overload_queued_tokens).
    """

    def __init__(
        self,
        engine: EngineParts,
        max_batch_size: int,
        continuous_batching: bool,
        max_prefill_tokens: int,
        overload_queued_tokens: Optional[int],
    ):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.continuous_batching = continuous_batching
        self.max_prefill_tokens = max_prefill_tokens
        self.overload_queued_tokens = (
            4 * max_prefill_tokens if overload_queued_tokens is None else overload_queued_tokens
        )
        self.joined_running_batch = 0  # requests that joined a batch already decoding
        self.cancelled_requests = 0  # requests whose caller went away before they finished
        self.aborted_by_pause = 0  # requests a pause ("abort" mode, or an abort while paused) ended
        self.dropped_stale = 0  # requests `abort_stale` ended
        self.batch: Optional[RunningBatch] = None
        self.continue_mode = "retract"  # how requests paused by the last pause() continue
        self.pending: list[Request] = []
        self.inflight: dict[str, Request] = {}
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{engine.name}-model")
        self.failure: Optional[BaseException] = None
        self._loop_task: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._wakeup: Optional[asyncio.Event] = None
        self._running: Optional[asyncio.Event] = None
        self._model_lock: Optional[asyncio.Lock] = None
        self._next_rid = 0
        self._pause_points: dict[str, int] = {}  # rid -> pause the engine once it has this many tokens

    def ensure_started(self) -> None:
        # (Re)start the scheduler on the running event loop; a new loop (e.g. a second
        # asyncio.run) gets fresh events, since asyncio primitives are bound to one loop.
        loop = asyncio.get_running_loop()
        if self._loop_task is None or self._loop is not loop or self._loop_task.done():
            self._loop = loop
            self.pending.clear()
            self.inflight.clear()
            self._pause_points.clear()
            self._wakeup = asyncio.Event()
            self._running = asyncio.Event()
            self._running.set()
            self._model_lock = asyncio.Lock()
            self._loop_task = loop.create_task(self._schedule_loop())

    async def run(self, fn, *args):
        """`fn(*args)` on the model thread, behind whatever it runs now."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """The model between two decode steps: no step, abort or weight load runs meanwhile."""
        self.ensure_started()
        async with self._model_lock:
            yield

    @property
    def healthy(self) -> bool:
        return self.failure is None and (self._loop_task is None or not self._loop_task.done())

    def weights_replaced(self) -> None:
        """A weight load finished: a failed model thread gets its chance again, and the requests in
        flight go on as the pause around this load says (a load outside a pause: retract)."""
        if self.failure is not None:  # the model thread failed on the old weights; the new ones get a chance
            log.warning(
                "embedded engine %s: healthy again after a weight load (it had failed: %r)",
                self.engine.name,
                self.failure,
            )
            self.failure = None
        self.continue_mode = self.continue_mode if self.paused else "retract"

    async def _schedule_loop(self) -> None:
        self.batch = None
        try:
            while True:
                while self.batch is None and not self.pending:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                await self._running.wait()
                async with self._model_lock:  # no abort or weight load in the middle of a step
                    await self._next_step()
                if self.batch is not None and not self.batch.requests:
                    self.batch = None
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a model failure makes the engine unhealthy; callers see it
            log.exception("embedded engine %s failed", self.engine.name)
            self.failure = e
            self.batch = None
            for r in list(self.inflight.values()):
                if not r.future.done():
                    r.future.set_exception(EngineError(f"engine {self.engine.name} failed: {e!r}"))

    async def _next_step(self) -> None:
        """Between two decode steps: cancelled rows leave, the KV is rebuilt after a weight load,
        queued requests join (continuous batching), then one decode step."""
        batch = self.batch
        if batch is not None:
            for r in batch.requests:
                if r.cancelled and r.finish_reason is None:
                    r.finish_reason, r.matched = "abort", None
            active = any(r.finish_reason is None for r in batch.requests)
            if active and batch.weights_epoch != self.engine.weights.epoch:  # weights changed since the cache was built
                await self.run(batch.continue_in_place if self.continue_mode == "in_place" else batch.rebuild)
        joinable = batch is None or (self.continuous_batching and batch.mergeable)
        slots = self.max_batch_size - (len(batch.requests) if batch is not None else 0)
        admitted = self._take_admissible(slots) if joinable else []
        if admitted:
            if batch is None:
                self.batch = batch = await self.run(RunningBatch, self.engine, admitted)
            else:
                await self.run(batch.admit, admitted)
                self.joined_running_batch += len(admitted)
        if batch is None:
            return
        done = await self.run(batch.step)
        self._after_step(batch.requests + done)
        for r in done:
            self._resolve(r)

    def _take_admissible(self, slots: int) -> list[Request]:
        """Queued requests to prefill now, in arrival order: the oldest always (nothing waits
        forever), then each later one whose uncached prompt still fits `max_prefill_tokens`, so a
        short prompt passes long ones that do not fit and one prefill never runs unbounded."""
        taken: list[Request] = []
        budget = self.max_prefill_tokens
        for r in list(self.pending):
            if len(taken) >= slots or budget <= 0:
                break
            if r.cancelled or self._finish_early(r):
                self.pending.remove(r)
                continue
            cost = len(r.input_ids) - self.engine.prefix_cache.match_length(r.input_ids, len(r.input_ids) - 1)
            if taken and cost > budget:
                continue
            if taken:
                budget -= cost
            taken.append(r)
            self.pending.remove(r)
        return taken

    def _after_step(self, requests: list[Request]) -> None:
        # Runs on the event loop right after a decode step, before the next one can start: a
        # pause point takes effect with exactly its number of tokens, and `decoded_tokens` shows
        # a count only once this has run (output_ids grows on the model thread during the step).
        for r in requests:
            r.decoded = len(r.output_ids)
            n = self._pause_points.get(r.rid)
            if n is not None and r.decoded >= n:
                del self._pause_points[r.rid]
                self._running.clear()

    def _finish_early(self, r: Request) -> bool:
        """Requests that need no forward pass: nothing to generate."""
        if r.sampling.max_new_tokens == 0 or len(r.input_ids) >= self.engine.max_positions:
            r.finish_reason, r.matched = "length", None
        else:
            return False
        self._resolve(r)
        return True

    def _resolve(self, r: Request) -> None:
        if r.resolved:
            return
        r.resolved = True
        if self.inflight.get(r.rid) is r:
            del self.inflight[r.rid]
            self._pause_points.pop(r.rid, None)
        if r.future.done():  # its caller was cancelled
            return
        r.future.set_result(self.engine.result(r))

    async def submit(self, ids: list[int], sampling: SamplingParams, rid: Optional[str]) -> GenerateResult:
        """Queue one checked request and wait for its result."""
        if rid is None:
            self._next_rid += 1
            rid = f"{self.engine.name}-{self._next_rid}"
        if rid in self.inflight:
            raise ValueError(f"request id {rid!r} is already in flight")
        req = Request(ids, sampling, rid, asyncio.get_running_loop().create_future())
        req.start_version = self.engine.weights.version
        if sampling.sampling_seed is not None:
            req.generator = torch.Generator().manual_seed(sampling.sampling_seed % (1 << 63))
        self.inflight[rid] = req
        self.pending.append(req)
        self._wakeup.set()
        try:
            return await req.future
        except asyncio.CancelledError:  # the caller went away (an HTTP client disconnected, a timeout)
            self._cancel(req)
            raise

    def _cancel(self, r: Request) -> None:
        """Stop a request nobody waits for: out of the queue now, out of the batch at the next step."""
        if r.resolved:
            return
        self.cancelled_requests += 1
        r.cancelled, r.resolved = True, True
        if r in self.pending:
            self.pending.remove(r)
        if self.inflight.get(r.rid) is r:
            del self.inflight[r.rid]
            self._pause_points.pop(r.rid, None)

    def stats(self) -> dict:
        """The scheduler's load: rows decoding, requests queued and their prompt tokens, whether
        that is more than the engine works off soon (`overloaded`), and counters."""
        queued_tokens = sum(len(r.input_ids) for r in self.pending)
        return {
            "running": len(self.batch.requests) if self.batch is not None else 0,
            "queued": len(self.pending),
            "queued_prompt_tokens": queued_tokens,
            "overloaded": queued_tokens > self.overload_queued_tokens or len(self.pending) > 4 * self.max_batch_size,
            "max_batch_size": self.max_batch_size,
            "continuous_batching": self.continuous_batching,
            "joined_running_batch": self.joined_running_batch,
            "cancelled_requests": self.cancelled_requests,
            "aborted_by_pause": self.aborted_by_pause,
            "dropped_stale": self.dropped_stale,
        }

    # ---- pause, abort ---------------------------------------------------------------------------

    async def pause(self, mode: str = "retract") -> int:
        """Hold every request between two decode steps. How they continue after a weight load,
        SGLang's modes: "retract" recomputes their KV with the new weights, "in_place" keeps the
        old weights' KV, "abort" ends them now (reason "abort", abort_reason "pause"). Returns how
        many requests it aborted."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.ensure_started()
        self._running.clear()
        self.continue_mode = mode
        return await self.abort() if mode == "abort" and self.inflight else 0

    async def resume(self) -> None:
        self.ensure_started()
        self._running.set()

    @property
    def paused(self) -> bool:
        """Held between two decode steps (`pause`, or a `pause_after` point reached)."""
        return self._running is not None and not self._running.is_set()

    async def pause_after(self, rid: str, num_tokens: int) -> None:
        """Pause the engine (as `pause()`) right after the decode step that gives request `rid`
        its `num_tokens`-th token; `resume()` continues. Returns at once: the request may not have
        arrived yet. If it already has that many tokens the engine pauses before its next step;
        if it finishes with fewer, nothing happens. For tests and drills that need a request held
        at a known point whatever the machine's speed (poll `decoded_tokens(rid)` to see it).
        """
        if int(num_tokens) < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.ensure_started()
        r = self.inflight.get(rid)
        if r is not None and r.decoded >= int(num_tokens):
            self._running.clear()
        else:
            self._pause_points[rid] = int(num_tokens)

    def decoded_tokens(self, rid: str) -> Optional[int]:
        """How many tokens request `rid` has generated so far (counting finished decode steps, so
        a request held by `pause_after(rid, n)` shows exactly n); None if it is not in flight."""
        r = self.inflight.get(rid)
        return None if r is None else r.decoded

    async def abort(self, rid: Optional[str] = None) -> int:
        """Finish the request(s) now with reason "abort", keeping the tokens generated so far.
        While the engine is paused (a weight update) they count as aborted by the pause
        (`aborted_by_pause`, their results' `abort_reason` "pause"). Returns how many it ended."""
        if rid is not None and rid not in self.inflight:
            return 0
        targets = list(self.inflight.values()) if rid is None else [self.inflight[rid]]
        self.ensure_started()
        reason = "pause" if not self._running.is_set() else None
        return await self._abort(targets, reason)

    async def abort_stale(self, min_version: int) -> int:
        """Abort every request that arrived before weight version `min_version` (abort_reason
        "stale"): its trajectory is past the staleness bound, continuing it (re-prefilled under
        new weights) only wastes the engine. Counted in `dropped_stale`; returns how many."""
        self.ensure_started()
        return await self._abort([r for r in self.inflight.values() if r.start_version < int(min_version)], "stale")

    async def _abort(self, targets: list[Request], reason: Optional[str]) -> int:
        ended = 0
        async with self._model_lock:  # no decode step is running while we finish requests
            for r in targets:
                if r in self.pending:
                    self.pending.remove(r)
                if r.finish_reason is None:
                    r.finish_reason, r.matched, r.abort_reason = "abort", None, reason
                if not r.future.done():
                    ended += not r.resolved
                    self._resolve(r)
        self.aborted_by_pause += ended if reason == "pause" else 0
        self.dropped_stale += ended if reason == "stale" else 0
        return ended

    async def close(self) -> None:
        await self.abort()
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
            self._loop_task = None
        self.executor.shutdown(wait=False)
