"""Rows left in the agent workers (`rollout.handoff: workers`): groups prepared one at a time
make the mini-batch `prepare` makes; rank 0 decides from row tables alone; a replica's fetched
rows make exactly the shard the whole mini-batch would have given it; a failed fetch on one
rank is an error on every rank."""

import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.algo.planner import plan_microbatches
from megatron_stepwise.algo.prepare import add_counts, prepare, prepare_rows
from megatron_stepwise.algo.reductions import REDUCTIONS, loss_token_weights, row_denominators
from megatron_stepwise.algo.rows import RowTable
from megatron_stepwise.algo.shards import ShardDecision, shard_rows
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps
from megatron_stepwise.loop.handoff import Handoff
from megatron_stepwise.loop.rounds import decide_round
from megatron_stepwise.metrics.core import rollout_metrics
from megatron_stepwise.steps import StepBatch
from megatron_stepwise.workers.worker_rows import HeldRows, HoldRequest, RemoteShard, RowFetcher, RowsInWorkers


def _groups(seed=3, prompts=6):
    return groups_of(make_agent_steps(AgentWorkload(num_prompts=prompts, samples_per_prompt=4, seed=seed)))


def _same_batch(a: StepBatch, b: StepBatch):
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.offsets, b.offsets)
    assert torch.equal(a.prompt_lens, b.prompt_lens) and a.trajectory_ids == b.trajectory_ids
    assert set(a.token_fields) == set(b.token_fields) and set(a.row_fields) == set(b.row_fields)
    for k in a.token_fields:
        assert torch.equal(a.token_fields[k], b.token_fields[k]), k
    for k in a.row_fields:
        assert torch.equal(a.row_fields[k], b.row_fields[k]), k


@pytest.mark.parametrize("estimator,merge", [("grpo", False), ("grpo", True), ("turn_rloo", False), ("rloo", True)])
def test_groups_prepared_one_at_a_time_make_the_minibatch_prepare_makes(estimator, merge):
    groups = _groups()
    options = {"estimator": estimator, "merge_steps": merge, "max_tokens": 16384}
    whole, whole_counts = prepare(groups, **options)
    parts = [prepare_rows([g], **options) for g in groups]
    _same_batch(StepBatch.concat([b for b, _ in parts]), whole)
    assert add_counts(c for _, c in parts) == whole_counts
    table = RowTable.concat([RowTable.of(b) for b, _ in parts])
    expected = RowTable.of(whole)
    for name in ("lengths", "trained", "trained_known", "traj_index", "group_index", "is_padding"):
        assert torch.equal(getattr(table, name), getattr(expected, name)), name


def test_metrics_from_summaries_equal_metrics_from_the_groups():
    groups = _groups(seed=5)
    assert rollout_metrics([g.summary() for g in groups]) == rollout_metrics(groups)
    assert rollout_metrics(groups_of([s for g in groups for s in g.steps])) == rollout_metrics(groups)


def _decide(rows: RowTable, dp: int, reduction: str):
    """decide_shards' cut without a model: the real planner, the reduction's denominators."""
    plan = plan_microbatches(rows.lengths.tolist(), dp_size=dp, max_tokens=16384)
    denominators = row_denominators(rows, reduction)
    out = []
    for rank, micros in enumerate(plan):
        mine, local = shard_rows(micros)
        index = torch.as_tensor(mine, dtype=torch.long)
        out.append(
            ShardDecision(
                local,
                mine,
                rank,
                dp,
                int(rows.trained.sum()),
                0,
                0,
                0,
                False,
                False,
                rows.traj_index[index],
                rows.group_index[index],
                denominators[index],
            )
        )
    return out


class _LocalFetcher(RowFetcher):
    """Fetches from in-process HeldRows instead of Ray actors."""

    def __init__(self, holders):
        super().__init__()
        self.holders = holders

    def _connect(self, address, auth_mode):
        pass

    def _actor(self, name):
        holder = self.holders[name]

        class Method:
            def __init__(self, fn):
                self.remote = fn

        return type("Actor", (), {"take": Method(lambda runs: _Ready(holder.take(runs)))})()


class _Ready:
    def __init__(self, value):
        self.value = value


