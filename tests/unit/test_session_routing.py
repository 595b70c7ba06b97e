"""Routing policies (rollout/fleet/session_routing.py) as `EngineRouter` uses them, and the replay harness
(tools/bench/replay_routing.py): stickiness, the token budget, re-pins counted, a dead engine's
sessions re-pinned within one request and never sent to it again, and sticky routing keeping far
more prefix hits than round robin on long agent sessions."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
from helpers import REPO, load_script, make_step, stride_decide

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.config import load_config
from megatron_stepwise.config.errors import ConfigError
from megatron_stepwise.loop.rounds import RowsOnRank0, decide_round
from megatron_stepwise.rollout.engines.protocol import EngineError, GenerateResult, SamplingParams
from megatron_stepwise.rollout.fleet.engine_router import EngineRouter, EngineSlot, EngineView
from megatron_stepwise.rollout.fleet.session_routing import BudgetSticky, RoundRobin, Sticky, make_policy
from megatron_stepwise.rundir.dump_recorder import DumpRecorder
from megatron_stepwise.rundir.dump_table import dump_path
from megatron_stepwise.rundir.dumps import write_dump

PARAMS = SamplingParams(max_new_tokens=10)


def _load(i, outstanding=0, tokens=0):
    return SimpleNamespace(index=i, outstanding=outstanding, outstanding_tokens=tokens)


def test_policies_stick_within_their_slack_or_budget_and_round_robin_ignores_sessions():
    a, b, c = _load(0, 5, 50_000), _load(1, 1, 10_000), _load(2, 2, 40_000)
    assert Sticky(4).choose(a, [a, b, c], 100) is a  # 4 above the least busy: stays
    assert Sticky(3).choose(a, [a, b, c], 100) is b  # 4 > 3: the least busy
    assert Sticky(3).choose(None, [a, b, c], 100) is b  # a new session
    budget = BudgetSticky(60_000)
    assert budget.choose(a, [a, b, c], 10_000) is a  # 60k fits the budget
    assert budget.choose(a, [a, b, c], 10_001) is b  # over it, and engine 1 stays under half of it
    assert budget.choose(c, [a, c], 30_000) is c  # over, but the lightest is no better: keep the cache
    assert budget.choose(None, [a, b, c], 1) is b  # new sessions: fewest outstanding tokens
    rr = RoundRobin()
    assert [rr.choose(a, [c, a, b], 1).index for _ in range(4)] == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="rollout.routing must be one of sticky, budget_sticky, round_robin"):
        make_policy("least_busy")


def test_the_routing_keys_default_to_sticky_and_refuse_an_unknown_policy():
    cfg = load_config(str(REPO / "configs" / "tiny_cpu.yaml"))
    assert (cfg.rollout.routing, cfg.rollout.sticky_slack) == ("sticky", 16)
    cfg = load_config(str(REPO / "configs" / "tiny_cpu.yaml"), ["rollout.routing=budget_sticky"])
    assert cfg.rollout.routing == "budget_sticky"
    with pytest.raises(ConfigError, match="rollout.routing"):
        load_config(str(REPO / "configs" / "tiny_cpu.yaml"), ["rollout.routing=random"])


class _Engine:
    """A Ray-handle look-alike that can die: its calls then raise RayActorError, as a killed actor's."""

    def __init__(self, index, hangs=False):
        self.index, self.dead, self.calls, self.tokens_seen = index, False, 0, []
        self.hangs = hangs  # its score requests never answer (it stays healthy)
        self.generate = SimpleNamespace(remote=self._generate)
        self.call = SimpleNamespace(remote=self._call)

    async def _generate(self, input_ids, sampling, rid, session):
        self.calls += 1
        if self.dead:
            raise ray.exceptions.RayActorError()
        return GenerateResult(output_ids=[1], logprobs=[0.0], finish_reason="stop", engine=str(self.index))

    async def _call(self, method, *args):
        if method != "score":
            return not self.dead
        self.calls += 1
        if self.dead:
            raise ray.exceptions.RayActorError()
        if self.hangs:
            await asyncio.sleep(3600)
        input_ids, start, temperature = args
        return [float(self.index)] * (len(input_ids) - start)  # who scored, one value per token


