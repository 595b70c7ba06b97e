"""GroupBuffer: the staleness bound, admission, atomic groups and conservation of async training.

The randomised tests drive the buffer exactly as the async driver does (a producer that starts
groups whenever admitted, a trainer that takes `prompts_per_minibatch` groups, trains, bumps the
version and syncs the fleet) on a simulated clock with random generation and training speeds,
random group sizes and random filters, for many seeds.
"""

import heapq
import itertools
import random
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from helpers import make_step

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.config.schema import AsyncConfig
from megatron_stepwise.loop.group_buffer import GroupBuffer
from megatron_stepwise.options import OptionError
from megatron_stepwise.steps import Step, TrajectoryID


def sample(i, pid=None):
    return {"prompt_id": pid or f"p{i}", "uid": i}


def counter_draw():
    n = itertools.count()
    return lambda: sample(next(n))


# ------------------------------------------------------------------------- hand-computed cases
def test_admission_keeps_the_fleet_at_most_max_staleness_steps_ahead():
    buf = GroupBuffer(4, AsyncConfig(max_staleness=1))
    draw = counter_draw()
    started = []
    while buf.can_start(0):
        started.append(buf.start(0, draw))
    assert len(started) == 8  # (0 + 1 + 1) * 4: this step's groups and the next step's
    for g in started:
        assert buf.finish(g.serial, [("row", g.serial)], version=0) == "ready"
    assert [g.serial for g in buf.take(4, 0)] == [0, 1, 2, 3]
    assert not buf.can_start(0)  # 4 trained + 4 outstanding = capacity until the version moves
    more = 0
    while buf.can_start(1):
        buf.start(1, draw)
        more += 1
    assert more == 4
    assert buf.capacity(1) == 12 and buf.counters.started == 12


def test_groups_that_leave_untrained_are_handed_to_on_discard():
    # Rows an agent worker holds for a group can go once the group is filtered or evicted; a
    # trained group is the trainer's to release, after its rows are fetched.
    discarded = []
    buf = GroupBuffer(
        1,
        AsyncConfig(max_staleness=0),
        keep_group=lambda rollout: rollout != "flat",
        on_discard=lambda g: discarded.append((g.serial, g.rollout)),
    )
    draw = counter_draw()
    a = buf.start(0, draw)
    buf.finish(a.serial, "flat", version=0)  # filtered
    b = buf.start(0, draw)
    buf.finish(b.serial, "ok", version=1)  # too stale when it finished: dropped
    c = buf.start(1, draw)
    buf.finish(c.serial, "ok", version=1)
    assert [g.serial for g in buf.take(1, 1)] == [c.serial]
    assert discarded == [(a.serial, "flat"), (b.serial, "ok")]


def test_take_returns_exactly_n_oldest_start_version_first_or_none():
    buf = GroupBuffer(2, AsyncConfig(max_staleness=3))
    draw = counter_draw()
    a, b = buf.start(0, draw), buf.start(0, draw)
    c, d = buf.start(1, draw), buf.start(2, draw)
    buf.finish(d.serial, ["d"], 2)
    buf.finish(c.serial, ["c"], 2)
    assert buf.take(3, 2) is None and buf.ready == 2  # not enough: nothing removed
    buf.finish(b.serial, ["b0", "b1", "b2"], 2)
    assert [g.serial for g in buf.take(2, 2)] == [b.serial, c.serial]  # start versions 0, 1 before 2
    assert buf.take(2, 2) is None
    buf.finish(a.serial, ["a"], 2)
    got = buf.take(2, 2)
    assert [g.rollout for g in got] == [["a"], ["d"]]
    assert buf.counters.trained == 4 and buf.ledger == {0: "trained", 1: "trained", 2: "trained", 3: "trained"}


@pytest.mark.parametrize("policy", ["drop", "requeue"])
def test_too_stale_groups_are_dropped_or_requeued_and_counted(policy):
    buf = GroupBuffer(1, AsyncConfig(max_staleness=1, stale_policy=policy), base_version=5)
    draw = counter_draw()
    old, fresh = buf.start(5, draw), buf.start(6, draw)
    buf.finish(old.serial, ["old"], version=6)  # staleness 1: still fine
    buf.finish(fresh.serial, ["fresh"], version=6)
    got = buf.take(1, version=7)  # old is now 2 versions behind
    assert [g.serial for g in got] == [fresh.serial]
    assert buf.ledger[old.serial] == ("dropped" if policy == "drop" else "requeued")
    assert (buf.counters.stale_dropped, buf.counters.stale_requeued) == ((1, 0) if policy == "drop" else (0, 1))
    again = buf.start(7, draw)
    if policy == "requeue":
        assert again.sample == old.sample and again.attempt == 1 and again.start_version == 7
    else:
        assert again.sample["uid"] == 2 and again.attempt == 0
    # a group that is already too stale when it finishes never becomes ready
    late = buf.start(7, draw)
    assert buf.finish(late.serial, ["late"], version=9) == ("dropped" if policy == "drop" else "requeued")
    assert buf.ready == 0


