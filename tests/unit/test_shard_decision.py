"""The shard decision (`algo/shards.py`) on its own: no model, no Megatron parallel state,
no process group. What the plugin's `plan_shards` / `decide_shards` decide for a layout is this
module's, the plugin only reads the layout off the model."""

import subprocess
import sys

import pytest
import torch

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.algo.losses import LossConfig
from megatron_stepwise.algo.prepare import prepare
from megatron_stepwise.algo.reductions import loss_token_weights
from megatron_stepwise.algo.rows import RowTable
from megatron_stepwise.algo.shards import (
    LOGPROBS,
    HostLoopMismatchError,
    ShardLayout,
    ShardPlanner,
    UnsupportedLayoutError,
)
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps
from megatron_stepwise.steps import StepwiseBatchError


def _minibatch(prompts=6, seed=3):
    workload = AgentWorkload(
        num_prompts=prompts,
        samples_per_prompt=4,
        turns=(1, 3),
        prompt_len=(10, 40),
        obs_len=(5, 30),
        response_len=(5, 30),
        vocab_size=300,
        seed=seed,
    )
    return prepare(groups_of(make_agent_steps(workload)), estimator="grpo", max_tokens=16384)[0]


def _token_index(batch, rows):
    return torch.cat([torch.arange(int(batch.offsets[r]), int(batch.offsets[r + 1])) for r in rows])


@pytest.mark.parametrize("reduction", ["token_mean", "step_mean", "trajectory_mean", "prompt_mean"])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_a_decision_from_row_counts_shards_the_minibatch_with_its_whole_batch_weights(reduction, dp):
    batch = _minibatch()
    planner = ShardPlanner(LossConfig(reduction=reduction), max_tokens=512)
    decisions = planner.decide(RowTable.of(batch), ShardLayout(dp=dp))
    assert [d.dp_rank for d in decisions] == list(range(dp))
    assert sorted(r for d in decisions for r in d.rows) == list(range(batch.num_rows))  # each row once
    assert len({len(d.plan) for d in decisions}) == 1  # every rank runs as many micro-batches
    weights = loss_token_weights(batch, reduction)
    for d in decisions:
        shard = d.cut(batch.select(d.rows))
        assert (shard.decision.trained_tokens, shard.decision.tokens) == (
            int(batch.token_fields["loss_mask"].sum()),
            batch.tokens.numel(),
        )
        assert torch.allclose(shard.token_fields["weights"], weights[_token_index(batch, d.rows)])
        assert sorted(i for micro in d.plan for i in micro) == list(range(len(d.rows)))


def test_interleaved_pipeline_count_and_padding_come_from_the_layout():
    batch = _minibatch()
    layout = ShardLayout(dp=2, pp=2, vpp=2, align=8)
    for d in ShardPlanner(LossConfig(), max_tokens=512).decide(RowTable.of(batch), layout):
        assert len(d.plan) % 2 == 0 and d.pad_to % 8 == 0
    with pytest.raises(HostLoopMismatchError, match="num_microbatches=3 is not a multiple of the pipeline-parallel"):
        ShardPlanner(LossConfig(), max_tokens=512, num_microbatches=3).decide(RowTable.of(batch), layout)


def test_the_decision_refuses_what_it_cannot_train_naming_the_numbers():
    batch = _minibatch()
    rows = RowTable.of(batch)
    with pytest.raises(HostLoopMismatchError, match=r"needs \d+ micro-batches .* num_microbatches=1"):
        ShardPlanner(LossConfig(), max_tokens=256, num_microbatches=1).decide(rows, ShardLayout(dp=1))
    longest = int(batch.lengths.max())
    with pytest.raises(StepwiseBatchError, match=f"max_tokens_per_microbatch={longest - 1}"):
        ShardPlanner(LossConfig(), max_tokens=longest - 1).decide(rows, ShardLayout(dp=1))
    custom = ShardPlanner(LossConfig(), max_tokens=512, token_weights=lambda b, r, **_: torch.ones(b.tokens.numel()))
    with pytest.raises(UnsupportedLayoutError, match="custom token_weights hook needs the whole mini-batch"):
        custom.decide(rows, ShardLayout(dp=2))
    shards = custom.plan(batch, ShardLayout(dp=2))  # the whole batch: the hook weighs it
    assert all(torch.equal(s.token_fields["weights"], torch.ones(s.batch.tokens.numel())) for s in shards)
    scored = ShardPlanner(LossConfig(), max_tokens=512).decide(rows, ShardLayout(dp=1), mode=LOGPROBS)
    assert scored[0].denominators is None  # log-probs only: nothing to weigh


@pytest.mark.timeout(120)
@pytest.mark.launches  # a fresh interpreter, to see what importing the decision loads
def test_deciding_imports_no_megatron():
    code = (
        "import sys\n"
        "import torch\n"
        "from megatron_stepwise.algo.losses import LossConfig\n"
        "from megatron_stepwise.algo.rows import RowTable\n"
        "from megatron_stepwise.algo import shards\n"
        "n = torch.tensor([5, 7, 3])\n"
        "rows = RowTable(n, n - 2, n - 2, torch.arange(3), torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.bool), [0, 1, 2])\n"
        "assert len(shards.ShardPlanner(LossConfig(), max_tokens=16).decide(rows, shards.ShardLayout(dp=2))) == 2\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'ray', 'transformer_engine'})\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=100)