def _turn(generator, session, n=4):
    return int(asyncio.run(generator.generate([7] * n, PARAMS, rid=f"{session}-r", session=session)).engine)


def test_a_dead_engines_sessions_re_pin_within_one_request_and_never_go_back():
    engines = [_Engine(i) for i in range(3)]
    view = EngineView(max_retries=2, request_timeout_s=5)  # an agent worker's router: on_dead stops using it
    view.refresh([EngineSlot(i, e) for i, e in enumerate(engines)])
    router = view.router
    assert [_turn(view, s) for s in ("a", "b", "c", "d")] == [0] * 4  # nothing in flight: the lowest index
    assert router.counters.repins == 0

    engines[0].dead = True
    assert _turn(view, "a") == 1  # one request: failed on engine 0, served on engine 1
    assert engines[0].calls == 5 and router.counters.retries == 1
    assert router.counters.repins == 1 and view.take_report()[0] == [(0, 0)]
    router.slots[1].outstanding = 1  # b's next turn: the least busy live engine, without a try on engine 0
    assert _turn(view, "b") == 2
    assert engines[0].calls == 5 and router.counters.repins == 1  # take_report reset the counters


def test_re_pinned_sessions_stay_on_their_new_engine_and_count_once():
    engines = [_Engine(i) for i in range(3)]
    view = EngineView(max_retries=2, request_timeout_s=5)
    view.refresh([EngineSlot(i, e) for i, e in enumerate(engines)])
    router = view.router
    for s in ("a", "b"):
        _turn(view, s)
    engines[0].dead = True
    first = [_turn(view, s) for s in ("a", "b")]
    assert 0 not in first and engines[0].calls == 3  # two turns before the death, one that found it
    again = [_turn(view, s) for _ in range(3) for s in ("a", "b")]
    assert again == first * 3 and engines[0].calls == 3  # pinned to the new engines, never back to 0
    assert router.counters.repins == 2 and router.counters.retries == 1


def test_a_score_request_is_retried_on_another_engine_when_one_dies_or_times_out():
    engines = [_Engine(0), _Engine(1, hangs=True), _Engine(2)]
    view = EngineView(max_retries=2, request_timeout_s=0.5)
    view.refresh([EngineSlot(i, e) for i, e in enumerate(engines)])
    engines[0].dead = True
    # engine 0 is dead (reported), engine 1 times out (healthy: kept), engine 2 scores
    assert asyncio.run(view.score([7] * 6, 2, 0.7)) == [2.0] * 4
    assert [e.calls for e in engines] == [1, 1, 1]
    deaths, counters = view.take_report()
    assert deaths == [(0, 0)] and view.router.slots[1].alive
    assert (counters.retries, counters.timeouts, counters.requests, counters.scored_tokens) == (2, 1, 1, 4)
    assert counters.generated_tokens == counters.prompt_tokens == 0
    assert all(s.outstanding == 0 and s.outstanding_tokens == 0 for s in view.router.slots)
    engines[2].dead = True  # no engine left that answers: the request fails, after every retry
    with pytest.raises(EngineError, match="failed after 3 attempts"):
        asyncio.run(view.score([7] * 6, 2, 0.7))


def test_budget_sticky_router_moves_a_session_off_an_engine_over_its_token_budget():
    engines = [_Engine(i) for i in range(2)]
    slots = [EngineSlot(i, e) for i, e in enumerate(engines)]
    router = EngineRouter(
        slots, max_retries=0, request_timeout_s=5, on_dead=lambda s, i: None, policy=BudgetSticky(100)
    )
    assert _turn(router, "a", n=20) == 0  # cost 20 + 10 max_new_tokens = 30 tokens
    slots[0].outstanding_tokens = 70
    assert _turn(router, "a", n=20) == 0  # 70 + 30 = 100: within the budget
    slots[0].outstanding_tokens = 71
    assert _turn(router, "a", n=20) == 1  # 101 > 100 and engine 1 (0 + 30 <= 50) has room: re-pinned
    assert router.counters.repins == 1 and slots[1].outstanding_tokens == 0  # released after the request
    slots[1].outstanding_tokens = 90
    assert _turn(router, "a", n=20) == 1  # over budget again, but engine 0 (71) is no lighter half
    assert router.counters.repins == 1


