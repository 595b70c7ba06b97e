"""The async source's rank-0 machinery with a fake fleet, agent and dataset (no Ray, no Megatron).

What the end-to-end run cannot show deterministically: groups keep finishing while the main
thread is busy (training), takes hand out whole groups with distinct ids, a failed rollout
surfaces in the trainer naming its group, filters that discard everything make the step give
up instead of hanging, and closing cancels the groups in flight.
"""

import asyncio
import time
from types import SimpleNamespace

import pytest

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.loop.async_source import AsyncRollouts, loop_in_thread
from megatron_stepwise.loop.sources import Driver
from megatron_stepwise.rollout.engines.protocol import EngineError
from megatron_stepwise.rundir.paths import BANK
from megatron_stepwise.steps import Step, TrajectoryID
from megatron_stepwise.workers.rollout_bank import read_group
from megatron_stepwise.workers.worker_rows import HeldGroup, HeldRows, bank_held


class FakeAgent:
    """Each group: 2 trajectories of 1 and 2 turns; the k-th group takes delays[k] seconds."""

    def __init__(self, fleet, delays=(), rewards=(0.0, 1.0), fail_prompt=None, hang=False):
        self.fleet, self.delays, self.rewards = fleet, list(delays), rewards
        self.fail_prompt, self.hang = fail_prompt, hang
        self.calls = self.cancelled = 0
        self.prompts = []  # the prompt of every rollout, in order

    async def rollout_groups(self, samples, seed=None):
        (sample,) = samples
        delay = self.delays[self.calls] if self.calls < len(self.delays) else 0.0
        self.calls += 1
        self.prompts.append(sample["prompt_id"])
        if self.hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        await asyncio.sleep(delay)
        pid = sample["prompt_id"]
        if pid == self.fail_prompt:
            raise EngineError("engine 1 died")
        v = self.fleet.weight_version
        steps = []
        for k, turns in enumerate((1, 2)):
            for t in range(turns):
                last = t == turns - 1
                steps.append(
                    Step(
                        TrajectoryID(pid, k),
                        [1, 2],
                        [3, 4],
                        [1, 1],
                        weight_versions=[v, v],
                        reward=self.rewards[k] if last else 0.0,
                        is_last_step=last,
                    )
                )
        return groups_of(steps)


class FakeHeldAgent(FakeAgent):
    """An agent worker that keeps the rows (rollout.handoff: workers), without Ray: each group is
    prepared and held in a real `HeldRows`, its bank file written where the rows are
    (`bank_held`), and a resumed run's banked groups adopted from their files."""

    name = "agent-test-0.0"

    def __init__(self, fleet, **kw):
        super().__init__(fleet, **kw)
        self.held = HeldRows()
        self.adopted = []  # group ids taken over from the bank

    async def rollout_groups(self, samples, seed=None, hold=None):
        groups = await super().rollout_groups(samples, seed)
        if hold is None:  # trainer.dump_rollouts: the rows go through rank 0
            return groups
        return [self.held.keep(g, hold, self.name, b) for g, b in zip(groups, bank_held(groups, hold))]

    async def adopt(self, path, group_id, hold):
        self.adopted.append(group_id)
        return self.held.adopt(read_group(path), group_id, hold, self.name)

    def drop(self, groups):
        self.held.drop([(g.key, g.prompt_id) for g in groups])

    def holders(self):
        return {self.name}


class FakeDataset:
    def __init__(self, size=3, drawn=0):
        self.size, self.drawn = size, drawn  # drawn: the position a checkpoint restores

    def next(self, n):
        out = [{"prompt_id": f"p{(self.drawn + i) % self.size}"} for i in range(n)]
        self.drawn += n
        return out


