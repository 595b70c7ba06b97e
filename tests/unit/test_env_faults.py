"""Faulty and hostile environments end only their own trajectory; hung calls give their worker back.

Hangs are real (a loop that never ends, a wait on an event nobody sets before the rollout
returns): every assertion is about the outcome, none about how long anything took.
"""

import asyncio
import logging
import threading
import time

import pytest
from helpers import tiny_lm

from megatron_stepwise.envs.echo import EchoEnv
from megatron_stepwise.rollout.agent.env_calls import EnvCaller, EnvError
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from megatron_stepwise.steps import TrajectoryID

TOK, CONFIG = tiny_lm("tiny_word")
HUNG = 8  # as many hung calls as env workers: a fixed pool was then stuck for good
RELEASE = threading.Event()  # frees the C-blocked hangs at the very end of the test session


class FaultyEnv(EchoEnv):
    """The sample's "kind" picks the fault, raised on the first step unless said otherwise."""

    def reset(self, sample):
        self.kind = sample["kind"]
        if self.kind == "reset_base_exception":
            raise BaseException("reset gave up")
        return super().reset(sample)

    def step(self, text):
        kind = self.kind
        if kind == "spin":  # a Python-level hang: interruptible, so its thread is reclaimed
            while True:
                time.sleep(0.01)
        if kind == "block":  # blocked in C: Python cannot interrupt it, the slot is reclaimed
            RELEASE.wait()
        if kind == "nan":
            return [], float("nan"), True, {}
        if kind == "inf":
            return [], float("inf"), True, {}
        if kind == "unpicklable":
            return [], 1.0, True, {"callback": lambda: None}
        if kind == "exit":
            raise SystemExit(3)
        if kind == "keyboard":
            raise KeyboardInterrupt  # from a worker thread: the env's, not a Ctrl-C
        if kind == "hostile_float":
            return [], _ExitOnFloat(), True, {}
        return super().step(text)


class _ExitOnFloat:
    def __float__(self):
        raise SystemExit("float() of this reward ends the process")


def rollout(loop, samples):
    return asyncio.run(loop.rollout(samples))


def make_loop(**cfg):
    cfg = {
        "sampling": SamplingParams(max_new_tokens=4),
        "max_turns": 2,
        "max_input_length": 200,
        "n_samples_per_prompt": 1,
        "env_concurrency": HUNG,
        "env_timeout_s": 5.0,
        "env_error_reward": -1.0,
        **cfg,
    }
    return AgentLoop(LocalEngine(CONFIG, tokenizer=TOK, seed=0), TOK, FaultyEnv, AgentLoopConfig(**cfg))


def sample(pid, kind):
    return {"prompt_id": pid, "digits": [1, 2, 3], "kind": kind}


