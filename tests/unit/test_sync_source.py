"""The synchronous source on rank 0 with a scripted agent: group filters and dynamic sampling
decide on whole prompt groups (their outcome rewards), and mini-batches hold whole groups."""

import asyncio
from types import SimpleNamespace

from helpers import make_step, stride_decide

from megatron_stepwise.algo.groups import RolloutGroup
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.loop.sources import Driver, SyncRollouts


class ScriptedAgent:
    """Prompt `p<i>` gets rewards (0, 1) (informative) when i is in `informative`, else (1, 1)."""

    def __init__(self, informative):
        self.informative = set(informative)
        self.calls = []

    async def rollout_groups(self, samples, seed=None, on_trajectory_done=None):
        self.calls.append([s["prompt_id"] for s in samples])
        groups = []
        for s in samples:
            pid = s["prompt_id"]
            rewards = (0.0, 1.0) if int(pid[1:]) in self.informative else (1.0, 1.0)
            groups.append(
                RolloutGroup(pid, [[make_step(pid, k, resp=[5, 6], reward=r)] for k, r in enumerate(rewards)])
            )
        return groups


class CountingDataset:
    def __init__(self):
        self.drawn = 0

    def next(self, n):
        out = [{"prompt_id": f"p{self.drawn + i}"} for i in range(n)]
        self.drawn += n
        return out


def decide(informative, *, per_iteration=4, per_minibatch=2, zero_variance=False, dynamic=False, rounds=3):
    cfg = ExperimentConfig()
    cfg.data.prompts_per_iteration, cfg.data.prompts_per_minibatch = per_iteration, per_minibatch
    cfg.data.samples_per_prompt = 2
    cfg.algo.filters.zero_variance, cfg.algo.filters.dynamic_sampling = zero_variance, dynamic
    cfg.algo.filters.max_sampling_rounds = rounds
    agent = ScriptedAgent(informative)
    source = SyncRollouts(
        cfg, dataset=CountingDataset(), handoff=None, vocab_size=64, decide=stride_decide(), dp_size=1
    )
    loop = asyncio.new_event_loop()
    source.start(Driver(loop, SimpleNamespace(metrics=dict), agent))
    try:
        (round_,) = source._decide(iteration=0)
    finally:
        loop.close()
    prompts = [sorted({t.prompt_id for t in shard.batch.trajectory_ids}) for shard in round_.shards]
    return prompts, round_.metrics, agent.calls


def test_without_filters_every_group_trains_in_order():
    prompts, metrics, calls = decide(informative=[1])
    assert calls == [["p0", "p1", "p2", "p3"]]
    assert prompts == [["p0", "p1"], ["p2", "p3"]]
    assert metrics["filter/groups_trained"] == 4 and metrics["filter/groups_dropped_zero_variance"] == 0


def test_zero_variance_drops_flat_groups_and_keeps_a_multiple_of_the_minibatch():
    prompts, metrics, _ = decide(informative=[0, 2, 3], zero_variance=True)
    # three informative groups, mini-batches of two: one mini-batch, the first two kept
    assert prompts == [["p0", "p2"]]
    assert (
        metrics["filter/groups_in"],
        metrics["filter/groups_dropped_zero_variance"],
        metrics["filter/groups_trained"],
    ) == (4, 1, 2)


def test_dynamic_sampling_rolls_out_fresh_prompts_until_enough_groups_vary():
    prompts, metrics, calls = decide(informative=[1, 3, 4, 6, 9], dynamic=True)
    assert calls == [["p0", "p1", "p2", "p3"], ["p4", "p5", "p6", "p7"]]  # 4 informative after two rounds
    assert prompts == [["p1", "p3"], ["p4", "p6"]]
    assert metrics["rollout/sampling_rounds"] == 2 and metrics["filter/groups_trained"] == 4


def test_dynamic_sampling_stops_at_its_round_limit_and_trains_what_it_has():
    prompts, metrics, calls = decide(informative=[1], dynamic=True, rounds=2)
    assert len(calls) == 2 and prompts == []  # one informative group < one mini-batch of two
    assert metrics["filter/groups_trained"] == 0