def make_driver(
    groups_per_step=2,
    zero_variance=False,
    pending=None,
    run_dir=None,
    state=None,
    max_staleness=1,
    mode="driver",
    **agent_kw,
):
    """(source, rank-0 context): the context has loop, fleet, agent and a mutable `version`.
    `run_dir`: where the rollout bank writes (None: no bank); `state`: a resume from a checkpoint
    of the source saved at weight version state["version"]. `mode`: "driver" (no agent workers),
    "held" (agent workers keep the rows), "dumps" (agent workers, but trainer.dump_rollouts sends
    the rows through rank 0)."""
    cfg = ExperimentConfig()
    if mode != "driver":
        cfg.rollout.agent_workers = 2
        cfg.trainer.dump_rollouts = 1 if mode == "dumps" else None
    cfg.async_.enabled = True
    cfg.async_.rollout_bank = run_dir is not None
    cfg.logging.run_dir = str(run_dir) if run_dir is not None else None
    cfg.async_.max_staleness = max_staleness
    cfg.data.prompts_per_minibatch = groups_per_step
    cfg.data.prompts_per_iteration = 2 * groups_per_step
    cfg.algo.filters.zero_variance = zero_variance
    version = state["version"] if state is not None else 0
    fleet = SimpleNamespace(weight_version=version, metrics=dict)
    ctx = SimpleNamespace(
        loop=asyncio.new_event_loop(),
        fleet=fleet,
        agent=(FakeAgent if mode == "driver" else FakeHeldAgent)(fleet, **agent_kw),
        version=version,
    )
    source = AsyncRollouts(
        cfg,
        dataset=FakeDataset(drawn=state["rollouts"]["draws"] if state is not None else 0),
        handoff=None,
        vocab_size=256,
        version=lambda: ctx.version,
        decide=lambda rows: [],  # decisions are not made here
        dp_size=1,
    )
    assert (source.fetcher is not None) == (mode == "held")
    if pending is not None:  # as a checkpoint restores it
        source.load_state_dict({"pending": pending})
    if state is not None:
        source.load_state_dict(state["rollouts"])
    source.start(Driver(ctx.loop, fleet, ctx.agent))
    return source, ctx


def take(driver, ctx):
    return ctx.loop.run_until_complete(driver.next_groups())


def close(driver, ctx):
    driver.close()
    ctx.loop.close()


def test_take_hands_out_whole_groups_with_distinct_ids():
    driver, trainer = make_driver(groups_per_step=2)
    groups = take(driver, trainer)
    assert len(groups) == 2 and driver.buffer.counters.started == 4  # admission: (1 + 1) x 2
    ids = [g.group_id for g in groups]
    assert len(set(ids)) == 2
    for g in groups:
        # all 3 rows (2 trajectories: 1 + 2 turns) of the group, carrying the group's id
        assert [(s.trajectory_id.prompt_id, s.trajectory_id.sample_index) for s in g.rollout.steps] == [
            (g.group_id, 0),
            (g.group_id, 1),
            (g.group_id, 1),
        ]
    close(driver, trainer)