def test_finish_twice_or_unknown_group_is_an_error():
    buf = GroupBuffer(1, AsyncConfig(max_staleness=1))
    g = buf.start(0, counter_draw())
    buf.finish(g.serial, [], 0)
    with pytest.raises(ValueError, match="group 0 is not in flight"):
        buf.finish(g.serial, [], 0)
    with pytest.raises(ValueError, match="group 7 is not in flight"):
        buf.finish(7, [], 0)


def test_a_prompt_in_flight_twice_gets_distinct_group_ids():
    buf = GroupBuffer(2, AsyncConfig(max_staleness=1))
    same = iter([sample(0, "q"), sample(1, "q"), sample(2, "q")])
    a, b = buf.start(0, lambda: next(same)), buf.start(0, lambda: next(same))
    assert (a.group_id, b.group_id) == ("q", "q~1")
    assert b.rollout_sample() == {"prompt_id": "q~1", "uid": 1} and b.sample["prompt_id"] == "q"
    buf.finish(a.serial, [], 0)
    buf.take(1, 0)
    assert buf.start(0, lambda: next(same)).group_id == "q"  # "q" is free again


def test_bad_settings_name_the_config_key():
    with pytest.raises(OptionError, match="async.max_staleness: must be >= 0"):
        AsyncConfig(max_staleness=-1)  # the section checks its bounds; the buffer trusts them
    with pytest.raises(ValueError, match="has no 'prompt_id'"):
        GroupBuffer(1, AsyncConfig()).start(0, lambda: {"x": 1})


def test_zero_variance_filter_acts_on_trajectory_groups_and_starvation_is_reported():
    buf = GroupBuffer(1, AsyncConfig(max_staleness=1), keep_group=lambda g: g.summary().has_reward_variance)
    draw = counter_draw()
    flat = buf.start(0, draw)
    # 2 trajectories; the first has an earlier step whose reward (0) differs: only last steps count
    steps = [
        make_step("p0", 0, [1, 2], [3], reward=0.0, last=False),
        make_step("p0", 0, [1, 2], [3], reward=1.0),
        make_step("p0", 1, [1, 2], [3], reward=1.0),
    ]
    assert buf.finish(flat.serial, groups_of(steps)[0], 0) == "filtered"
    assert buf.starved(1) and not buf.starved(2)
    assert buf.can_start(0)  # the filtered group freed its slot
    good = buf.start(0, draw)
    rows = [make_step("p1", 0, [1, 2], [3], reward=0.0), make_step("p1", 1, [1, 2], [3], reward=1.0)]
    assert buf.finish(good.serial, groups_of(rows)[0], 0) == "ready"
    assert [g.serial for g in buf.take(1, 0)] == [good.serial]
    assert not buf.starved(1) and buf.counters.filtered == 1 and buf.ledger[flat.serial] == "filtered"


def test_pending_samples_survive_for_a_checkpoint():
    buf = GroupBuffer(2, AsyncConfig(max_staleness=1, stale_policy="requeue"))
    draw = counter_draw()
    gs = [buf.start(0, draw) for _ in range(4)]
    for g in gs[:3]:
        buf.finish(g.serial, [g.serial], 0)
    buf.take(2, 0)  # uids 0, 1 trained; 2 ready; 3 in flight
    assert [s["uid"] for s in buf.pending_samples()] == [2, 3]
    other = GroupBuffer(2, AsyncConfig(max_staleness=1))
    other.requeue_samples(buf.pending_samples())
    assert [other.start(0, draw).sample["uid"] for _ in range(3)] == [2, 3, 4]


# ------------------------------------------------------------------------- randomised schedules
@dataclass
class Scenario:
    groups_per_step: int
    max_staleness: int
    policy: str
    gen: str  # distribution of a group's generation time
    train: str
    filter_prob: float = 0.0


@dataclass
class Rollout:
    """A finished group as the buffer reads it: its summary's turns (the length buckets)."""

    trajectories: list  # each a list of turns

    @property
    def prompt_id(self) -> str:
        return "simulated"

    def summary(self):
        return SimpleNamespace(turns=[len(t) for t in self.trajectories])


def _duration(kind, rng):
    if kind == "const":
        return 1.0
    if kind == "uniform":
        return rng.uniform(0.1, 2.0)
    if kind == "fast":
        return rng.uniform(0.01, 0.2)
    if kind == "slow":
        return rng.uniform(2.0, 6.0)
    if kind == "heavy":  # mostly quick, sometimes a very long straggler
        return rng.expovariate(1.0) if rng.random() < 0.9 else rng.uniform(5.0, 30.0)
    raise ValueError(kind)


