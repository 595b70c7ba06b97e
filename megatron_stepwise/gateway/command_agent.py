"""`env.agent_command`: your agent as a program, run once per trajectory in the sandbox.

The command runs in the trainer's working directory with the sample as JSON on its stdin (and in
the file `$STEPWISE_SAMPLE_FILE`), `OPENAI_BASE_URL` (`.../trajectories/<id>/v1`),
`ANTHROPIC_BASE_URL` (the same without `/v1`), `OPENAI_API_KEY` = `ANTHROPIC_API_KEY` = the
trajectory's own key (no other path of the gateway takes it), PATH, VIRTUAL_ENV and PYTHONPATH
so `python -m my_agent` imports what the trainer does, and HOME = TMPDIR = its private directory.
`envs/sandbox_command.py` gives it its own network namespace whose one endpoint is its
trajectory. The outcome is the last line of its stdout that is a JSON object with `reward`
(`{"reward", "turn_rewards", "info"}`, as `solve` returns), else `env.reward_fn(text, sample,
transcript=...)` on its calls; a nonzero exit, a timeout, a broken limit or neither outcome ends
only its trajectory (invalid, with its stderr's tail).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence, Union

from megatron_stepwise.envs.custom import load_object
from megatron_stepwise.envs.sandbox import SandboxError, kill_all
from megatron_stepwise.envs.sandbox_command import (
    BRIDGE_PORT,
    CommandLimits,
    CommandResult,
    bridged,
    command_environment,
    command_isolation,
    run_command,
)
from megatron_stepwise.gateway.outcome import AgentError, AgentFailure
from megatron_stepwise.gateway.server import Gateway
from megatron_stepwise.steps import TrajectoryID

log = logging.getLogger(__name__)

_PROBE_ID = TrajectoryID("agent-command-probe", 0)
STDERR_IN_REASON = 300  # characters of the stderr's tail in `invalid_reason` (4000 in `agent_info`)


class CommandAgent:
    """Runs `argv` per trajectory (a strategy of `AgentRollout`; see the module docstring)."""

    def __init__(
        self,
        argv: Sequence[str],
        reward_fn: Union[str, Callable, None] = None,
        max_concurrency: int = 64,
        cwd: Optional[str] = None,
        limits: Optional[CommandLimits] = None,
    ):
        self.argv, self.cwd, self.limits = list(argv), cwd or os.getcwd(), limits
        self.reward_fn = load_object(reward_fn, key="env.reward_fn") if isinstance(reward_fn, str) else reward_fn
        if self.reward_fn is not None and not callable(self.reward_fn):
            raise AgentError(f"env.reward_fn={reward_fn!r} is not a function")
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="env-agent-command")
        self._running: set = set()
        self._lock = threading.Lock()

    async def start(self, gateway: Gateway) -> None:
        """Run `true` once through the sandbox: a machine that cannot confine a command fails the
        run here (SandboxError, with why), not every trajectory."""
        await asyncio.get_running_loop().run_in_executor(self._pool, command_isolation)
        url = gateway.open(_PROBE_ID)
        try:
            limits = CommandLimits(timeout_s=60.0)
            result = await self._in_thread(gateway, url, {}, limits, ["true"])
        finally:
            gateway.finish(url, 0.0)
        if result.returncode != 0:
            raise SandboxError(f"env.agent_command: the sandbox cannot run `true`: {result.stderr[-500:]}")

    async def run(self, gateway: Gateway, sample: dict, url: str, timeout_s: float) -> Any:
        limits = dataclasses.replace(self.limits or CommandLimits(), timeout_s=timeout_s)
        try:
            result = await self._in_thread(gateway, url, sample, limits, self.argv)
        except SandboxError as e:
            log.error("env.agent_command: the sandbox failed: %s", e)
            raise AgentFailure(f"sandbox_error: {e}"[:500]) from None
        info = {"exit_code": result.returncode, "stderr_tail": result.stderr[-4000:]}
        if result.timed_out:
            raise asyncio.TimeoutError
        if result.limit:
            raise AgentFailure(f"agent_limit: {result.limit}", info)
        if result.returncode != 0:
            raise AgentFailure(f"agent_exit: exit code {result.returncode}{_tail(result)}", info)
        outcome = last_outcome(result.stdout)
        if outcome is not None:
            return outcome
        if self.reward_fn is None:
            reason = "agent_no_outcome: printed no JSON line with 'reward' and env.reward_fn is not set"
            raise AgentFailure(reason + _tail(result), info)
        transcript = gateway.recorder(url).transcript
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, score, self.reward_fn, sample, transcript
            )
        except Exception as e:  # noqa: BLE001 - the user's reward function: ends only this trajectory
            raise AgentFailure(f"reward_fn_error: {type(e).__name__}: {e}"[:500], info) from None

    async def _in_thread(self, gateway: Gateway, url: str, sample: dict, limits, argv) -> CommandResult:
        loop = asyncio.get_running_loop()
        key = gateway.key_of(url)
        path = url[len(gateway.url) :]  # /trajectories/<id>/v1
        root = f"http://127.0.0.1:{BRIDGE_PORT}" if bridged(command_isolation()) else gateway.url
        base = root + path
        env = command_environment(
            {
                "OPENAI_BASE_URL": base,
                "OPENAI_API_KEY": key,
                "ANTHROPIC_BASE_URL": base.removesuffix("/v1"),
                "ANTHROPIC_API_KEY": key,
            }
        )

        def serve(listener):
            site = asyncio.run_coroutine_threadsafe(gateway.serve_socket(listener), loop).result(60)
            return lambda: asyncio.run_coroutine_threadsafe(site.stop(), loop).result(60)

        port = int(gateway.url.rsplit(":", 1)[1])
        return await loop.run_in_executor(
            self._pool,
            lambda: run_command(argv, env, self.cwd, sample, limits, serve, port, started=self._track),
        )

    def _track(self, proc) -> None:
        with self._lock:
            self._running = {p for p in self._running if p.poll() is None} | {proc}

    def close(self) -> None:
        """Stop: every command still running is killed with its whole tree."""
        with self._lock:
            running, self._running = list(self._running), set()
        for proc in running:
            if proc.poll() is None:
                kill_all(proc, supervised=not bridged(command_isolation()))
        self._pool.shutdown(wait=False, cancel_futures=True)


def last_outcome(stdout: str) -> Optional[dict]:
    """The last line of `stdout` that is a JSON object with "reward" (None: there is none)."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict) and "reward" in value:
                return value
    return None


def score(reward_fn: Callable, sample: dict, transcript: list[dict]) -> Any:
    """`env.reward_fn(text, sample)` as the agent loop calls it, on the last reply's text, with
    `transcript=` (every call's messages and reply) when it takes that keyword."""
    text = ""
    if transcript:
        content = transcript[-1]["reply"].get("content")
        text = content if isinstance(content, str) else ""
    try:
        params = inspect.signature(reward_fn).parameters
    except (TypeError, ValueError):
        params = {}
    takes = "transcript" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    out = reward_fn(text, sample, transcript=transcript) if takes else reward_fn(text, sample)
    return out[0] if isinstance(out, tuple) else out  # (reward, message): no next turn to send it to


def _tail(result: CommandResult) -> str:
    lines = result.stderr.strip()
    return f"; stderr: ...{lines[-STDERR_IN_REASON:]}" if lines else ""