def test_groups_keep_finishing_while_the_main_thread_trains():
    driver, trainer = make_driver(groups_per_step=2, delays=(0.0, 0.0, 0.3, 0.3))
    assert len(take(driver, trainer)) == 2
    assert (driver.buffer.ready, driver.buffer.in_flight) == (0, 2)
    # Without the event loop running nothing may move: a check of absence, which a slow or fast
    # machine cannot pass or fail by timing (0.6 s is twice the groups' own delay).
    time.sleep(0.6)
    assert (driver.buffer.ready, driver.buffer.in_flight) == (0, 2)
    with loop_in_thread(trainer.loop):
        # "training" on the main thread until the 0.3 s groups have finished in the helper thread
        deadline = time.monotonic() + 120
        while (driver.buffer.ready, driver.buffer.in_flight) != (2, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert (driver.buffer.ready, driver.buffer.in_flight) == (2, 0)
    # the loop is usable from the main thread again, and the version bump admits 2 more groups
    trainer.version = trainer.fleet.weight_version = 1
    assert len(take(driver, trainer)) == 2
    assert driver.buffer.counters.started == 6
    close(driver, trainer)


def test_a_failed_rollout_surfaces_in_the_take_naming_its_group():
    driver, trainer = make_driver(groups_per_step=2, fail_prompt="p1")
    with pytest.raises(RuntimeError, match=r"rollout of prompt group 'p1' failed: EngineError\('engine 1 died'\)"):
        take(driver, trainer)
    close(driver, trainer)


def test_filters_that_discard_every_group_make_the_step_give_up():
    driver, trainer = make_driver(groups_per_step=2, zero_variance=True, rewards=(1.0, 1.0))
    assert take(driver, trainer) is None
    # max_sampling_rounds (3) x prompts_per_iteration (4) groups were filtered first
    assert driver.buffer.counters.filtered == driver.starve_limit == 12
    assert driver.buffer.counters.trained == 0
    close(driver, trainer)


def test_close_cancels_the_groups_in_flight():
    driver, trainer = make_driver(groups_per_step=2, hang=True)
    deadline = time.monotonic() + 120
    while trainer.agent.calls < 4 and time.monotonic() < deadline:  # the producer starts its groups
        trainer.loop.run_until_complete(asyncio.sleep(0.01))
    assert trainer.agent.calls == 4 and driver.buffer.in_flight == 4
    close(driver, trainer)
    assert trainer.agent.cancelled == 4


def test_a_resumed_driver_rolls_out_the_checkpointed_pending_prompts_first():
    driver, trainer = make_driver(groups_per_step=2, pending=[{"prompt_id": "q1"}, {"prompt_id": "q2"}])
    groups = take(driver, trainer)
    assert sorted(g.group_id for g in groups) == ["q1", "q2"]
    assert [s["prompt_id"] for s in driver.state_dict()["pending"]] == ["p0", "p1"]  # drawn after them
    close(driver, trainer)


def test_a_stall_ends_in_one_error_naming_the_groups_in_flight(caplog):
    # Every rollout hangs (an environment or engine call that never returns): the trainer warns
    # while it waits, then stops with an error instead of waiting forever.
    driver, trainer = make_driver(groups_per_step=2, hang=True)
    driver.stall_timeout_s = 2.0
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError) as e:
        take(driver, trainer)
    message = str(e.value)
    assert "no prompt group finished for 2 s" in message and "2 groups, 0 ready, 4 in flight" in message
    assert "oldest: group 'p0', started at weight version 0" in message
    assert "async.stall_timeout_s=2" in message
    assert any("still waiting" in r.getMessage() for r in caplog.records)
    close(driver, trainer)


class ExhaustedDataset(FakeDataset):
    """Ends after `limit` draws: raises StopIteration (an iterator-backed dataset) or returns nothing."""

    def __init__(self, limit, how):
        super().__init__()
        self.limit, self.how = limit, how

    def next(self, n):
        if self.drawn >= self.limit:
            if self.how == "stop":
                raise StopIteration
            return []
        return super().next(n)


@pytest.mark.parametrize("how,what", [("stop", "StopIteration"), ("empty", "LookupError: it returned no sample")])
def test_an_exhausted_dataset_ends_the_take_with_one_error_naming_it(how, what):
    # 3 prompts, then nothing: the 4th draw fails. The trainer gets one error saying so at once,
    # not a producer that died silently (the take waited a heartbeat or the stall bound first).
    driver, trainer = make_driver(groups_per_step=2)
    driver.dataset = ExhaustedDataset(3, how)
    driver.stall_timeout_s = 3600.0
    with pytest.raises(RuntimeError) as e:
        trainer.loop.run_until_complete(asyncio.wait_for(driver.next_groups(), timeout=120))
    assert str(e.value).startswith(f"async training: drawing prompt 4 from the dataset failed: {what}")
    close(driver, trainer)


class EchoSamples:
    """Echo environment samples with fresh prompt ids."""

    def __init__(self):
        self.drawn = 0

    def next(self, n):
        self.drawn += n
        return [{"prompt_id": f"e{self.drawn - n + i}", "digits": [1, 2, 3]} for i in range(n)]


def test_a_never_returning_environment_call_ends_its_trajectory_not_the_run():
    # A real agent loop over the embedded engine; every environment step hangs forever. The call
    # is abandoned at rollout.env_timeout_s (the trajectory ends as env_error) and the trainer
    # gets its groups, long before the stall bound.
    from helpers import tiny_lm

    from megatron_stepwise.envs.echo import EchoEnv
    from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
    from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
    from megatron_stepwise.rollout.engines.protocol import SamplingParams

    class HangingEnv(EchoEnv):
        def step(self, text):
            while True:  # a Python-level hang: the env caller abandons it at its deadline
                time.sleep(0.01)

    tok, model = tiny_lm("tiny_word")
    config = AgentLoopConfig(
        sampling=SamplingParams(max_new_tokens=4),
        max_turns=2,
        max_input_length=200,
        n_samples_per_prompt=2,
        env_concurrency=4,
        env_timeout_s=1.0,
        env_error_reward=-1.0,
    )
    agent = AgentLoop(LocalEngine(model, tokenizer=tok, seed=0), tok, HangingEnv, config)
    driver, trainer = make_driver(groups_per_step=2)
    driver.close()
    driver.dataset = EchoSamples()
    driver.stall_timeout_s = 600.0
    driver.start(Driver(trainer.loop, trainer.fleet, agent))
    groups = trainer.loop.run_until_complete(asyncio.wait_for(driver.next_groups(), timeout=300))
    assert len(groups) == 2
    for g in groups:
        last = [t[-1] for t in g.rollout.trajectories]
        assert all(s.stop_reason == "env_error" and "timed out" in s.metadata["error"] for s in last)
    close(driver, trainer)