def simulate(sc: Scenario, seed: int, train_steps: int = 40, max_events: int = 200_000):
    """Producer and trainer around one GroupBuffer on a simulated clock; returns a trace."""
    rng = random.Random(seed)
    keep = (lambda rows: rows[0][2]) if sc.filter_prob else None
    buf = GroupBuffer(
        sc.groups_per_step, AsyncConfig(max_staleness=sc.max_staleness, stale_policy=sc.policy), keep_group=keep
    )
    uid = itertools.count()
    # a small dataset, so the same prompt is often in flight twice
    draw = lambda: (lambda i: {"prompt_id": f"p{i % 7}", "uid": i})(next(uid))  # noqa: E731
    clock, fleet_v, trainer_v = 0.0, 0, 0
    events, seq = [], itertools.count()
    generated = {}  # serial -> rows as generated
    trace = {"takes": [], "starts": [], "skips": 0, "buf": buf, "generated": generated}
    state = "waiting"  # trainer: waiting | training | syncing

    def produce():
        while buf.can_start(fleet_v):
            g = buf.start(fleet_v, draw)
            if sc.gen == "bimodal":  # half the groups are long agent sessions: 6 turns, 6x the time
                turns = 6 if rng.random() < 0.5 else 1
                rows = Rollout([[(g.serial, k, t) for t in range(turns)] for k in range(4)])
                duration = turns * rng.uniform(0.4, 0.6)
            else:
                keep_it = rng.random() >= sc.filter_prob
                rows = [(g.serial, r, keep_it) for r in range(rng.randint(1, 12))]  # trajectories x turns
                duration = _duration(sc.gen, rng)
            generated[g.serial] = rows
            trace["starts"].append((g.serial, g.sample["uid"], fleet_v))
            heapq.heappush(events, (clock + duration, next(seq), "finish", g.serial))
            assert buf.counters.trained + buf.outstanding <= buf.capacity(fleet_v)

    def try_train():
        nonlocal state
        got = buf.take(sc.groups_per_step, trainer_v)
        if got is None and buf.starved(3 * sc.groups_per_step):
            buf.skip_step()
            trace["skips"] += 1
            return
        if got is not None:
            trace["takes"].append((trainer_v, got))
            state = "training"
            heapq.heappush(events, (clock + _duration(sc.train, rng), next(seq), "trained", None))

    produce()
    for _ in range(max_events):
        if len(trace["takes"]) >= train_steps or not events:
            break
        clock, _, kind, payload = heapq.heappop(events)
        if kind == "finish":
            buf.finish(payload, generated[payload], trainer_v)
        elif kind == "trained":
            trainer_v += 1
            state = "syncing"
            heapq.heappush(events, (clock + 0.05, next(seq), "synced", None))
        elif kind == "synced":
            fleet_v = trainer_v
            state = "waiting"
        if state == "waiting":
            try_train()
        produce()
    return trace


