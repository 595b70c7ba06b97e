"""Environment calls with deadlines: a hung or hostile environment ends only its trajectory.

Environments are user code: `step` may block forever (a dead service, a deadlock), raise
`SystemExit`, or return garbage. The agent loop calls them through `EnvCaller`:

- a blocking call runs on its own daemon worker thread; at most `threads` run at once. At the
  deadline the call fails with `EnvTimeout` and its slot is given back at once, so hung calls
  never use up the capacity (a fixed thread pool did: once all its threads were stuck every
  later call timed out too, and its non-daemon threads kept the process from exiting). The
  abandoned thread is then asked to stop with an asynchronous exception, which ends any hang
  that runs Python code (a polling loop, a retry loop); one blocked inside a C call (a socket
  read, `time.sleep`) cannot be interrupted by Python and stays parked as a daemon thread until
  that call returns. `stuck` counts those; beyond `max_stuck` new calls are refused (an error
  for that trajectory) instead of piling up threads;
- whatever the call raises, `BaseException` included (`SystemExit` from an environment must
  not end the run), comes back as `EnvError` naming the exception;
- coroutine methods run on the event loop with the same deadline (cancelled at it).

Counters (`stats()`): calls, errors, timeouts, stuck threads now.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import threading
from typing import Any, Callable


class EnvError(RuntimeError):
    """An environment call failed; ends only the trajectory that made it."""


class EnvTimeout(EnvError):
    pass


class _Abandoned(BaseException):
    """Raised inside a timed-out worker thread to unwind it (a BaseException: env code that
    catches Exception does not swallow it)."""


class EnvCaller:
    def __init__(self, threads: int, timeout_s: float, max_stuck: int | None = None):
        if threads < 1 or timeout_s <= 0:
            raise ValueError(f"EnvCaller needs threads >= 1 and timeout_s > 0, got {threads}, {timeout_s}")
        self.threads = threads
        self.timeout_s = timeout_s
        self.max_stuck = 4 * threads if max_stuck is None else max_stuck
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
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
            if inspect.iscoroutinefunction(fn):
                return await self._call_async(fn, args, name)
            return await self._call_thread(fn, args, name)
        except EnvError:
            self.errors += 1
            raise

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
        if self.stuck() >= self.max_stuck:
            raise EnvError(f"environment {name} not called: {self.stuck()} earlier calls are still stuck "
                           f"(the environment hangs in a blocking call)")
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # one semaphore per event loop
            self._slots, self._slots_loop = asyncio.Semaphore(self.threads), loop
        async with self._slots:
            future: asyncio.Future = loop.create_future()

            def deliver(outcome: tuple[bool, Any]) -> None:
                if not future.done():
                    future.set_result(outcome)

            def work() -> None:
                try:
                    try:
                        outcome = (True, fn(*args))
                    except _Abandoned:
                        return
                    except BaseException as e:  # noqa: BLE001 - a worker thread: nothing here is a real signal
                        outcome = (False, e)
                    loop.call_soon_threadsafe(deliver, outcome)
                except (_Abandoned, RuntimeError):  # abandoned just as it finished; the event loop is gone
                    pass

            thread = threading.Thread(target=work, name=f"env-{name}", daemon=True)
            thread.start()
            try:
                ok, value = await asyncio.wait_for(future, self.timeout_s)
            except asyncio.TimeoutError:
                self.timeouts += 1
                self._abandon(thread)
                raise EnvTimeout(f"environment {name} timed out after {self.timeout_s}s") from None
        if ok:
            return value
        raise EnvError(f"environment {name} raised {type(value).__name__}: {value}") from value

    def _abandon(self, thread: threading.Thread) -> None:
        with self._lock:
            self._abandoned.append(thread)
        if thread.ident is not None and thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Abandoned))
