"""Environment calls with deadlines: a hung or hostile environment ends only its trajectory.

Environments are user code: `step` may block forever, raise `SystemExit` or return garbage. The
agent loop calls them through `EnvCaller`: blocking calls run on a reused pool of daemon
threads, and at the deadline the call fails with `EnvTimeout` and its worker is replaced;
whatever a call raises (`BaseException` included) comes back as `EnvError`; coroutine methods
run on the event loop with the same deadline. Counters: `stats()`.

Why the pool replaces hung workers, and what happens to threads stuck in C calls:
docs/security.md, 'Environment calls with deadlines'.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import itertools
import queue
import threading
from typing import Any, Callable

from megatron_stepwise.time_budget import ENVIRONMENT, NO_ACTIVITY


class EnvError(RuntimeError):
    """An environment call failed; ends only the trajectory that made it."""


class EnvTimeout(EnvError):
    pass


class _Abandoned(BaseException):
    """Raised inside a timed-out worker thread to unwind it (a BaseException: env code that
    catches Exception does not swallow it)."""


class _Pool:
    """Worker threads sharing one job queue; counters change under `EnvCaller._lock`."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.workers = 0  # live workers (an abandoned one no longer counts: it was replaced)
        self.idle = 0  # workers waiting for a job
        self.queued = 0  # jobs put but not yet taken: each will take one of the idle workers


class _Job:
    """One blocking call handed to the pool; `worker` is set when a worker takes it."""

    __slots__ = ("fn", "args", "loop", "future", "worker", "finished", "abandoned", "pool")

    def __init__(self, fn: Callable, args: tuple, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.fn, self.args, self.loop, self.future = fn, args, loop, future
        self.worker: threading.Thread | None = None
        self.pool: _Pool | None = None
        self.finished = self.abandoned = False


def _deliver(future: asyncio.Future, outcome: tuple[bool, Any]) -> None:
    if not future.done():  # not already given up at the deadline
        future.set_result(outcome)


class EnvCaller:
    activity = NO_ACTIVITY  # where environment time goes (the agent loop's `track`)

    def __init__(self, threads: int, timeout_s: float, max_stuck: int | None = None):
        if threads < 1 or timeout_s <= 0:
            raise ValueError(f"EnvCaller needs threads >= 1 and timeout_s > 0, got {threads}, {timeout_s}")
        self.threads = threads
        self.timeout_s = timeout_s
        self.max_stuck = 4 * threads if max_stuck is None else max_stuck
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._pool = _Pool()
        self._names = itertools.count()
        self._abandoned: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.calls = self.errors = self.timeouts = 0

    def stuck(self) -> int:
        """Timed-out worker threads still running (blocked in a call Python cannot interrupt)."""
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            return len(self._abandoned)

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "errors": self.errors, "timeouts": self.timeouts, "stuck_threads": self.stuck()}

    async def call(self, fn: Callable[..., Any], *args: Any, name: str | None = None) -> Any:
        """`fn(*args)` under the deadline; any failure raises `EnvError` (`name` names it)."""
        name = name or getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
        self.calls += 1
        try:
            with self.activity.active(ENVIRONMENT):
                if inspect.iscoroutinefunction(fn):
                    return await self._call_async(fn, args, name)
                return await self._call_thread(fn, args, name)
        except EnvError:
            self.errors += 1
            raise

    def close(self) -> None:
        """Ends the pool's workers (a busy one after its call); later calls start a new pool."""
        with self._lock:
            pool, self._pool = self._pool, _Pool()
        for _ in range(pool.workers):
            pool.jobs.put(None)

    async def _call_async(self, fn, args, name):
        try:
            return await asyncio.wait_for(fn(*args), self.timeout_s)
        except asyncio.TimeoutError:
            self.timeouts += 1
            raise EnvTimeout(f"environment {name} timed out after {self.timeout_s}s") from None
        except (KeyboardInterrupt, asyncio.CancelledError):
            raise  # on the event loop these are a real Ctrl-C or our own cancellation
        except BaseException as e:  # noqa: BLE001 - SystemExit and the like end only this trajectory
            raise EnvError(f"environment {name} raised {type(e).__name__}: {e}") from e

    async def _call_thread(self, fn, args, name):
        if self._abandoned and self.stuck() >= self.max_stuck:
            raise EnvError(
                f"environment {name} not called: {self.stuck()} earlier calls are still stuck "
                f"(the environment hangs in a blocking call)"
            )
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # one semaphore per event loop
            self._slots, self._slots_loop = asyncio.Semaphore(self.threads), loop
        async with self._slots:
            job = _Job(fn, args, loop, loop.create_future())
            self._submit(job)
            try:
                ok, value = await asyncio.wait_for(job.future, self.timeout_s)
            except asyncio.TimeoutError:
                self.timeouts += 1
                self._abandon(job, name)
                raise EnvTimeout(f"environment {name} timed out after {self.timeout_s}s") from None
        if ok:
            return value
        raise EnvError(f"environment {name} raised {type(value).__name__}: {value}") from value

    def _submit(self, job: _Job) -> None:
        pool = self._pool
        with self._lock:
            # The semaphore caps calls in flight at `threads`, so the pool grows to that at most.
            # An idle worker already owed to a queued job is not free: two calls submitted before
            # it wakes would otherwise share it, and the second waits (and times out) in the queue.
            grow = pool.idle <= pool.queued and pool.workers < self.threads
            if grow:
                pool.workers += 1
            pool.queued += 1
        if grow:
            threading.Thread(
                target=self._work, args=(pool,), name=f"env-worker-{next(self._names)}", daemon=True
            ).start()
        job.pool = pool
        pool.jobs.put(job)

    def _work(self, pool: _Pool) -> None:
        """A pool worker: runs jobs until it is abandoned (its call hung) or the pool is closed."""
        me = threading.current_thread()
        try:
            while True:
                with self._lock:
                    pool.idle += 1
                job = pool.jobs.get()
                with self._lock:
                    pool.idle -= 1
                    if job is not None:
                        pool.queued -= 1
                    if job is None:
                        pool.workers -= 1
                        return
                    if job.abandoned:
                        continue  # timed out while queued: nobody waits for it
                    job.worker = me
                try:
                    outcome = (True, job.fn(*job.args))
                except _Abandoned:
                    return
                except BaseException as e:  # noqa: BLE001 - a worker thread: nothing here is a real signal
                    outcome = (False, e)
                with self._lock:
                    if job.abandoned:  # replaced already; an asynchronous exception may be pending
                        return
                    job.finished = True
                try:
                    job.loop.call_soon_threadsafe(_deliver, job.future, outcome)
                except RuntimeError:  # the event loop that waited is gone
                    pass
        except _Abandoned:  # arrived after the call returned: this worker was replaced, just end
            return

    def _abandon(self, job: _Job, name: str) -> None:
        """Gives up a timed-out job: its worker (if it has one and is still in the call) is
        replaced, renamed `env-stuck-<name>` and sent `_Abandoned`."""
        with self._lock:
            if job.finished:  # returned just at the deadline: the worker is fine, keep it
                return
            job.abandoned = True
            worker = job.worker
            if worker is None:  # still queued: a worker will skip it
                return
            job.pool.workers -= 1  # a new worker takes its place on the next call
            self._abandoned.append(worker)
            # Sent under the lock: the worker cannot have moved on to another job yet (it
            # checks `abandoned` under this lock after its call), so only this call is unwound.
            if worker.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(_Abandoned))
        try:
            worker.name = f"env-stuck-{name}"
        except Exception:  # noqa: BLE001 - a name is only a debugging aid
            pass
