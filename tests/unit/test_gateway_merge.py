"""A context-managing agent through the gateway, trained merged and unmerged (`data.merge_steps`):
the same loss and gradients of a small causal model, and merges only where the prefix holds.

The agent keeps the system prompt and the last two exchanges, so from its fourth call on each
call breaks the prefix. `prepare` (what the trainer runs) makes the batch both ways; the loss
is the plugin's (`policy_loss` over `loss_token_weights`), its log-probs a tiny Qwen2's, one
unpadded forward per row, as the trainer computes them without Megatron.
"""

from __future__ import annotations

import pytest
import torch

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.algo.losses import LossConfig, LossInputs, policy_loss
from megatron_stepwise.algo.prepare import prepare
from megatron_stepwise.algo.reductions import MERGE_INVARIANT_REDUCTIONS, loss_token_weights
from megatron_stepwise.rollout.engines.embedded.hf_model import load_config
from tests.gateway_fixtures import assert_exact_in_any_order, record_window_agent
from tests.helpers import tiny_lm

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

_, CONFIG = tiny_lm("tiny_bpe")
TURNS = 6  # calls per trajectory; calls 4, 5 and 6 break the prefix


@pytest.fixture(scope="module")
def steps():
    """Two trajectories of one prompt (rewards 1 and 0, so GRPO's advantages are not zero)."""
    out, calls, counts = record_window_agent(rewards=(1.0, 0.0), turns=TURNS)
    assert counts["prefix_breaks"] == 2 * 3
    assert_exact_in_any_order(out, calls)
    return out


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(load_config(CONFIG)).double().eval()


def loss_and_grads(model, batch, reduction: str, cfg: LossConfig):
    """The policy loss of `batch` and its gradient with respect to every model parameter."""
    mask = batch.token_fields["loss_mask"].bool()
    logprobs = []
    for r in range(batch.num_rows):  # one unpadded causal forward per row
        ids = batch.tokens[batch.row_slice(r)]
        logits = model(input_ids=ids[None]).logits[0, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
        logprobs.append(torch.cat([logp.new_zeros(1), logp])[mask[batch.row_slice(r)]])  # token 0: never trained
    logprobs = torch.cat(logprobs)
    assert bool(batch.token_fields["rollout_logprobs_known"][mask].all())
    inputs = LossInputs(
        logprobs=logprobs,
        old_logprobs=logprobs.detach(),  # on-policy, as the trainer without old log-probs
        advantages=batch.token_fields["advantages"][mask].double(),
        weights=loss_token_weights(batch, reduction)[mask].double(),
        segment_ids=batch.row_of_token()[mask],
        rollout_logprobs=batch.token_fields["rollout_logprobs"][mask].double(),  # the engine's: tis weights
    )
    model.zero_grad()
    loss, _ = policy_loss(inputs, cfg)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_merges_happen_only_where_the_prefix_holds(steps):
    groups = groups_of(steps)
    merged, metrics = prepare(groups, merge_steps=True, keep_metadata=True)
    plain, plain_metrics = prepare(groups, merge_steps=False)
    # Per trajectory: calls 1-3 extend one prefix (one row), 4, 5 and 6 each start afresh.
    assert [s.metadata["prefix_break"] for s in steps] == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert (metrics["batch/rows_before_merge"], metrics["batch/rows_after_merge"]) == (12, 8)
    assert metrics["batch/broken_prefixes"] == 6 and plain.num_rows == 12 and merged.num_rows == 8
    assert [m["merged_steps"] for m in merged.metadata] == [3, 1, 1, 1] * 2
    # A merged row is the exact concatenation: the first call's prompt, then each later call's
    # prompt delta and response; its trained tokens are the unmerged rows' trained tokens.
    assert int(merged.token_fields["loss_mask"].sum()) == int(plain.token_fields["loss_mask"].sum())
    assert merged.tokens[merged.row_slice(0)].tolist() == plain.tokens[plain.row_slice(2)].tolist()


@pytest.mark.parametrize("reduction", sorted(MERGE_INVARIANT_REDUCTIONS))
def test_merged_and_unmerged_training_give_the_same_loss_and_gradients(steps, model, reduction):
    groups = groups_of(steps)
    cfg = LossConfig(policy_loss="ppo", reduction=reduction, tis="token", clip_c=3.0)
    plain_loss, plain_grads = loss_and_grads(model, prepare(groups, merge_steps=False)[0], reduction, cfg)
    merged_loss, merged_grads = loss_and_grads(model, prepare(groups, merge_steps=True)[0], reduction, cfg)
    assert plain_loss != 0 and any(bool(g.abs().max() > 1e-4) for g in plain_grads.values())
    assert abs(float(plain_loss - merged_loss)) < 1e-6
    assert plain_grads.keys() == merged_grads.keys()
    worst = max(float((plain_grads[n] - merged_grads[n]).abs().max()) for n in plain_grads)
    assert worst < 1e-6, f"largest gradient difference {worst:.3g}"