SCENARIOS = {
    "const-eta1": Scenario(4, 1, "drop", "const", "const"),
    "gen-slower-eta1": Scenario(4, 1, "drop", "slow", "uniform"),
    "gen-faster-eta2": Scenario(2, 2, "requeue", "fast", "uniform"),
    "uniform-eta1-requeue": Scenario(3, 1, "requeue", "uniform", "uniform"),
    "heavy-tail-eta1-drop": Scenario(4, 1, "drop", "heavy", "uniform"),
    "heavy-tail-eta3-requeue": Scenario(2, 3, "requeue", "heavy", "fast"),
    "filters-eta1": Scenario(4, 1, "requeue", "heavy", "uniform", filter_prob=0.5),
    "mostly-filtered": Scenario(2, 1, "drop", "uniform", "fast", filter_prob=0.95),
    "heavy-tail-eta1-pace": Scenario(4, 1, "pace", "heavy", "uniform"),
    "slow-eta0-pace": Scenario(2, 0, "pace", "slow", "uniform"),
    "filters-eta2-pace": Scenario(3, 2, "pace", "heavy", "fast", filter_prob=0.5),
    "bimodal-eta1-pace": Scenario(4, 1, "pace", "bimodal", "uniform"),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_randomised_schedules_keep_the_bound_and_lose_or_duplicate_nothing(name):
    sc = SCENARIOS[name]
    totals = {"evicted": 0, "trained": 0}
    for seed in range(150):
        trace = simulate(sc, seed)
        buf, generated = trace["buf"], trace["generated"]
        trained_serials = []
        for version, groups in trace["takes"]:
            assert len(groups) == sc.groups_per_step  # exactly one mini-batch of groups per step
            for g in groups:
                # the staleness bound
                assert 0 <= version - g.start_version <= sc.max_staleness, (seed, version, g)
                # a group's rows arrive together, complete and in order
                assert g.rollout == generated[g.serial]
            # distinct advantage groups inside one mini-batch
            assert len({g.group_id for g in groups}) == len(groups)
            trained_serials += [g.serial for g in groups]
        # nothing trained twice
        assert len(trained_serials) == len(set(trained_serials))
        # every started group ended exactly once, or is still outstanding
        started = {s for s, _, _ in trace["starts"]}
        outstanding = {g.serial for g in buf.outstanding_groups()}
        assert not (outstanding & set(buf.ledger))
        assert set(buf.ledger) | outstanding == started
        assert {s for s, o in buf.ledger.items() if o == "trained"} == set(trained_serials)
        # every drawn sample: trained, filtered or dropped at most once overall, and either that
        # or still pending; re-queued attempts come back as new groups
        uid_of = {s: u for s, u, _ in trace["starts"]}
        final = {}
        for serial in sorted(started):
            outcome = buf.ledger.get(serial, "pending")
            u = uid_of[serial]
            assert final.get(u) in (None, "requeued"), (seed, u, final.get(u), outcome)
            final[u] = outcome
        pending = {s["uid"] for s in buf.pending_samples()}
        for u, outcome in final.items():
            assert (outcome in ("pending", "requeued")) == (u in pending), (seed, u, outcome)
        if sc.policy == "drop":
            assert buf.counters.stale_requeued == 0
        else:
            assert buf.counters.stale_dropped == 0
        totals["evicted"] += buf.counters.stale_dropped + buf.counters.stale_requeued
        totals["trained"] += len(trace["takes"])
    # the schedules were not vacuous: the trainer made progress...
    assert totals["trained"] >= 150 * (5 if name == "mostly-filtered" else 40)
    # ...and the stale path was exercised where stragglers exist, never with constant speeds
    if sc.gen == "heavy" and sc.policy != "pace":
        assert totals["evicted"] > 0
    if sc.policy == "pace" and sc.max_staleness > 0 and not sc.filter_prob:
        assert totals["evicted"] == 0  # the trainer waited instead: nothing generated is thrown away
    if name == "const-eta1":
        assert totals["evicted"] == 0


def test_token_versions_count_only_trained_tokens():
    from megatron_stepwise.workers.worker_rows import TokenVersions

    a = Step(TrajectoryID("p", 0), [1], [5, 6, 7], [1, 1, 0], weight_versions=[3, 4, 4])
    b = Step(TrajectoryID("p", 1), [1], [5, 6], [1, 1], weight_versions=[5, 5])
    c = Step(TrajectoryID("p", 2), [1], [5], [1])  # no versions recorded
    versions = TokenVersions.of([[a], [b], [c]])
    assert versions.tokens == {3: 1, 4: 1, 5: 2}
    assert versions.staleness(5) == {2: 1, 1: 1, 0: 2}


def test_token_versions_see_updates_inside_a_trajectory():
    from megatron_stepwise.workers.worker_rows import TokenVersions

    trajectories = [
        [
            Step(TrajectoryID("p", 0), [1], [5, 6], [1, 1], weight_versions=[3, 3]),
            Step(TrajectoryID("p", 0), [1], [5, 6, 2], [1, 1, 0], weight_versions=[4, 5, 9]),  # 9: untrained EOS
        ],
        [Step(TrajectoryID("p", 1), [1], [5], [1], weight_versions=[4])],
    ]
    assert TokenVersions.of(trajectories).spreads == [2, 0]


def length_shares(policy: str, seeds: int = 30) -> dict[str, tuple[float, float]]:
    """{bucket: (trained share, generated share)} over many bimodal schedules."""
    generated, trained = Counter(), Counter()
    for seed in range(seeds):
        buf = simulate(Scenario(4, 1, policy, "bimodal", "uniform"), seed)["buf"]
        generated.update(buf.generated_by_length)
        trained.update(buf.trained_by_length)
    return {b: (trained[b] / sum(trained.values()), generated[b] / sum(generated.values())) for b in generated}


def test_pacing_trains_long_trajectories_as_often_as_they_are_generated():
    # Long multi-turn groups take ~6x longer; with max_staleness 1 they finish too stale.
    drop, pace = length_shares("drop"), length_shares("pace")
    print(f"bimodal lengths, (trained, generated) share per bucket: drop {drop}, pace {pace}")
    trained, generated = pace["turns_6"]
    assert abs(trained - generated) <= 0.05  # pacing: the long bucket is trained in proportion
    trained, generated = drop["turns_6"]
    assert generated - trained >= 0.08  # discarding: the long bucket is measurably under-trained