@pytest.mark.parametrize("reduction", [r for r in REDUCTIONS if r != "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_fetched_rows_make_the_shard_of_the_whole_minibatch(monkeypatch, reduction, dp):
    import ray

    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(ray, "get", lambda ref: ref.value)
    groups = _groups(prompts=8)
    options = {"estimator": "grpo", "merge_steps": True, "max_tokens": 16384}
    request = HoldRequest(4, functools.partial(prepare_rows, **options), vocab_size=None)
    holders = {"w0": HeldRows(), "w1": HeldRows()}
    held = [holders[f"w{i % 2}"].keep(g, request, f"w{i % 2}") for i, g in enumerate(groups)]
    minibatches = [held[:5], held[5:]]  # a mini-batch's groups on both workers
    rounds = decide_round(
        minibatches, RowsInWorkers(4, "unused"), decide=lambda rows: _decide(rows, dp, reduction), dp_size=dp
    )
    shards, counts = [[r.shards[mb] for r in rounds] for mb in range(2)], rounds[0].counts
    assert len(rounds) == dp and all(r.skipped == 0 and len(r.shards) == 2 for r in rounds)
    fetcher = _LocalFetcher(holders)
    for groups_of_mb, remote in zip([groups[:5], groups[5:]], shards):
        whole, whole_counts = prepare(groups_of_mb, **options)
        weights = loss_token_weights(whole, reduction)
        for shard in (fetcher.fetch(r) for r in remote):
            expected = whole.select(shard.decision.rows)
            expected.token_fields["weights"] = weights[
                torch.cat([torch.arange(int(whole.offsets[r]), int(whole.offsets[r + 1])) for r in shard.decision.rows])
            ]
            _same_batch(shard.batch, expected)
    assert counts[0] == prepare(groups[:5], **options)[1]
    assert fetcher.bytes_fetched > 0
    # the decision travels without a token: a manifest is far smaller than the rows it names
    assert all(isinstance(r, RemoteShard) and r.num_rows == len(r.decision.rows) for mb in shards for r in mb)


def test_a_worker_names_what_it_does_not_hold_and_drops_released_rounds():
    holder = HeldRows()
    group = _groups(prompts=1)[0]
    holder.keep(group, HoldRequest(1, prepare_rows, None), "w0")
    assert holder.take([(1, group.prompt_id, [0])]).num_rows == 1
    with pytest.raises(KeyError, match="no rows of prompt group 'nope' in round 1"):
        holder.take([(1, "nope", [0])])
    holder.release(1)
    assert holder.batches == {}


def test_async_groups_are_held_and_dropped_one_at_a_time_with_their_versions():
    # Asynchronous training holds each group under its own key (its serial); the same prompt id
    # may be held twice (a small dataset wraps around), and dropping one group keeps the other.
    holder = HeldRows()
    group = _groups(prompts=1)[0]
    for s in group.steps:
        s.weight_versions = torch.full_like(s.response_ids, 3)
    first = holder.keep(group, HoldRequest(7, prepare_rows, None), "w0")
    second = holder.keep(group, HoldRequest(9, prepare_rows, None), "w0")
    assert (first.key, second.key) == (7, 9)
    trained = sum(int(s.loss_mask.sum()) for s in group.steps)
    assert first.versions.tokens == {3: trained} and first.versions.staleness(4) == {1: trained}
    holder.drop([(7, group.prompt_id)])
    assert list(holder.batches) == [(9, group.prompt_id)]
    assert holder.take([(9, group.prompt_id, [0])]).num_rows == 1


class _Failing:
    """An ObjectRef whose value is an error."""

    def __init__(self, error):
        self.error = error


def test_a_lost_fetch_names_each_lost_worker_its_node_and_what_became_of_it(monkeypatch):
    import ray
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from megatron_stepwise.workers.worker_rows import RowsLost

    pending = _Ready(None)  # never answers

    def get(ref):
        if isinstance(ref, _Failing):
            raise ref.error
        return ref.value

    monkeypatch.setattr(
        ray, "wait", lambda refs, num_returns=1, timeout=None: ([r for r in refs if r is not pending], [])
    )
    monkeypatch.setattr(ray, "get", get)
    unreachable = ActorUnavailableError("RpcError: recvmsg:Connection timed out", b"\x01" * 16)
    died = ActorDiedError(
        ActorDiedErrorContext(
            class_name="AgentWorker",
            actor_id=b"\x02" * 16,
            name="w2",
            node_ip_address="10.213.5.2",
            error_message="The actor is dead because its node has died.",
        )
    )
    fetcher = RowFetcher(timeout_s=5)
    # where the workers run, as `_actor` asked them: w3's answer has not come
    fetcher._nodes = {"w1": _Ready("10.213.5.2"), "w2": _Ready("10.213.5.2"), "w3": pending}
    refs = [_Ready("rows"), _Failing(unreachable), _Failing(died), pending]
    with pytest.raises(RowsLost) as e:
        fetcher._gather(["w0", "w1", "w2", "w3"], refs, 2)
    assert e.value.lost == ["w1", "w2", "w3"]
    assert str(e.value) == (
        f"fetching the rows of round 2: agent worker w1 on 10.213.5.2 could not be reached (ActorUnavailableError: "
        f"{unreachable}); agent worker w2 on 10.213.5.2 died (ActorDiedError: The actor is dead because its node "
        "has died.); agent worker w3 did not answer within 5 s (rollout.agent_worker_timeout_s)"
    )
    assert fetcher._nodes == {}  # the lost workers are forgotten (a replacement has a new name)


def _resolve_worker(rank: int, store_path: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=4)

    class Position:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    out = {}
    handoff = Handoff(Position(), dp_rank=rank // 2)  # DP2 x 2 model-parallel ranks
    got = handoff.to_ranks(lambda: [["a"], ["b"]], "rollout", 1, resolve=lambda p: p + [dist.get_rank()])
    out["ok"] = got

    def resolve(payload):
        if dist.get_rank() == 2:
            raise ConnectionError("agent worker agent-x-1.0 is gone")
        return payload

    try:
        handoff.to_ranks(lambda: [["a"], ["b"]], "rollout", 2, resolve=resolve)
    except RuntimeError as e:
        out["error"] = str(e)
    dist.barrier()  # every rank got here: none is left in a collective
    dist.destroy_process_group()
    results[rank] = out


@pytest.mark.distributed
def test_a_replica_leader_resolves_for_its_replica_and_a_failure_reaches_every_rank():
    # the Manager's server is spawned: forked from this process (Ray's threads may run in it) it can deadlock
    with tempfile.TemporaryDirectory() as tmp, mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.spawn(_resolve_worker, args=(os.path.join(tmp, "store"), results), nprocs=4, join=True)
        results = dict(results)
    # the leaders (ranks 0 and 2) resolve; their replica peers get the leader's result
    assert [results[r]["ok"] for r in range(4)] == [["a", 0], ["a", 0], ["b", 2], ["b", 2]]
    for rank in range(4):
        assert results[rank]["error"] == (
            "rollout at iteration 2: fetching the rows failed on DP rank 1 (global "
            "rank 2): ConnectionError: agent worker agent-x-1.0 is gone"
        ), rank