# ---- the replay harness -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness():
    return load_script(Path(REPO) / "tools" / "bench" / "replay_routing.py")


@pytest.mark.timeout(120)  # a few seconds: 120 sessions, 3 policies, twice
def test_replay_sticky_keeps_prefix_hits_round_robin_loses_and_a_kill_re_pins_every_orphan(harness):
    out = harness.run(quick=True)
    synthetic = out["traces"]["synthetic"]["policies"]
    rr, sticky, budget = synthetic["round_robin"], synthetic["sticky"], synthetic["budget_sticky"]
    assert sticky["hit_rate"] >= rr["hit_rate"] + 0.2
    assert sticky["hit_rate"] <= out["traces"]["synthetic"]["ceiling_hit_rate"] + 1e-9
    assert budget["hit_rate"] >= rr["hit_rate"] + 0.2
    assert budget["imbalance"] <= sticky["imbalance"]  # the budget trades a few hits for balance
    assert sticky["repins"] < rr["repins"] / 10
    for r in out["kill"]["policies"].values():
        k = r["kill"]
        assert k["orphaned_sessions"] > 0 and k["orphans_served_again"] == k["orphaned_sessions"]
        assert k["attempts_max"] <= 2  # at most the one try that found the engine dead
        assert k["in_flight_at_kill"] <= k["failed_attempts"]


def _two_turn_group(pid):
    steps = []
    for k in range(2):
        steps.append(make_step(pid, k, prompt=[1, 2, 3], resp=[4 + k, 5, 2], mask=[1, 1, 0], last=False))
        steps.append(make_step(pid, k, prompt=[1, 2, 3, 4 + k, 5, 2, 9], resp=[6, 2], mask=[1, 1], last=True))
        steps[-2].metadata["turn"], steps[-1].metadata["turn"] = 0, 1
    return steps


def test_replay_reads_a_runs_rollout_dumps_as_sessions(tmp_path, harness):
    recorder = DumpRecorder(every=1)
    recorder.begin(0)
    steps = _two_turn_group("a") + _two_turn_group("b")
    decide_round(
        [groups_of(steps[:4]), groups_of(steps[4:])],
        RowsOnRank0(recorder=recorder),
        decide=stride_decide(2),
        dp_size=2,
    )
    config = {"rollout": {"max_new_tokens": 8}}
    write_dump(
        dump_path(tmp_path, 0), recorder.minibatches, iteration=0, weight_version=0, config=config, train_metrics=[]
    )
    traces = load_script(Path(REPO) / "tools" / "bench" / "routing_traces.py")
    trace = traces.dump_trace(tmp_path, block_tokens=1)
    assert len(trace) == 4 and all(len(s.turns) == 2 for s in trace)
    assert [t.prompt_tokens for t in trace[0].turns] == [3, 7] and trace[0].turns[0].max_new_tokens == 8
    sim = load_script(Path(REPO) / "tools" / "bench" / "routing_sim.py")
    # turn 2 finds its first turn's 5 tokens; turn 1 shares [1, 2] with an earlier session's: 2 more
    assert sim.cache_ceiling(trace) > 0.5
    r = sim.replay(trace, make_policy("sticky"), sim.SimConfig(engines=2, cache_tokens=1000))
    assert r["requests"] == 8 and r["hit_rate"] > 0.5 and r["repins"] == 0


def test_replay_refuses_a_dump_directory_without_dumps_before_replaying_anything(
    tmp_path, harness, monkeypatch, capsys
):
    out = tmp_path / "out.json"
    monkeypatch.setattr("sys.argv", ["replay_routing.py", "--quick", "--dumps", str(tmp_path), "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        harness.main()
    assert e.value.code == 2 and not out.exists()
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"replay_routing: --dumps {tmp_path}: no rollouts/iter_*.parquet") and "\n" not in err
