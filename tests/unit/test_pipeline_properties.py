"""Property tests: padding, merging, mini-batching and planning never lose, duplicate or
reorder a trainable token, and merging keeps every trainable token's context and log-prob."""

from collections import Counter

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_stepwise import (
    Step,
    TrajectoryID,
    merge_steps,
    pad_for_data_parallel,
    plan_microbatches,
    prompt_minibatches,
    validate_steps,
)
from megatron_stepwise.algo.planner import _lpt, plan_stats

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

small_ids = st.lists(st.integers(0, 20), max_size=4)


@st.composite
def agent_batches(draw):
    """A valid step-wise batch: 1-4 prompts x 1-3 samples x 1-4 turns; prompts are the
    growing history (obs appended between turns), sometimes with re-tokenisation drift."""
    steps = []
    num_prompts = draw(st.integers(1, 4))
    for p in range(num_prompts):
        for k in range(draw(st.integers(1, 3))):
            tid = TrajectoryID(f"p{p}", k)
            history = draw(st.lists(st.integers(0, 20), min_size=1, max_size=4))
            with_lp = draw(st.booleans())
            turns = draw(st.integers(1, 4))
            for t in range(turns):
                if t > 0:
                    history = history + draw(small_ids)
                    if draw(st.booleans()) and draw(st.booleans()):  # drift, 1 in 4
                        history[-1] = history[-1] + 1
                resp = draw(small_ids)
                mask = draw(st.lists(st.integers(0, 1), min_size=len(resp), max_size=len(resp)))
                lp = [-0.125 * draw(st.integers(0, 16)) for _ in resp] if with_lp else None
                steps.append(
                    Step(
                        tid,
                        list(history),
                        resp,
                        mask,
                        rollout_logprobs=lp,
                        is_last_step=t == turns - 1,
                        reward=float(t),
                    )
                )
                history = history + resp
    return steps, num_prompts


def trainable_tokens(rows):
    """(trajectory, full context up to and including the token, log-prob) of every loss_mask=1
    token, in row order: what the loss sees."""
    out = []
    for r in rows:
        full = torch.cat([r.prompt_ids, r.response_ids]).tolist()
        start = r.prompt_ids.numel()
        lps = None if r.rollout_logprobs is None else r.rollout_logprobs.tolist()
        for j, m in enumerate(r.loss_mask.tolist()):
            if m:
                out.append((r.trajectory_id, tuple(full[: start + j + 1]), None if lps is None else lps[j]))
    return out


@SETTINGS
@given(agent_batches(), st.integers(1, 5))
def test_padding_keeps_every_trainable_token(batch, dp):
    steps, _ = batch
    padded = pad_for_data_parallel(steps, dp)
    assert len(padded) % dp == 0 and len(padded) - len(steps) < dp
    assert padded[: len(steps)] == steps
    assert trainable_tokens(padded) == trainable_tokens(steps)
    pad_ids = [s.trajectory_id for s in padded if s.is_padding]
    assert len(set(pad_ids)) == len(pad_ids)
    validate_steps(padded)


@SETTINGS
@given(agent_batches())
def test_merge_keeps_trainable_tokens_contexts_and_logprobs(batch):
    steps, _ = batch
    validate_steps(steps)
    merged, stats = merge_steps(steps)
    validate_steps(merged)
    # Same trainable tokens, same order, each conditioned on exactly the same context.
    assert trainable_tokens(merged) == trainable_tokens(steps)
    assert stats.trainable_tokens == sum(s.num_trainable for s in steps)
    assert stats.rows_before == len(steps) and stats.rows_after == len(merged) <= len(steps)
    assert stats.tokens_after == sum(r.num_tokens for r in merged) <= stats.tokens_before
    assert sum(r.metadata["merged_steps"] for r in merged) == len(steps)
    # Each trajectory keeps its outcome: the last row carries the last step's reward.
    last_reward = {s.trajectory_id: s.reward for s in steps if s.is_last_step}
    assert {r.trajectory_id: r.reward for r in merged if r.is_last_step} == last_reward


@SETTINGS
@given(agent_batches(), st.data())
def test_minibatches_partition_the_batch_by_prompt(batch, data):
    steps, num_prompts = batch
    k = data.draw(st.sampled_from([d for d in range(1, num_prompts + 1) if num_prompts % d == 0]))
    steps = pad_for_data_parallel(steps, data.draw(st.integers(1, 4)))
    mbs = prompt_minibatches(steps, k)
    assert [s for mb in mbs for s in mb] == steps
    assert trainable_tokens([s for mb in mbs for s in mb]) == trainable_tokens(steps)
    owners = Counter()
    for mb in mbs:
        prompts = {s.trajectory_id.prompt_id for s in mb if not s.is_padding}
        assert len(prompts) == k
        owners.update(prompts)
    assert all(c == 1 for c in owners.values())


lengths_st = st.lists(st.integers(0, 120), max_size=60)


@SETTINGS
@given(lengths_st, st.integers(1, 6), st.integers(0, 200), st.sampled_from([0.0, 1 / 64, 1.0]))
def test_plan_invariants(lengths, dp, slack, weight):
    max_tokens = max(lengths, default=1) + slack or 1
    plan = plan_microbatches(lengths, dp_size=dp, max_tokens=max_tokens, attention_weight=weight)
    assert len(plan) == dp
    counts = {len(rank) for rank in plan}
    assert len(counts) == 1 and counts.pop() >= 1
    flat = [i for rank in plan for mb in rank for i in mb]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in mb) <= max_tokens for rank in plan for mb in rank)
    assert plan == plan_microbatches(lengths, dp_size=dp, max_tokens=max_tokens, attention_weight=weight)
    # The exchange pass only ever lowers the heaviest rank below plain longest-first greedy.
    cost = np.asarray(lengths, dtype=float) + weight * np.asarray(lengths, dtype=float) ** 2
    greedy = np.bincount(_lpt(cost, dp), weights=cost, minlength=dp).max() if lengths else 0.0
    assert max(plan_stats(lengths, plan, attention_weight=weight).rank_costs) <= greedy + 1e-6


@SETTINGS
@given(agent_batches(), st.data())
def test_whole_pipeline_keeps_every_trainable_token(batch, data):
    steps, num_prompts = batch
    validate_steps(steps)
    merged, _ = merge_steps(steps)
    k = data.draw(st.sampled_from([d for d in range(1, num_prompts + 1) if num_prompts % d == 0]))
    dp = data.draw(st.integers(1, 4))
    planned_rows = []
    for mb in prompt_minibatches(merged, k):
        mb = pad_for_data_parallel(mb, dp, first_index=len(planned_rows))
        lengths = [s.num_tokens for s in mb]
        plan = plan_microbatches(lengths, dp_size=dp, max_tokens=max(lengths) + data.draw(st.integers(0, 30)))
        planned_rows += [mb[i] for rank in plan for micro in rank for i in micro]
    # Planning reorders rows across ranks by design; as a multiset nothing is lost or duplicated.
    assert Counter(trainable_tokens(planned_rows)) == Counter(trainable_tokens(steps))