def run_until(ctx, condition, what):
    """Run the rank-0 event loop (rollouts finish, the bank writes) until `condition()`."""
    deadline = time.monotonic() + 120
    while not condition() and time.monotonic() < deadline:
        ctx.loop.run_until_complete(asyncio.sleep(0.01))
    assert condition(), what


MODES = ["driver", "held", "dumps"]


def token_versions(group):
    """The weight versions of a taken group's trained tokens (from the staleness summary when its
    rows stay in the worker)."""
    if isinstance(group.rollout, HeldGroup):
        return set(group.rollout.versions.tokens)
    return {int(v) for s in group.rollout.steps for v in s.weight_versions}


def killed_run(run_dir, mode, monkeypatch):
    """A run checkpointed at version 1 and killed at version 2: its checkpoint and what it banked.

    Two of draws 0-3 trained at version 0; checkpoint (version 1, the other two pending, finished
    with version-0 tokens); those two trained at version 1 (lost with the kill); draws 4 and 5
    finished with version-1 tokens, 6 and 7 with version-2 weights the kill loses. With the rows
    kept in the workers, rank 0 writes no bank file: the worker holding the rows does."""
    from megatron_stepwise.workers.rollout_bank import RolloutBank

    rank0_writes = []
    put = RolloutBank.put
    monkeypatch.setattr(RolloutBank, "put", lambda bank, group: rank0_writes.append(group.draw) or put(bank, group))
    first, ctx = make_driver(groups_per_step=2, run_dir=run_dir, mode=mode)
    trained = {g.draw for g in take(first, ctx)}  # whichever finished first
    run_until(ctx, lambda: first.buffer.ready == 2, "the other two of draws 0-3 finish")
    ctx.version = ctx.fleet.weight_version = 1  # the step trained, weights pushed, then the checkpoint
    state = {"version": 1, "rollouts": first.state_dict()}
    first.after_save()
    pending = sorted({0, 1, 2, 3} - trained)
    assert state["rollouts"] == {
        "pending": [{"prompt_id": f"p{d % 3}"} for d in pending],
        "pending_draws": pending,
        "draws": 4,
    }
    assert sorted(g.draw for g in take(first, ctx)) == pending
    run_until(ctx, lambda: first.buffer.ready == 2, "draws 4 and 5 finish")
    ctx.version = ctx.fleet.weight_version = 2
    first._notify()
    run_until(ctx, lambda: first.buffer.ready == 4, "draws 6 and 7 finish")
    assert first.bank.held == 6  # the pending two trained, but only after the checkpoint
    assert len(list((run_dir / BANK).glob("draw_*.parquet"))) == 6
    if mode == "held":  # every file written by the worker that holds the rows, recorded by rank 0
        assert rank0_writes == []
        assert all(g.rollout.bank is not None for g in first.buffer.ready_groups())
    else:
        assert sorted(rank0_writes) == list(range(8))
    close(first, ctx)  # SIGKILL: nothing more is saved
    monkeypatch.undo()
    return state


