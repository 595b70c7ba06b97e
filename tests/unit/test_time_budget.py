"""The iteration's time budget (time_budget.py) under a controllable clock: overlapping rollout
activity is counted once, and the parts add up to the wall time."""

import pytest

from megatron_stepwise.time_budget import PARTS, ActivityClock, TimeBudget, budget_line


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def to(self, t):
        assert t >= self.now - 100.0
        self.now = 100.0 + t


def test_overlapping_generation_and_environment_calls_are_counted_once_by_priority():
    clock = Clock()
    act = ActivityClock(clock)
    a, b, e1, e2 = (act.active(k) for k in ("generation", "generation", "environment", "environment"))
    a.__enter__()  # t=0 trajectory A generates
    clock.to(1)
    b.__enter__()  # t=1 B generates too
    clock.to(3)
    a.__exit__(None, None, None)
    e1.__enter__()  # t=3 A's environment step, B still generating
    clock.to(3.5)
    e1.__exit__(None, None, None)
    clock.to(4)
    b.__exit__(None, None, None)
    e2.__enter__()  # t=4 only B's environment step
    clock.to(5)
    e2.__exit__(None, None, None)
    clock.to(6)  # nothing in flight: host work
    assert act.snapshot() == {"generation": 4.0, "environment": 1.0}


def test_the_parts_add_up_to_the_iteration_wall_time():
    clock = Clock()
    act = ActivityClock(clock)
    produced = [0.0]
    budget = TimeBudget(clock, act)  # t=0 the iteration starts
    clock.to(0.2)  # 0.2 s before the take: idle
    with budget.rollout(lambda: produced[0]):
        with act.active("generation"):  # rank 0 produces from 0.2 to 6.2
            clock.to(3.2)
        with act.active("environment"):
            clock.to(4.2)
        clock.to(6.2)  # 2 s tokenising, validating, preparing
        produced[0] += 6.0
        clock.to(6.7)  # 0.5 s sending the shards
    with budget.part("train"):
        clock.to(8.7)
    with budget.part("weight_push"):
        clock.to(9.7)
    with budget.part("host"):  # the dump
        clock.to(9.9)
    clock.to(10.0)  # metrics: idle
    out = budget.finish(tokens=5000, devices=4)
    expected = {
        "generation": 3.0,
        "environment": 1.0,
        "host": 2.2,
        "handoff": 0.5,
        "train": 2.0,
        "weight_push": 1.0,
        "idle": 0.3,
    }
    for k, v in expected.items():
        assert out[f"budget/{k}"] == pytest.approx(v), k
    assert out["budget/wall"] == pytest.approx(10.0)
    total = sum(out[f"budget/{k}"] for k in PARTS)
    assert abs(total - out["budget/wall"]) <= 0.02 * out["budget/wall"]
    assert out["perf/tokens_per_s_per_gpu"] == pytest.approx(5000 / 10.0 / 4)
    line = budget_line([{"iteration": 0, **out}])
    assert line.startswith("time budget per iteration (mean of 1, wall 10 s): generation 3 s (30%)")


def test_a_rank_that_only_waits_for_rank_0_counts_the_take_as_hand_off():
    clock = Clock()
    budget = TimeBudget(clock)
    with budget.rollout(lambda: 0.0):
        clock.to(4.0)
    out = budget.finish()
    assert out["budget/handoff"] == 4.0 and out["budget/generation"] == 0.0 and "perf/tokens_per_s_per_gpu" not in out


def test_the_agent_loop_reports_its_engine_and_environment_calls():
    """A real agent loop (embedded engine, echo env) on the controllable clock: each engine call
    takes 1 s and each environment step 0.5 s; one trajectory of 3 turns at a time."""
    import asyncio

    from helpers import tiny_lm

    from megatron_stepwise.envs.echo import EchoEnv, echo_dataset
    from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
    from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
    from megatron_stepwise.rollout.engines.protocol import SamplingParams

    tok, config = tiny_lm("tiny_word")
    clock = Clock()
    engine = LocalEngine(config, tokenizer=tok, seed=0)

    class SlowEngine:
        async def generate(self, *args, **kwargs):
            result = await engine.generate(*args, **kwargs)
            clock.to(clock.now - 100.0 + 1.0)
            return result

    class SlowEnv(EchoEnv):
        def step(self, text):
            clock.to(clock.now - 100.0 + 0.5)
            return super().step(text)

    loop = AgentLoop(
        SlowEngine(),
        tok,
        SlowEnv,
        AgentLoopConfig(
            max_turns=3,
            max_input_length=200,
            n_samples_per_prompt=1,
            max_concurrency=1,
            sampling=SamplingParams(max_new_tokens=2),
        ),
    )
    act = ActivityClock(clock)
    loop.track(act)
    try:
        steps = asyncio.run(loop.rollout(echo_dataset(num_prompts=1, num_turns=3, seed=1)))
    finally:
        loop.close()
    turns = len(steps)
    assert turns >= 1
    assert act.snapshot() == {"generation": pytest.approx(1.0 * turns), "environment": pytest.approx(0.5 * turns)}
