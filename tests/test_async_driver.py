"""AsyncDriver's rank-0 machinery with a fake fleet, agent and dataset (no Ray, no Megatron).

What the end-to-end run cannot show deterministically: groups keep finishing while the main
thread is busy (training), takes hand out whole groups with distinct ids, a failed rollout
surfaces in the trainer naming its group, filters that discard everything make the step give
up instead of hanging, and closing cancels the groups in flight.
"""

import asyncio
import time
from types import SimpleNamespace

import pytest

from megatron_stepwise.async_driver import AsyncDriver, loop_in_thread
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.rollout.engine import EngineError
from megatron_stepwise.types import Step, TrajectoryID


class FakeAgent:
    """Each group: 2 trajectories of 1 and 2 turns; the k-th group takes delays[k] seconds."""

    def __init__(self, fleet, delays=(), rewards=(0.0, 1.0), fail_prompt=None, hang=False):
        self.fleet, self.delays, self.rewards = fleet, list(delays), rewards
        self.fail_prompt, self.hang = fail_prompt, hang
        self.calls = 0

    async def rollout(self, samples, seed=None):
        (sample,) = samples
        delay = self.delays[self.calls] if self.calls < len(self.delays) else 0.0
        self.calls += 1
        if self.hang:
            await asyncio.Event().wait()
        await asyncio.sleep(delay)
        pid = sample["prompt_id"]
        if pid == self.fail_prompt:
            raise EngineError("engine 1 died")
        v = self.fleet.weight_version
        steps = []
        for k, turns in enumerate((1, 2)):
            for t in range(turns):
                last = t == turns - 1
                steps.append(Step(TrajectoryID(pid, k), [1, 2], [3, 4], [1, 1], weight_versions=[v, v],
                                  reward=self.rewards[k] if last else 0.0, is_last_step=last))
        return steps


class FakeDataset:
    def __init__(self, size=3):
        self.size, self.drawn = size, 0

    def next(self, n):
        out = [{"prompt_id": f"p{(self.drawn + i) % self.size}"} for i in range(n)]
        self.drawn += n
        return out


def make_driver(groups_per_step=2, zero_variance=False, pending=None, **agent_kw):
    cfg = ExperimentConfig()
    cfg.async_.enabled = True
    cfg.async_.max_staleness = 1
    cfg.data.prompts_per_minibatch = groups_per_step
    cfg.data.prompts_per_iteration = 2 * groups_per_step
    cfg.algo.filters.zero_variance = zero_variance
    fleet = SimpleNamespace(weight_version=0, partial_rollouts=False)
    trainer = SimpleNamespace(cfg=cfg, is_driver=True, state=SimpleNamespace(weight_version=0, iteration=0, async_pending=pending),
                              loop=asyncio.new_event_loop(), fleet=fleet, dataset=FakeDataset(),
                              agent=FakeAgent(fleet, **agent_kw))
    return AsyncDriver(trainer), trainer


def close(driver, trainer):
    driver.close()
    trainer.loop.close()


def test_take_hands_out_whole_groups_with_distinct_ids():
    driver, trainer = make_driver(groups_per_step=2)
    groups = trainer.loop.run_until_complete(driver._take())
    assert trainer.fleet.partial_rollouts is True
    assert len(groups) == 2 and driver.buffer.counters.started == 4  # admission: (1 + 1) x 2
    ids = [g.group_id for g in groups]
    assert len(set(ids)) == 2
    for g in groups:
        # all 3 rows (2 trajectories: 1 + 2 turns) of the group, carrying the group's id
        assert [(s.trajectory_id.prompt_id, s.trajectory_id.sample_index) for s in g.steps] == \
            [(g.group_id, 0), (g.group_id, 1), (g.group_id, 1)]
    close(driver, trainer)


def test_groups_keep_finishing_while_the_main_thread_trains():
    driver, trainer = make_driver(groups_per_step=2, delays=(0.0, 0.0, 0.3, 0.3))
    assert len(trainer.loop.run_until_complete(driver._take())) == 2
    assert (driver.buffer.ready, driver.buffer.in_flight) == (0, 2)
    time.sleep(0.6)  # busy without the loop: nothing moves
    assert (driver.buffer.ready, driver.buffer.in_flight) == (0, 2)
    with loop_in_thread(trainer.loop):
        time.sleep(0.6)  # "training" on the main thread; the loop runs in the helper thread
    assert (driver.buffer.ready, driver.buffer.in_flight) == (2, 0)
    # the loop is usable from the main thread again, and the version bump admits 2 more groups
    driver.version = trainer.fleet.weight_version = 1
    assert len(trainer.loop.run_until_complete(driver._take())) == 2
    assert driver.buffer.counters.started == 6
    close(driver, trainer)


def test_a_failed_rollout_surfaces_in_the_take_naming_its_group():
    driver, trainer = make_driver(groups_per_step=2, fail_prompt="p1")
    with pytest.raises(RuntimeError, match=r"rollout of prompt group 'p1' failed: EngineError\('engine 1 died'\)"):
        trainer.loop.run_until_complete(driver._take())
    close(driver, trainer)


def test_filters_that_discard_every_group_make_the_step_give_up():
    driver, trainer = make_driver(groups_per_step=2, zero_variance=True, rewards=(1.0, 1.0))
    assert trainer.loop.run_until_complete(driver._take()) is None
    # max_sampling_rounds (3) x prompts_per_iteration (4) groups were filtered first
    assert driver.buffer.counters.filtered == driver.starve_limit == 12
    assert driver.buffer.counters.trained == 0
    close(driver, trainer)


def test_close_cancels_the_groups_in_flight():
    driver, trainer = make_driver(groups_per_step=2, hang=True)
    trainer.loop.run_until_complete(asyncio.sleep(0.05))  # the producer starts its groups
    tasks = list(driver._tasks)
    assert len(tasks) == 4
    close(driver, trainer)
    assert all(t.cancelled() for t in tasks) and driver._producer.cancelled()


def test_a_resumed_driver_rolls_out_the_checkpointed_pending_prompts_first():
    driver, trainer = make_driver(groups_per_step=2, pending=[{"prompt_id": "q1"}, {"prompt_id": "q2"}])
    groups = trainer.loop.run_until_complete(driver._take())
    assert sorted(g.group_id for g in groups) == ["q1", "q2"]
    assert [s["prompt_id"] for s in driver.pending_samples()] == ["p0", "p1"]  # drawn after them
    close(driver, trainer)