@pytest.mark.parametrize("mode", MODES)
def test_a_resume_trains_the_banked_groups_and_rolls_none_of_them_out_again(tmp_path, monkeypatch, mode):
    state = killed_run(tmp_path, mode, monkeypatch)
    pending = state["rollouts"]["pending_draws"]
    resumed, ctx = make_driver(groups_per_step=2, run_dir=tmp_path, state=state, mode=mode)
    first = take(resumed, ctx)  # the checkpoint's pending draws, from the bank: nothing rolled out
    assert sorted((g.draw, g.start_version) for g in first) == [(d, 0) for d in pending] and ctx.agent.calls == 0
    assert {v for g in first for v in token_versions(g)} == {0}
    ctx.version = ctx.fleet.weight_version = 2
    second = take(resumed, ctx)  # draws 4 and 5, which the dataset re-issued: from the bank too
    assert sorted((g.draw, g.start_version) for g in second) == [(4, 1), (5, 1)]
    assert {v for g in second for v in token_versions(g)} == {1}
    if mode == "held":  # a worker adopted each one: it holds the banked rows, rank 0 got summaries
        assert sorted(ctx.agent.adopted) == sorted(g.group_id for g in first + second)
        for g in first + second:
            rows = ctx.agent.held.batches[(g.serial, g.group_id)].token_fields
            trained = rows["weight_versions"][rows["loss_mask"] != 0]
            assert set(trained.tolist()) == token_versions(g)
    counters = resumed.buffer.counters
    assert counters.recovered == 4 and resumed.bank.discarded == 2  # 6 and 7: version-2 tokens
    run_until(ctx, lambda: ctx.agent.calls == 2, "draws 6 and 7 are rolled out again")
    assert ctx.agent.prompts == ["p0", "p1"]  # draws 6 and 7; none of the four recovered prompts
    metrics = resumed.iteration_metrics()
    assert metrics["async/groups_recovered"] == 4 and metrics["async/bank_groups_discarded"] == 2
    close(resumed, ctx)


@pytest.mark.parametrize("mode", MODES)
def test_a_recovered_group_too_stale_for_the_resumed_policy_meets_the_stale_policy(tmp_path, monkeypatch, mode):
    state = killed_run(tmp_path, mode, monkeypatch)
    # resumed with max_staleness 0: the pending two (started at version 0) are too old at version 1
    resumed, ctx = make_driver(groups_per_step=2, run_dir=tmp_path, state=state, max_staleness=0, mode=mode)
    # (held: adopted by a worker first, as the loop runs; the slots they free admit draws 4 and 5)
    run_until(ctx, lambda: len(resumed.buffer.ledger) == 2, "the pending two are recovered")
    assert resumed.buffer.counters.stale_dropped == 2
    assert resumed.buffer.ledger == {0: "dropped", 1: "dropped"}
    # a dropped group's bank file goes at once, and a worker that adopted it drops its rows
    assert sorted(p.name.split(".")[0] for p in (tmp_path / BANK).iterdir()) == ["draw_4", "draw_5"]
    if mode == "held":
        assert not any(serial in (0, 1) for serial, _ in ctx.agent.held.batches)
    groups = take(resumed, ctx)  # the version-1 groups of draws 4 and 5 are fresh enough
    assert sorted((g.draw, g.start_version) for g in groups) == [(4, 1), (5, 1)]
    assert ctx.agent.calls == 0
    close(resumed, ctx)


def test_a_banked_group_no_worker_can_adopt_is_rolled_out_again_and_counted(tmp_path, monkeypatch, caplog):
    # Rank 0 read the bank at the resume; the file of one pending group goes bad before a worker
    # reads it again to hold its rows: that group is discarded, counted, and its prompt rolled out.
    state = killed_run(tmp_path, "held", monkeypatch)
    pending = state["rollouts"]["pending_draws"]
    resumed, ctx = make_driver(groups_per_step=2, run_dir=tmp_path, state=state, mode="held")
    (damaged,) = (tmp_path / BANK).glob(f"draw_{pending[0]}.*.parquet")
    damaged.write_bytes(damaged.read_bytes()[:100])
    with caplog.at_level("WARNING"):
        first = take(resumed, ctx)
    assert sorted(g.draw for g in first) == pending
    assert ctx.agent.calls == 1 and ctx.agent.prompts == [f"p{pending[0] % 3}"]  # the damaged one only
    # counted as discarded (with the two of lost weights), never as recovered
    assert resumed.bank.discarded == 3 and resumed.buffer.counters.recovered == len(ctx.agent.adopted) - 1
    assert any("no agent worker could adopt it" in r.getMessage() for r in caplog.records)
    close(resumed, ctx)
