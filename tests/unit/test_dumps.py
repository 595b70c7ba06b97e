"""Rollout dumps (rundir/dumps.py): what the trainer trained, written and read back exactly."""

import functools

import pytest
import torch
from helpers import make_step, stride_decide

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.algo.prepare import prepare
from megatron_stepwise.loop.rounds import RowsOnRank0, decide_round
from megatron_stepwise.rundir.dump_recorder import DumpRecorder, assemble_logprobs
from megatron_stepwise.rundir.dump_table import DumpError, dump_path
from megatron_stepwise.rundir.dumps import read_dump, write_dump


def _group(pid, rewards, *, routed=False, merged_history=False):
    """A prompt group of two-turn trajectories (the second prompt extends the first turn)."""
    steps = []
    for k, reward in enumerate(rewards):
        first = make_step(
            pid,
            k,
            prompt=[1, 2, 3],
            resp=[4 + k, 5, 2],
            mask=[1, 1, 0],
            last=False,
            lp=[-0.5, -0.25, 0.0],
            versions=[3, 3, 3],
            meta={"turn": 0, "env_info": {"x": k}},
            stop="length",
        )
        second = make_step(
            pid,
            k,
            prompt=[1, 2, 3, 4 + k, 5, 2, 9],
            resp=[6, 2],
            mask=[1, 1],
            last=True,
            reward=reward,
            lp=[-1.5, -0.125],
            versions=[3, 4],
            meta={"turn": 1},
            stop="env_error" if reward < 0 else "stop",
        )
        if reward < 0:
            second.metadata["error"] = "ValueError: bad tool call"
        if routed:
            for s in (first, second):
                s.routed_experts = torch.randint(-1, 4, (s.num_tokens, 2, 2), dtype=torch.int16)
        steps += [first, second]
    return steps


def _round(steps, merge=False, dp=2, recorder=None):
    if recorder is None:
        recorder = DumpRecorder(every=1)
        recorder.begin(0)
    rounds = decide_round(
        [groups_of(steps[: len(steps) // 2]), groups_of(steps[len(steps) // 2 :])],
        RowsOnRank0(functools.partial(prepare, merge_steps=merge), recorder),
        decide=stride_decide(dp),
        dp_size=dp,
    )
    return recorder, rounds


def _same_batch(a, b):
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.offsets, b.offsets)
    assert torch.equal(a.prompt_lens, b.prompt_lens)
    assert set(a.token_fields) == set(b.token_fields)
    for k in a.token_fields:
        assert a.token_fields[k].dtype == b.token_fields[k].dtype, k
        assert torch.equal(a.token_fields[k], b.token_fields[k]), k
    assert set(a.row_fields) == set(b.row_fields)
    for k in a.row_fields:
        assert torch.equal(a.row_fields[k], b.row_fields[k]), k
    assert a.trajectory_ids == b.trajectory_ids and a.stop_reasons == b.stop_reasons


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("routed", [False, True])
def test_a_dump_rebuilds_every_trained_minibatch_bit_for_bit(tmp_path, merge, routed):
    steps = (
        _group("a", [1.0, 0.0]) + _group("b", [0.5, -1.0])
        if not routed
        else _group("a", [1.0, 0.0], routed=True) + _group("b", [0.5, -1.0], routed=True)
    )
    recorder, rounds = _round(steps, merge=merge)
    assert len(recorder.minibatches) == 2
    # the shards travel without the step metadata the dump keeps
    assert all(s.batch.metadata is None for r in rounds for s in r.shards)
    for cap in recorder.minibatches:
        cap.trainer_logprobs = torch.randn(cap.batch.tokens.numel())
    path = write_dump(
        dump_path(tmp_path, 3),
        recorder.minibatches,
        iteration=3,
        weight_version=7,
        config={"name": "x"},
        train_metrics=[{"loss": 0.5, "grad_norm": 1.25}] * 2,
    )
    assert path.name == "iter_0000003.parquet"
    dump = read_dump(tmp_path, 3)
    assert dump.iteration == 3 and dump.meta["weight_version"] == 7 and dump.meta["config"] == {"name": "x"}
    assert dump.meta["train_metrics"][1]["grad_norm"] == 1.25
    for cap, batch, lp in zip(recorder.minibatches, dump.minibatches, dump.trainer_logprobs):
        _same_batch(cap.batch, batch)
        resp = torch.zeros_like(lp, dtype=torch.bool)
        for r in range(batch.num_rows):
            resp[batch.response_slice(r)] = True
        assert torch.equal(lp[resp], cap.trainer_logprobs[resp])
    assert ("routed_experts" in dump.minibatches[0].token_fields) == routed
    rows = dump.table.to_pylist()
    assert len(rows) == sum(b.num_rows for b in dump.minibatches)
    failed = [r for r in rows if r["stop_reason"] == "env_error"]
    assert failed and all(r["env_error"] == "ValueError: bad tool call" for r in failed)
    # every row of a trajectory carries the trajectory's outcome
    by_traj = {(r["prompt_id"], r["sample_index"]): r["outcome_reward"] for r in rows if r["is_last"]}
    assert all(r["outcome_reward"] == by_traj[(r["prompt_id"], r["sample_index"])] for r in rows)
    assert by_traj[("b", 1)] == -1.0


def test_an_iteration_that_is_not_dumped_keeps_nothing():
    recorder = DumpRecorder(every=3)
    assert [recorder.begin(i) for i in range(7)] == [True, False, False, True, False, False, True]
    recorder.begin(1)
    _, rounds = _round(_group("a", [1.0, 0.0]) + _group("b", [0.0, 1.0]), recorder=recorder)
    assert recorder.minibatches == [] and all(s.batch.metadata is None for r in rounds for s in r.shards)
    assert DumpRecorder().begin(0) is False  # off by default


def test_shard_log_probs_assemble_into_the_minibatch_order():
    recorder, rounds = _round(_group("a", [1.0, 0.0]) + _group("b", [0.0, 1.0]))
    mb = recorder.minibatches[0].batch
    truth = torch.arange(mb.tokens.numel(), dtype=torch.float32)
    pieces = []
    for dp, r in enumerate(rounds):
        shard = r.shards[0]
        rows = list(range(dp, mb.num_rows, 2))
        flat = torch.cat([truth[mb.row_slice(i)] for i in rows])
        pieces.append((rows, shard.batch.offsets, flat))
    assert torch.equal(assemble_logprobs(mb, pieces), truth)


def test_a_missing_dump_is_one_error_naming_the_iteration_and_the_key(tmp_path):
    with pytest.raises(DumpError, match="trainer.dump_rollouts"):
        read_dump(tmp_path)
    recorder, _ = _round(_group("a", [1.0, 0.0]) + _group("b", [0.0, 1.0]))
    write_dump(dump_path(tmp_path, 4), recorder.minibatches, iteration=4, weight_version=4, config={}, train_metrics=[])
    with pytest.raises(DumpError, match=r"no dump of iteration 5 .*\[4\]"):
        read_dump(tmp_path, 5)
    assert read_dump(tmp_path).iteration == 4  # the last one by default