def wait_until(predicate, deadline_s=60.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture(scope="module", autouse=True)
def _release_blocked_threads():
    yield
    RELEASE.set()


def test_hung_env_calls_end_as_env_error_and_their_workers_are_reclaimed():
    earlier_workers = {t for t in threading.enumerate() if t.name.startswith("env-worker-")}  # other loops'
    loop = make_loop()
    spins = [sample(f"spin{i}", "spin") for i in range(HUNG // 2)]
    blocks = [sample(f"block{i}", "block") for i in range(HUNG - HUNG // 2)]
    fine = [sample(f"fine{i}", "ok") for i in range(4)]
    steps = rollout(loop, spins + blocks + fine)
    last = {s.trajectory_id.prompt_id: s for s in steps if s.is_last_step}
    for p in spins + blocks:
        s = last[p["prompt_id"]]
        assert s.stop_reason == "env_error" and s.reward == -1.0 and "timed out" in s.metadata["error"]
    assert all(last[p["prompt_id"]].stop_reason != "env_error" for p in fine)
    stats = loop.env_stats()
    assert stats["timeouts"] == HUNG
    # The spinning threads unwind (asynchronous exception); the C-blocked ones stay parked, as daemons.
    assert wait_until(lambda: loop.env_stats()["stuck_threads"] == len(blocks)), loop.env_stats()

    def env_threads(kind="env-"):
        return [t for t in threading.enumerate() if t.name.startswith(kind)]

    # The unwound spinners end; the parked ones are the only abandoned workers left, and the
    # pool itself never grew past its size (each abandoned worker was replaced, not added to).
    assert wait_until(lambda: len(env_threads("env-stuck-")) == len(blocks)), env_threads()
    assert len(set(env_threads("env-worker-")) - earlier_workers) <= HUNG
    assert all(t.daemon for t in env_threads())  # neither the parked nor the idle ones keep the process alive
    # Every slot came back: a second rollout on the same loop runs all its env calls.
    again = rollout(loop, [sample(f"again{i}", "ok") for i in range(HUNG)])
    assert all(s.stop_reason != "env_error" for s in again), [s.metadata.get("error") for s in again]
    RELEASE.set()
    assert wait_until(lambda: loop.env_stats()["stuck_threads"] == 0)


@pytest.mark.parametrize(
    "kind,fragment",
    [
        ("nan", "non-finite reward (nan)"),
        ("inf", "non-finite reward (inf)"),
        ("unpicklable", "info must be picklable"),
        ("exit", "raised SystemExit: 3"),
        ("keyboard", "raised KeyboardInterrupt"),
        ("hostile_float", "raised SystemExit"),
        ("reset_base_exception", "raised BaseException: reset gave up"),
    ],
)
def test_a_bad_env_result_ends_only_its_trajectory(kind, fragment):
    loop = make_loop()
    steps = rollout(loop, [sample("bad", kind), sample("good", "ok")])
    last = {s.trajectory_id: s for s in steps if s.is_last_step}
    bad, good = last[TrajectoryID("bad", 0)], last[TrajectoryID("good", 0)]
    assert bad.stop_reason == "env_error" and bad.reward == -1.0, bad.metadata
    assert fragment in bad.metadata["error"]
    assert good.stop_reason != "env_error" and good.reward == good.reward  # finite, the other one ran on


def test_a_rollout_dominated_by_env_errors_warns(caplog):
    loop = make_loop()
    with caplog.at_level(logging.WARNING, logger="megatron_stepwise.rollout.agent.loop"):
        rollout(loop, [sample("a", "nan"), sample("b", "exit"), sample("c", "ok")])
    assert "most trajectories fail" in caplog.text
    assert "2 of 3 trajectories ended in env_error" in caplog.text and "non-finite reward" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_stepwise.rollout.agent.loop"):
        rollout(loop, [sample("d", "ok"), sample("e", "ok"), sample("f", "ok")])
    assert "env_error" not in caplog.text


def test_a_few_env_errors_log_one_sample_traceback_with_file_and_line(caplog):
    loop = make_loop()
    with caplog.at_level(logging.WARNING, logger="megatron_stepwise.rollout.agent.loop"):
        steps = rollout(loop, [sample("d", "exit"), sample("e", "ok"), sample("f", "ok"), sample("g", "ok")])
    records = [r for r in caplog.records if "env_error" in r.getMessage()]
    assert len(records) == 1, "one warning per rollout"
    text = records[0].getMessage()
    assert "1 of 4 trajectories ended in env_error" in text and "most trajectories fail" not in text
    raise_line = next(i for i, line in enumerate(open(__file__), 1) if "raise SystemExit(3)" in line)
    assert f'test_env_faults.py", line {raise_line}, in step' in text  # the env's own file:line
    failed = next(s for s in steps if s.stop_reason == "env_error")
    assert "SystemExit" in failed.metadata["error_traceback"]


def test_env_caller_refuses_new_calls_once_too_many_are_stuck():
    gate = threading.Event()
    caller = EnvCaller(threads=2, timeout_s=0.2, max_stuck=2)

    async def scenario():
        for _ in range(2):
            with pytest.raises(EnvError, match="timed out"):
                await caller.call(gate.wait)
        with pytest.raises(EnvError, match="2 earlier calls are still stuck"):
            await caller.call(lambda: 1)

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
    assert wait_until(lambda: caller.stuck() == 0)
    assert asyncio.run(caller.call(lambda: 7)) == 7


def test_env_caller_reuses_its_workers_and_replaces_a_hung_one():
    gate = threading.Event()
    caller = EnvCaller(threads=2, timeout_s=2.0, max_stuck=4)

    async def scenario():
        # Calls one after another, and several at once: always on the pool's (at most 2) workers.
        ran_on = [await caller.call(threading.current_thread) for _ in range(10)]
        ran_on += await asyncio.gather(*(caller.call(threading.current_thread) for _ in range(10)))
        assert len(set(ran_on)) <= 2 and all(t.daemon for t in ran_on)
        # A call that hangs in C takes its worker with it; the pool gets a new one, so a single
        # call slot still serves every later call while the hung worker stays parked.
        with pytest.raises(EnvError, match="timed out"):
            await caller.call(gate.wait)
        assert caller.stuck() == 1
        after = await asyncio.gather(*(caller.call(threading.current_thread) for _ in range(4)))
        assert caller.stuck() == 1 and len(set(after)) <= 2
        return set(ran_on) | set(after)

    try:
        workers = asyncio.run(scenario())
    finally:
        gate.set()
    assert wait_until(lambda: caller.stuck() == 0)
    caller.close()  # the idle workers end; a later call starts a new pool
    assert wait_until(lambda: not any(t.is_alive() for t in workers))
    assert asyncio.run(caller.call(lambda: 7)) == 7
    caller.close()


def test_calls_submitted_together_each_get_a_worker():
    # Two calls submitted in one event-loop tick while one worker idles: the worker is owed to the
    # first, so the second must get a new one, not wait behind a call that may block (and time out).
    caller = EnvCaller(threads=4, timeout_s=300.0)
    gate = threading.Event()
    started = [threading.Event(), threading.Event()]

    def blocked(k):
        started[k].set()
        gate.wait(300)
        return k

    async def go():
        await caller.call(lambda: None, name="warm-up")  # one worker, idle again
        calls = asyncio.gather(*(caller.call(blocked, k, name=f"call{k}") for k in range(2)))
        deadline = time.monotonic() + 120
        while not all(e.is_set() for e in started) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        both_started = all(e.is_set() for e in started)
        gate.set()
        return both_started, await calls

    both_started, results = asyncio.run(go())
    caller.close()
    assert both_started and results == [0, 1]
